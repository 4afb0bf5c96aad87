"""`turbollm bench spec` end to end on the tiny model: every setting runs, the rows carry the fields the
issue asks for, the outputs equal the baseline's, and a bad config fails before anything loads."""

from __future__ import annotations

import json

import pytest

from quant_tiny import build_tiny
from turbollm.cli.main import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny("qwen2", tmp_path_factory.mktemp("bench_spec")))


def test_bench_spec_runs_every_setting(tiny, tmp_path, capsys):
    out = tmp_path / "spec.json"
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    suffix = json.dumps({"method": "suffix", "num_speculative_tokens": 3})
    rc = main(["bench", "spec", "-m", tiny, "--threads", "2", "--kv-cache-memory", "0.01", "--num-prompts", "2",
               "--max-tokens", "8", "--speculative-config", ngram, suffix, "--batch-sizes", "1", "2",
               "--k-sweep", "1", "2", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    # batch 1: none, ngram, suffix, then each pinned at K = 1 and 2; batch 2: none, ngram, suffix
    assert [(r["setting"], r["batch"], r["K"]) for r in rows] == [
        ("none", 1, "-"), ("ngram", 1, 3), ("suffix", 1, 3), ("ngram", 1, 1), ("ngram", 1, 2), ("suffix", 1, 1),
        ("suffix", 1, 2), ("none", 2, "-"), ("ngram", 2, 3), ("suffix", 2, 3)]
    for r in rows[1:7] + rows[8:]:
        assert r["token_exact"] is True and r["speedup"] > 0 and r["tok_s"] > 0
        assert set(r) >= {"acceptance", "mean_accepted_len", "draft_s", "verify_s"}
    assert "setting:" in capsys.readouterr().out


def test_bench_spec_bad_config_fails_first(tiny, capsys, monkeypatch):
    import turbollm.benchmarks.spec_bench as bench

    monkeypatch.setattr(bench, "run_setting", lambda *a, **k: pytest.fail("a setting ran"))
    rc = main(["bench", "spec", "-m", tiny, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
               '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert rc == 1 and "'num_speculative_tokens' must be 1..7" in capsys.readouterr().err
