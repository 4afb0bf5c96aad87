"""`bench throughput --backend vllm | openvino` and `bench latency --compare vllm | openvino`: the peers run in
their own interpreters, here this one with stand-in packages on PYTHONPATH, so the JSON contract, the checks on
what comes back and the ratios are tested without vLLM or OpenVINO installed."""

from __future__ import annotations

import json

import pytest

from bench_tiny import bench_ns as _ns, build_tiny_qwen2
from turbollm.errors import BenchmarkError


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-peers"))


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
