#!/usr/bin/env python
"""The quantization table of docs/QUANTIZATION.md for one model: quality, memory and speed per format.

    python scripts/quant_table.py smollm2-135m --formats none,int8,int4 \\
        --row Q8_0=/tmp/smol-q8_0.gguf --row "GPTQ 4-bit g128=/tmp/smol-gptq4" \\
        --max-tokens 65536 --threads 2 --json /tmp/quant_table.json

Rows: each name in --formats is MODEL loaded with that `--quantization` (`none` = the GGUF's
weights dequantized to fp32: the reference); each --row LABEL=PATH is another checkpoint (an
exported GGUF file, a GPTQ/AWQ folder) loaded as it is.
Quality: `turbollm eval ppl` statistics (library: turbollm.eval.perplexity) against the fp32
reference, every candidate in one pass over the windows (the reference runs once per window).
Speed: `turbollm bench latency` at batch 1, 512 prompt tokens, 128 decode tokens (decode tok/s
and prefill tok/s), one row at a time after the quality pass; with ``--rounds N`` every row N
times, round-robin over the rows (so a slow spell of the machine falls on all of them), and the
table takes each row's median, with the rounds' min–max printed below it. ``--no-quality``: speed
(and resident memory) only.
Columns: bits/weight = 8 x the weights' bytes by their formats' definitions
(`quantization.footprint.format_bytes`: int4 = b-bit codes + fp16 scale + b-bit zero per group,
GGML types their block size; embeddings and norms included) / the reference's parameter count;
resident weight MB = `LoadedModel.weight_bytes` / 1e6; resident ÷ format = the two byte counts'
ratio (what the in-memory layout adds to the format).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time

HEADER = ("| format | bits/weight | resident weight MB | resident ÷ format | perplexity | Δppl | KLD "
          "| top-1 agreement | decode tok/s | prefill tok/s |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="the model whose fp32 weights are the reference (catalog name, GGUF, folder)")
    p.add_argument("--formats", default="none", help="comma-separated --quantization names applied to MODEL")
    p.add_argument("--row", action="append", default=[], metavar="LABEL=PATH",
                   help="another checkpoint as a row (exported GGUF, GPTQ/AWQ folder); repeatable")
    p.add_argument("--max-tokens", type=int, default=65536)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--score", choices=["all", "half"], default="all")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--data", default=None, help="evaluation text (default: WikiText-2 test beside the repository)")
    p.add_argument("--qmatmul", choices=["auto", "q8", "dequant"], default=None,
                   help="the candidates' quantized-matmul path in the quality pass (turbollm.kernels.quant)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens of the latency run")
    p.add_argument("--output-len", type=int, default=128, help="decode tokens of the latency run")
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--no-latency", action="store_true", help="quality and memory only")
    p.add_argument("--no-quality", action="store_true", help="speed and memory only (no perplexity pass)")
    p.add_argument("--rounds", type=int, default=1,
                   help="latency runs per row, round-robin over the rows; the table shows the median")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--compare", default=None, metavar="LABEL",
                   help="also print every row paired against row LABEL on the same tokens: ln(PPL ratio) and "
                        "KLD difference with standard errors over windows")
    ns = p.parse_args(argv)
    ns.rows = [("fp32 reference" if f == "none" else f, ns.model, f) for f in ns.formats.split(",") if f]
    for spec in ns.row:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            p.error(f"--row wants LABEL=PATH, got {spec!r}")
        ns.rows.append((label, path, None))
    if not ns.rows:
        p.error("no rows: give --formats and/or --row")
    if ns.no_quality and ns.no_latency:
        p.error("--no-quality with --no-latency leaves nothing to measure")
    if ns.rounds < 1:
        p.error("--rounds must be at least 1")
    if ns.no_quality and ns.compare is not None:
        p.error("--compare needs the quality pass (drop --no-quality)")
    labels = [r[0] for r in ns.rows]
    if len(set(labels)) != len(labels):
        p.error(f"row labels must be unique: {labels}")
    candidates = [r[0] for r in ns.rows if r[2] != "none"]
    if ns.compare is not None and ns.compare not in candidates:
        p.error(f"--compare {ns.compare!r} is not a candidate row (one of {candidates})")
    return ns


def quality(ns: argparse.Namespace) -> tuple[list[dict], float]:
    """eval-ppl statistics of every row against the fp32 reference; also the reference's parameter count."""
    import torch

    from turbollm.eval.perplexity import (check_window_args, evaluate, load_text, plan_windows, qmatmul_mode,
                                          tokenize_text)
    from turbollm.loader import load_model

    check_window_args(ns.ctx, ns.score, ns.max_tokens, ns.batch)
    text = load_text(ns.data)
    ref = load_model(ns.model, quantization="none")
    ref_params = param_count(ref.model)
    ids, bos = tokenize_text(ref.tokenizer, text)
    plan = plan_windows(ids, ns.ctx, bos, ns.score, ns.max_tokens)
    cands, labels = [], []
    for label, path, q in ns.rows:
        if q == "none" and path == ns.model:
            continue
        with qmatmul_mode(ns.qmatmul):
            cands.append(load_model(path, quantization=q))
        labels.append(label)
        sample = text[:20000]
        if cands[-1].tokenizer.encode(sample, add_special_tokens=False) != ref.tokenizer.encode(
                sample, add_special_tokens=False):
            raise SystemExit(f"row {label!r}: {path} tokenizes the text differently from {ns.model}")
    print(f"quality: {len(plan.windows)} windows of {ns.ctx}, {plan.tokens} scored tokens, "
          f"{len(cands)} candidate(s) + reference", file=sys.stderr)
    res: dict[str, dict] = {}
    if cands:
        res = dict(zip(labels, evaluate(cands, plan, ref, batch=ns.batch, qmatmul=ns.qmatmul)))
        first = res[labels[0]]
        ref_stats = {"windows": first["windows"], "tokens": first["tokens"], "ppl": first["ref_ppl"],
                     "entropy": first["ref_entropy"]}
    else:
        ref_stats = evaluate([ref], plan, batch=ns.batch)[0]
    ref_stats.update(delta_ppl=0.0, delta_ppl_pct=0.0, kld_mean=0.0, kld_p99=0.0, top1_agreement=100.0,
                     entropy_delta=0.0)
    models = dict(zip(labels, cands))
    out = [{**memory_columns(label, path, q, models.get(label, ref), ref_params), **res.get(label, ref_stats)}
           for label, path, q in ns.rows]
    del cands, ref
    gc.collect()
    return out, ref_params


def param_count(model) -> int:
    """Parameters of `model`, a tied table counted once."""
    return sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())


def memory_columns(label: str, path: str, q: str | None, m, ref_params: int) -> dict:
    """A row's identity and memory columns for the loaded model `m`."""
    from turbollm.quantization.footprint import format_bytes

    wb, fb = m.weight_bytes, format_bytes(m.model)
    return {"format": label, "checkpoint": path, "quantization": q, "weight_bytes": wb, "format_bytes": fb,
            "resident_over_format": wb / fb, "bits_per_weight": 8 * fb / ref_params}


def memory_only(ns: argparse.Namespace) -> tuple[list[dict], int]:
    """Rows with the memory columns only (each checkpoint loaded once, in turn)."""
    from turbollm.loader import load_model

    ref = load_model(ns.model, quantization="none")
    ref_params = param_count(ref.model)
    out = []
    for label, path, q in ns.rows:
        m = ref if (q == "none" and path == ns.model) else load_model(path, quantization=q)
        out.append(memory_columns(label, path, q, m, ref_params))
        if m is not ref:
            del m
            gc.collect()
    del ref
    gc.collect()
    return out, ref_params


def latency(ns: argparse.Namespace, label: str, path: str, q: str | None) -> dict:
    """`turbollm bench latency` on one row (batch 1): its results block."""
    from turbollm.cli.bench_perf_cmd import bench_latency
    from turbollm.cli.main import build_parser

    argv = ["bench", "latency", "-m", path, "--input-len", str(ns.input_len), "--output-len", str(ns.output_len),
            "--batch-size", "1", "--num-iters", str(ns.num_iters), "--kv-cache-memory", "0.25"]
    argv += ["--quantization", q] if q else []
    argv += ["--threads", str(ns.threads)] if ns.threads else []
    print(f"latency: {label}", file=sys.stderr)
    rec = bench_latency(build_parser().parse_args(argv))
    gc.collect()
    return rec["results"]


def markdown_row(r: dict) -> str:
    lat = r.get("latency") or {}
    speed = (f"{lat['decode_tok_per_s']:.1f} | {lat['prefill_tok_per_s']:.1f}" if lat else "– | –")
    quality = (f"{r['ppl']:.4f} | {r['delta_ppl']:+.4f} ({r['delta_ppl_pct']:+.2f}%) | {r['kld_mean']:.5f} "
               f"| {r['top1_agreement']:.2f}%" if "ppl" in r else "– | – | – | –")
    return (f"| {r['format']} | {r['bits_per_weight']:.2f} | {r['weight_bytes'] / 1e6:.1f} "
            f"| {r['resident_over_format']:.3f} | {quality} | {speed} |")


def print_paired(rows: list[dict], label: str) -> None:
    """Each candidate row against row `label` on the same scored tokens (window-clustered errors)."""
    from turbollm.eval.perplexity import paired_difference

    base = next(r for r in rows if r["format"] == label)
    print(f"\npaired against {label!r} (mean per scored token; ± one standard error over the "
          f"{len(base['batch_tokens'])} window batches):\n")
    print("| format | ln(PPL / PPL base) | PPL ratio | KLD − KLD base | entropy − entropy base (nats) |\n"
          "|---|---:|---:|---:|---:|")
    for r in rows:
        if "batch_nll" not in r or r is base:
            continue
        d, e = paired_difference(r["batch_nll"], base["batch_nll"], r["batch_tokens"])
        k, ke = paired_difference(r["batch_kl"], base["batch_kl"], r["batch_tokens"])
        h, he = paired_difference(r["batch_entropy"], base["batch_entropy"], r["batch_tokens"])
        print(f"| {r['format']} | {d:+.5f} ± {e:.5f} | {math.exp(d):.4f} | {k:+.5f} ± {ke:.5f} "
              f"| {h:+.4f} ± {he:.4f} |")


def main(argv: list[str] | None = None) -> int:
    import torch

    ns = parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    t0 = time.perf_counter()
    rows, ref_params = memory_only(ns) if ns.no_quality else quality(ns)
    if not ns.no_latency:
        runs: list[list[dict]] = [[] for _ in rows]
        for i in range(ns.rounds):
            for runs_of_row, (label, path, q) in zip(runs, ns.rows):
                runs_of_row.append(latency(ns, f"{label} (round {i + 1}/{ns.rounds})", path, q))
        for r, runs_of_row in zip(rows, runs):
            r["latency_runs"] = runs_of_row
            r["latency"] = {key: statistics.median(run[key] for run in runs_of_row)
                            for key in ("decode_tok_per_s", "prefill_tok_per_s")}
    tokens = "no quality pass" if ns.no_quality else f"{rows[0]['tokens']} WikiText-2 tokens"
    print(f"\n{ns.model}: {tokens}, ctx {ns.ctx}, scoring {ns.score!r}, "
          f"threads {torch.get_num_threads()}, reference = fp32 dequantized GGUF weights "
          f"({ref_params / 1e6:.1f} M parameters)\n")
    print(HEADER)
    for r in rows:
        print(markdown_row(r))
    if not ns.no_latency and ns.rounds > 1:
        print(f"\nspeed over {ns.rounds} rounds (median, min–max):\n")
        print("| format | decode tok/s | prefill tok/s |\n|---|---:|---:|")
        for r in rows:
            cells = []
            for key in ("decode_tok_per_s", "prefill_tok_per_s"):
                v = [run[key] for run in r["latency_runs"]]
                cells.append(f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})")
            print(f"| {r['format']} | {cells[0]} | {cells[1]} |")
    if ns.compare is not None:
        print_paired(rows, ns.compare)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"model": ns.model, "ctx": ns.ctx, "scoring": ns.score, "max_tokens": ns.max_tokens,
                       "qmatmul": ns.qmatmul, "threads": torch.get_num_threads(), "reference_params": ref_params,
                       "seconds": round(time.perf_counter() - t0, 1), "rows": rows}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
