"""Calibration tokens through the decoder, one layer and one residual branch at a time.

Offline quantizers (GPTQ, AWQ) work layer by layer: the calibration tokens' hidden states
``x`` (the residual stream, ``[tokens, hidden]``) enter layer i, each of its two residual
*branches* is quantized with inputs computed by the already-quantized parts before it, and
the branch's output is added to ``x`` for what follows. A `Branch` describes one:

    h = norm(x);  y = inner(h) = second(mix(first(h)));  x = x + post(y)

attention: first = qkv_proj, mix = RoPE + attention, second = o_proj;
MLP:       first = gate_up_proj, mix = act(gate) * up, second = down_proj.
``post`` is Gemma 3's post-branch norm (identity for Llama/Qwen2). The per-architecture
pieces (which norm feeds which branch, the embedding scale) live in `ARCH_ADAPTERS`; a test
holds the branch-wise composition equal to the model's own forward.

This is serving-path code (it describes the architectures, beside them): the offline quantizers
and ``eval branches`` import it from here, and the ``int8`` method's equalization at load reaches
it through the model it is handed (`CausalLM.residual_branches`, `CausalLM.forward_windows`),
since ``turbollm.quantization`` sits below the models. The scale folding on a branch is
``quantization/scale_folding.py``.

`CalibrationRunner` cuts the token windows into batches of whole sequences and builds, once,
a `ForwardBatch` for each (a scratch paged KV cache shared by every layer and batch), so a
layer or branch can be run on any batch: attention sees each window as one causal sequence.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from turbollm.attention import AttentionMetadata, get_attention_backend
from turbollm.attention.kv_storage import LayerKVCache
from turbollm.errors import UnsupportedArchitectureError
from turbollm.layers.linear import LinearBase
from turbollm.layers.norm import RMSNorm
from turbollm.models.forward_batch import ForwardBatch
from turbollm.quantization.scale_folding import expand_group, reduce_group

TOKENS_PER_BATCH = 4096


@dataclass
class Branch:
    """One residual branch of a decoder layer (see the module docstring)."""

    name: str  # "self_attn" | "mlp": the HF module name, prefix of its linears
    norm: RMSNorm
    first: LinearBase
    second: LinearBase
    inner: Callable[[torch.Tensor, ForwardBatch], torch.Tensor]
    post: RMSNorm | None
    # Output rows of `first` whose values reach `second`'s inputs linearly and channel by
    # channel (V rows through attention, up rows through act(gate) * up): scaling them by 1/s
    # and `second`'s matching input columns by s leaves the function unchanged (AWQ). With GQA
    # one V row feeds the same channel of `group` query heads (`expand` / `reduce`).
    feeder: slice
    group: int = 1  # query heads per KV head (attention; 1 for the MLP)
    head_dim: int = 1

    def residual(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + (self.post(y) if self.post is not None else y)

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """Scales of the feeder rows → scales of `second`'s input columns (GQA: repeat per group)."""
        return expand_group(s, self.group, self.head_dim)

    def reduce(self, col_stat: torch.Tensor) -> torch.Tensor:
        """A per-input-column statistic of `second` → per feeder row (GQA: mean over the group)."""
        return reduce_group(col_stat, self.group, self.head_dim)


@dataclass(frozen=True)
class ArchAdapter:
    embed: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (CausalLM, ids) → layer-0 input
    branches: Callable[[nn.Module], list[Branch]]  # decoder layer → its branches, in order


def _attn_branch(layer: nn.Module, post: RMSNorm | None) -> Branch:
    attn = layer.self_attn
    qkv = attn.qkv_proj
    return Branch("self_attn", layer.input_layernorm, qkv, attn.o_proj, lambda h, batch: attn(h, batch), post,
                  slice(qkv.q_size + qkv.kv_size, qkv.q_size + 2 * qkv.kv_size),
                  group=attn.num_heads // attn.num_kv_heads, head_dim=attn.head_dim)


def _mlp_branch(layer: nn.Module, norm: RMSNorm, post: RMSNorm | None) -> Branch:
    mlp = layer.mlp
    inter = mlp.gate_up_proj.output_sizes[0]
    return Branch("mlp", norm, mlp.gate_up_proj, mlp.down_proj, lambda h, batch: mlp(h), post,
                  slice(inter, 2 * inter))


def _llama_branches(layer: nn.Module) -> list[Branch]:
    return [_attn_branch(layer, None), _mlp_branch(layer, layer.post_attention_layernorm, None)]


def _gemma3_branches(layer: nn.Module) -> list[Branch]:
    return [_attn_branch(layer, layer.post_attention_layernorm),
            _mlp_branch(layer, layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)]


def _model_embed(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model.embed(ids)  # CausalLM.embed: the architecture's own (Gemma 3 scales it)


ARCH_ADAPTERS: dict[str, ArchAdapter] = {
    "llama": ArchAdapter(_model_embed, _llama_branches),
    "qwen2": ArchAdapter(_model_embed, _llama_branches),
    "gemma3": ArchAdapter(_model_embed, _gemma3_branches),
}


def get_adapter(arch: str) -> ArchAdapter:
    if arch not in ARCH_ADAPTERS:
        raise UnsupportedArchitectureError(f"offline quantization does not know architecture {arch!r}; "
                                           f"supported: {', '.join(sorted(ARCH_ADAPTERS))}")
    return ARCH_ADAPTERS[arch]


class _Stop(Exception):
    """Raised by a capture hook to end a forward pass early."""


@contextmanager
def capture_input(module: nn.Module, stop: bool = True) -> Iterator[dict]:
    """Record the first positional input of `module` in ``box["x"]``; with `stop`, skip the module
    (and the rest of the forward pass: call through `run_until_captured`)."""
    box: dict = {}

    def hook(mod, args):
        box["x"] = args[0]
        if stop:
            raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


def run_until_captured(fn: Callable[[], object], box: dict) -> torch.Tensor:
    box.pop("x", None)
    try:
        fn()
    except _Stop:
        pass
    if "x" not in box:
        raise RuntimeError("the capture hook did not fire: the module is not on this forward path")
    return box.pop("x")


def spread_indices(n: int, count: int) -> list[int]:
    """`count` indices of ``range(n)`` spread evenly from the first to the last (all when count ≥ n)."""
    if count >= n:
        return list(range(n))
    return sorted({round(i * (n - 1) / max(1, count - 1)) for i in range(count)})


class CalibrationRunner:
    """Token windows ``[S, L]`` cut into batches of whole sequences, each with its ForwardBatch."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, tokens_per_batch: int = TOKENS_PER_BATCH,
                 block_size: int = 16):
        cfg = model.config
        self.model, self.windows = model, windows
        samples, seq_len = windows.shape
        self.seq_len = seq_len
        per = max(1, tokens_per_batch // seq_len)
        blocks_per_seq = -(-seq_len // block_size)
        shape = (per * blocks_per_seq, block_size, cfg.num_kv_heads, cfg.head_dim)
        cache = LayerKVCache.of(torch.zeros(shape), torch.zeros(shape))
        caches = [cache] * cfg.num_layers  # one scratch cache: layers and batches run one at a time
        backend = get_attention_backend()
        self.batches: list[tuple[slice, ForwardBatch]] = []
        for s0 in range(0, samples, per):
            s1 = min(samples, s0 + per)
            n = s1 - s0
            tables = torch.arange(n * blocks_per_seq, dtype=torch.int64).view(n, blocks_per_seq)
            pos = torch.arange(seq_len, dtype=torch.int64)
            slots = (tables[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
            meta = AttentionMetadata(slots, [i * seq_len for i in range(n + 1)], [seq_len] * n, tables, block_size)
            batch = ForwardBatch(windows[s0:s1].reshape(-1), pos.repeat(n), meta, caches, backend)
            self.batches.append((slice(s0 * seq_len, s1 * seq_len), batch))

    @property
    def num_tokens(self) -> int:
        return self.windows.numel()

    def embed(self, adapter: ArchAdapter) -> torch.Tensor:
        """Layer-0 input of every calibration token, float32 ``[tokens, hidden]``."""
        with torch.no_grad():
            return torch.cat([adapter.embed(self.model, b.input_ids) for _, b in self.batches])

    def spread(self, count: int) -> list[int]:
        """Indices of `count` batches spread evenly over all of them (all when count ≥ len)."""
        return spread_indices(len(self.batches), count)
