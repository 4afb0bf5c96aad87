"""Sliding-window layers release their blocks (issue 31, item 2): the pool of a releasing group is
capped at what it can hold at once (`SlidingWindowSpec.max_blocks`) and the budget's rest goes to
the groups that keep everything; every running sequence returns what its windows passed each
step, scheduled or not; a prefix hit needs of a windowed group only the blocks its window sees;
"auto" (release) and "dense" (keep) give the same outputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from quant_tiny import build_tiny
from test_kv_groups import _seq, _step
from turbollm import LLM, SamplingParams
from turbollm.attention.kv_storage import KVLayout
from turbollm.config import FULL, SLIDING, ModelConfig
from turbollm.core.block_pool import NULL_BLOCK, BlockPool
from turbollm.core.kv_cache_manager import KVCacheManager
from turbollm.core.kv_sizing import default_kv_budget, kv_config_for_model, kv_config_from_budget
from turbollm.core.scheduler import Scheduler
from turbollm.engine_args import EngineArgs
from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_cache_spec import SinkWindowSpec, SlidingWindowSpec

BS = 4
GEMMA_LIKE = dict(arch="gemma3", hidden_size=64, num_layers=6, num_heads=2, num_kv_heads=1, head_dim=32,
                  intermediate_size=128, vocab_size=100, max_position_embeddings=8192, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=True, sliding_window=512,
                  layer_types=[SLIDING] * 5 + [FULL])


def _manager(window: int, blocks: int, sliding_blocks: int | None = None) -> KVCacheManager:
    layout = KVLayout(torch.float32, BS, 1, 8)
    return KVCacheManager(BS, [BlockPool(blocks), BlockPool(sliding_blocks or blocks)],
                          [None, SlidingWindowSpec(layout, window)], [b"full", b"sliding"], b"model", [10, 50])


def test_releasing_group_gets_its_cap_and_the_rest_goes_to_full_layers():
    cfg = ModelConfig(**GEMMA_LIKE)
    spec = kv_config_for_model(cfg, 1, 16).groups[1].spec
    cap = spec.max_blocks(4, 512)
    assert cap == 4 * (32 + 3) + 32  # ceil(511 / 16) + 3 per sequence slot, plus a step's tokens
    budget = 64 << 20
    kv = kv_config_from_budget(cfg, budget, 16, torch.float16, b"", "auto", 4, 512)
    assert kv.blocks_of(1) == cap and kv.blocks_of(0) == kv.num_blocks > cap
    assert kv.total_bytes <= budget < kv.total_bytes + kv.block_bytes(0)  # the full group took what was left
    equal = kv_config_from_budget(cfg, budget, 16, torch.float16, b"", "dense", 4, 512)
    assert equal.group_blocks == () and equal.groups[1].spec.kind == "sliding_window(512), blocks kept"
    assert kv.num_tokens > 4 * equal.num_tokens  # 1 full layer of 6 takes nearly the whole budget
    # the default budget (max_num_seqs sequences of the whole context) shrinks the same way
    dense = default_kv_budget(cfg, torch.float16, 16, 4096, 4, "dense", 512)
    auto = default_kv_budget(cfg, torch.float16, 16, 4096, 4, "auto", 512)
    assert dense == 6 * 4 * 4096 * 2 * 32 * 2 and auto == (4 * 4096 + 5 * cap * 16) * 2 * 32 * 2
    # a small budget: nothing capped below the equal split
    small = kv_config_from_budget(cfg, 1 << 20, 16, torch.float16, b"", "auto", 4, 512)
    assert small.group_blocks == () and small.total_bytes <= 1 << 20


def test_unknown_policy_is_refused_before_anything_loads():
    with pytest.raises(InvalidRequestError, match="kv_policy 'h3o'.*auto, dense"):
        EngineArgs(model="no-such-model", kv_policy="h3o")


@pytest.mark.parametrize("seed", range(6))
def test_releasing_group_never_holds_more_than_its_cap(seed):
    """Random prompts, chunked prefill, decodes, n finishing at random, and a budget that leaves some
    running sequences unscheduled: the sliding pool (given far more blocks than its cap) never holds
    more than `max_blocks` at once, and the full pool decides every preemption."""
    rng = random.Random(seed)
    window, max_seqs, budget = rng.choice([5, 8, 13]), rng.choice([2, 3, 5]), rng.choice([6, 9, 16])
    kv = _manager(window, blocks=200, sliding_blocks=1000)
    cap = kv.specs[1].max_blocks(max_seqs, budget)
    sched = Scheduler(kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    ids = iter(range(10_000))
    peak = 0
    for step in range(300):
        if rng.random() < 0.3:
            sched.add(_seq(next(ids), [rng.randrange(50) for _ in range(rng.randint(1, 40))]))
        _step(sched)
        peak = max(peak, kv.pools[1].num_used)
        assert kv.pools[1].num_used <= cap, (step, kv.pools[1].num_used, cap)
        for s in list(sched.running):
            if len(s.output_token_ids) > rng.randint(3, 30):
                sched.finish(s)
    assert peak > cap // 3  # the workload came near the cap


def test_unscheduled_sequence_releases_and_the_workers_hear_when_it_runs_again():
    kv = _manager(window=4, blocks=64)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=8)
    a = _seq(0, list(range(12)))
    sched.add(a)
    _step(sched)  # a: prompt tokens 0..7
    _step(sched)  # a: 8..11 (its window then starts at 5: block 0 released), first token sampled
    assert a.block_tables[1][:2] == [NULL_BLOCK, 1]
    b = _seq(1, list(range(100, 140)))
    sched.add(b)
    sched.running.insert(0, sched.waiting.popleft())  # b runs first and takes the whole budget
    b.status = a.status
    out = _step(sched)
    assert list(out.scheduled_token_ids) == [b.seq_id]
    # a did not run, yet its window moved on (next token at 12 sees 9..12): block 1 went back to the pool
    assert a.block_tables[1][:2] == [NULL_BLOCK, NULL_BLOCK] and sched._released[a.seq_id] == [(1, 1)]
    sched.running.reverse()
    out = _step(sched)
    (cached,) = [c for c in out.cached_reqs if c.seq_id == a.seq_id]
    assert cached.replaced_block_ids[1] == [(1, NULL_BLOCK)] and a.seq_id not in sched._released


def _hit_by_brute_force(full: list[bool], windowed: list[tuple[list[bool], int, int]], max_blocks: int) -> int:
    """The longest m <= max_blocks such that the full group holds blocks 0..m-1 and each windowed group
    (held, window, kept blocks) its kept blocks and the blocks of positions m*BS - window + 1 .. m*BS - 1."""
    best = 0
    for m in range(max_blocks + 1):
        if all(full[:m]) and all(all(held[max(0, m * BS - w + 1) // BS:m]) and all(held[:min(keep, m)])
                                 for held, w, keep in windowed):
            best = m
    return best


@pytest.mark.parametrize("seed", range(16))
def test_window_aware_prefix_hit_equals_brute_force(seed):
    """One full group and one or two windowed groups (two window sizes: a shorter hit moves every
    window back, so each is checked again; some with attention sinks, whose blocks a hit needs too),
    cached blocks evicted at random."""
    rng = random.Random(seed)
    windows = [rng.choice([3, 4, 8, 9])] + ([rng.choice([5, 13])] if seed % 2 else [])
    sinks = [rng.choice([0, 0, 1, 5]) for _ in windows]
    layout = KVLayout(torch.float32, BS, 1, 8)
    specs = [SinkWindowSpec(layout, w, sinks=s) if s else SlidingWindowSpec(layout, w) for w, s in zip(windows, sinks)]
    kv = KVCacheManager(BS, [BlockPool(64) for _ in range(1 + len(windows))], [None] + specs,
                        [b"full"] + [f"w{w}s{s}".encode() for w, s in zip(windows, sinks)], b"model")
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=256)
    prompt = [rng.randrange(50) for _ in range(rng.randint(20, 48))]
    a = _seq(0, prompt)
    sched.add(a)
    _step(sched)
    hashes = list(a.block_hashes)
    sched.finish(a)
    held = [[True] * len(hashes) for _ in range(kv.num_groups)]
    for g in range(kv.num_groups):  # evict some cached blocks of each group
        for i in range(len(hashes)):
            if rng.random() < (0.08 if g == 0 else 0.25):
                kv.pools[g].cached.pop(kv.keys[g] + hashes[i], None)
                held[g][i] = False
    # the windowed groups had released a's early blocks: they are cached (released, hashed) unless evicted
    b = _seq(1, prompt + [99])
    kv.take_cached_prefix(b)
    keeps = [spec.kept_blocks() for spec in specs]
    m = _hit_by_brute_force(held[0], list(zip(held[1:], windows, keeps)), len(prompt) // BS)
    assert b.num_computed_tokens == m * BS
    assert NULL_BLOCK not in b.block_tables[0] and len(b.block_tables[0]) == m
    for g, (w, keep) in enumerate(zip(windows, keeps), start=1):
        lo, k = max(0, m * BS - w + 1) // BS, min(keep, m)
        table = b.block_tables[g]
        assert NULL_BLOCK not in table[:k] + table[max(lo, k):]
        assert table[k:lo] == [NULL_BLOCK] * max(0, lo - k)


def test_cap_counts_the_blocks_of_rejected_drafts():
    spec = SlidingWindowSpec(KVLayout(torch.float32, BS, 1, 8), 8)
    assert spec.max_blocks(3, 16, spec_tokens=7) - spec.max_blocks(3, 16) == 3 * 2  # ceil(7 / 4) per slot
    cfg = ModelConfig(**GEMMA_LIKE)
    plain = kv_config_from_budget(cfg, 64 << 20, 16, torch.float16, b"", "auto", 4, 512)
    spec4 = kv_config_from_budget(cfg, 64 << 20, 16, torch.float16, b"", "auto", 4, 512, spec_tokens=4)
    assert spec4.blocks_of(1) == plain.blocks_of(1) + 4


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return build_tiny("gemma3", tmp_path_factory.mktemp("kvrelease"))


def test_auto_and_dense_give_the_same_outputs_and_auto_holds_less(tiny_gemma3):
    """Window 16: by 120 tokens the sliding layer's blocks are mostly released (auto) or all kept
    (dense); tokens and logprobs are identical, the peak K/V bytes smaller, every block returned."""
    prompts = [torch.randint(4, 384, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (90, 60)]
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=3)
    runs = {}
    for policy in ("auto", "dense"):
        llm = LLM(str(tiny_gemma3), kv_cache_memory=1 << 20, threads=2, block_size=16, kv_policy=policy,
                  max_num_seqs=2, max_num_batched_tokens=64)
        outs = llm.generate([{"prompt_token_ids": t} for t in prompts], p, use_tqdm=False)
        stats = llm.engine.stats()
        assert stats["kv_cache_bytes_used"] == 0 and stats["kv_cache_bytes_total"] <= 1 << 20
        runs[policy] = ([(o.outputs[0].token_ids, [sorted((t, x.logprob) for t, x in lp.items())
                                                   for lp in o.outputs[0].logprobs]) for o in outs],
                        stats["kv_cache_bytes_peak"], llm.engine.kv_config)
    assert runs["auto"][0] == runs["dense"][0]
    assert runs["auto"][1] < 0.75 * runs["dense"][1]
    auto_cfg = runs["auto"][2]  # the sliding group's pool is capped: 2 slots × (1 + 3) + 4 blocks
    assert auto_cfg.blocks_of(1) == 12 and auto_cfg.num_tokens > runs["dense"][2].num_tokens


def test_bench_kv_compares_policies_in_one_run(tiny_gemma3, tmp_path, capsys):
    """`turbollm bench kv` on the tiny Gemma 3 (window 16): dense then auto, same tokens, auto's decode
    peak smaller, the JSON written."""
    import json

    from turbollm.cli.main import main

    words = torch.randint(4, 384, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in words))
    out = tmp_path / "kv.json"
    rc = main(["bench", "kv", "-m", str(tiny_gemma3), "--ctx", "120", "--max-tokens", "8", "--data", str(text),
               "--threads", "2", "--max-num-batched-tokens", "32", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "setting:" in printed and "policy=dense" in printed and "policy=auto" in printed
    dense, auto = json.loads(out.read_text())["results"]
    assert auto["token_exact"] is True and auto["max_dlogprob"] == 0.0
    assert auto["decode_peak_vs_ref"] > 1.3 and auto["pool_vs_ref"] > 1.0
