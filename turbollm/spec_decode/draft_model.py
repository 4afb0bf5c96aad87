"""Draft-model speculation: a smaller model with the target's tokenizer proposes the next tokens greedily.

The draft runs in the worker that gives the target's step output (`worker/drafter.py`; its runner is
`worker/draft_runner.py`'s, handed in as `ProposerContext.make_draft_runner`), after each target step,
with its own `ModelRunner` and its own paged K/V storage, allocated with the target pool's number of
blocks and addressed through the target sequence's own block table (the same block ids: the scheduler
reserves the blocks for the drafts' positions with their room, `Proposer.needs_blocks`). Per sequence it remembers which tokens' draft K/V are written; on
the next call that count falls back to the first position where the sequence's tokens differ from
the ones the draft computed (the rejected drafts) or where the block table changed (copy-on-write),
and to zero after a preemption (`preempted`: the blocks may have served others meanwhile); the
draft catches up from there in one step (the prompt at the first call, then the last verified
tokens) that also drafts the first token, then drafts one token per step. Drafts are greedy (the
argmax of the draft's logits), so verification is rejection sampling with a one-hot q.

`check_draft_model` (called by the engine before any weights load) refuses a draft whose tokenizer
differs from the target's, one with more parameters than the target, and models with
sliding-window layers (their block tables are not the target's).
"""

from __future__ import annotations

import time

from torch import nn

from turbollm.config import ModelConfig
from turbollm.errors import InvalidRequestError
from turbollm.layers.embedding import LMHead
from turbollm.quantization.qtensor import mark_ggml
from turbollm.spec_decode.adaptive import StepCosts
from turbollm.spec_decode.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from turbollm.spec_decode.proposers import Proposer, ProposerContext, register_proposer


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
        if context.block_table is None or context.make_draft_runner is None:
            raise InvalidRequestError("speculative_config: a draft model runs inside a worker (no worker context)")
        self.runner = context.make_draft_runner(config)  # worker/draft_runner.py: the model, its K/V
        self.block_table = context.block_table
        self.block_size = context.block_size
        # per sequence: the tokens the draft computed (the K/V of all but the last are written), and its
        # table's entries under them
        self.computed: dict[int, list[int]] = {}
        self.tables_seen: dict[int, list[int]] = {}
        # the draft's step time by tokens computed (catch-up steps compute several): a further draft
        # token costs a one-token step
        self.costs = StepCosts(16)

    @property
    def seconds_per_draft(self) -> float:
        return self.costs.step_seconds(1)  # 0 before anything was measured: drafts start out cheap

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        table = self.block_table(seq_id)
        valid = self._valid(seq_id, token_ids, table)
        tokens, drafts = list(token_ids), []
        while len(drafts) < k:
            t0 = time.perf_counter()
            t = self.runner.run(seq_id, tokens, valid, table)
            self.costs.observe(len(tokens) - valid, time.perf_counter() - t0)  # (a prompt's prefill: too long)
            if t is None:  # the draft's sampling failed: no (more) drafts this time
                break
            valid = len(tokens)
            tokens.append(t)
            drafts.append(t)
        self.computed[seq_id] = tokens[:valid]
        self.tables_seen[seq_id] = list(table[:-(-valid // self.block_size)])
        return drafts

    def _valid(self, seq_id: int, token_ids: list[int], table: list[int]) -> int:
        """How many leading tokens' draft K/V still hold: the ones computed for these same tokens, in
        blocks that are still the sequence's."""
        done = self.computed.get(seq_id, [])
        valid = min(len(done), len(token_ids) - 1)
        seen = self.tables_seen.get(seq_id, [])
        for i in range(min(len(seen), -(-valid // self.block_size))):
            if i >= len(table) or seen[i] != table[i]:
                valid = min(valid, i * self.block_size)
                break
        for i in range(max(0, valid - MAX_SPECULATIVE_TOKENS - 1), valid):  # only the last drafts can differ
            if done[i] != token_ids[i]:
                return i
        return valid

    def finish(self, seq_id: int, output_token_ids: list[int]) -> None:
        self.runner.drop(seq_id)
        self.computed.pop(seq_id, None)
        self.tables_seen.pop(seq_id, None)

    def preempted(self, seq_id: int) -> None:
        """Its blocks went back to the pool (other sequences' drafts may write into them): start over."""
        self.finish(seq_id, [])
