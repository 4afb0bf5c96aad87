"""The offline quantization methods: what each accepts, and how its settings are checked.

`QUANTIZE_METHODS` maps a ``--method`` name to a `MethodSpec` (allowed bits and group sizes,
whether it calibrates, which checkpoint layout it writes, how to build its grid). Every check
here runs before any model weight is read: `validate_options` on the options alone,
`validate_for_model` once the model's config is known (group sizes that divide each layer,
word packing of the layout, which needs K·bits and N·bits to fill whole int32 words).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from turbollm.config import ModelConfig
from turbollm.errors import InvalidRequestError
from turbollm.quantization.checkpoint_layouts import LayoutConfig
from turbollm.quantization.group_quant import QuantGrid

GROUP_SIZES = (32, 64, 128)
GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")


@dataclass(frozen=True)
class MethodSpec:
    name: str
    bits: tuple[int, ...]
    default_bits: int
    calibrates: bool
    layout: str  # checkpoint layout written ("gptq" | "awq")
    act_order: bool = False  # --act-order allowed
    per_channel_bits: tuple[int, ...] = ()  # bit widths that use one group per row (no --group-size)
    description: str = ""

    def group_size(self, bits: int, requested: int | None) -> int:
        """The group size to use (-1: per channel); InvalidRequestError for a combination it refuses."""
        if bits in self.per_channel_bits:
            if requested not in (None, -1):
                raise InvalidRequestError(f"--method {self.name} --bits {bits} is per output channel; "
                                          f"--group-size does not apply (got {requested})")
            return -1
        group = 128 if requested is None else requested
        if group not in GROUP_SIZES:
            raise InvalidRequestError(f"--method {self.name} --bits {bits}: --group-size must be one of "
                                      f"{', '.join(map(str, GROUP_SIZES))}, got {group}")
        return group

    def grid(self, bits: int) -> QuantGrid:
        if bits in self.per_channel_bits:
            return QuantGrid(bits, symmetric=True)
        # GPTQ's v1 layout stores zero - 1 in unsigned fields: a zero point of 0 is not writable
        return QuantGrid(bits, zero_min=1 if self.layout == "gptq" else 0)

    def layout_config(self, bits: int, group: int, act_order: bool) -> LayoutConfig:
        sym = bits in self.per_channel_bits
        return LayoutConfig(self.layout, bits, group, act_order=act_order, symmetric=sym,
                            zero_offset=1 if self.layout == "gptq" else 0)


QUANTIZE_METHODS: dict[str, MethodSpec] = {s.name: s for s in (
    MethodSpec("int8", (8,), 8, False, "gptq", per_channel_bits=(8,),
               description="calibration-free channel equalization, then round-to-nearest, symmetric per "
                           "output channel (written as 8-bit GPTQ)"),
    MethodSpec("int4", (4, 3), 4, False, "gptq",
               description="round-to-nearest, group-wise asymmetric (written as GPTQ without act-order)"),
    MethodSpec("gptq", (4, 3, 8), 4, True, "gptq", act_order=True, per_channel_bits=(8,),
               description="GPTQ: Hessian-based error feedback from calibration activations"),
    MethodSpec("awq", (4,), 4, True, "awq",
               description="AWQ: activation-aware scales folded into the preceding ops, RTN (optional clipping), "
                           "then the logit-scale fit"),
)}


@dataclass
class QuantizeOptions:
    model: str
    method: str
    out: Path
    bits: int | None = None
    group_size: int | None = None
    act_order: bool = False
    calib_samples: int | None = None
    calib_seq_len: int | None = None
    calib_data: str | None = None
    damp: float = 0.01
    awq_search_tokens: int = 2048
    awq_clip: bool | None = None  # None: not given, i.e. no clipping search (see `clip`)
    equalize: bool | None = None  # int8: None (not given) = equalize; False = --no-equalize
    logit_scale: bool | None = None  # gptq/awq: None (not given) = the method's default (`fit_logit_scale`)
    gguf_type: str | None = None
    progress: bool = True
    resolved_bits: int = field(default=0, init=False)
    resolved_group: int = field(default=0, init=False)

    @property
    def clip(self) -> bool:
        """AWQ's weight-clipping search: off unless asked for (it raised qwen2.5-coder-0.5b's
        perplexity from +14.3% to +31.4%, docs/AWQ_QWEN.md)."""
        return bool(self.awq_clip)

    @property
    def clip_flag(self) -> str:
        return "--awq-clip" if self.awq_clip else "--awq-no-clip"

    @property
    def fit_logit_scale(self) -> bool:
        """The logit-scale fit after quantizing (quantize/logit_scale.py): on by default for AWQ, whose
        outputs come out sharper than the reference's (docs/AWQ_QWEN.md), off for GPTQ unless asked."""
        return self.logit_scale if self.logit_scale is not None else self.method == "awq"

    @property
    def logit_scale_flag(self) -> str:
        return "--fit-logit-scale" if self.logit_scale else "--no-fit-logit-scale"

    @property
    def samples(self) -> int:
        return self.calib_samples if self.calib_samples is not None else 128

    @property
    def seq_len(self) -> int:
        return self.calib_seq_len if self.calib_seq_len is not None else 512


def validate_options(opts: QuantizeOptions) -> MethodSpec | None:
    """Check the options alone; returns the method's spec (None for gguf). Fills resolved bits/group."""
    from turbollm.quantize.export_safetensors import check_output_free

    opts.out = Path(opts.out).expanduser()
    methods = (*QUANTIZE_METHODS, "gguf")
    if opts.method not in methods:
        raise InvalidRequestError(f"--method {opts.method!r} is not one of {', '.join(methods)}")
    calib_given = [f for f, v in (("--calib-samples", opts.calib_samples), ("--calib-seq-len", opts.calib_seq_len),
                                  ("--calib-data", opts.calib_data)) if v is not None]
    if opts.method == "gguf":
        given = [f for f, v in (("--bits", opts.bits), ("--group-size", opts.group_size)) if v is not None]
        given += ["--act-order"] * opts.act_order + [opts.clip_flag] * (opts.awq_clip is not None) + calib_given
        given += ["--no-equalize"] * (opts.equalize is not None)
        given += [opts.logit_scale_flag] * (opts.logit_scale is not None)
        if given:
            raise InvalidRequestError(f"--method gguf takes --type, not {', '.join(given)}")
        if opts.gguf_type not in GGUF_TYPES:
            raise InvalidRequestError(f"--method gguf needs --type, one of {', '.join(GGUF_TYPES)}"
                                      + (f" (got {opts.gguf_type!r})" if opts.gguf_type else ""))
        check_output_free(opts.out)
        return None
    spec = QUANTIZE_METHODS[opts.method]
    if opts.gguf_type is not None:
        raise InvalidRequestError(f"--type applies to --method gguf only (got --method {opts.method})")
    bits = spec.default_bits if opts.bits is None else opts.bits
    if bits not in spec.bits:
        raise InvalidRequestError(f"--method {spec.name} supports --bits {' or '.join(map(str, spec.bits))}, "
                                  f"got {bits}")
    if opts.act_order and not spec.act_order:
        raise InvalidRequestError(f"--act-order applies to --method gptq only (got --method {spec.name})")
    if opts.act_order and bits in spec.per_channel_bits:
        raise InvalidRequestError(f"--act-order needs groups; --bits {bits} is per channel")
    if opts.awq_clip is not None and spec.name != "awq":
        raise InvalidRequestError(f"{opts.clip_flag} applies to --method awq only (got --method {spec.name})")
    if opts.equalize is not None and spec.name != "int8":
        raise InvalidRequestError(f"--no-equalize applies to --method int8 only (got --method {spec.name})")
    if opts.logit_scale is not None and not spec.calibrates:
        raise InvalidRequestError(f"{opts.logit_scale_flag} applies to --method gptq or awq only "
                                  f"(got --method {spec.name})")
    if calib_given and not spec.calibrates:
        raise InvalidRequestError(f"--method {spec.name} uses no calibration data; drop {', '.join(calib_given)}")
    if spec.calibrates and (opts.samples < 1 or opts.seq_len < 16):
        raise InvalidRequestError(f"--calib-samples must be >= 1 and --calib-seq-len >= 16, got "
                                  f"{opts.samples} and {opts.seq_len}")
    if not 0 < opts.damp < 1:
        raise InvalidRequestError(f"dampening must be in (0, 1), got {opts.damp}")
    opts.resolved_bits = bits
    opts.resolved_group = spec.group_size(bits, opts.group_size)
    check_output_free(opts.out)
    return spec


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Decoder linear → (K inputs, [N outputs of each checkpoint tensor fused into it])."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv_proj": (cfg.hidden_size, [q, kv, kv]), "o_proj": (q, [cfg.hidden_size]),
            "gate_up_proj": (cfg.hidden_size, [cfg.intermediate_size] * 2),
            "down_proj": (cfg.intermediate_size, [cfg.hidden_size])}


def validate_for_model(spec: MethodSpec, opts: QuantizeOptions, cfg: ModelConfig) -> None:
    """Shape checks against the model (before loading its weights)."""
    bits, group = opts.resolved_bits, opts.resolved_group
    shapes = linear_shapes(cfg)
    if group > 0:
        bad = sorted({k for k, _ in shapes.values() if k % group})
        if bad:
            fits = [str(g) for g in GROUP_SIZES if all(k % g == 0 for k, _ in shapes.values())]
            raise InvalidRequestError(
                f"--group-size {group} does not divide the input width {', '.join(map(str, bad))} of this model's "
                f"layers (widths: {', '.join(str(k) for k in sorted({k for k, _ in shapes.values()}))}); "
                f"group sizes that fit: {', '.join(fits) or 'none'}")
    for name, (k, outs) in shapes.items():
        for n in outs:
            if spec.layout == "gptq" and ((k * bits) % 32 or (n * bits) % 32):
                raise InvalidRequestError(f"{bits}-bit GPTQ packing needs input and output widths whose {bits}-bit "
                                          f"codes fill 32-bit words; {name} is {n}×{k}")
            if spec.layout == "awq" and n % 8:
                raise InvalidRequestError(f"AWQ packing needs output widths divisible by 8; {name} has {n}")
    if spec.calibrates and opts.seq_len > cfg.max_position_embeddings:
        raise InvalidRequestError(f"--calib-seq-len {opts.seq_len} exceeds the model's context of "
                                  f"{cfg.max_position_embeddings} tokens")
