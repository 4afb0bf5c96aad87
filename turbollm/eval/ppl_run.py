"""WikiText-2 perplexity of one configuration, measured by `turbollm eval ppl` in a process of its own (the
tuner's quality bound and the ablation's quality column)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from turbollm.errors import BenchmarkError


def wikitext_ppl(model: str, quantization: str | None, kv: str, tokens: int = 2048, ctx: int = 512,
                 dtype: str | None = None, kv_recent_window: int | None = None) -> float:
    """Perplexity of `model` with weights `quantization` (None: the file's own) and K/V `kv` (int8 / int4:
    `kv_recent_window` newest tokens in float16, None: the default) on the first `tokens` tokens of WikiText-2,
    windows of `ctx`."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, "-m", "turbollm", "eval", "ppl", model, "--no-reference", "--no-progress",
               "--max-tokens", str(tokens), "--ctx", str(ctx), "--kv-cache-dtype", kv, "--json", f.name]
        if quantization:
            cmd += ["--quantization", quantization]
        if dtype:
            cmd += ["--dtype", dtype]
        if kv_recent_window is not None:
            cmd += ["--kv-recent-window", str(kv_recent_window)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise BenchmarkError(f"eval ppl failed for {quantization or 'file'} weights, {kv} K/V: "
                                 f"{out.stderr[-800:]}")
        with open(f.name) as fh:
            return float(json.load(fh)["ppl"])
