"""Parity with Hugging Face `transformers` on the same checkpoint (the oracle for logits).

For each prompt we compare, at every position, the next-token distribution of turbollm
(alone and with all prompts in one flat batch) with transformers' in fp32:
- top-1 agreement wherever the reference's top-1/top-2 logprob margin exceeds `margin`;
- the largest absolute difference over the reference's top-5 logprobs;
and greedy generation of `gen_tokens` tokens through the real engine path, which must
equal the reference's greedy tokens up to the first step whose reference margin is below
`margin` (past a near-tie, fp32 rounding may legitimately pick the other token).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from turbollm.attention import AttentionMetadata, get_attention_backend
from turbollm.attention.kv_quant import RecentMeta
from turbollm.attention.kv_storage import QUANT_FORMATS, KVLayout, LayerKVCache
from turbollm.loader import LoadedModel
from turbollm.models.forward_batch import ForwardBatch

MARGIN = 0.01
TOP5_TOL = 0.01


@dataclass
class PromptParity:
    name: str
    num_tokens: int
    confident_positions: int
    top1_mismatches: int
    max_top5_diff: float
    max_top5_diff_batched: float
    greedy_equal_prefix: int
    greedy_first_tie: int | None  # first step with reference margin < MARGIN (None: none in range)
    greedy_ok: bool

    @property
    def ok(self) -> bool:
        return (self.top1_mismatches == 0 and self.max_top5_diff < TOP5_TOL
                and self.max_top5_diff_batched < TOP5_TOL and self.greedy_ok)


@dataclass
class ParityReport:
    model: str
    prompts: list[PromptParity] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.prompts)

    def as_dict(self) -> dict:
        return {"model": self.model, "ok": self.ok, "seconds": round(self.seconds, 1),
                "prompts": [dict(asdict(p), ok=p.ok) for p in self.prompts]}


def flat_prefill_batch(loaded: LoadedModel, prompts: list[list[int]], block_size: int | None = None,
                       kv_dtype: torch.dtype = torch.float32,
                       kv_recent_window: int = 128) -> tuple[ForwardBatch, list[int]]:
    """One flat prefill batch of `prompts` over a fresh KV cache (of `kv_dtype`) sized for them, and
    the query start offsets (`qsl[i]:qsl[i+1]` are prompt i's rows). No scheduler, no sampler. A
    quantized `kv_dtype` (torch.int8: int8, torch.uint8: int4; 32-token blocks by default) stores
    each prompt's blocks older than its last `kv_recent_window` tokens quantized as they are written,
    so the prompt's own attention reads them back quantized, the newer ones in float16."""
    cfg = loaded.config
    layout = KVLayout(kv_dtype, block_size or (32 if kv_dtype in QUANT_FORMATS else 16), cfg.num_kv_heads,
                      cfg.head_dim, kv_recent_window if kv_dtype in QUANT_FORMATS else 0)
    block_size = layout.block_size
    blocks_per = [-(-len(p) // block_size) for p in prompts]
    total_blocks = sum(blocks_per)
    n = len(prompts)
    # a quantized format's rings: pool blocks past the prompts', ring slots first_ring .. first_ring + n - 1
    first_ring = -(-total_blocks // layout.ring_pool_blocks) if layout.quant else 0
    num_blocks = (first_ring + n) * layout.ring_pool_blocks if layout.quant else total_blocks
    caches = [LayerKVCache.allocate(layout, num_blocks) for _ in range(cfg.num_layers)]
    tables, slots, qsl, first = [], [], [0], 0
    for p, nb in zip(prompts, blocks_per):
        table = list(range(first, first + nb))
        first += nb
        tables.append(table + [0] * (max(blocks_per) - nb))
        slots += [table[i // block_size] * block_size + i % block_size for i in range(len(p))]
        qsl.append(qsl[-1] + len(p))
    meta = AttentionMetadata(torch.tensor(slots), qsl, [len(p) for p in prompts], torch.tensor(tables), block_size)
    if layout.quant:
        qlo = [max(0, len(p) - kv_recent_window) // block_size * block_size for p in prompts]
        # one pass from position 0: the ring holds each prompt from its qlo on, for every row
        meta.recent = RecentMeta(list(range(first_ring, first_ring + n)), [0] * n, [0] * n, qlo,
                                 [q for q, p in zip(qlo, prompts) for _ in p])
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.tensor([i for p in prompts for i in range(len(p))])
    return ForwardBatch(ids, pos, meta, caches, get_attention_backend()), qsl


@torch.inference_mode()
def score(loaded: LoadedModel, prompts: list[list[int]], block_size: int = 16) -> list[torch.Tensor]:
    """Logits [L, vocab] at every position of each prompt, all prompts in one flat batch."""
    batch, qsl = flat_prefill_batch(loaded, prompts, block_size)
    logits = loaded.model.compute_logits(loaded.model(batch))
    return [logits[qsl[i]:qsl[i + 1]] for i in range(len(prompts))]


def _top5_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    lo, lr = ours.float().log_softmax(-1), ref.float().log_softmax(-1)
    idx = lr.topk(5, dim=-1).indices
    return float((lo.gather(-1, idx) - lr.gather(-1, idx)).abs().max())


def _margins(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.float().log_softmax(-1).topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


@torch.inference_mode()
def _reference_greedy(hf, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    out = hf(input_ids=torch.tensor([ids]), use_cache=True)
    past, logits = out.past_key_values, out.logits[0, -1]
    tokens, margins = [], []
    for _ in range(n):
        tok = int(logits.argmax())
        tokens.append(tok)
        margins.append(float(_margins(logits)))
        out = hf(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
    return tokens, margins


def load_reference(loaded: LoadedModel):
    """The transformers model for the same checkpoint, in fp32."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise RuntimeError("parity needs transformers (pip install 'turbollm[test]')") from None
    from turbollm.hub.resolve import CheckpointFormat

    path = loaded.resolved.path
    if loaded.resolved.format is CheckpointFormat.GGUF:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return hf.eval()


def run_parity(loaded: LoadedModel, prompts: dict[str, str], gen_tokens: int = 32, hf=None) -> ParityReport:
    """Compare turbollm with transformers on `prompts` (name → text); see the module docstring."""
    from turbollm.engine_args import EngineArgs
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.sampling_params import SamplingParams

    t0 = time.perf_counter()
    hf = hf if hf is not None else load_reference(loaded)
    tok = loaded.tokenizer
    id_lists = {name: tok.encode(text) for name, text in prompts.items()}
    batched = dict(zip(id_lists, score(loaded, list(id_lists.values()))))
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(loaded.resolved.path), kv_cache_memory=256 << 20,
                                  max_num_batched_tokens=128, kv_cache_dtype="float32"), loaded=loaded)
    report = ParityReport(loaded.resolved.name)
    for name, ids in id_lists.items():
        alone = score(loaded, [ids])[0]
        with torch.inference_mode():
            ref = hf(input_ids=torch.tensor([ids])).logits[0]
        margins = _margins(ref)
        confident = margins > MARGIN
        mism = int(((alone.argmax(-1) != ref.argmax(-1)) & confident).sum())
        ref_tokens, ref_margins = _reference_greedy(hf, ids, gen_tokens)
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=gen_tokens,
                                                                     ignore_eos=True), request_id=name)
        ours = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    ours = o.outputs[0].token_ids
        equal = next((i for i, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b), min(len(ours), len(ref_tokens)))
        first_tie = next((i for i, m in enumerate(ref_margins) if m < MARGIN), None)
        greedy_ok = len(ours) == gen_tokens and (equal == gen_tokens or (first_tie is not None and equal >= first_tie))
        report.prompts.append(PromptParity(name, len(ids), int(confident.sum()), mism, _top5_diff(alone, ref),
                                           _top5_diff(batched[name], ref), equal, first_tie, greedy_ok))
    report.seconds = time.perf_counter() - t0
    return report
