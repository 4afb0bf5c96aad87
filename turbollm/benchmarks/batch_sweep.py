"""How decode throughput grows with the batch: `turbollm bench throughput --batch-sweep 1 4 16 64`.

For each batch size B, B requests of `input_len` random prompt tokens decode `output_len`
greedy tokens together (the latency benchmark's workload, `benchmarks/latency.py`); the
decode tokens/s of the batch is compared with batch 1's. Decode at batch 1 streams every weight
once per token; at batch B the same read serves B tokens, so tokens/s grows until the step
becomes compute-bound (quantized weights: the dot-product kernels' arithmetic).
"""

from __future__ import annotations

from turbollm.benchmarks.latency import run_latency
from turbollm.benchmarks.physics import Ceilings, ModelPhysics


def run_batch_sweep(engine, phys: ModelPhysics, ceilings: Ceilings, batch_sizes: list[int], input_len: int,
                    output_len: int, num_iters: int = 1, warmup: int = 1, seed: int = 0) -> dict:
    """Latency runs at each batch size; rows with decode tok/s and the ratio to the first batch size."""
    rows = []
    for bs in batch_sizes:
        res = run_latency(engine, phys, ceilings, input_len, output_len, bs, num_iters, warmup, seed)
        rows.append({"batch_size": bs, "decode_tok_per_s": res["decode_tok_per_s"],
                     "decode_ms_per_step": res["decode_ms_per_step_mean"],
                     "weights_GBps": res["physics"]["decode"]["weights_GBps"],
                     "GFLOPs": res["physics"]["decode"]["GFLOPs"],
                     "prefill_tok_per_s": res["prefill_tok_per_s"]})
    base = rows[0]["decode_tok_per_s"]
    for r in rows:
        r["x_first_batch"] = round(r["decode_tok_per_s"] / base, 2) if base else None
    return {"input_len": input_len, "output_len": output_len, "rows": rows}


def format_sweep(sweep: dict) -> str:
    """The sweep as a markdown table."""
    lines = ["| batch | decode tok/s | × batch %d | ms/step | weights GB/s | GFLOP/s |" % sweep["rows"][0]["batch_size"],
             "|---:|---:|---:|---:|---:|---:|"]
    for r in sweep["rows"]:
        lines.append(f"| {r['batch_size']} | {r['decode_tok_per_s']:.1f} | {r['x_first_batch']:.2f} | "
                     f"{r['decode_ms_per_step']:.1f} | {r['weights_GBps']:.2f} | {r['GFLOPs']:.1f} |")
    return "\n".join(lines)
