"""KV-cache groups: one pool and one block table per group of layers (full attention, each sliding
window), a sliding-window group releasing the blocks its window left behind, prefix hits that every
group holds, copy-on-write and preemption per group; the runner's layer hooks and layer ranges.
"""

from __future__ import annotations

import pytest
import torch

from conftest import catalog_model_path
from quant_tiny import build_tiny, hf_logits
from turbollm import LLM, SamplingParams
from turbollm.attention.kv_storage import KVLayout
from turbollm.config import FULL, SLIDING, ModelConfig
from turbollm.core.block_pool import NULL_BLOCK, BlockPool
from turbollm.core.kv_cache_manager import KVCacheManager
from turbollm.core.kv_sizing import kv_config_for_model
from turbollm.core.scheduler import Scheduler
from turbollm.core.sequence import Sequence
from turbollm.handoff.kv_cache_spec import KVCacheSpec, SlidingWindowSpec
from turbollm.handoff.runner_output import ModelRunnerOutput, SampledToken
from turbollm.sampling_params import SamplingParams as SP

BS = 4


def _manager(window: int = 8, blocks: int = 16) -> KVCacheManager:
    layout = KVLayout(torch.float32, BS, 1, 8)
    return KVCacheManager(BS, [BlockPool(blocks), BlockPool(blocks)], [None, SlidingWindowSpec(layout, window)],
                          [b"full", b"sliding"], b"model")


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, str(i), 0, list(tokens), SP(max_tokens=None))


def _step(sched: Scheduler, token: int = 7):
    """Schedule once, pretend the workers computed it and sampled `token` for every up-to-date sequence."""
    out = sched.schedule()
    sampled = {sid: [SampledToken(token)] for sid, t in out.scheduled_token_ids.items()
               if sched.seqs[sid].num_computed_tokens + len(t) == sched.seqs[sid].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return out


def test_groups_follow_the_layer_types():
    common = dict(arch="gemma3", hidden_size=64, num_layers=6, num_heads=2, num_kv_heads=1, head_dim=32,
                  intermediate_size=128, vocab_size=100, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=True)
    cfg = ModelConfig(**common, sliding_window=512, layer_types=[SLIDING] * 5 + [FULL])
    kv = kv_config_for_model(cfg, 10, 16, torch.float16)
    assert [type(g.spec) for g in kv.groups] == [KVCacheSpec, SlidingWindowSpec]
    assert kv.groups[0].layer_ids == (5,) and kv.groups[1].layer_ids == (0, 1, 2, 3, 4)
    assert kv.groups[1].spec.window == 512 and kv.layer_groups == [1, 1, 1, 1, 1, 0]
    assert kv.bytes_per_token == 6 * 2 * 32 * 2 and kv.num_tokens == 160
    assert kv.salt(0) != kv.salt(1)  # the group is in every prefix key
    plain = kv_config_for_model(ModelConfig(**common, layer_types=[FULL] * 6), 10, 16)
    assert len(plain.groups) == 1 and plain.layer_groups == [0] * 6


def test_sliding_group_releases_blocks_out_of_its_window():
    kv = _manager(window=8)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    a = _seq(0, list(range(10, 30)))  # 20 tokens: 5 blocks
    sched.add(a)
    _step(sched)
    full, sliding = a.block_tables
    assert full == [0, 1, 2, 3, 4] and sliding == [0, 1, 2, 3, 4]  # nothing released before a step runs
    out = _step(sched)  # computes token 20: its window is positions 13..20, blocks 3..5
    assert a.block_tables[0] == [0, 1, 2, 3, 4, 5]
    assert a.block_tables[1] == [NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 3, 4, 5]
    assert kv.pools[0].num_used == 6 and kv.pools[1].num_used == 3
    # the workers hear of the released entries (their old ids may go to other sequences)
    (cached,) = out.cached_reqs
    assert cached.replaced_block_ids == ([], [(0, NULL_BLOCK), (1, NULL_BLOCK), (2, NULL_BLOCK)])
    assert cached.new_block_ids == ([5], [5])
    sched.finish(a)
    assert kv.pools[0].num_used == kv.pools[1].num_used == 0


def test_prefix_hit_is_what_every_group_still_holds():
    kv = _manager(window=8, blocks=8)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    prompt = list(range(40, 53))  # 13 tokens: 3 full blocks
    a = _seq(0, prompt)
    sched.add(a)
    _step(sched)
    sched.finish(a)
    b = _seq(1, prompt + [99])
    sched.add(b)
    _step(sched)
    assert b.num_computed_tokens == 14 and kv.stats.hits == 12  # 3 cached blocks in both groups
    # the sliding group released the hit blocks its window cannot see (positions < 12 - 8 + 1)
    assert b.block_tables[1][0] == NULL_BLOCK and b.block_tables[0][0] != NULL_BLOCK
    sched.finish(b)
    # evict the sliding group's first cached block: a hit of 3 blocks does not need it (its window
    # starts at position 5), so a third request still hits 12 tokens
    kv.pools[1].cached.pop(kv.keys[1] + b.block_hashes[0])
    c = _seq(2, prompt + [98])
    sched.add(c)
    out = _step(sched)
    assert [len(t) for t in out.scheduled_token_ids.values()] == [2] and c.block_tables[1][0] == NULL_BLOCK
    sched.finish(c)
    # evict its third block too: a 2-block hit would need positions 1..7, block 0 among them: no hit
    kv.pools[1].cached.pop(kv.keys[1] + b.block_hashes[2])
    d = _seq(3, prompt + [97])
    sched.add(d)
    out = _step(sched)
    assert [len(t) for t in out.scheduled_token_ids.values()] == [14]
    sched.finish(d)
    assert kv.pools[0].num_used == kv.pools[1].num_used == 0


def test_copy_on_write_and_preemption_in_every_group():
    kv = _manager(window=64, blocks=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    parent = _seq(0, [1, 2, 3, 4, 5, 6])
    sched.add(parent)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput())  # computed, nothing sampled
    child = _seq(1, [1, 2, 3, 4, 5, 6])
    child.num_computed_tokens = parent.num_computed_tokens
    kv.share(parent, child)
    sched.add_running(child)
    parent.output_token_ids.append(7)
    child.output_token_ids.append(8)
    out = sched.schedule()
    assert out.copy_blocks == [(0, 1, 2), (1, 1, 2)]  # one copy per group, each in its own pool
    assert parent.block_tables == [[0, 2], [0, 2]] and child.block_tables == [[0, 1], [0, 1]]
    sched.update_from_output(out, ModelRunnerOutput())
    big = _seq(2, list(range(100, 104)))
    sched.add(big)  # needs one more block in each group; one is free
    for s in (parent, child):
        s.output_token_ids += [5, 5, 5]  # both need a third block: the newest running one is preempted
    out = sched.schedule()
    assert out.preempted_seq_ids == [child.seq_id] and child.block_tables == []
    assert kv.pools[0].ref_counts == kv.pools[1].ref_counts


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return build_tiny("gemma3", tmp_path_factory.mktemp("kvgroups"))


def test_tiny_gemma3_past_its_window_matches_transformers(tiny_gemma3):
    """Window 16, block 16: by the end, most of the sliding layer's blocks were released and reused by
    the other prompt, and the logprobs still match transformers on the whole sequence."""
    import transformers

    llm = LLM(str(tiny_gemma3), kv_cache_memory=1 << 20, threads=2, block_size=16)
    eng = llm.engine
    assert [g.spec.kind for g in eng.kv_config.groups] == ["full_attention", "sliding_window(16)"]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 384, (n,), generator=g).tolist() for n in (70, 45)]
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0)
    live = []  # per step: live sliding-group blocks of each running sequence
    real_step = eng.scheduler.update_from_output

    def watch(sched, out):
        live.append([len([b for b in s.block_tables[1] if b != NULL_BLOCK]) for s in eng.scheduler.running])
        return real_step(sched, out)

    eng.scheduler.update_from_output = watch
    outs = llm.generate([{"prompt_token_ids": t} for t in prompts], p, use_tqdm=False)
    assert max(live[0]) == 5  # the 70-token prefill holds its 5 blocks while it runs
    assert all(n <= 2 for step in live[2:] for n in step)  # decoding: a 16-token window spans at most 2
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_gemma3), torch_dtype=torch.float32).eval()
    for prompt, o in zip(prompts, outs):
        gen = list(o.outputs[0].token_ids)
        with torch.no_grad():
            ref = torch.log_softmax(hf_logits(hf, prompt + gen), -1)[len(prompt) - 1:-1]
        assert gen == ref.argmax(-1).tolist()
        ours = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, gen)])
        torch.testing.assert_close(ours, ref[torch.arange(len(gen)), gen], atol=2e-3, rtol=0)
    assert eng.kv_manager.num_used == 0


@pytest.mark.model
def test_gemma3_270m_has_two_groups_with_their_own_tables():
    """The catalog Gemma 3: 15 sliding layers (window 512) and 3 full ones, two pools, two tables; past
    the window the sliding table's first entries are released while the full table keeps them."""
    llm = LLM(str(catalog_model_path("gemma3-270m")), kv_cache_memory=1 << 26, threads=2, max_model_len=1024)
    eng = llm.engine
    groups = eng.kv_config.groups
    assert [(g.spec.kind, len(g.layer_ids)) for g in groups] == [("full_attention", 3), ("sliding_window(512)", 15)]
    runner = eng.executor.worker.runner
    assert len(runner.layer_groups) == 18 and runner.layer_groups.count(0) == 3
    prompt = list(range(1000, 1000 + 600))
    tables = {}
    real = eng.scheduler.update_from_output

    def watch(sched, out):
        for s in eng.scheduler.running:
            tables[s.seq_id] = [list(t) for t in s.block_tables]
        return real(sched, out)

    eng.scheduler.update_from_output = watch
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    full, sliding = next(iter(tables.values()))
    assert NULL_BLOCK not in full and len(full) == len(sliding) == -(-603 // 16)
    assert sliding[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in sliding[-32:]
    assert eng.kv_manager.num_used == 0
