"""A decoder layer as its residual branches: what the offline quantizers and the int8 method's equalization see.

The calibration tokens' hidden states ``x`` (the residual stream, ``[tokens, hidden]``) enter layer i, and each of
its two residual *branches* reads and adds to it. A `Branch` describes one:

    h = norm(x);  y = inner(h) = second(mix(first(h)));  x = x + post(y)

attention: first = qkv_proj, mix = RoPE + attention, second = o_proj;
MLP:       first = gate_up_proj, mix = act(gate) * up, second = down_proj.
``post`` is Gemma 3's post-branch norm (identity for Llama/Qwen2). The per-architecture pieces (which norm feeds
which branch, the embedding scale) live in `ARCH_ADAPTERS`; a test holds the branch-wise composition equal to the
model's own forward.

This describes the architectures, beside them (serving-path code): the offline quantizers (`turbollm.quantize`,
layer by layer through `quantize/calibration_runner.py`) and ``eval branches`` import it from here, and the ``int8``
method's equalization at load reaches it through the model it is handed (`CausalLM.residual_branches`,
`CausalLM.forward_windows`), since ``turbollm.quantization`` sits below the models. The scale folding on a branch
is ``quantization/scale_folding.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from turbollm.errors import UnsupportedArchitectureError
from turbollm.layers.linear import LinearBase
from turbollm.layers.norm import RMSNorm
from turbollm.models.forward_batch import ForwardBatch
from turbollm.quantization.scale_folding import expand_group, reduce_group


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
