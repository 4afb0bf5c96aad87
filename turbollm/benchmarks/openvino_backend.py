"""The OpenVINO GenAI anchor for `turbollm bench throughput --backend openvino --openvino-python PATH`.

OpenVINO GenAI lives in a virtual environment of its own (`pip install torch==2.13.0 openvino-genai==2026.4.1.0
'optimum-intel[openvino]'`; torch named first so that no CUDA build is fetched — installed as `pip install
torch==2.13.0`, then the rest, optimum-intel moved it to 2.14.1 from this machine's disk (a CUDA build, 6 GB of
venv), which exports on the CPU all the same). It runs models
exported to OpenVINO IR by optimum-intel, from the same HF fp32 folder turbollm and vLLM read
(`vllm_backend.hf_fp32_folder`): `optimum-cli export openvino --weight-format {fp32,int8,int4}`, cached under
$TURBOLLM_HOME/openvino/<folder>-<format> (written to a temporary sibling and renamed). int8 is optimum's
per-channel symmetric weight compression, int4 its default group-wise asymmetric scheme (group 128, or 64 / 32
where the model's widths are not multiples of 128, with some layers kept in int8) — as configured by optimum,
not tuned here.

As with vLLM, the exact request token ids and the settings go to a JSON file, `PATH openvino_runner.py
request.json result.json` runs in an empty temporary folder, and the figures come back; a run that does not
generate exactly the requested tokens is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from turbollm.benchmarks.datasets import BenchRequest
from turbollm.benchmarks.peer_process import check_python as peer_python, run_runner, tail as _tail
from turbollm.errors import BenchmarkError

RUNNER = Path(__file__).with_name("openvino_runner.py")
WEIGHT_FORMATS = ("fp32", "int8", "int4")


def check_python(path: str | None) -> Path:
    """The `--openvino-python` interpreter, or a BenchmarkError saying what is wrong with it."""
    return peer_python(path, "--openvino-python", "--backend openvino",
                       "OpenVINO GenAI (python3 -m venv VENV && VENV/bin/pip install torch==2.13.0 "
                       "openvino-genai==2026.4.1.0 'optimum-intel[openvino]')")


def int4_group_size(hf_dir: Path) -> int | None:
    """The int4 group size to ask for: None (optimum's default, 128) when the model's widths are multiples of 128,
    else the largest of 64 and 32 that divides them (smollm2-135m's 576: nncf refuses a group of 128 there)."""
    cfg = json.loads((Path(hf_dir) / "config.json").read_text(encoding="utf-8"))
    widths = [cfg.get("hidden_size", 0), cfg.get("intermediate_size", 0)]
    for group in (128, 64, 32):
        if all(w % group == 0 for w in widths):
            return None if group == 128 else group
    raise BenchmarkError(f"{hf_dir}: widths {widths} take no int4 group of 128, 64 or 32")


def export_command(python: Path, hf_dir: Path, weight_format: str, out: Path) -> list[str]:
    """optimum-intel's export of `hf_dir` to OpenVINO IR with weights in `weight_format`."""
    if weight_format not in WEIGHT_FORMATS:
        raise BenchmarkError(f"OpenVINO weight format {weight_format!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    group = int4_group_size(hf_dir) if weight_format == "int4" else None
    return [str(python), "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(hf_dir),
            "--task", "text-generation-with-past", "--weight-format", weight_format,
            *(["--group-size", str(group)] if group else []), str(out)]


def _ready(folder: Path) -> bool:
    return (folder / "openvino_model.xml").is_file() and (folder / "openvino_model.bin").is_file()


def exported_folder(python: Path, hf_dir: Path, weight_format: str, cache_root: Path | None = None,
                    timeout_s: float | None = 3600) -> tuple[Path, bool]:
    """The OpenVINO IR folder of `hf_dir` in `weight_format` (exported now or found in the cache) and whether it
    was exported now."""
    if cache_root is None:
        from turbollm.hub.catalog import turbollm_home

        cache_root = turbollm_home() / "openvino"
    target = Path(cache_root) / f"{Path(hf_dir).name}-{weight_format}"
    if _ready(target):
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    try:
        proc = subprocess.run(export_command(python, Path(hf_dir), weight_format, tmp), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 or not _ready(tmp):
            raise BenchmarkError(f"optimum-intel's export of {hf_dir} ({weight_format}) failed with exit status "
                                 f"{proc.returncode}; its output ends with:\n{_tail(proc.stderr or proc.stdout)}")
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target, True


def _run(python: Path, request: dict, timeout_s: float | None) -> dict:
    return run_runner("OpenVINO GenAI", python, RUNNER, request,
                      dict(os.environ, OMP_NUM_THREADS=str(request["threads"])), timeout_s)


def _check_lens(got, want: list[int]) -> None:
    if got != want:
        raise BenchmarkError(f"OpenVINO GenAI generated {got if got is None else sum(got)} tokens instead of "
                             f"{sum(want)} (per request: {got}): the figures would not be comparable")


def run_openvino_throughput(python: str | Path, model_dir: str | Path, requests: list[BenchRequest], threads: int,
                            max_num_seqs: int, max_num_batched_tokens: int, kv_cache_gib: int, warmup: bool = True,
                            timeout_s: float | None = None) -> dict:
    """Run the requests through OpenVINO GenAI's continuous-batching pipeline in `python`; its figures."""
    python = check_python(str(python))
    request = {"model": str(Path(model_dir).resolve()), "prompt_token_ids": [list(r.prompt_token_ids) for r in requests],
               "output_lens": [r.output_len for r in requests], "warmup": warmup, "threads": threads,
               "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
               "kv_cache_gib": kv_cache_gib}
    res = _run(python, request, timeout_s)
    _check_lens(res.pop("output_lens", None), [r.output_len for r in requests])
    return res


def run_openvino_latency(python: str | Path, model_dir: str | Path, prompts: list[list[int]], output_len: int,
                         threads: int, warmup: int = 1, timeout_s: float | None = None) -> dict:
    """Each prompt alone through OpenVINO GenAI's `LLMPipeline` (greedy, exactly `output_len` tokens); TTFT and
    time per output token as its perf_metrics give them (the first `warmup` prompts not counted)."""
    python = check_python(str(python))
    if len(prompts) <= warmup:
        raise BenchmarkError("no measured OpenVINO iterations (num_iters must be >= 1)")
    request = {"mode": "latency", "model": str(Path(model_dir).resolve()), "prompts": [list(p) for p in prompts],
               "output_len": output_len, "warmup": warmup, "threads": threads}
    res = _run(python, request, timeout_s)
    _check_lens(res.pop("output_lens", None), [output_len] * len(prompts))
    return res
