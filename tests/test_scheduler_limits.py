"""The scheduler never loops without progress, and its limits count what they claim (tiny pools, no model)."""

from __future__ import annotations

from turbollm.core.block_pool import BlockPool
from turbollm.core.kv_cache_manager import KVCacheManager
from turbollm.core.scheduler import Scheduler
from turbollm.core.sequence import Sequence
from turbollm.handoff.runner_output import ModelRunnerOutput, SampledToken
from turbollm.sampling_params import SamplingParams

BS = 4


def seq(i: int, tokens: list[int], **params) -> Sequence:
    return Sequence(i, str(i), 0, list(tokens), SamplingParams(max_tokens=None, **params))


def run_step(sched: Scheduler, sample: bool = True):
    """Schedule once, pretend the workers computed it, and sample token 7 for every sequence that is up to date."""
    out = sched.schedule()
    sampled = {}
    for sid, tokens in out.scheduled_token_ids.items():
        seq = sched.seqs[sid]
        if sample and seq.num_computed_tokens + len(tokens) == seq.num_tokens:
            sampled[sid] = [SampledToken(7)]
            sampled.update({f.seq_id: [SampledToken(7)] for f in out.forks.get(sid, [])})
    sched.update_from_output(out, ModelRunnerOutput(sampled=sampled))
    return out


def scheduled(sched: Scheduler, out) -> list[Sequence]:
    return [sched.seqs[sid] for sid in out.scheduled_token_ids]


def unschedulable(sched: Scheduler, out) -> list[Sequence]:
    return [sched.seqs[sid] for sid in out.unschedulable_seq_ids]


def test_a_sequence_that_outgrows_the_pool_is_reported_not_spun_on():
    """A sequence that can no longer fit even alone must leave the schedule (before: it preempted
    itself and, with its cached blocks taken back, the scheduler returned an empty step forever)."""
    for caching in (True, False):
        pool = BlockPool(3, enable_caching=caching)  # 12 tokens
        sched = Scheduler(KVCacheManager(BS, [pool]), max_num_seqs=4, max_num_batched_tokens=64)
        a = seq(0, list(range(6)))
        sched.add(a)
        failed = []
        for _ in range(40):
            out = run_step(sched)
            gone = unschedulable(sched, out)
            failed += gone
            assert out.scheduled_token_ids or gone or not sched.has_unfinished(), \
                f"caching={caching}: an empty step with work left"
            if not sched.has_unfinished():
                break
        assert failed == [a], f"caching={caching}"
        assert a.num_tokens == 13  # it ran until the 13th token needed a 4th block
        assert pool.num_free == 3 and not sched.has_unfinished()


def test_a_waiting_sequence_larger_than_the_pool_is_reported():
    pool = BlockPool(2)
    sched = Scheduler(KVCacheManager(BS, [pool]), 4, 64)
    big, small = seq(0, list(range(12))), seq(1, [1, 2, 3])
    sched.add(big)
    sched.add(small)
    out = run_step(sched)
    assert unschedulable(sched, out) == [big]
    assert scheduled(sched, out) == [small]


def test_prefix_cache_queries_never_go_down():
    """A prompt_logprobs request skips the lookup; refusing its admission must not undo a query it never made."""
    pool = BlockPool(4)
    sched = Scheduler(KVCacheManager(BS, [pool]), 4, 64)
    holder = seq(0, list(range(12)))  # 3 of the 4 blocks
    sched.add(holder)
    run_step(sched)
    before = pool.stats.queries
    waiting = seq(1, list(range(100, 110)), prompt_logprobs=1)  # needs 3 blocks, 1 free
    sched.add(waiting)
    for _ in range(2):
        run_step(sched)
        assert pool.stats.queries >= before
        before = pool.stats.queries
    # a lookup refused for lack of blocks is not counted either: only admitted lookups are queries
    other = seq(2, list(range(200, 210)))
    sched.waiting.appendleft(other)
    q0, h0 = pool.stats.queries, pool.stats.hits
    run_step(sched)
    assert (pool.stats.queries, pool.stats.hits) == (q0, h0)


def test_pending_forks_count_against_max_num_seqs():
    """n > 1: the siblings that will fork off a prompt take their sequence slots at admission."""
    pool = BlockPool(64)
    sched = Scheduler(KVCacheManager(BS, [pool]), max_num_seqs=3, max_num_batched_tokens=64)
    a = seq(0, [1, 2, 3])
    a.pending_forks = 2  # n = 3
    b = seq(1, [4, 5, 6])
    sched.add(a)
    sched.add(b)
    out = run_step(sched, sample=False)
    assert scheduled(sched, out) == [a]  # b would make 4 sequences once a forks
    assert sched.num_seq_slots == 3


def _back(sched: Scheduler, out) -> None:
    """The workers' answer to step `out`: token 7 for every sequence that is up to date."""
    sampled = {sid: [SampledToken(7)] for sid, tokens in out.scheduled_token_ids.items()
               if sched.seqs[sid].num_computed_tokens + len(tokens) == sched.seqs[sid].num_tokens}
    sched.update_from_output(out, ModelRunnerOutput(sampled=sampled))


def test_steps_in_flight_share_the_sequences_and_never_repeat_one():
    """Two steps in flight (pipeline stages): each takes half of the sequences, a sequence in a step still out
    is in no other, and it is schedulable again once its step is back."""
    sched = Scheduler(KVCacheManager(BS, [BlockPool(64)]), max_num_seqs=8, max_num_batched_tokens=256)
    sched.max_steps_in_flight = 2
    for i in range(4):
        sched.add(seq(i, [1, 2, 3]))
    a, b = sched.schedule(), sched.schedule()
    assert sorted(a.scheduled_token_ids) == [0, 1] and sorted(b.scheduled_token_ids) == [2, 3]
    assert sched.schedule().is_empty  # everything is in flight
    _back(sched, a)
    c = sched.schedule()
    assert sorted(c.scheduled_token_ids) == [0, 1] and all(len(t) == 1 for t in c.scheduled_token_ids.values())
    _back(sched, b)
    _back(sched, c)
    assert [len(sched.seqs[i].output_token_ids) for i in range(4)] == [2, 2, 1, 1]


def test_a_sequence_waits_for_blocks_held_in_flight_instead_of_preempting_itself():
    """The oldest sequence needs a block and only newer sequences in a step still out hold blocks: it waits
    (keeping its place and its computed tokens) rather than being preempted, and runs once they are back."""
    pool = BlockPool(3)  # 12 tokens
    sched = Scheduler(KVCacheManager(BS, [pool]), max_num_seqs=4, max_num_batched_tokens=64)
    sched.max_steps_in_flight = 2
    old, new = seq(0, [1, 2, 3, 4]), seq(1, [1, 2, 3])
    sched.add(old)
    _back(sched, sched.schedule())  # old: 4 + 1 tokens, 1 block full
    sched.add(new)
    first = sched.schedule()
    assert sorted(first.scheduled_token_ids) == [0]  # old takes its 2nd block; new waits for the next step
    second = sched.schedule()
    assert sorted(second.scheduled_token_ids) == [1]  # new: its prompt, the 3rd block
    _back(sched, first)
    assert pool.num_free == 0
    for _ in range(6):  # old fills its 2nd block; then it needs a 3rd of its own: none free, new is out
        out = sched.schedule()
        if not out.scheduled_token_ids:
            break
        _back(sched, out)
    assert out.is_empty and not out.preempted_seq_ids and old.num_computed_tokens > 0 and sched.num_preemptions == 0
    _back(sched, second)
    out = sched.schedule()  # new is back: old, the oldest, preempts it for its block
    assert sorted(out.scheduled_token_ids) == [0] and out.preempted_seq_ids == [1]


def test_a_waiting_sequence_is_not_overtaken_while_it_waits_for_blocks_in_flight():
    """While the oldest sequence waits for blocks held in a step in flight, no newer sequence is preempted for it
    or admitted into the pool (which would keep it waiting for ever); once the step is back it takes its block."""
    pool = BlockPool(4, enable_caching=True)  # 16 tokens
    sched = Scheduler(KVCacheManager(BS, [pool]), max_num_seqs=4, max_num_batched_tokens=64)
    sched.max_steps_in_flight = 2
    old, mid, new = seq(0, [1, 2, 3, 4]), seq(1, [5, 6, 7]), seq(2, [8, 9, 10])
    sched.add(old)
    _back(sched, sched.schedule())  # old: 1 block full, its 5th token next
    sched.add(mid)
    sched.add(new)
    a = sched.schedule()  # old (its 2nd block) and mid (1 block)
    b = sched.schedule()  # new (1 block): the pool is full
    assert sorted(a.scheduled_token_ids) == [0, 1] and sorted(b.scheduled_token_ids) == [2] and pool.num_free == 0
    _back(sched, a)
    for _ in range(6):  # old fills its 2nd block, then needs a 3rd: mid is free to preempt, new is out
        out = sched.schedule()
        if 0 not in out.scheduled_token_ids:
            break
        _back(sched, out)
    assert out.is_empty and sched.num_preemptions == 0 and not sched.waiting
    late = seq(3, [1, 2])
    sched.add(late)
    assert sched.schedule().is_empty  # not admitted while old waits
    _back(sched, b)
    out = sched.schedule()  # nothing newer in flight: old preempts the newest for its block
    assert 0 in out.scheduled_token_ids and sched.num_preemptions >= 1
