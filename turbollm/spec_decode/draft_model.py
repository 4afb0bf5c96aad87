"""Draft-model speculation: a smaller model with the target's tokenizer proposes the next tokens greedily.

The draft runs in the engine's process with its own `ModelRunner` and its own paged K/V storage,
allocated with the target pool's number of blocks and addressed through the target sequence's own
block table (the same block ids: the scheduler allocates the blocks for the drafts' positions before
asking, `Proposer.needs_blocks`). Per sequence it remembers how many tokens' draft K/V are valid; on
the next call that count falls back to the first position where the sequence's tokens differ from the
ones the draft computed (the rejected drafts) or where the block table changed (copy-on-write), and
to zero after a preemption (`preempted`: the blocks may have served others meanwhile), and the draft catches up from there in one step (the prompt at the first call, then
the last verified tokens) before drafting k tokens one step each. Drafts are greedy (the argmax of
the draft's logits), so verification is rejection sampling with a one-hot q.

`check_draft_model` refuses, before any weights load, a draft whose tokenizer differs from the
target's, one with more parameters than the target, and models with sliding-window layers (their
block tables are not the target's).
"""

from __future__ import annotations

import logging

from torch import nn

from turbollm.config import ModelConfig
from turbollm.layers.embedding import LMHead
from turbollm.quantization.qtensor import mark_ggml
from turbollm.engine.model_runner import ModelRunner, SeqState
from turbollm.engine.scheduler_output import SchedulerOutput
from turbollm.errors import InvalidRequestError
from turbollm.sampling_params import SamplingParams
from turbollm.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from turbollm.spec_decode.proposers import Proposer, ProposerContext, register_proposer

logger = logging.getLogger("turbollm")
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


def approx_num_params(cfg: ModelConfig) -> int:
    """Weights of a decoder from its shape: embeddings (and an untied head), attention, gated MLP."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2) + cfg.num_layers * layer


def trimmed_head(head: LMHead, n: int) -> LMHead:
    """An LM head over token ids 0..n-1 of `head` (its first n rows: a view, GGML blocks or dense)."""
    out = LMHead(n, head.dim)
    qtype = head.qtype
    rows = nn.Parameter(head.weight.data[:n], requires_grad=False)
    out.weight = mark_ggml(rows, qtype) if qtype is not None else rows
    return out


def check_draft_model(name: str, target, quantization: str | None = None) -> object:
    """The draft's description (no weights) if it can draft for `target` (a ModelDescription); else an
    InvalidRequestError naming speculative_config's 'model' field."""
    from turbollm.loader import describe_model

    bad = f"speculative_config: 'model' {name!r} cannot draft for the target: "
    try:
        draft = describe_model(name, quantization=quantization)
    except Exception as e:  # noqa: BLE001 - unknown name, unreadable file: say which field
        raise InvalidRequestError(bad + f"{type(e).__name__}: {e}") from None
    if draft.tokenizer.backend.get_vocab() != target.tokenizer.backend.get_vocab():
        raise InvalidRequestError(bad + "its tokenizer differs from the target's (the drafts would be other tokens)")
    if draft.config.vocab_size > target.config.vocab_size:
        raise InvalidRequestError(bad + f"its vocabulary ({draft.config.vocab_size}) is larger than the target's "
                                  f"({target.config.vocab_size})")
    d, t = approx_num_params(draft.config), approx_num_params(target.config)
    if d > t:
        raise InvalidRequestError(bad + f"it is larger than the target ({d / 1e9:.2f}B against {t / 1e9:.2f}B "
                                  "parameters)")
    for who, cfg in (("the draft", draft.config), ("the target", target.config)):
        if cfg.sliding_window is not None and any(cfg.layer_window(i) for i in range(cfg.num_layers)):
            raise InvalidRequestError(bad + f"{who} has sliding-window layers (draft models run on full-attention "
                                      "models only)")
    return draft


@register_proposer("draft_model")
class DraftModelProposer(Proposer):
    needs_blocks = True

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        from turbollm.attention import get_attention_backend
        from turbollm.engine.kv_cache_spec import KVCacheConfig, allocate_kv_storage
        from turbollm.loader import load_model
        from turbollm.quantization.base import set_qmatmul

        args, kv_config = context.args, context.kv_config
        if context.block_table is None or kv_config is None or args is None:
            raise InvalidRequestError("speculative_config: a draft model runs inside an engine (no engine context)")
        if context.target is not None:
            check_draft_model(config.model, context.target, config.quantization)
        self.loaded = load_model(config.model, quantization=config.quantization)
        if config.draft_vocab_size is not None and config.draft_vocab_size < self.loaded.config.vocab_size:
            self.loaded.model.lm_head = trimmed_head(self.loaded.model.lm_head, config.draft_vocab_size)
        set_qmatmul(self.loaded.model, args.qmatmul)
        draft_kv = KVCacheConfig.for_model(self.loaded.config, kv_config.num_blocks, kv_config.block_size,
                                           kv_config.dtype)
        logger.info("draft model %s: %s; its KV cache %d blocks, %.0f MiB", config.model, self.loaded.weights_storage,
                    draft_kv.num_blocks, draft_kv.total_bytes / (1 << 20))
        self.runner = ModelRunner(self.loaded.model, allocate_kv_storage(draft_kv), kv_config.block_size,
                                  get_attention_backend(args.attention_backend), fused_decode=not args.enforce_eager,
                                  layer_groups=draft_kv.layer_groups)
        self.block_table = context.block_table
        self.block_size = kv_config.block_size
        self.tables_seen: dict[int, list[int]] = {}  # per sequence: its table's entries under the valid K/V
        self.draft_seconds = 0.0

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        table = self.block_table(seq_id)
        st = self.runner.states.get(seq_id)
        if st is None:
            st = SeqState(params=_GREEDY, token_ids=[], num_prompt_tokens=len(token_ids), seq_id=seq_id, index=0,
                          block_ids=(table,), num_computed_tokens=0)
            self.runner.states[seq_id] = st
        st.block_ids = (table,)
        valid = self._valid(st, token_ids, table)
        st.token_ids, st.num_computed_tokens = list(token_ids), valid
        drafts: list[int] = []
        step = token_ids[valid:]
        while len(drafts) < k:
            out = self.runner.execute_model(SchedulerOutput(scheduled_token_ids={seq_id: step}))
            sampled = out.sampled.get(seq_id)
            if not sampled:  # the draft's sampling failed: no (more) drafts this time
                break
            drafts.append(sampled[0].token_id)
            step = [drafts[-1]]
        # the K/V of every token but the last draft is now written
        self.tables_seen[seq_id] = list(table[:-(-st.num_computed_tokens // self.block_size)])
        return drafts

    def _valid(self, st: SeqState, token_ids: list[int], table: list[int]) -> int:
        """How many leading tokens' draft K/V still hold: the ones computed for these same tokens, in
        blocks that are still the sequence's."""
        valid = min(st.num_computed_tokens, len(token_ids) - 1)
        seen = self.tables_seen.get(st.seq_id, [])
        for i in range(min(len(seen), -(-valid // self.block_size))):
            if i >= len(table) or seen[i] != table[i]:
                valid = min(valid, i * self.block_size)
                break
        start = max(0, valid - MAX_SPECULATIVE_TOKENS - 1)  # only the last step's drafts can differ
        for i in range(start, valid):
            if st.token_ids[i] != token_ids[i]:
                return i
        return valid

    def finish(self, seq_id: int, output_token_ids: list[int]) -> None:
        self.runner.states.pop(seq_id, None)
        self.tables_seen.pop(seq_id, None)

    def preempted(self, seq_id: int) -> None:
        """Its blocks went back to the pool (other sequences' drafts may write into them): start over."""
        self.finish(seq_id, [])
