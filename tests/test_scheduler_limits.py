"""The scheduler never loops without progress, and its limits count what they claim (tiny pools, no model)."""

from __future__ import annotations

from turbollm.engine.kv_cache import BlockPool
from turbollm.engine.kv_cache_manager import KVCacheManager
from turbollm.engine.runner_output import ModelRunnerOutput, SampledToken
from turbollm.engine.scheduler import Scheduler
from turbollm.engine.sequence import Sequence
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
