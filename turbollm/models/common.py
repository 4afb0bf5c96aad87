"""Pieces shared by the decoder architectures: self-attention, gated MLP, the CausalLM shell.

`CausalLM.load_weights` is the one loading loop for every checkpoint format: it receives
(Hugging Face name, tensor) pairs, routes stacked projections (q/k/v → qkv_proj, gate/up →
gate_up_proj) to their shard, and reports missing, unexpected or mis-shaped tensors by name.
A tensor may be a `QuantizedTensor` (raw GGML blocks): the linear layers and the embeddings
keep it, any other parameter gets it decoded. Once every tensor is in, the linear method may
transform the model as a whole (`process_model_after_loading`), each linear layer's method
finishes its storage (`process_weights_after_loading`), and a dense vocabulary table is
re-encoded when the method asks for it (`LinearMethod.vocab_table_type`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from turbollm.config import ModelConfig
from turbollm.distributed import get_tp
from turbollm.errors import WeightLoadError
from turbollm.layers.activation import GatedActivation
from turbollm.layers.attention import Attention, sink_positions
from turbollm.layers.embedding import LMHead, VocabEmbedding
from turbollm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from turbollm.layers.norm import RMSNorm
from turbollm.layers.rotary import RotaryEmbedding
from turbollm.models.branches import Branch, get_adapter
from turbollm.models.forward_batch import ForwardBatch
from turbollm.models.windows import WindowBatches
from turbollm.quantization import LinearMethod, QuantizedTensor
from turbollm.quantization.qtensor import as_dense, copy_checked


class SelfAttention(nn.Module):
    """QKV projection, optional per-head QK-norm, RoPE, paged attention, output projection."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, method: LinearMethod | None = None,
                 qk_norm_offset: float | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          bias=cfg.attention_bias, method=method)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False, method=method)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        if qk_norm_offset is not None:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, qk_norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, qk_norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.layer_rope_theta(layer_idx),
                                      cfg.layer_rope_scaling(layer_idx), cfg.rope_freq_factors)
        self.attn = Attention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.attention_scale,
                              cfg.layer_window(layer_idx), cfg.attn_logit_softcapping)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        meta = batch.attn_for(self.layer_idx)
        q_sink = q.clone(memory_format=torch.contiguous_format) if meta.sinks else None  # before its rotation
        q, k = self.rotary(batch.positions, q, k, batch.max_position)
        if q_sink is not None:  # the queries at their sink position
            q_sink = self.rotary.rotate_q(sink_positions(batch.positions, meta), q_sink)
        out = self.attn(q, k, v, batch.kv_caches[self.layer_idx], meta, batch.backend, q_sink)
        out = self.o_proj(out)
        if batch.hooks is not None and batch.hooks.attn_out is not None:
            batch.hooks.attn_out(self.layer_idx, out)
        return out


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, method: LinearMethod | None = None, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        align = get_tp().mlp_align  # tensor parallelism: the MLP width split on the down projection's blocks
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, method=method,
                                                       align=align)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, method=method, align=align)
        self.act = GatedActivation(cfg.hidden_act)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        out = self.down_proj(self.act(self.gate_up_proj(x)))
        if batch is not None and batch.hooks is not None and batch.hooks.mlp_out is not None:
            batch.hooks.mlp_out(self.layer_idx, out)
        return out


# checkpoint name fragment → (our parameter fragment, shard id)
STACKED_PARAMS = [
    (".q_proj.", ".qkv_proj.", "q"),
    (".k_proj.", ".qkv_proj.", "k"),
    (".v_proj.", ".qkv_proj.", "v"),
    (".gate_proj.", ".gate_up_proj.", 0),
    (".up_proj.", ".gate_up_proj.", 1),
]


class MissingLayer(nn.Module):
    """A module another pipeline stage holds (`distributed.ParallelState.holds_layer`): no parameters."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module is held by another pipeline stage")


def held(present: bool, build) -> nn.Module:
    """`build()` when this pipeline stage holds the module, else a `MissingLayer`."""
    return build() if present else MissingLayer()


def stage_layers(cfg: ModelConfig, build) -> nn.ModuleList:
    """The decoder layers, `build(i)` for those this pipeline stage runs and `MissingLayer` for the others
    (indices stay global: layer i reads KV cache i)."""
    stage = get_tp()
    return nn.ModuleList(held(stage.holds_layer(i), lambda i=i: build(i)) for i in range(cfg.num_layers))


class CausalLM(nn.Module):
    """Shell shared by the architectures: `model` (the decoder), `lm_head`, weight loading, logits. A
    pipeline stage builds only what it runs (`held`): the first stage the embedding, the last the final
    norm and the LM head (and the embedding when they are tied), each its own range of layers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.lm_head = held(get_tp().is_last_stage, lambda: LMHead(cfg.vocab_size, cfg.hidden_size))
        self.weights_version = 0  # counts load_weights calls (what a built fused step checks)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and isinstance(self.lm_head, LMHead):
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] of every new token (after the final norm)."""
        return self.final_norm(*self.run_layers(self.embed(batch.input_ids), batch))

    # The three pieces of `forward`, for a runner that runs the layers its own way (the fused step,
    # a pipeline stage's slice of them):
    def embed(self, input_ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """Layer 0's input [T, hidden] (`reduce=False`: this tensor-parallel rank's vocabulary share of it)."""
        return self.model.embed(input_ids, reduce)

    def run_layers(self, x: torch.Tensor, batch: ForwardBatch, start: int = 0, end: int | None = None,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoder layers start .. end - 1 through the modules: (block output, residual stream); the
        stream excludes the output until the next norm adds it (None before layer 0)."""
        for layer in self.model.layers[start:end]:
            x, residual = layer(x, residual, batch)
        return x, residual

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.model.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cap_logits(self.lm_head(hidden))

    def cap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The final logit soft-cap, where the architecture has one (identity otherwise)."""
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def residual_branches(self) -> list[Branch]:
        """Every decoder layer's residual branches in order (`models/branches.py: Branch`), for cross-layer
        transforms handed the model (the int8 method's channel equalization). Raises
        UnsupportedArchitectureError for an architecture without a branch adapter."""
        adapter = get_adapter(self.config.arch)
        return [br for layer in self.model.layers for br in adapter.branches(layer)]

    def forward_windows(self, windows: torch.Tensor) -> torch.Tensor:
        """Hidden states of token windows ``[S, L]`` (each one causal sequence) on a scratch KV cache,
        without an engine: for passes that only watch the layers (calibration hooks)."""
        return self(WindowBatches(self, windows, tokens_per_batch=windows.numel()).batches[0][1])

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedTensor]], *, hf_layout: bool,
                     source: str = "checkpoint") -> None:
        """Load (HF name, tensor) pairs; raise WeightLoadError on missing/unexpected/mis-shaped tensors."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, shard = name, None
            for ckpt_frag, our_frag, shard_id in STACKED_PARAMS:
                if ckpt_frag in name:
                    target, shard = name.replace(ckpt_frag, our_frag), shard_id
                    break
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            if isinstance(tensor, QuantizedTensor) and not _keeps_blocks(self, target):
                tensor = as_dense(tensor)
            try:
                if hf_layout and hasattr(param, "hf_weight_loader"):
                    param.hf_weight_loader(param, tensor)
                elif hasattr(param, "weight_loader"):
                    if shard is None:
                        param.weight_loader(param, tensor)
                    else:
                        param.weight_loader(param, tensor, shard)
                else:
                    copy_checked(param, tensor, name)
            except WeightLoadError as e:
                raise WeightLoadError(f"{source}: tensor {name!r}: {e}") from None
            loaded.add(f"{target}#{shard}" if shard is not None else target)
        if unexpected:
            raise WeightLoadError(f"{source}: unexpected tensors not used by the model: {', '.join(unexpected[:10])}"
                                  + (f" (and {len(unexpected) - 10} more)" if len(unexpected) > 10 else ""))
        missing = []
        for pname, param in self.named_parameters():
            if self.config.tie_word_embeddings and pname == "lm_head.weight":
                continue
            layer = self.get_submodule(pname.rsplit(".", 1)[0])
            shards = _expected_shards(layer)
            if shards is None:
                if pname not in loaded:
                    missing.append(pname)
            else:
                missing += [_checkpoint_name(pname, s) for s in shards if f"{pname}#{s}" not in loaded]
        if missing:
            raise WeightLoadError(f"{source}: missing tensors: {', '.join(missing[:10])}"
                                  + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))
        method = next((m.method for m in self.modules() if isinstance(m, LinearBase)), None)
        if method is not None:
            method.process_model_after_loading(self)
        for mname, layer in self.named_modules():
            if isinstance(layer, LinearBase):
                try:
                    layer.method.process_weights_after_loading(layer)
                except WeightLoadError as e:
                    raise WeightLoadError(f"{source}: layer {mname!r}: {e}") from None
        self._compress_vocab_tables()
        self.tie_weights()
        self.weights_version += 1  # a runner's fused step built before holds the old weights

    def _compress_vocab_tables(self) -> None:
        """Store dense vocabulary tables in the linear method's `vocab_table_type`, if it names one."""
        method = next((m.method for m in self.modules() if isinstance(m, LinearBase)), None)
        qtype = method.vocab_table_type if method is not None else None
        if qtype is None:
            return
        if isinstance(self.model.embed_tokens, VocabEmbedding):
            self.model.embed_tokens.compress(qtype)
        if not self.config.tie_word_embeddings and isinstance(self.lm_head, LMHead):
            self.lm_head.compress(qtype)


def _keeps_blocks(model: nn.Module, pname: str) -> bool:
    """Whether parameter `pname` takes raw GGML blocks: an embedding table, or a linear weight whose method does."""
    owner = model.get_submodule(pname.rsplit(".", 1)[0])
    if isinstance(owner, VocabEmbedding):
        return True
    return isinstance(owner, LinearBase) and pname.endswith(".weight") and owner.method.accepts_ggml_blocks


def _checkpoint_name(pname: str, shard) -> str:
    """The checkpoint's name for one shard of a fused parameter (qkv_proj.weight, k → k_proj.weight)."""
    for ckpt_frag, our_frag, shard_id in STACKED_PARAMS:
        if our_frag in pname and shard_id == shard:
            return pname.replace(our_frag, ckpt_frag)
    return f"{pname}[{shard}]"


def _expected_shards(layer: nn.Module) -> list | None:
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return None


def make_embedding(cfg: ModelConfig) -> nn.Module:
    """The token embedding (a `MissingLayer` on a pipeline stage that neither looks tokens up nor ties it)."""
    return held(get_tp().holds_embedding(cfg.tie_word_embeddings), lambda: VocabEmbedding(cfg.vocab_size, cfg.hidden_size))


def make_final_norm(cfg: ModelConfig, build) -> nn.Module:
    """The final norm, on the last pipeline stage only."""
    return held(get_tp().is_last_stage, build)
