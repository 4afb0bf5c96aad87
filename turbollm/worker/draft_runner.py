"""The draft model's forward passes, for the draft-model proposer (turbollm/spec_decode/draft_model.py).

`DraftRunner.load` loads the draft (quantized at load when the config says so, its LM head cut to
`draft_vocab_size` ids; whole, never sharded, on a rank of a tensor-parallel engine), allocates its
paged K/V as the engine sized it (the target pool's number of blocks), and wraps a `ModelRunner` over
them. `run(seq_id, tokens, num_computed, table)` computes tokens[num_computed:]
into the blocks of `table` (the target sequence's own block ids) and returns the draft's greedy next
token. The proposer decides what is still valid; this module only runs the model. The worker's
`Drafter` (worker/drafter.py) owns the proposer, which receives this runner through
`ProposerContext.make_draft_runner`.
"""

from __future__ import annotations

import logging

from turbollm.handoff.scheduler_output import SchedulerOutput
from turbollm.sampling_params import SamplingParams
from turbollm.worker.model_runner import ModelRunner, SeqState

logger = logging.getLogger("turbollm")
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class DraftRunner:
    def __init__(self, loaded, runner: ModelRunner):
        self.loaded, self.runner = loaded, runner

    @classmethod
    def load(cls, config, model, draft_kv, block_size: int) -> "DraftRunner":
        """`config`: the `SpeculativeConfig`; `model`: the target's `ModelArgs` (matmul path, kernel form,
        dense dtype, attention backend: the draft computes as the target does); `draft_kv`: the draft's `KVCacheConfig`,
        sized by the engine (the target's number of blocks)."""
        from turbollm.attention import get_attention_backend
        from turbollm.distributed import single_rank
        from turbollm.kernels.forms import resolve_form
        from turbollm.loader import load_model
        from turbollm.quantization.base import set_kernel_form, set_qmatmul
        from turbollm.quantization.dense_dtype import resolve_dtype, set_dtype
        from turbollm.spec_decode.draft_model import trimmed_head
        from turbollm.worker.kv_allocation import allocate_kv_storage

        with single_rank():  # every layer built whole, the trimmed head too (layers read the state when built)
            loaded = load_model(config.model, quantization=config.quantization)
            if config.draft_vocab_size is not None and config.draft_vocab_size < loaded.config.vocab_size:
                loaded.model.lm_head = trimmed_head(loaded.model.lm_head, config.draft_vocab_size)
            set_qmatmul(loaded.model, model.qmatmul)
            set_kernel_form(loaded.model, resolve_form(model.kernel_form))
            set_dtype(loaded.model, resolve_dtype(model.dtype, loaded.model))
        logger.info("draft model %s: %s; its KV cache %d blocks, %.0f MiB", config.model, loaded.weights_storage,
                    draft_kv.num_blocks, draft_kv.total_bytes / (1 << 20))
        runner = ModelRunner(loaded.model, allocate_kv_storage(draft_kv), block_size,
                             get_attention_backend(model.attention_backend), fused_decode=not model.enforce_eager,
                             layer_groups=draft_kv.layer_groups)
        return cls(loaded, runner)

    def run(self, seq_id: int, token_ids: list[int], num_computed: int, table: list[int]) -> int | None:
        """Compute token_ids[num_computed:] (K/V into `table`'s blocks); the greedy next token, or None
        if sampling it failed."""
        st = self.runner.states.get(seq_id)
        if st is None:
            st = SeqState(params=_GREEDY, token_ids=[], num_prompt_tokens=len(token_ids), seq_id=seq_id, index=0,
                          block_ids=(table,))
            self.runner.states[seq_id] = st
        st.block_ids, st.token_ids, st.num_computed_tokens = (table,), list(token_ids), num_computed
        out = self.runner.execute_model(SchedulerOutput(scheduled_token_ids={seq_id: token_ids[num_computed:]}))
        sampled = out.sampled.get(seq_id)
        return sampled[0].token_id if sampled else None

    def drop(self, seq_id: int) -> None:
        self.runner.states.pop(seq_id, None)
