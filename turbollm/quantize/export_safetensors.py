"""Write a quantized model as a Hugging Face folder: safetensors in the GPTQ/AWQ tensor layouts.

The folder holds ``model.safetensors``, ``config.json`` (with ``quantization_config``) and
the tokenizer files (`hf_folder`), so ``LLM(model=DIR)`` — or another tool that reads these
layouts — loads it. Tensor names are Hugging Face's: our fused Q/K/V and gate/up linears are
split back into ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` (each a row
range of the fused codes, scales and zeros; an act-order permutation is shared). Everything
that is not a decoder linear (embeddings, norms, an untied LM head, biases) is written in
float32, exactly as the quantized model computes with it; Gemma norms are written as
``w`` of ``x·(1+w)``, as Hugging Face stores them.

Writes are atomic: everything goes to ``.<name>.partial-<pid>`` beside the target and is
renamed to the target at the end. An existing target is an error before any work; a crashed
or interrupted run leaves only a ``.partial-<pid>`` folder (removed on failure when possible,
and swept by the next run once its process is gone), never a folder that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from turbollm.errors import InvalidRequestError
from turbollm.layers.embedding import LMHead, VocabEmbedding
from turbollm.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from turbollm.layers.norm import RMSNorm
from turbollm.models.common import STACKED_PARAMS
from turbollm.procfs import pid_alive
from turbollm.quantization.checkpoint_layouts import LayoutConfig, QuantLayout
from turbollm.quantization.group_quant import QuantizedWeight
from turbollm.quantize.hf_folder import source_config_dict, write_tokenizer

WEIGHTS_FILE = "model.safetensors"


def check_output_free(out: Path) -> None:
    """An InvalidRequestError when `out` already exists (raised before any work)."""
    if out.exists() or out.is_symlink():
        raise InvalidRequestError(f"--out {out} already exists; remove it or choose another path")


def sweep_stale_partials(out: Path) -> None:
    """Remove ``.<name>.partial-<pid>`` folders of `out` whose process no longer runs."""
    if not out.parent.is_dir():
        return
    for p in out.parent.glob(f".{out.name}.partial-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """Yield a scratch folder that becomes `out` only if the block completes."""
    out = Path(out).expanduser().absolute()
    check_output_free(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_partials(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        check_output_free(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def linear_shards(name: str, layer: LinearBase) -> list[tuple[str, int, int]]:
    """(HF module name, first row, end row) of each checkpoint tensor fused into `layer`."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.q_size, layer.kv_size
        bounds = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    elif isinstance(layer, MergedColumnParallelLinear):
        starts = [sum(layer.output_sizes[:i]) for i in range(len(layer.output_sizes) + 1)]
        bounds = {i: (starts[i], starts[i + 1]) for i in range(len(layer.output_sizes))}
    else:
        return [(name, 0, layer.out_features)]
    shards = []
    for ckpt_frag, our_frag, shard in STACKED_PARAMS:
        ours = our_frag.strip(".")
        if shard in bounds and name.endswith("." + ours):
            shards.append((name[: -len(ours)] + ckpt_frag.strip("."), *bounds[shard]))
    return shards


def hf_tensors(model: nn.Module, results: dict[str, QuantizedWeight], layout: QuantLayout,
               cfg: LayoutConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the quantized checkpoint, by Hugging Face name."""
    tied = model.config.tie_word_embeddings
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            if name not in results:
                raise ValueError(f"{name}: not quantized (every decoder linear must be)")
            qw = results[name]
            for hf_name, a, b in linear_shards(name, module):
                for suffix, t in layout.from_quantized(cfg, qw.rows(a, b)).items():
                    yield f"{hf_name}.{suffix}", t
                if module.bias is not None:
                    yield f"{hf_name}.bias", module.bias.data[a:b].float().clone()
        elif isinstance(module, RMSNorm):
            yield f"{name}.weight", (module.weight.data.float() - module.weight_offset).contiguous()
        elif isinstance(module, LMHead):
            if not tied:
                yield f"{name}.weight", module.weight.data.float().contiguous()
        elif isinstance(module, VocabEmbedding):
            yield f"{name}.weight", module.weight.data.float().contiguous()


def write_quantized_folder(loaded, results: dict[str, QuantizedWeight], layout: QuantLayout, cfg: LayoutConfig,
                           out: Path, extra_config: dict[str, Any] | None = None) -> Path:
    """Write `loaded`'s quantized model to the folder `out` (atomic); returns its path."""
    from safetensors.torch import save_file

    from turbollm.hub.resolve import CheckpointFormat

    source = loaded.resolved.path if loaded.resolved.format is CheckpointFormat.SAFETENSORS else None
    with atomic_folder(out) as tmp:
        tensors = dict(hf_tensors(loaded.model, results, layout, cfg))
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        os.chmod(tmp / WEIGHTS_FILE, 0o644)
        write_tokenizer(tmp, loaded.tokenizer, source)
        config = source_config_dict(source, loaded.config)
        config["quantization_config"] = layout.quantization_config(cfg, **(extra_config or {}))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    return Path(out).expanduser().absolute()
