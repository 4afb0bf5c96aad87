"""One pipeline stage's part of a step (distributed/pipeline_parallel.py): its layers over every
micro-batch of the step's sequences.

The step's sequences are cut into micro-batches of about equal tokens (`split_microbatches`; a step of
fewer than 64 tokens a micro-batch, a decode step of a few sequences, stays whole); each goes through the
stage in turn: the first stage embeds its tokens (or, when the table is tied to the LM head, receives the
rows the last stage looked up in it: a thread of the last stage's does that as soon as a step reaches
it, `queued`), a later one receives (block output, residual stream) from the stage before; then the
stage's layers (the fused C++ step when the batch allows it, else the modules); then the hidden states
are sent on (a send that does not wait: the stage goes on to the next micro-batch while the next stage
computes this one, which is what lets the stages overlap), or, on the last stage, normed and kept. The
last stage returns every row's hidden state in the step's order, the others None: only the last one
samples.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

import torch

from turbollm.distributed import get_tp
from turbollm.distributed.pipeline_parallel import (MIN_MICROBATCH_TOKENS, recv_embedded, recv_hidden,
                                                    send_embedded, send_hidden, split_microbatches, wait_sends)
from turbollm.handoff.scheduler_output import SchedulerOutput

logger = logging.getLogger("turbollm")


class PipelineStage:
    def __init__(self, runner, microbatches: int):
        self.runner, self.microbatches = runner, microbatches
        stage = get_tp()
        embeds = stage.embedding_stage(runner.model.config.tie_word_embeddings)
        self.receives_rows = stage.is_first_stage and embeds != 0  # a tied table's rows come from the last stage
        self.looks_up = embeds == stage.pp_rank and not stage.is_first_stage  # ... which looks them up
        if self.looks_up:
            self._fed: deque[SchedulerOutput] = deque()  # steps handed to the lookup thread, not yet run here
            self._lookups: queue.Queue[SchedulerOutput] = queue.Queue()
            self._lookup_error: BaseException | None = None
            threading.Thread(target=self._look_up, name="turbollm-lookups", daemon=True).start()

    def _groups(self, sched: SchedulerOutput) -> list[range]:
        counts = [len(t) for t in sched.scheduled_token_ids.values()]
        return split_microbatches(counts, self.microbatches, MIN_MICROBATCH_TOKENS)

    def queued(self, sched: SchedulerOutput) -> None:
        """Step `sched` reached this worker (its reader thread calls this before queueing the step): the tied
        table's stage looks its tokens up at once, beside the step it runs, so that the first stage can start
        it while this one still computes (several steps in flight)."""
        if self.looks_up and sched.scheduled_token_ids:  # (an empty step does not run: ModelRunner.execute_model)
            self._fed.append(sched)
            self._lookups.put(sched)

    def _look_up(self) -> None:
        """The lookup thread: each step's rows, micro-batch by micro-batch, sent to the first stage in the order
        the steps came (this rank's vocabulary share under tensor parallelism: no collective here)."""
        while True:
            sched = self._lookups.get()
            try:
                with torch.inference_mode():
                    tokens = list(sched.scheduled_token_ids.values())
                    for g in self._groups(sched):
                        ids = torch.tensor([t for seq in tokens[g.start:g.stop] for t in seq], dtype=torch.int64)
                        send_embedded(self.runner.model.embed(ids, reduce=False))
            except BaseException as e:  # noqa: BLE001 - raised by the next step this stage runs
                logger.exception("the tied table's lookups failed")
                self._lookup_error = e
                return

    def run(self, sched: SchedulerOutput) -> torch.Tensor | None:
        runner, stage = self.runner, get_tp()
        model = runner.model
        hidden = model.config.hidden_size
        if self.looks_up:
            if self._lookup_error is not None:
                raise RuntimeError("the tied table's lookups for the first stage failed") from self._lookup_error
            if any(f is sched for f in self._fed):  # (steps fed before it that never ran: failed, now fatal)
                while self._fed.popleft() is not sched:
                    pass
            else:  # a step no reader thread saw coming (ranks torchrun started): looked up now
                self._lookups.put(sched)
        items = list(sched.scheduled_token_ids.items())
        batches = [runner.prepare(sched, items[g.start:g.stop]) for g in self._groups(sched)]
        parts, pending = [], []
        for batch in batches:
            n = len(batch.input_ids)
            if not stage.is_first_stage:
                x, residual = recv_hidden(n, hidden)
            else:
                x, residual = (recv_embedded(n, hidden) if self.receives_rows else model.embed(batch.input_ids)), None
            out = runner.run_layers(x, batch, residual)
            if stage.is_last_stage:
                parts.append(model.final_norm(*out))
            else:
                pending.append(send_hidden(*out))
        wait_sends(pending)
        return torch.cat(parts) if parts else None
