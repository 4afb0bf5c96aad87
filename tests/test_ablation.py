"""`turbollm bench ablation` (turbollm/ablation/study.py): the configurations it builds from the steps and
the engine's own refusals, the columns and factors it reports, the Markdown section it puts in a file, the
waterfall chart, and the whole command on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from bench_tiny import build_tiny_qwen2
from turbollm.ablation.study import (BASELINE, AblationReport, Config, ablation_steps, agreement, build_configs,
                                     parallel_change, summarize)
from turbollm.ablation.report import compare, markdown, plot_waterfall, replace_section

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


def _cfg(heads: int, kv_heads: int):
    return SimpleNamespace(num_heads=heads, num_kv_heads=kv_heads, num_layers=4, head_dim=16)


def test_parallel_step_follows_the_heads_and_the_cores():
    assert parallel_change(_cfg(12, 2), 2)[0] == {"tensor_parallel_size": 2}
    par, why = parallel_change(_cfg(9, 3), 2)
    assert par == {"pipeline_parallel_size": 2} and "9 query / 3 K/V heads" in why
    assert parallel_change(_cfg(12, 2), 1)[0] is None
    assert [s.key for s in ablation_steps(_cfg(12, 2), 1, 8, SPEC, "gguf")] == [
        "int8", "4bit", "fused", "batching", "prefix", "spec", "kv-int8"]


def test_configs_stack_in_order_and_leave_one_out_reverts_a_whole_technique():
    steps = ablation_steps(_cfg(12, 2), 2, 8, SPEC, "int4")
    configs = build_configs("smollm2-135m", steps, {"kv_cache_memory": 1 << 26, "max_model_len": 256, "seed": 0})
    base = configs[0]
    assert base.kind == "baseline" and all(base.engine[k] == v for k, v in BASELINE.items())
    added = [c for c in configs if c.kind == "step"]
    assert len(added) == len(steps)
    for prev, c, s in zip([base] + added, added, steps):  # each step = the one before + its own change
        assert c.engine == {**prev.engine, **s.change}
    full = added[-1].engine
    assert full["quantization"] == "int4" and full["tensor_parallel_size"] == 2 and not full["enforce_eager"]
    loo = {c.name: c for c in configs if c.kind == "leave-one-out"}
    assert len(loo) == 7  # weights (int8 and 4-bit together), fused, batching, prefix, spec, K/V, parallel
    weights = next(c for n, c in loo.items() if "INT8 weights and 4-bit" in n)
    assert weights.engine == {**full, "quantization": "none"}
    fused = next(c for n, c in loo.items() if "fused" in n)
    assert fused.engine["enforce_eager"] and fused.engine["attention_backend"] == "torch"
    # int8 weights, which tensor parallelism refuses, are never on together with it: every configuration runs
    assert not [c.name for c in configs if c.skipped]


def test_a_step_the_stack_refuses_is_skipped_and_the_stack_goes_on():
    steps = ablation_steps(_cfg(9, 3), 2, 8, SPEC, "gguf")  # pipeline parallelism: refused with speculation
    configs = build_configs("smollm2-135m", steps, {"kv_cache_memory": 1 << 26, "max_model_len": 256, "seed": 0})
    par = next(c for c in configs if c.kind == "step" and "pipeline" in c.name)
    assert par.skipped and "speculative decoding" in par.skipped
    assert not any("pipeline" in c.name for c in configs if c.kind == "leave-one-out")
    full = [c for c in configs if c.kind == "step" and not c.skipped][-1]
    assert full.engine["pipeline_parallel_size"] == 1 and full.engine["kv_cache_dtype"] == "int8"


def test_agreement_counts_the_tokens_before_the_first_difference():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert agreement(ref, ref) == 1.0
    assert agreement([[1, 2, 9, 4], [5, 6, 7, 8]], ref) == pytest.approx((0.5 + 1.0) / 2)
    assert agreement([[9, 2, 3, 4], [5, 6, 7]], ref) == pytest.approx((0 + 0.75) / 2)


def _run(tok_s: float, seconds: float = 2.0) -> dict:
    n = int(tok_s * seconds)
    return {"seconds": seconds, "output_tokens": n, "steps": 10, "ttft": [0.1, 0.2, 0.3], "itl": [0.01, 0.02, 0.05],
            "tpot": [0.02, 0.025, 0.03], "tokens": [[1, 2, 3], [4, 5, 6]], "kv_tokens": 512, "most_running": 2,
            "peak_bytes": 3 << 29, "prefix_cache_hits": 10, "prefix_cache_queries": 40, "preemptions": 0,
            "spec_drafted": None, "spec_accepted": None}


def _report(tmp_rates: dict[str, list[float]]) -> AblationReport:
    steps = ablation_steps(_cfg(12, 2), 1, 4, SPEC, "gguf")
    configs = build_configs("m", steps, {"kv_cache_memory": 1 << 26, "max_model_len": 256, "seed": 0})
    rep = AblationReport("m", {"date": "2026-12-06", "cpu": "cpu", "cores": 1, "requests": 2,
                               "system_prompt_tokens": 10, "prompt_tokens_mean": 20.0, "new_tokens": 3,
                               "kv_cache_memory_mib": 64.0, "kv_budget_note": "note", "repeats": 3, "spec": SPEC,
                               "parallel": "one core", "ppl": {"tokens": 256, "ctx": 64}},
                         configs, {"none/float32": 10.0, "int8/float32": 10.1, "gguf/float32": 10.5,
                                   "gguf/int8/32": 10.6, "none/int8/32": 10.05})
    ref = [[1, 2, 3], [4, 5, 6]]
    for c in configs:
        rates = tmp_rates.get(c.kind, [10.0, 11.0, 12.0])
        c.runs = [summarize(_run(r), ref) for r in rates]
    return rep


def test_summary_factors_and_markdown():
    s = summarize(_run(50.0), [[1, 2, 3], [4, 5, 7]])
    assert s["out_tok_s"] == pytest.approx(50.0) and s["per_user_tok_s"] == pytest.approx(40.0)
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["itl_p99_ms"] == pytest.approx(50.0)
    assert s["agreement"] == pytest.approx((1 + 2 / 3) / 2) and s["prefix_hit"] == 0.25 and s["peak_gib"] == 1.5
    rep = _report({"baseline": [10.0, 11.0, 12.0], "step": [20.0, 22.0, 24.0]})
    d = rep.to_dict()
    st = d["stacked_speedup"]
    assert st["median"] == pytest.approx(2.0) and st["min"] == pytest.approx(20 / 12) and st["max"] == 2.4
    assert len(d["step_factors"]) == 7 and d["step_factors"][1]["median"] == pytest.approx(1.0)
    assert rep.ppl_change(rep.configs[1]) == pytest.approx(0.01)
    json.dumps(d)  # plain data all the way
    md = markdown(rep, "turbollm bench ablation m")
    assert "**Whole stack over the baseline: 2.00×**" in md and "| baseline | 11.0 (10.0–12.0) | 1.00 |" in md
    assert "+1.00%" in md and "+6.00%" in md  # Δppl of INT8 weights, of 4-bit weights with int8 K/V
    assert md.count("\n| - ") == 6  # leave-one-out rows (no parallel step on one core)
    # a rerun within ±15% everywhere, then one whose baseline was 20% faster (every factor over it moves too)
    again = _report({"baseline": [10.5, 11.5, 12.0], "step": [21.0, 22.0, 23.0]}).to_dict()
    table, ok = compare(d, again)
    assert ok and "| stacked speedup | 2.00 |" in table and "outside" not in table
    faster = _report({"baseline": [13.0, 13.5, 14.0], "step": [20.0, 22.0, 24.0]}).to_dict()
    table, ok = compare(d, faster)
    assert not ok and "| baseline | 11.00 | 13.50 | 1.23 (outside ±15%) |" in table


def test_section_replaced_in_place_and_waterfall_drawn(tmp_path):
    text = "# Ablation\n\nintro\n"
    once = replace_section(text, "m", "### m\nfirst")
    twice = replace_section(replace_section(once, "other", "### other\nx"), "m", "### m\nsecond")
    assert "first" not in twice and "second" in twice and "### other" in twice and twice.startswith("# Ablation")
    assert twice.count("<!-- ablation:m -->") == 1 and twice.index("### m") < twice.index("### other")
    png = tmp_path / "w.png"
    plot_waterfall(_report({"step": [15.0, 16.0, 17.0]}), str(png))
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000


def test_process_tree_peak_counts_children_and_restarts():
    import time

    from turbollm.procfs import descendants, reset_tree_peak, tree_peak_bytes

    code = "import numpy as np, time; a = np.ones(80_000_000 // 8); a += 1; del a; time.sleep(4)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(2.0)
        assert child.pid in descendants()
        own = tree_peak_bytes(child.pid)  # the child's own peak: its array, freed since
        assert own > 80_000_000
        assert tree_peak_bytes() >= own + 10_000_000  # this process's peak added to it
        reset_tree_peak(child.pid)  # the peak starts again from what it holds now
        assert tree_peak_bytes(child.pid) < own - 60_000_000
    finally:
        child.kill()
        child.wait()


def test_bad_speculative_config_is_refused_before_anything_runs(capsys):
    from turbollm.cli.main import main

    assert main(["bench", "ablation", "smollm2-135m", "--speculative-config", "{nope"]) == 1
    assert "not JSON" in capsys.readouterr().err
    assert main(["bench", "ablation", "smollm2-135m", "--speculative-config", '{"method": "magic"}']) == 1
    assert "magic" in capsys.readouterr().err


@pytest.mark.slow
def test_ablation_end_to_end_on_a_tiny_model(tmp_path):
    """Every configuration of the tiny model runs in its own process: the baseline's greedy tokens are the
    reference, each lossless step repeats them, the K/V budget bounds the batch until K/V is quantized, and the
    report's files are written."""
    from turbollm.ablation.study import run_ablation

    model = build_tiny_qwen2(tmp_path / "tiny")
    rep = run_ablation(str(model), num_prompts=4, max_input_len=12, max_tokens=6, repeats=1, four_bit="int4-g32",
                       kv_cache_memory=1 << 17, ppl_tokens=256,
                       ppl_ctx=64, system_prompt="you are a helpful assistant . " * 8,
                       log=lambda m: None)
    assert not [c.skipped for c in rep.configs if c.skipped and c.skipped.startswith("failed")]
    ran = [c for c in rep.configs if not c.skipped]
    assert all(len(c.runs) == 1 for c in ran) and len(ran) >= 12
    by = {c.name: c for c in rep.configs}
    assert by["baseline"].runs[0]["agreement"] == 1.0 and by["baseline"].runs[0]["most_running"] == 1
    fused = by["+ fused kernels + tiled attention"].runs[0]
    assert fused["agreement"] == 1.0  # the same numbers through the fused path
    batch = by["+ continuous batching (up to 4)"].runs[0]
    assert 1 < batch["most_running"] <= 4
    kv = next(c for c in rep.configs if c.name.startswith("+ INT8 K/V")).runs[0]
    assert kv["kv_tokens"] > 2 * batch["kv_tokens"]  # the same memory holds more tokens
    assert by["+ prefix caching"].runs[0]["prefix_hit"] > 0
    assert isinstance(rep.quality["none/float32"], float) and rep.ppl_change(by["baseline"]) == 0.0
    md = markdown(rep, "cmd")
    assert "Whole stack over the baseline" in md
    for c in ran:
        assert c.runs[0]["out_tok_s"] > 0 and c.runs[0]["peak_gib"] > 0.05
