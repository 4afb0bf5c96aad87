"""`turbollm eval ppl`: window layout, perplexity, KL divergence against a reference, bad input.

A tiny random llama (transformers `save_pretrained`, WordLevel tokenizer over words `w4..w383`)
is evaluated on a generated text; every statistic is checked against a plain loop over
`eval.parity.score`. One smoke test runs smollm2-135m through the CLI on ~1k WikiText tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from turbollm.cli.main import main
from turbollm.eval.parity import score
from turbollm.eval.perplexity import (EvalError, check_window_args, evaluate, load_text,
                                      paired_difference, plan_windows, qmatmul_mode)
from turbollm.loader import load_model

VOCAB = 384
CTX = 16


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A tiny random llama checkpoint whose logits are far from uniform."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("tiny-llama-ppl")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                                   tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "embed" in name else p.shape[-1] ** -0.5))
    hf.float().eval().save_pretrained(str(folder))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", pad_token="<pad>").save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    return load_model(str(tiny_folder))


@pytest.fixture(scope="module")
def perturbed(tiny_folder):
    m = load_model(str(tiny_folder))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in m.model.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("down_proj.weight"):
                p.add_(0.05 * p.abs().mean() * torch.randn(p.shape, generator=g))
    return m


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _direct(plan, cand, ref=None) -> dict:
    """The statistics by a plain loop: each window alone through parity.score, float64 log-softmax."""
    nll, kl, agree = [], [], 0
    ref_nll, ent, ref_ent = [], [], []
    for i, w in enumerate(plan.windows):
        rows = slice(plan.first, plan.first + plan.counts[i])
        t = torch.tensor(plan.targets(i))
        lq = score(cand, [w])[0][rows].double().log_softmax(-1)
        nll += (-lq[torch.arange(len(t)), t]).tolist()
        ent += (-(lq.exp() * lq).sum(-1)).tolist()
        if ref is not None:
            lr = score(ref, [w])[0][rows].double().log_softmax(-1)
            ref_nll += (-lr[torch.arange(len(t)), t]).tolist()
            kl += (lr.exp() * (lr - lq)).sum(-1).tolist()
            ref_ent += (-(lr.exp() * lr).sum(-1)).tolist()
            agree += int((lq.argmax(-1) == lr.argmax(-1)).sum())
    out = {"tokens": len(nll), "ppl": math.exp(sum(nll) / len(nll)), "entropy": sum(ent) / len(ent)}
    if ref is not None:
        k = torch.tensor(kl, dtype=torch.float64)
        out.update(ref_ppl=math.exp(sum(ref_nll) / len(ref_nll)), kld_mean=float(k.mean()),
                   kld_p99=float(torch.quantile(k, 0.99)), top1_agreement=100 * agree / len(nll),
                   ref_entropy=sum(ref_ent) / len(ref_ent))
    return out


# ----------------------------------------------------------------------------- windows
def test_windows_without_bos_do_not_overlap():
    ids = list(range(1000))
    plan = plan_windows(ids, 10)
    assert len(plan.windows) == 100 and plan.first == 0 and plan.counts == [9] * 100 and plan.tokens == 900
    assert [t for w in plan.windows for t in w] == ids  # consecutive, non-overlapping, nothing dropped
    assert all(plan.targets(i) == w[1:] for i, w in enumerate(plan.windows))  # first token is context only


def test_windows_with_bos_score_every_text_token_once():
    ids = list(range(10, 1010))
    plan = plan_windows(ids, 10, bos_id=1)
    assert all(len(w) == 10 and w[0] == 1 for w in plan.windows) and plan.bos
    assert len(plan.windows) == 1000 // 9 and plan.counts == [9] * 111
    assert [t for i in range(len(plan.windows)) for t in plan.targets(i)] == ids[:111 * 9]  # BOS never a target


def test_half_scoring_and_max_tokens():
    plan = plan_windows(list(range(1000)), 10, scoring="half")
    assert plan.first == 5 and plan.counts == [4] * 100 and plan.targets(0) == [6, 7, 8, 9]
    capped = plan_windows(list(range(1000)), 10, max_tokens=95)
    assert len(capped.windows) == 11 and capped.counts == [9] * 10 + [5] and capped.tokens == 95
    assert capped.targets(10) == [101, 102, 103, 104, 105] and len(capped.windows[10]) == 10
    assert plan_windows(list(range(1000)), 10, max_tokens=10**6).tokens == 900  # a cap above the text is no cap


def test_bad_window_arguments(tmp_path):
    with pytest.raises(EvalError, match="at least 2"):
        check_window_args(1)
    with pytest.raises(EvalError, match="no scored token"):
        check_window_args(2, "half")
    with pytest.raises(EvalError, match="less than one window"):
        check_window_args(512, max_tokens=100)
    with pytest.raises(EvalError, match="--batch"):
        check_window_args(512, batch=0)
    with pytest.raises(EvalError, match="unknown scoring"):
        check_window_args(512, "third")
    with pytest.raises(EvalError, match="fewer than one window"):
        plan_windows(list(range(100)), 512)
    with pytest.raises(EvalError, match="not found"):
        load_text(tmp_path / "missing.raw")
    (tmp_path / "empty.raw").write_text(" \n")
    with pytest.raises(EvalError, match="empty"):
        load_text(tmp_path / "empty.raw")


def test_cli_bad_input_fails_before_loading(tmp_path, capsys):
    missing = str(tmp_path / "nope.raw")
    assert main(["eval", "ppl", "no-such-model", "--data", missing]) == 1
    assert "evaluation text not found" in capsys.readouterr().err
    assert main(["eval", "ppl", "no-such-model", "--ctx", "1"]) == 1
    assert "--ctx must be at least 2" in capsys.readouterr().err
    assert main(["eval", "ppl", "no-such-model", "--ctx", "512", "--max-tokens", "10"]) == 1
    assert "less than one window" in capsys.readouterr().err


def test_qmatmul_mode_sets_and_restores():
    """The flag switches the kernels' default path for the models built inside (at load), and back."""
    from turbollm.kernels import quant

    assert quant.DEFAULT_PATH == "auto"
    with qmatmul_mode("q8"):
        assert quant._resolve_path(512, None) == "q8"
    assert quant._resolve_path(1, None) == "q16" and quant._resolve_path(512, None) == "dequant"  # auto
    with pytest.raises(EvalError, match="unknown --qmatmul"):
        with qmatmul_mode("int2"):
            pass
    assert quant.DEFAULT_PATH == "auto"


# ----------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("scoring,bos", [("all", None), ("half", 1)])
def test_ppl_equals_plain_loop(tiny, scoring, bos):
    plan = plan_windows(_ids(CTX * 7 + 3), CTX, bos_id=bos, scoring=scoring, max_tokens=CTX * 5)
    want = _direct(plan, tiny)
    for batch in (1, 3):
        got = evaluate([tiny], plan, batch=batch, progress=False)[0]
        assert got["tokens"] == want["tokens"] == plan.tokens
        assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-5)
        assert got["entropy"] == pytest.approx(want["entropy"], rel=1e-5)
    assert 1 < want["ppl"] < math.inf and 0 < want["entropy"] < math.log(VOCAB)


def test_kl_against_itself_is_zero(tiny):
    plan = plan_windows(_ids(CTX * 4), CTX)
    r = evaluate([tiny], plan, tiny, batch=2, progress=False)[0]
    assert abs(r["kld_mean"]) < 1e-12 and abs(r["kld_p99"]) < 1e-12 and r["top1_agreement"] == 100.0
    assert r["delta_ppl"] == 0 and r["ref_ppl"] == r["ppl"]
    assert r["entropy_delta"] == 0 and r["ref_entropy"] == r["entropy"] > 0


def test_kl_against_perturbed_copy_matches_direct(tiny, perturbed):
    plan = plan_windows(_ids(CTX * 6, seed=3), CTX)
    want = _direct(plan, perturbed, tiny)
    got = evaluate([perturbed], plan, tiny, batch=2, progress=False)[0]
    assert want["kld_mean"] > 1e-4 and got["kld_mean"] == pytest.approx(want["kld_mean"], rel=1e-4)
    assert got["kld_p99"] == pytest.approx(want["kld_p99"], rel=1e-4) and got["kld_p99"] >= got["kld_mean"]
    assert got["top1_agreement"] == pytest.approx(want["top1_agreement"], abs=100 / plan.tokens + 1e-9)
    assert got["top1_agreement"] < 100
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-5)
    assert got["ref_ppl"] == pytest.approx(want["ref_ppl"], rel=1e-5)
    assert got["entropy"] == pytest.approx(want["entropy"], rel=1e-5)
    assert got["ref_entropy"] == pytest.approx(want["ref_entropy"], rel=1e-5)
    assert abs(want["entropy"] - want["ref_entropy"]) > 1e-4  # the perturbation moves the entropy measurably
    assert got["entropy_delta"] == pytest.approx(want["entropy"] - want["ref_entropy"], rel=1e-4)
    assert 0 < got["entropy_delta_stderr"] < math.inf
    assert got["delta_ppl"] == pytest.approx(got["ppl"] - got["ref_ppl"])
    assert got["ln_ppl_ratio"] == pytest.approx(math.log(got["ppl"] / got["ref_ppl"]), rel=1e-9, abs=1e-12)
    assert 0 < got["ln_ppl_ratio_stderr"] < math.inf and sum(got["batch_tokens"]) == plan.tokens
    both = evaluate([tiny, perturbed], plan, tiny, progress=False)  # several candidates, one reference pass
    assert both[0]["kld_mean"] < 1e-12 and both[1]["kld_mean"] == pytest.approx(got["kld_mean"], rel=1e-4)
    # candidates paired against each other: perturbed vs the reference's own copy is the row against the reference
    d, _ = paired_difference(both[1]["batch_nll"], both[0]["batch_nll"], both[1]["batch_tokens"])
    k, _ = paired_difference(both[1]["batch_kl"], both[0]["batch_kl"], both[1]["batch_tokens"])
    # `got` ran 2 windows per pass (32 rows: at::linear), `both` 1 (16 rows: dense_linear's own kernel, which
    # serves up to 16 rows): the two products round differently, ~2e-7 nats per token here
    assert d == pytest.approx(got["ln_ppl_ratio"], rel=1e-6, abs=1e-6) and k == pytest.approx(got["kld_mean"], rel=1e-4)


def test_paired_difference_by_hand():
    """Mean of Σ(a−b)/Σn, error from the batches as units: d = (2, 0, 4) over n = (2, 2, 4), mean 6/8;
    residuals d − n·mean = (0.5, −1.5, 1); variance 3/2 · 3.5 = 5.25; error sqrt(5.25)/8."""
    mean, err = paired_difference([3.0, 1.0, 5.0], [1.0, 1.0, 1.0], [2, 2, 4])
    assert mean == pytest.approx(0.75) and err == pytest.approx(math.sqrt(5.25) / 8)
    assert math.isnan(paired_difference([1.0], [0.0], [3])[1])
    with pytest.raises(EvalError):
        paired_difference([1.0, 2.0], [0.0], [3, 3])


def test_float16_kv_candidate_is_measured_against_float32(tiny, tiny_folder, tmp_path):
    """kv_dtype=float16 rounds the candidate's stored K/V (the reference keeps float32): a small,
    non-zero KL; and the CLI then measures the model against itself instead of skipping the reference."""
    plan = plan_windows(_ids(CTX * 4, seed=5), CTX)
    r = evaluate([tiny], plan, tiny, batch=2, progress=False, kv_dtype=torch.float16)[0]
    assert 0 < r["kld_mean"] < 1e-3 and r["top1_agreement"] > 90
    words = " ".join(f"w{t}" for t in _ids(CTX * 6, seed=6))
    (tmp_path / "text.raw").write_text(words + "\n")
    out = tmp_path / "kv16.json"
    assert main(["eval", "ppl", str(tiny_folder), "--data", str(tmp_path / "text.raw"), "--ctx", str(CTX),
                 "--kv-cache-dtype", "float16", "--threads", "1", "--no-progress", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["kv_cache_dtype"] == "float16" and rec["reference_note"] is None and rec["kld_mean"] > 0
    # against a float16-K/V reference of the same weights: the candidate itself, KL exactly 0
    out16 = tmp_path / "kv16ref16.json"
    assert main(["eval", "ppl", str(tiny_folder), "--data", str(tmp_path / "text.raw"), "--ctx", str(CTX),
                 "--kv-cache-dtype", "float16", "--reference-kv-cache-dtype", "float16", "--threads", "1",
                 "--no-progress", "--json", str(out16)]) == 0
    same = json.loads(out16.read_text())
    assert same["reference_note"].startswith("the candidate is the reference")
    # float32 candidate against the float16 reference: measured with the candidate's own weights
    out32 = tmp_path / "kv32ref16.json"
    assert main(["eval", "ppl", str(tiny_folder), "--data", str(tmp_path / "text.raw"), "--ctx", str(CTX),
                 "--kv-cache-dtype", "float32", "--reference-kv-cache-dtype", "float16", "--threads", "1",
                 "--no-progress", "--json", str(out32)]) == 0
    rev = json.loads(out32.read_text())
    assert rev["reference_kv_cache_dtype"] == "float16" and rev["kld_mean"] == pytest.approx(rec["kld_mean"], rel=0.5)
    # int8 / int4 K/V against float16 (64-token windows, recent window 8: the first 32-token block of each
    # window is read back quantized): some KL, int4 more than int8
    kl = {}
    for name in ("int8", "int4"):
        outq = tmp_path / f"kv{name}.json"
        assert main(["eval", "ppl", str(tiny_folder), "--data", str(tmp_path / "text.raw"), "--ctx", "64",
                     "--kv-cache-dtype", name, "--kv-recent-window", "8", "--reference-kv-cache-dtype", "float16",
                     "--threads", "1", "--no-progress", "--json", str(outq)]) == 0
        r = json.loads(outq.read_text())
        assert r["kv_cache_dtype"] == name and r["kv_recent_window"] == 8
        kl[name] = r["kld_mean"]
    assert 0 < kl["int8"] < kl["int4"], kl


# ----------------------------------------------------------------------------- CLI
def test_cli_tiny_json(tiny_folder, tmp_path, capsys):
    words = " ".join(f"w{t}" for t in _ids(CTX * 10, seed=4))
    (tmp_path / "text.raw").write_text(words + "\n")
    out = tmp_path / "r.json"
    rc = main(["eval", "ppl", str(tiny_folder), "--data", str(tmp_path / "text.raw"), "--ctx", str(CTX),
               "--batch", "4", "--max-tokens", "100", "--threads", "1", "--no-progress", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 100 and r["windows"] == 7 and r["text_tokens"] == CTX * 10 and r["ctx"] == CTX
    assert r["scoring"]["rule"] == "all" and r["bos_per_window"] is False
    assert "the candidate is the reference" in r["reference_note"] and r["kld_mean"] == 0 and r["delta_ppl"] == 0
    for key in ("model", "quantization", "reference", "ppl", "ref_ppl", "delta_ppl_pct", "kld_p99",
                "top1_agreement", "seconds", "tokens_per_s", "date"):
        assert key in r
    assert "eval ppl" in capsys.readouterr().out


@pytest.mark.model
def test_cli_smollm2_smoke(tmp_path):
    from conftest import SHARED_DATA, catalog_model_path

    data = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"
    if not data.is_file():
        pytest.skip(f"{data} is missing")
    out = tmp_path / "smol.json"
    rc = main(["eval", "ppl", str(catalog_model_path("smollm2-135m")), "--data", str(data), "--ctx", "128",
               "--max-tokens", "1016", "--batch", "2", "--threads", "1", "--no-progress", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 1016 and r["windows"] == 8 and r["text_tokens"] > 250_000
    assert 5 < r["ppl"] < 100 and r["quantization"] == "gguf" and r["reference"] == "none"
    assert r["kld_mean"] < 0.01 and r["top1_agreement"] > 95 and r["ref_ppl"] == pytest.approx(r["ppl"], rel=0.02)


def test_quant_table_script_on_tiny(tiny_folder, tmp_path, capsys):
    import importlib.util

    script = Path(__file__).parents[1] / "scripts" / "quant_table.py"
    spec = importlib.util.spec_from_file_location("quant_table", script)
    qt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qt)
    (tmp_path / "text.raw").write_text(" ".join(f"w{t}" for t in _ids(CTX * 6, seed=5)) + "\n")
    out = tmp_path / "table.json"
    assert qt.main([str(tiny_folder), "--formats", "none", "--row", f"copy={tiny_folder}", "--row",
                    f"copy2={tiny_folder}", "--data", str(tmp_path / "text.raw"), "--ctx", str(CTX), "--max-tokens",
                    "60", "--threads", "1", "--input-len", "16", "--output-len", "4", "--num-iters", "1",
                    "--compare", "copy", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert qt.HEADER.splitlines()[0] in printed and "| fp32 reference | 32.00 |" in printed and "| copy |" in printed
    assert "paired against 'copy'" in printed and "| copy2 | +0.00000 ± 0.00000 | 1.0000 | +0.00000 ± 0.00000 |" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == ["fp32 reference", "copy", "copy2"] and rows[1]["tokens"] == 60
    assert rows[1]["kld_mean"] < 1e-12 and rows[1]["ppl"] == pytest.approx(rows[0]["ppl"])
    assert rows[0]["resident_over_format"] == 1.0 and rows[0]["format_bytes"] == rows[0]["weight_bytes"]
    assert rows[0]["latency"]["decode_tok_per_s"] > 0 and rows[1]["latency"]["prefill_tok_per_s"] > 0
    with pytest.raises(SystemExit):
        qt.parse_args(["m", "--row", "no-equals-sign"])
    with pytest.raises(SystemExit):
        qt.parse_args(["m", "--formats", "none,int8", "--compare", "fp32 reference"])


def test_quant_table_speed_only_rounds(tiny_folder, tmp_path, capsys):
    """--no-quality: memory and speed columns only; --rounds 2: two latency runs per row (round-robin),
    the table's speed the median of them."""
    import importlib.util

    script = Path(__file__).parents[1] / "scripts" / "quant_table.py"
    spec = importlib.util.spec_from_file_location("quant_table", script)
    qt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qt)
    out = tmp_path / "table.json"
    assert qt.main([str(tiny_folder), "--formats", "none,int8", "--no-quality", "--rounds", "2", "--threads", "1",
                    "--input-len", "16", "--output-len", "4", "--num-iters", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no quality pass" in printed and "speed over 2 rounds (median, min–max)" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [r["format"] for r in rows] == ["fp32 reference", "int8"] and "ppl" not in rows[1]
    assert rows[1]["bits_per_weight"] < 10 and rows[0]["resident_over_format"] == 1.0
    for r in rows:
        runs = [run["decode_tok_per_s"] for run in r["latency_runs"]]
        assert len(runs) == 2 and r["latency"]["decode_tok_per_s"] == pytest.approx(sum(runs) / 2)
    assert "| int8 | " in printed and "| – | – | – | – |" in printed
    for bad in (["--no-quality", "--no-latency"], ["--rounds", "0"], ["--no-quality", "--formats", "none,int8",
                                                                        "--compare", "int8"]):
        with pytest.raises(SystemExit):
            qt.parse_args(["m", *bad])
