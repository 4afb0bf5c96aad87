"""A quantized K/V format's float16 rings of recent tokens come out of the block pool while a sequence runs
(core/kv_cache_manager.py `take_rings`; ring slot s is blocks s * ring_blocks .. of every pool, which
attention/kv_storage.py views as float16): no model, tiny pools."""

from __future__ import annotations

import random

from test_scheduler_limits import BS, run_step, seq

from turbollm.core.block_pool import BlockPool
from turbollm.core.kv_cache_manager import KVCacheManager
from turbollm.core.scheduler import Scheduler
from turbollm.core.sequence import Sequence
from turbollm.sampling_params import SamplingParams

RING = 4  # pool blocks a ring takes


def manager(num_blocks: int, groups: int = 1) -> KVCacheManager:
    return KVCacheManager(BS, [BlockPool(num_blocks) for _ in range(groups)], ring_blocks=RING,
                          num_ring_slots=num_blocks // RING)


def held_rings(kv: KVCacheManager) -> list[int]:
    return list(kv.ring_of.values()) + [s for spare in kv.spare_rings.values() for s in spare]


def check_disjoint(kv: KVCacheManager, seqs) -> None:
    """Every ring held is whole and none of its blocks is a sequence's K/V block; nothing else is in use."""
    rings = {b for s in held_rings(kv) for b in range(s * RING, (s + 1) * RING)}
    for g, pool in enumerate(kv.pools):
        tables = {b for s in seqs if s.block_tables for b in s.block_tables[g]}
        assert not rings & tables, "a ring's blocks are a sequence's K/V blocks"
        assert all(pool.ref_counts[b] == 1 for b in rings)
        assert pool.num_used == len(rings) + len(tables)


def test_rings_come_from_the_top_of_every_pool_and_go_back():
    kv = manager(20, groups=2)  # 5 ring slots
    a, b = seq(0, [1] * 9), seq(1, [2] * 5)
    b.pending_forks = 1  # its sibling-to-be holds a ring from the start
    assert kv.take_rings(a) and kv.ring_of == {0: 4}
    assert kv.take_rings(b) and kv.ring_of[1] == 3 and kv.spare_rings == {1: [2]}
    assert all(p.num_free == 8 for p in kv.pools) and kv.num_rings == 3
    kv.grow(a, 9)
    assert a.block_tables == [[0, 1, 2], [0, 1, 2]]  # K/V blocks from the bottom
    assert kv.take_rings(a) and kv.num_rings == 3  # it has its ring already
    child = seq(2, [2] * 5)
    kv.grow(b, 5)
    kv.share(b, child, kv.fork_ring(b, 0))
    assert kv.ring_of[2] == 2 and kv.spare_rings == {1: []}
    kv.free(b)
    kv.free(child)
    kv.free(a)
    assert all(p.num_free == 20 for p in kv.pools) and kv.num_rings == 0 and kv.bytes_used == 0


def test_no_whole_free_range_no_ring_and_nothing_taken():
    kv = manager(16)  # 4 slots of 4 blocks
    pool = kv.pools[0]
    for b in (1, 5, 9, 13):  # one block used in each slot's range: 12 free blocks, no free range
        pool.take(b)
    a = seq(0, [1] * 3)
    assert not kv.take_rings(a) and pool.num_free == 12 and kv.num_rings == 0
    pool.give_back(range(13, 14))
    assert kv.take_rings(a) and kv.ring_of == {0: 3}


def test_scheduler_runs_as_many_as_the_rings_allow_and_finishes_every_sequence():
    """Random prompts and lengths, a pool where rings and K/V blocks compete: every step keeps the rings
    disjoint from the tables, sequences are admitted only with a ring, and every sequence finishes."""
    rng = random.Random(0)
    kv = manager(48)  # 12 ring slots if nothing else ran
    sched = Scheduler(kv, max_num_seqs=16, max_num_batched_tokens=32)
    seqs = []
    for i in range(24):
        s = Sequence(sched.next_seq_id(), str(i), 0, [rng.randrange(50) for _ in range(rng.randrange(2, 20))],
                     SamplingParams(max_tokens=rng.randrange(1, 30)))
        s.pending_forks = 1 if i % 5 == 0 else 0
        seqs.append(s)
        sched.add(s)
    max_rings = forks = 0
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = run_step(sched)
        max_rings, forks = max(max_rings, len(kv.ring_of)), forks + len(out.forks)
        alive = [sched.seqs[sid] for sid in out.scheduled_token_ids if sid in sched.seqs]  # (not finished by it)
        assert all(s.seq_id in kv.ring_of for s in alive), "a sequence ran without a ring"
        check_disjoint(kv, list(sched.seqs.values()))
    assert sched.num_preemptions > 0 and max_rings >= 4 and forks == 5  # what the pool forced, and the n = 2 forks
    assert not sched.has_unfinished() and kv.num_rings == 0 and kv.pools[0].num_free == 48
    assert all(s.is_finished for s in seqs)
