"""Speculative decoding in the engine, n-gram (turbollm/spec_decode, Scheduler._drafts,
ModelRunner._verify): outputs token for token those of the same engine without speculation — the
decode path is row-invariant, so a verified row is the decode of that position — alone and batched,
with drafts accepted and rejected, ending at max_tokens, at an end token or a stop string inside
accepted drafts; seeded sampled requests of every setting draw the same tokens as without
speculation; bad configurations fail before loading. The distribution test is test_spec_distribution.py."""

from __future__ import annotations

import pytest
from conftest import drafter, proposer_state_gone
import torch

from quant_tiny import build_tiny
from turbollm import LLM, SamplingParams
from turbollm.errors import InvalidRequestError
from turbollm.spec_decode.proposers import Proposer

# K pinned (adaptive off): these tests are about verification; tests/test_spec_adaptive.py is about K
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "adaptive": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny("qwen2", tmp_path_factory.mktemp("spec")))


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(4, 384, (6 + i,), generator=g).tolist()
        out.append({"prompt_token_ids": base * 3 + base[:2]})  # repetitive: prompt lookup finds drafts
    return out


def _tokens(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


SUFFIX = {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.05, "adaptive": False}


@pytest.mark.parametrize("quantization,config", [(None, SPEC), ("int8", SPEC), (None, SUFFIX)])
def test_greedy_speculation_is_token_exact(tiny, quantization, config):
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2, quantization=quantization)
    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, quantization=quantization, speculative_config=config)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = _prompts(6)
    assert _tokens(spec, prompts[:1], greedy) == _tokens(plain, prompts[:1], greedy)
    assert _tokens(spec, prompts, greedy) == _tokens(plain, prompts, greedy)
    counts = spec.engine.scheduler.spec_counts
    assert counts["num_drafts"] > 0 and 0 < counts["num_accepted_tokens"] < counts["num_draft_tokens"], counts
    for n in (1, 2, 5):  # drafts never run past max_tokens
        p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        assert [len(t) for t in _tokens(spec, prompts, p)] == [n] * len(prompts)
        assert _tokens(spec, prompts, p) == _tokens(plain, prompts, p)


def test_suffix_drafts_from_earlier_requests_outputs(tiny):
    """The global tree: a request like an earlier one is drafted from that one's output."""
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2)
    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config=SUFFIX)
    prompts = _prompts(4, seed=21)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _tokens(plain, prompts, greedy)
    counts = spec.engine.scheduler.spec_counts
    accepted = []
    for _ in range(2):
        before = counts["num_accepted_tokens"]
        assert _tokens(spec, prompts, greedy) == want
        accepted.append(counts["num_accepted_tokens"] - before)
    assert accepted[1] > accepted[0] + 40, accepted
    assert proposer_state_gone(spec, drafter(spec).proposer.requests)  # per-request trees go with their sequences


def test_end_token_inside_accepted_drafts_stops_there(tiny):
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2)
    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config=SPEC)
    prompts = _prompts(4, seed=3)
    ref = _tokens(plain, prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    # make a token of each greedy continuation an end token: generation must stop right at it
    stops = [r[len(r) // 2] for r in ref]
    for prompt, r, stop in zip(prompts, ref, stops):
        p = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop], ignore_eos=True)
        got = _tokens(spec, [prompt], p)[0]
        assert got == _tokens(plain, [prompt], p)[0] == r[:r.index(stop) + 1]


SAMPLED = [
    SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.7, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=9, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=10, max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.5),
    SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3, frequency_penalty=1.0, ignore_eos=True),
    SamplingParams(temperature=0.9, seed=11, max_tokens=16, min_tokens=8, logit_bias={2: 6.0, 40: 2.0}),
]


class GreedyOracle(Proposer):
    """Drafts the target's own greedy continuation (computed by a plain engine): a sampled request
    accepts them often enough (the tiny model's top token carries 10-70% of the mass) to exercise
    acceptance and rejection alike, where prompt lookup on a random model rarely has a guess."""

    def __init__(self, llm: LLM):
        self.llm = llm

    def propose(self, seq_id: int, token_ids: list[int], k: int) -> list[int]:
        return _tokens(self.llm, [{"prompt_token_ids": token_ids}], SamplingParams(temperature=0, max_tokens=k,
                                                                                   ignore_eos=True))[0]


def test_seeded_sampling_draws_the_same_tokens_with_speculation(tiny):
    """Every sampling setting speculates (rows verified with their own history, drafts included), and a
    seeded request draws exactly the tokens it draws without speculation: same logits (row-invariant),
    same penalties and min_tokens mask at each position, same noise (the generator rewound to the rows used)."""
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2)
    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config=SPEC)
    drafter(spec).proposer = GreedyOracle(LLM(tiny, kv_cache_memory=1 << 22, threads=2))
    prompts = _prompts(len(SAMPLED), seed=5)
    for i, params in enumerate(SAMPLED):  # alone: each setting's own drafts are verified
        before = dict(spec.engine.scheduler.spec_counts)
        want = _tokens(plain, prompts[i:i + 1], params)
        assert _tokens(spec, prompts[i:i + 1], params) == want, params
        counts = spec.engine.scheduler.spec_counts
        assert counts["num_accepted_tokens"] > before["num_accepted_tokens"], params
        assert counts["num_accepted_tokens"] - before["num_accepted_tokens"] < \
            counts["num_draft_tokens"] - before["num_draft_tokens"], params  # and rejected some
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, SAMPLED, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, SAMPLED, use_tqdm=False)] == want  # batched


def test_stop_strings_end_the_output_inside_accepted_drafts(tiny):
    """A stop string written by a token in the middle of a verified step ends the output at that token."""
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2)
    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config=SPEC)
    drafter(spec).proposer = GreedyOracle(plain)  # every draft accepted: stops fall inside steps
    prompts = _prompts(4, seed=3)
    ref = plain.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    checked = 0
    for prompt, r in zip(prompts, ref):
        words = r.outputs[0].text.split()
        for stop in (words[len(words) // 2], words[-3]):
            for include in (False, True):
                p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                   include_stop_str_in_output=include)
                a = plain.generate([prompt], p, use_tqdm=False)[0].outputs[0]
                b = spec.generate([prompt], p, use_tqdm=False)[0].outputs[0]
                assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                    (a.token_ids, a.text, a.finish_reason, a.stop_reason) and a.finish_reason == "stop"
                checked += 1
    assert checked == 16 and spec.engine.scheduler.spec_counts["num_accepted_tokens"] > 0


@pytest.mark.parametrize("config,match", [
    ({"method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens"),
    ('{"method": "ngram"', "not valid JSON"),
])
def test_bad_configs_fail_before_loading(config, match):
    with pytest.raises(InvalidRequestError, match=match):
        LLM("no-such-model-is-loaded", speculative_config=config)


def test_row_limit_is_the_kernels_row_invariant_range():
    """The scheduler's row limit is the kernels' row-invariant range, and K's bound their small-query range
    (kernels/limits.py against the built module's own constants)."""
    from conftest import require_kernels
    from turbollm.kernels.limits import ROW_INVARIANT_ROWS, SMALL_QUERY_MAX
    from turbollm.kernels.quant import Q8X2_MAX_TOKENS
    from turbollm.spec_decode.config import MAX_SPECULATIVE_TOKENS

    kernels = require_kernels()  # strict mode: fails if the kernels do not build
    assert ROW_INVARIANT_ROWS == Q8X2_MAX_TOKENS == kernels.dense_max_rows
    assert SMALL_QUERY_MAX == kernels.small_query_max == MAX_SPECULATIVE_TOKENS + 1


def test_steps_stay_within_the_row_invariant_range(tiny):
    """A batch of 8 decodes drafts only as far as 16 rows allow, and stays token-exact."""
    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config=SPEC)
    runner = spec.engine.executor.worker.runner
    sizes, real = [], runner.run_model

    def watch(batch):  # decode and verification steps (the prompts, 20+ tokens each, prefill before)
        if batch.attn.max_query_len <= 8:
            sizes.append(batch.input_ids.numel())
        return real(batch)

    runner.run_model = watch
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2)
    prompts = _prompts(8, seed=9)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert _tokens(spec, prompts, p) == _tokens(plain, prompts, p)
    assert sizes and max(sizes) <= 16 and spec.engine.scheduler.spec_counts["num_drafts"] > 0, sizes


def test_worker_process_verifies_too(tiny):
    """The drafts and the verified tokens cross the process boundary as plain data."""
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2)
    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config=SPEC, distributed_executor_backend="mp")
    prompts = _prompts(6)
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert _tokens(spec, prompts, p) == _tokens(plain, prompts, p)
    assert spec.engine.scheduler.spec_counts["num_accepted_tokens"] > 0


def test_metrics_carry_the_spec_decode_counters(tiny):
    """/metrics: vLLM's spec_decode counters under turbollm:, equal to the scheduler's counts."""
    from prometheus_client import CollectorRegistry, generate_latest

    from turbollm.server.metrics import _EngineCollector

    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config=SPEC)
    _tokens(spec, _prompts(6), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    registry = CollectorRegistry()
    registry.register(_EngineCollector(spec.engine, "tiny"))
    text = generate_latest(registry).decode()
    counts, per_pos = spec.engine.scheduler.spec_counts, spec.engine.scheduler.spec_accepted_per_pos
    assert counts["num_accepted_tokens"] == sum(per_pos) > 0 and len(per_pos) == 4
    assert per_pos == sorted(per_pos, reverse=True)  # position i accepted only after 0..i-1
    for name, value in counts.items():
        assert f'turbollm:spec_decode_{name}_total{{model_name="tiny"}} {float(value)}' in text, name
    for pos, value in enumerate(per_pos):
        assert (f'turbollm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="tiny",position="{pos}"}} '
                f'{float(value)}') in text
    plain = LLM(tiny, kv_cache_memory=1 << 22, threads=2)
    registry = CollectorRegistry()
    registry.register(_EngineCollector(plain.engine, "tiny"))
    assert "spec_decode" not in generate_latest(registry).decode()  # off: no such series


def test_preemption_and_n_siblings_with_speculation(tiny):
    """A pool too small for the batch preempts speculating sequences (their drafts' slots go with their
    blocks) and n = 2 siblings speculate after their fork: the seeded tokens stay those without speculation."""
    small = dict(kv_cache_memory=12 * 16 * 512, threads=2)  # 12 blocks of 16 tokens (float32, 512 B per token)
    plain, spec = LLM(tiny, **small), LLM(tiny, **small, speculative_config=SPEC)
    drafter(spec).proposer = GreedyOracle(LLM(tiny, kv_cache_memory=1 << 22, threads=2))
    prompts = _prompts(6, seed=13)
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    want = [[c.token_ids for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.scheduler.spec_counts["num_accepted_tokens"] > 0


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("config,message", [
    ('{"method": "ngram"', "not valid JSON"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "'method' must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 12}', "'num_speculative_tokens' must be 1..7"),
])
def test_cli_refuses_a_bad_speculative_config_before_loading(command, config, message, capsys, monkeypatch):
    """`serve` / `generate` with a config that does not parse: exit 1 with the field named, nothing loaded."""
    from turbollm.cli.main import main

    monkeypatch.setattr("turbollm.engine.llm_engine.load_model", lambda *a, **k: pytest.fail("a model loaded"))
    argv = [command, "-m", "smollm2-135m", "--speculative-config", config]
    if command == "generate":
        argv += ["--prompt", "hi"]
    assert main(argv) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("config", [SPEC, SUFFIX])
def test_streaming_and_abort_with_speculation(tiny, config):
    """Streams get several tokens per verified step and add up to the offline output; aborting a
    speculating request mid-way returns its blocks and the proposer's state for it."""
    import asyncio

    from turbollm.entrypoints.async_engine import AsyncLLMEngine
    from turbollm.entrypoints.streaming import DeltaTracker

    spec = LLM(tiny, kv_cache_memory=1 << 22, threads=2, speculative_config=config)
    if config is SPEC:  # drafts that are always right: every step verifies several tokens
        drafter(spec).proposer = GreedyOracle(LLM(tiny, kv_cache_memory=1 << 22, threads=2))
    prompts = _prompts(2, seed=31)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = _tokens(spec, prompts, params)  # (suffix: now its global tree holds these outputs)

    async def body():
        aengine = AsyncLLMEngine(spec.engine)
        try:
            outs = [o async for o in aengine.generate(prompts[0], params, "a")]
            partial, stream = [], aengine.generate(prompts[1], params, "b")
            async for o in stream:
                partial.append(o)
                if len(o.outputs[0].token_ids) >= 6:
                    break
            await stream.aclose()  # leaving the stream aborts the request
            for _ in range(200):
                if not spec.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            return outs, partial
        finally:
            await aengine.shutdown()

    outs, partial = asyncio.run(body())
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths[-1] == 24 and max(b - a for a, b in zip([0] + lengths, lengths)) > 1  # several per step
    tracker, ids = DeltaTracker(), []
    for o in outs:
        for d in tracker.update(o):
            ids += d.token_ids
    assert ids == outs[-1].outputs[0].token_ids == want[0]
    assert partial[-1].outputs[0].token_ids == want[1][:len(partial[-1].outputs[0].token_ids)]
    assert not spec.engine.has_unfinished_requests() and spec.engine.kv_manager.num_used == 0
    if config is SUFFIX:
        assert proposer_state_gone(spec, drafter(spec).proposer.requests)  # the aborted sequence's tree is gone
