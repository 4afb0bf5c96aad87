"""Long-context evaluation through the engine (turbollm/eval/long_context.py): the streamed
per-position log-probs against transformers, buckets, the passkey prompt and its scoring, and
`eval ppl --stream` / `eval passkey` on a tiny model (dense against auto on a sliding-window model:
the same perplexity, less K/V)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from quant_tiny import build_tiny, hf_logits
from turbollm import LLM
from turbollm.cli.main import main
from turbollm.eval.long_context import KEY_LINE, QUESTION, StreamResult, passkey, passkey_prompt, stream_score


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {arch: build_tiny(arch, tmp_path_factory.mktemp(f"long_{arch}")) for arch in ("llama", "gemma3")}


def _text(tmp_path, n: int = 600):
    words = torch.randint(4, 384, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    p = tmp_path / "text.txt"
    p.write_text(" ".join(f"w{i}" for i in words))
    return p


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_stream_logprobs_match_transformers(tiny, arch):
    """200 tokens scored as one request in 64-token chunks (gemma3: past its 16-token window, blocks
    released between chunks): every position's log-prob equals transformers' on the whole sequence."""
    import transformers

    ids = torch.randint(4, 384, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(str(tiny[arch]), threads=2, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=201)
    res = stream_score(llm, ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny[arch]), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf_logits(hf, ids), -1)[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0]
    assert res.tokens == 199
    torch.testing.assert_close(torch.tensor(res.nll), -ref, atol=2e-3, rtol=0)
    assert res.peak_kv_bytes > 0 and res.kv_pool_bytes >= res.peak_kv_bytes


def test_buckets_and_perplexity():
    r = StreamResult(5, [math.log(2)] * 3 + [math.log(8)] * 2)
    assert r.by_position(3) == [(1, 3, pytest.approx(2.0)), (4, 5, pytest.approx(8.0))]
    assert r.ppl == pytest.approx(math.exp((3 * math.log(2) + 2 * math.log(8)) / 5))


class _Tok:
    """Whitespace 'tokenizer': one token per word (ids are word lengths: only counts matter here)."""

    def encode(self, text, add_special_tokens=True):
        return [len(w) for w in text.split()]


def test_passkey_prompt_length_and_depth():
    tok = _Tok()
    for depth in (0.0, 0.5, 1.0):
        ids = passkey_prompt(tok, 500, depth, 12345)
        assert 470 <= len(ids) <= 500
    # the key line sits at the asked depth of the filler
    text_start = passkey_prompt(_Words(), 500, 0.0, 12345)
    text_end = passkey_prompt(_Words(), 500, 1.0, 12345)
    assert text_start.startswith(KEY_LINE.format(key=12345))
    assert text_end.endswith(KEY_LINE.format(key=12345) + QUESTION)


class _Words(_Tok):
    """Returns the text itself from encode when asked for the whole prompt (len() still counts words)."""

    def encode(self, text, add_special_tokens=True):
        return text if text.endswith(QUESTION) and len(text.split()) > 40 else super().encode(text)


class _FakeLLM:
    """generate() answers the key for prompts whose key line comes before the middle (a model that
    'forgets' late keys), so the accuracy table has both outcomes."""

    class _Out:
        def __init__(self, text):
            self.outputs = [type("C", (), {"text": text})()]

    def __init__(self):
        self.engine = type("E", (), {"tokenizer": _Words()})()

    def generate(self, prompts, params, use_tqdm=False):
        outs = []
        for p in prompts:
            text = p["prompt_token_ids"]
            key = text.split("secret number is ")[1][:5]
            early = text.index("Remember") < len(text) / 2
            outs.append(self._Out(f" {key}." if early else " 99999."))
        return outs


def test_passkey_counts_what_the_model_answers():
    cells = passkey(_FakeLLM(), [300], [0.0, 0.25, 0.75, 1.0], trials=3, seed=1)
    assert [(c.depth, c.correct, c.trials) for c in cells] == [(0.0, 3, 3), (0.25, 3, 3), (0.75, 0, 3), (1.0, 0, 3)]


def test_eval_ppl_stream_cli_dense_and_auto(tiny, tmp_path, capsys):
    out = tmp_path / "stream.json"
    rc = main(["eval", "ppl", str(tiny["gemma3"]), "--stream", "--ctx", "160", "--kv-policy", "dense", "auto",
               "--data", str(_text(tmp_path)), "--threads", "2", "--bucket", "40", "--max-num-batched-tokens", "32",
               "--json", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    dense, auto = rec["results"]
    assert dense["kv_policy"] == "dense" and auto["kv_policy"] == "auto" and dense["tokens"] == 160
    assert dense["ppl"] == auto["ppl"] and len(dense["ppl_by_position"]) == 4  # the window hides nothing it sees
    assert auto["peak_kv_MiB"] < dense["peak_kv_MiB"]
    assert "ppl by position" in capsys.readouterr().out


def test_eval_ppl_stream_past_the_context(tiny, tmp_path):
    """Dense scores what the model's context takes (and says so); streaming, with and without sinks, the
    whole stream past it at flat K/V memory."""
    out = tmp_path / "stream.json"
    rc = main(["eval", "ppl", str(tiny["llama"]), "--stream", "--ctx", "400", "--kv-policy", "dense", "streaming",
               "--attention-sinks", "4", "0", "--kv-window", "64", "--data", str(_text(tmp_path)), "--threads", "2",
               "--bucket", "100", "--max-num-batched-tokens", "32", "--json", str(out)])
    assert rc == 0
    dense, sinks, window = json.loads(out.read_text())["results"]
    assert dense["tokens"] == 255 and sinks["tokens"] == window["tokens"] == 400
    assert (sinks["attention_sinks"], window["attention_sinks"], sinks["kv_window"]) == (4, 0, 64)
    assert sinks["peak_kv_MiB"] < dense["peak_kv_MiB"] and sinks["ppl"] != window["ppl"]


def test_eval_ppl_stream_segments_and_eviction_budget(tiny, tmp_path):
    """--segments pools several requests by position; --kv-budget reaches the eviction policies only, which
    evict and stay within the budget (plus a chunk) while the window runs beside them."""
    out = tmp_path / "stream.json"
    rc = main(["eval", "ppl", str(tiny["llama"]), "--stream", "--ctx", "200", "--segments", "2", "--kv-policy",
               "auto", "h2o", "snapkv", "--kv-budget", "64", "--data", str(_text(tmp_path)), "--threads", "2",
               "--bucket", "50", "--max-num-batched-tokens", "32", "--json", str(out)])
    assert rc == 0
    rec = json.loads(out.read_text())
    auto, h2o, snap = rec["results"]
    assert rec["segments"] == 2 and auto["tokens"] == h2o["tokens"] == 200
    assert "kv_budget" not in auto and h2o["kv_budget"] == snap["kv_budget"] == 64
    assert h2o["peak_kv_MiB"] < auto["peak_kv_MiB"] and h2o["ppl"] != auto["ppl"] != snap["ppl"]


def test_eval_long_bad_input(tiny, tmp_path, capsys):
    """Clear errors, exit status 1, before anything is scored."""
    text = str(_text(tmp_path))
    for argv, message in (
            (["eval", "ppl", str(tiny["llama"]), "--stream", "--ctx", "400", "--attention-sinks", "4", "--data", text],
             "apply to --kv-policy streaming"),
            (["eval", "ppl", str(tiny["llama"]), "--stream", "--kv-policy", "streaming", "--data", text],
             "needs kv_window"),
            (["eval", "ppl", str(tiny["llama"]), "--kv-window", "64", "--data", text], "apply to --stream only"),
            (["eval", "ppl", str(tiny["llama"]), "--kv-policy", "auto", "--data", text], "apply to --stream only"),
            (["eval", "ppl", str(tiny["llama"]), "--max-num-batched-tokens", "64", "--data", text],
             "apply to --stream only"),
            (["eval", "ppl", str(tiny["llama"]), "--kv-cache-dtype", "float16", "float32", "--data", text],
             "need --stream"),
            (["eval", "ppl", str(tiny["llama"]), "--stream", "--max-tokens", "50", "--data", text],
             "--max-tokens do(es) not apply to --stream"),
            (["eval", "ppl", str(tiny["llama"]), "--stream", "--kv-budget", "64", "--data", text],
             "--kv-budget applies to --kv-policy h2o or snapkv"),
            (["eval", "ppl", str(tiny["llama"]), "--stream", "--segments", "0", "--data", text],
             "--segments must be >= 1"),
            (["eval", "ppl", str(tiny["llama"]), "--segments", "2", "--data", text], "apply to --stream only"),
            (["eval", "passkey", str(tiny["llama"]), "--kv-policy", "nope"], "kv_policy 'nope'"),
            (["eval", "passkey", str(tiny["llama"]), "--depths", "1.5"], "--depths within")):
        assert main(argv) == 1
        assert message in capsys.readouterr().err


def test_plot_by_position_writes_a_png_or_says_it_cannot(tmp_path):
    """With matplotlib (the bench extra): a PNG; without it: False and no file (the CLI then says so)."""
    import importlib.util

    from turbollm.eval.long_context import plot_by_position

    out = tmp_path / "ppl.png"
    made = plot_by_position({"dense": [(1, 10, 5.0), (11, 20, 6.0)], "window": [(1, 10, 5.0)]}, str(out), "t")
    if importlib.util.find_spec("matplotlib") is None:
        assert made is False and not out.exists()
    else:
        assert made and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
