"""Draft-model speculation (turbollm/spec_decode/draft_model.py) on tiny models sharing one tokenizer.

The target drafting for itself is the sharpest check of the draft's K/V bookkeeping (catch-up,
rollback of rejected positions, table changes): its greedy drafts are then the target's own tokens,
so nearly every draft must be accepted, and any stale or misplaced draft K/V shows up as rejections.
A draft with perturbed weights exercises acceptance and rejection alike; outputs stay those of the
target alone, greedy and seeded-sampled, through preemption and n = 2. Bad drafts fail before loading.
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import drafter, proposer_state_gone

from quant_tiny import build_tiny
from turbollm import LLM, SamplingParams
from turbollm.errors import InvalidRequestError
from test_spec_decode import _prompts, _tokens


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    qwen, llama, gemma = (str(build_tiny(a, root / a)) for a in ("qwen2", "llama", "gemma3"))
    other = root / "other_tokenizer"
    shutil.copytree(llama, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["w4"], vocab["w5"] = vocab["w5"], vocab["w4"]  # two tokens swapped: another tokenizer
    (other / "tokenizer.json").write_text(json.dumps(tok))
    noisy = root / "qwen_noisy"  # the target's weights, perturbed: a draft that is right part of the time
    shutil.copytree(qwen, noisy)
    from safetensors.torch import load_file, save_file

    import torch

    g = torch.Generator().manual_seed(1)
    for f in noisy.glob("*.safetensors"):
        w = load_file(str(f))
        w = {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if v.ndim == 2 else v for k, v in w.items()}
        save_file(w, str(f), metadata={"format": "pt"})
    return {"qwen": qwen, "llama": llama, "gemma": gemma, "other": str(other), "noisy": str(noisy)}


def _draft(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k, "adaptive": False}


def test_target_drafting_for_itself_accepts_nearly_everything(models):
    plain = LLM(models["qwen"], kv_cache_memory=1 << 22, threads=2)
    spec = LLM(models["qwen"], kv_cache_memory=1 << 22, threads=2, speculative_config=_draft(models["qwen"]))
    prompts = _prompts(6, seed=2)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert _tokens(spec, prompts[:1], greedy) == _tokens(plain, prompts[:1], greedy)
    assert _tokens(spec, prompts, greedy) == _tokens(plain, prompts, greedy)
    c = spec.engine.scheduler.spec_counts
    assert c["num_draft_tokens"] > 150 and c["num_accepted_tokens"] >= 0.95 * c["num_draft_tokens"], c
    assert proposer_state_gone(spec, drafter(spec).proposer.runner.runner.states)  # the draft's states go with their sequences


def test_other_draft_is_token_exact_through_preemption_and_siblings(models):
    small = dict(kv_cache_memory=12 * 16 * 512, threads=2)  # 12 blocks: preemptions
    plain = LLM(models["qwen"], **small)
    spec = LLM(models["qwen"], **small, speculative_config=_draft(models["noisy"], 3))
    prompts = _prompts(6, seed=13)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _tokens(spec, prompts, greedy) == _tokens(plain, prompts, greedy)
    sampled = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, sampled, use_tqdm=False)]
    assert [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, sampled, use_tqdm=False)] == want
    sched = spec.engine.scheduler
    assert sched.num_preemptions > 0 and 0 < sched.spec_counts["num_accepted_tokens"] < \
        sched.spec_counts["num_draft_tokens"], sched.spec_counts


def test_self_draft_survives_preemption_with_full_acceptance(models):
    """After a preemption the target's blocks change: the draft must recompute, not read stale K/V."""
    small = dict(kv_cache_memory=12 * 16 * 512, threads=2)
    spec = LLM(models["qwen"], **small, speculative_config=_draft(models["qwen"]))
    plain = LLM(models["qwen"], **small)
    prompts = _prompts(6, seed=17)
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert _tokens(spec, prompts, greedy) == _tokens(plain, prompts, greedy)
    sched = spec.engine.scheduler
    c = sched.spec_counts
    assert sched.num_preemptions > 0 and c["num_accepted_tokens"] >= 0.95 * c["num_draft_tokens"], c


@pytest.mark.parametrize("draft,match", [
    ("other", "tokenizer differs"),
    ("qwen-as-draft-of-llama", "larger than the target"),
    ("gemma", "sliding-window"),
    ("no-such-draft", "'model' 'no-such-draft'"),
])
def test_bad_drafts_fail_before_loading(models, draft, match, monkeypatch):
    target = models["llama"] if draft == "qwen-as-draft-of-llama" else models["qwen"]
    name = {"qwen-as-draft-of-llama": models["qwen"]}.get(draft, models.get(draft, draft))
    from turbollm.loader import model_loader

    def no_load(*a, **kw):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr("turbollm.engine.llm_engine.load_model", no_load)
    with pytest.raises(InvalidRequestError, match=match):
        LLM(target, kv_cache_memory=1 << 22, threads=2, speculative_config=_draft(name))
    assert model_loader  # imported: the monkeypatch target exists


def test_trimmed_head_is_the_first_rows_of_the_full_head(models):
    """draft_vocab_size: the draft's head computes exactly the first N logits of the full head."""
    import torch

    from turbollm.layers.embedding import LMHead
    from turbollm.spec_decode.draft_model import trimmed_head

    head = LMHead(384, 64)
    head.weight.data.copy_(torch.randn(384, 64, generator=torch.Generator().manual_seed(0)))
    h = torch.randn(3, 64)
    assert torch.equal(trimmed_head(head, 256)(h), head(h)[:, :256])
    blocks = LMHead(384, 64)  # GGML Q8_0 blocks: rows are independent, so the first rows are a view
    blocks.weight.data.copy_(head.weight.data)
    assert blocks.compress(8)
    assert torch.equal(trimmed_head(blocks, 256)(h), blocks(h)[:, :256])
    spec = LLM(models["qwen"], kv_cache_memory=1 << 22, threads=2, speculative_config={
        **_draft(models["qwen"]), "draft_vocab_size": 256, "quantization": "int8"})
    plain = LLM(models["qwen"], kv_cache_memory=1 << 22, threads=2)
    prompts = _prompts(4, seed=23)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert _tokens(spec, prompts, greedy) == _tokens(plain, prompts, greedy)
    assert drafter(spec).proposer.runner.loaded.model.lm_head.vocab_size == 256
    assert spec.engine.scheduler.spec_counts["num_accepted_tokens"] > 0


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("parallel", [{"distributed_executor_backend": "mp"}, {"tensor_parallel_size": 2}],
                         ids=["mp", "tp2"])
def test_draft_model_runs_in_the_worker_processes(models, parallel):
    """The draft model runs where the target does (worker/drafter.py): in the worker process, and with tensor
    parallelism on the rank that gives the output, loaded whole there. Outputs stay the target's alone under
    the same executor; the engine's process loads no weights."""
    kw = dict(kv_cache_memory=1 << 22, threads=2, **parallel)
    plain = LLM(models["qwen"], **kw)
    prompts = _prompts(4, seed=29)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _tokens(plain, prompts, greedy)
    plain.engine.shutdown()
    # (its head cut to 256 ids: built whole on a tensor-parallel rank too)
    spec = LLM(models["qwen"], **kw, speculative_config={**_draft(models["noisy"], 3), "draft_vocab_size": 256})
    try:
        assert _tokens(spec, prompts, greedy) == want
        c = spec.engine.scheduler.spec_counts
        assert 0 < c["num_accepted_tokens"] < c["num_draft_tokens"], c
        assert spec.engine.loaded is None and spec.engine.scheduler.propose_seconds > 0
    finally:
        spec.engine.shutdown()
