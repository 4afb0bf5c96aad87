"""The setting block every benchmark prints first, result printing, and the `--json FILE` output."""

from __future__ import annotations

import json
import platform
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from turbollm.benchmarks.physics import Ceilings, ModelPhysics, measure_read_bandwidth


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display), or None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def checkpoint_types(resolved) -> dict[str, dict]:
    """Tensor storage types of the checkpoint file(s): type → {tensors, MB}."""
    from turbollm.hub.resolve import CheckpointFormat

    count: Counter = Counter()
    size: Counter = Counter()
    if resolved.format is CheckpointFormat.GGUF:
        from turbollm.formats.gguf_file import read_gguf

        for t in read_gguf(resolved.path).tensors.values():
            count[t.type_name] += 1
            size[t.type_name] += t.nbytes
    else:
        from safetensors import safe_open

        for f in sorted(Path(resolved.path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    dtype, shape = sl.get_dtype(), sl.get_shape()
                    n = 1
                    for d in shape:
                        n *= d
                    count[dtype] += 1
                    size[dtype] += n * torch.empty(0, dtype=_st_dtype(dtype)).element_size()
    return {k: {"tensors": count[k], "MB": round(size[k] / 1e6, 1)} for k in sorted(count, key=lambda k: -size[k])}


def _st_dtype(name: str) -> torch.dtype:
    return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
            "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}.get(name, torch.float32)


def model_setting(resolved, config, phys: ModelPhysics) -> dict[str, Any]:
    """Model, checkpoint types, how the weights are held, resident weights and what a step reads."""
    return {
        "model": resolved.name, "path": str(resolved.path), "format": resolved.format.value, "arch": config.arch,
        "layers": config.num_layers, "hidden": config.hidden_size, "heads_q_kv": f"{config.num_heads}:{config.num_kv_heads}",
        "vocab": config.vocab_size, "tied_embeddings": config.tie_word_embeddings,
        "checkpoint_types": checkpoint_types(resolved),
        "weights_dtype": phys.weights_storage,
        "weights_resident_MB": round(phys.weight_bytes / 1e6, 1),
        "weights_read_per_step_MB": round(phys.step_weight_bytes / 1e6, 1),
        "linear_params_M": round(phys.linear_params / 1e6, 2),
        "lm_head_params_M": round(phys.lm_head_params / 1e6, 2),
        "kv_bytes_per_token": sum(phys.kv_layer_bytes),
    }


def machine_setting(ceilings: Ceilings) -> dict[str, Any]:
    """The machine block of a benchmark's setting: the ceilings the percentages use, and the read
    bandwidth measured now (a quarter-second sum of 256 MB) to judge them by."""
    return {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "ceiling_bandwidth_GBps": ceilings.bandwidth_gbs, "ceiling_fp32_GFLOPs": ceilings.fp32_gflops,
            "measured_read_GBps": round(measure_read_bandwidth(), 1)}


def engine_setting(args) -> dict[str, Any]:
    """The engine arguments, the quantized-matmul path spelled out (None: the kernels' default)."""
    from turbollm.kernels.quant import DEFAULT_PATH

    d = asdict(args)
    d.pop("model", None)
    d["qmatmul"] = args.qmatmul or DEFAULT_PATH
    return d


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.1f}"
    if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
        return ", ".join(f"{k} " + " ".join(f"{a}={b}" for a, b in x.items()) for k, x in v.items())
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def print_block(title: str, rec: dict[str, Any], indent: int = 2) -> None:
    """`== title ==` then one `key: value` line per entry; nested blocks indented."""
    print(f"== {title} ==")
    _print_items(rec, indent)


def _print_items(rec: dict[str, Any], indent: int) -> None:
    width = max((len(k) for k in rec), default=0)
    for k, v in rec.items():
        if isinstance(v, dict) and v and k != "checkpoint_types":
            print(" " * indent + f"{k}:")
            _print_items(v, indent + 2)
        else:
            print(" " * indent + f"{k:<{width}}  {_fmt(v)}")


def write_json(path: str | None, obj: dict[str, Any]) -> None:
    if not path:
        return
    p = Path(path)
    if p.parent and not p.parent.exists():
        p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=2, default=str) + "\n", encoding="utf-8")
    print(f"results written to {p}")
