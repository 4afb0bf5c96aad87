"""The KV block pool and the scheduler's use of it, pinned exactly on tiny pools (no model)."""

from __future__ import annotations

from turbollm.core.block_pool import BlockPool, hash_block
from turbollm.core.kv_cache_manager import KVCacheManager
from turbollm.core.scheduler import Scheduler
from turbollm.core.sequence import Sequence
from turbollm.handoff.runner_output import ModelRunnerOutput
from turbollm.sampling_params import SamplingParams

BS = 4


def seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, str(i), 0, list(tokens), SamplingParams(max_tokens=8))


def run_step(sched: Scheduler):
    """Schedule once and pretend the model computed everything scheduled (sampling nothing)."""
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput())
    return out


def new_tokens(out) -> list[int]:
    return [len(t) for t in out.scheduled_token_ids.values()]


def test_allocate_release_order_and_refcounts():
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    assert pool.ref_counts == [1, 1, 1, 0] and pool.num_free == 1
    pool.touch(1)
    assert pool.ref_counts[1] == 2
    pool.release([0, 1])
    assert pool.ref_counts == [0, 1, 1, 0]
    # unhashed blocks go to the front of the free queue: reused before anything cached
    assert list(pool.free) == [0, 3]
    pool.release([1, 2])
    assert list(pool.free) == [1, 2, 0, 3]
    assert pool.num_used == 0


def test_prefix_hash_chain_depends_on_all_previous_tokens():
    a = hash_block(None, [1, 2, 3, 4])
    b = hash_block(a, [5, 6, 7, 8])
    assert b != hash_block(hash_block(None, [1, 2, 3, 9]), [5, 6, 7, 8])
    assert b == hash_block(hash_block(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_prefix_cache_hit_reuses_exact_blocks_and_counts_tokens():
    pool = BlockPool(8)
    sched = Scheduler(KVCacheManager(BS, [pool]), max_num_seqs=4, max_num_batched_tokens=64)
    a = seq(0, list(range(10)))  # blocks: [0..3] [4..7] [8, 9]
    sched.add(a)
    run_step(sched)
    assert a.block_tables[0] == [0, 1, 2] and a.num_computed_tokens == 10
    assert set(pool.cached.values()) == {0, 1}  # only full blocks are indexed
    assert pool.stats.queries == 10 and pool.stats.hits == 0
    sched.finish(a)
    # released tail first: the partial block 2 at the front, then the cached 1 before 0
    assert list(pool.free) == [2, 3, 4, 5, 6, 7, 1, 0]
    b = seq(1, list(range(8)) + [42, 43, 44])
    sched.add(b)
    out = run_step(sched)
    assert b.block_tables[0][:2] == [0, 1]  # the cached prefix, same block ids
    assert new_tokens(out)[0] == 3  # only the tokens after the hit are computed
    assert pool.stats.hits == 8 and pool.stats.queries == 10 + 11
    assert pool.ref_counts[0] == pool.ref_counts[1] == 1


def test_full_prompt_hit_still_computes_the_last_token():
    pool = BlockPool(8)
    sched = Scheduler(KVCacheManager(BS, [pool]), 4, 64)
    a = seq(0, list(range(8)))
    sched.add(a)
    run_step(sched)
    sched.finish(a)
    b = seq(1, list(range(8)))
    sched.add(b)
    out = run_step(sched)
    assert b.block_tables[0][0] == 0 and new_tokens(out)[0] == 4  # block 1 recomputed (1 hit of 2)
    assert pool.stats.hits == 4


def test_lru_eviction_order():
    pool = BlockPool(4)
    sched = Scheduler(KVCacheManager(BS, [pool]), 4, 64)
    for i, base in enumerate([100, 200]):
        s = seq(i, [base + t for t in range(8)])  # two full blocks each
        sched.add(s)
        run_step(sched)
        sched.finish(s)
    # free queue: seq0's blocks were released first (older), tail block first
    assert list(pool.free) == [1, 0, 3, 2]
    assert len(pool.cached) == 4
    c = seq(2, [300 + t for t in range(5)])  # needs 2 new blocks: evicts 1 then 0
    sched.add(c)
    run_step(sched)
    assert c.block_tables[0] == [1, 0] and pool.stats.evictions == 2
    # block 1 now holds c's first (full) block; block 0 its partial one, not indexed
    assert sorted(pool.cached.values()) == [1, 2, 3] and pool.block_hash[0] is None
    # seq1's prefix is still cached and hits
    sched.finish(c)
    d = seq(3, [200 + t for t in range(8)] + [7])
    sched.add(d)
    run_step(sched)
    assert d.block_tables[0][:2] == [2, 3]


def test_copy_on_write_when_a_shared_block_is_written():
    pool = BlockPool(6)
    sched = Scheduler(KVCacheManager(BS, [pool]), 4, 64)
    parent = seq(0, [1, 2, 3, 4, 5, 6])  # the second block is partial: [5, 6, _, _]
    sched.add(parent)
    run_step(sched)
    child = seq(1, [1, 2, 3, 4, 5, 6])
    child.num_computed_tokens = parent.num_computed_tokens
    child.block_tables = [list(parent.block_tables[0])]
    for b in child.block_tables[0]:
        pool.touch(b)
    sched.add_running(child)
    assert pool.ref_counts[:2] == [2, 2]
    parent.output_token_ids.append(7)
    child.output_token_ids.append(8)
    out = sched.schedule()
    # the parent writes into shared block 1 first: it gets a copy; then the child owns block 1 alone
    assert out.copy_blocks == [(0, 1, 2)]
    assert parent.block_tables[0] == [0, 2] and child.block_tables[0] == [0, 1]
    assert pool.ref_counts[:3] == [2, 1, 1]


def test_preemption_frees_newest_and_requeues_it_first():
    pool = BlockPool(3)
    sched = Scheduler(KVCacheManager(BS, [pool]), 4, 64)
    a, b = seq(0, [1, 2, 3, 4]), seq(1, [9, 8, 7, 6])
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert a.block_tables[0] == [0] and b.block_tables[0] == [1]
    for s in (a, b):
        s.output_token_ids += [5, 5, 5, 5]  # both need a second block; one block is free
    out = run_step(sched)
    assert list(out.scheduled_token_ids) == [a.seq_id] and out.preempted_seq_ids == [b.seq_id]
    assert b.num_computed_tokens == 0 and b.block_tables == [] and sched.waiting[0] is b
    assert sched.num_preemptions == 1


def test_engine_stats_counters_shape():
    from turbollm.core.block_pool import CacheStats

    s = CacheStats(queries=10, hits=4)
    assert s.hit_rate == 0.4 and CacheStats().hit_rate == 0.0
