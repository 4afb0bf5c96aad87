"""One pipeline stage's part of a step (distributed/pipeline_parallel.py): its layers over every
micro-batch of the step's sequences.

The step's sequences are cut into micro-batches of about equal tokens (`split_microbatches`; a step of
fewer than 64 tokens a micro-batch, a decode step of a few sequences, stays whole); each
goes through the stage in turn: the first stage embeds its tokens (or, when the table is tied to the
LM head, receives the rows the last stage looked up in it at the start of the step), a later one
receives (block output, residual stream) from the stage before; then the stage's layers (the fused C++ step when the batch
allows it, else the modules); then the hidden states are sent on (a send that does not wait: the
stage goes on to the next micro-batch while the next stage computes this one, which is what lets the
stages overlap), or, on the last stage, normed and kept. The last stage returns every row's hidden
state in the step's order, the others None: only the last one samples.
"""

from __future__ import annotations

import torch

from turbollm.distributed import get_tp
from turbollm.distributed.pipeline_parallel import (MIN_MICROBATCH_TOKENS, recv_embedded, recv_hidden,
                                                    send_embedded, send_hidden, split_microbatches, wait_sends)
from turbollm.engine.scheduler_output import SchedulerOutput


class PipelineStage:
    def __init__(self, runner, microbatches: int):
        self.runner, self.microbatches = runner, microbatches
        # the tied table's stage: lookups sent ahead for steps queued behind the running one, with their sends
        self._ahead: list[tuple[SchedulerOutput, list]] = []

    def _groups(self, sched: SchedulerOutput) -> list[range]:
        counts = [len(t) for t in sched.scheduled_token_ids.values()]
        return split_microbatches(counts, self.microbatches, MIN_MICROBATCH_TOKENS)

    def _send_lookups(self, sched: SchedulerOutput) -> list:
        """The tied table's stage: look up the step's tokens, micro-batch by micro-batch, and start sending the
        rows to the first stage; returns the sends."""
        tokens = list(sched.scheduled_token_ids.values())
        ids = [torch.tensor([t for seq in tokens[g.start:g.stop] for t in seq], dtype=torch.int64)
               for g in self._groups(sched)]
        return [send_embedded(self.runner.model.embed(i)) for i in ids]

    def run(self, sched: SchedulerOutput, upcoming: list[SchedulerOutput] = ()) -> torch.Tensor | None:
        """This stage's part of step `sched`; `upcoming`: the steps queued behind it (several steps in flight),
        whose lookups the tied table's stage sends ahead so that the first stage can start them while this
        one still computes."""
        runner, stage = self.runner, get_tp()
        model = runner.model
        hidden = model.config.hidden_size
        embeds = stage.embedding_stage(model.config.tie_word_embeddings)
        items = list(sched.scheduled_token_ids.items())
        batches = [runner.prepare(sched, items[g.start:g.stop]) for g in self._groups(sched)]
        parts, pending = [], []
        if embeds != 0 and stage.pp_rank == embeds:
            if self._ahead and self._ahead[0][0] is sched:
                pending.extend(self._ahead.pop(0)[1])
            else:
                pending.extend(self._send_lookups(sched))
            if stage.tp_size == 1:  # (a vocabulary-parallel lookup all-reduces: its ranks must agree on when)
                sent = [s for s, _ in self._ahead]
                self._ahead.extend((s, self._send_lookups(s)) for s in upcoming
                                   if not s.is_empty and not any(s is t for t in sent))
        for batch in batches:
            if stage.is_first_stage:
                n = len(batch.input_ids)
                x, residual = (model.embed(batch.input_ids) if embeds == 0 else recv_embedded(n, hidden)), None
            else:
                x, residual = recv_hidden(len(batch.input_ids), hidden)
            out = runner.run_layers(x, batch, residual)
            if stage.is_last_stage:
                parts.append(model.final_norm(*out))
            else:
                pending.append(send_hidden(*out))
        wait_sends(pending)
        return torch.cat(parts) if parts else None
