"""One pipeline stage's part of a step (distributed/pipeline_parallel.py): its layers over every
micro-batch of the step's sequences.

The step's sequences are cut into micro-batches of about equal tokens (`split_microbatches`; a step of
fewer than 64 tokens a micro-batch, a decode step of a few sequences, stays whole); each
goes through the stage in turn: the first stage embeds its tokens, a later one receives (block output,
residual stream) from the stage before; then the stage's layers (the fused C++ step when the batch
allows it, else the modules); then the hidden states are sent on (a send that does not wait: the
stage goes on to the next micro-batch while the next stage computes this one, which is what lets the
stages overlap), or, on the last stage, normed and kept. The last stage returns every row's hidden
state in the step's order, the others None: only the last one samples.
"""

from __future__ import annotations

import torch

from turbollm.distributed import get_tp
from turbollm.distributed.pipeline_parallel import (MIN_MICROBATCH_TOKENS, recv_hidden, send_hidden,
                                                    split_microbatches, wait_sends)
from turbollm.engine.scheduler_output import SchedulerOutput


class PipelineStage:
    def __init__(self, runner, microbatches: int):
        self.runner, self.microbatches = runner, microbatches

    def run(self, sched: SchedulerOutput) -> torch.Tensor | None:
        runner, stage = self.runner, get_tp()
        model = runner.model
        items = list(sched.scheduled_token_ids.items())
        parts, pending = [], []
        for group in split_microbatches([len(t) for _, t in items], self.microbatches, MIN_MICROBATCH_TOKENS):
            batch = runner.prepare(sched, items[group.start:group.stop])
            if stage.is_first_stage:
                x, residual = model.embed(batch.input_ids), None
            else:
                x, residual = recv_hidden(len(batch.input_ids), model.config.hidden_size)
            out = runner.run_layers(x, batch, residual)
            if stage.is_last_stage:
                parts.append(model.final_norm(*out))
            else:
                pending.append(send_hidden(*out))
        wait_sends(pending)
        return torch.cat(parts) if parts else None
