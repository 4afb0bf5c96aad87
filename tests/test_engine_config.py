"""Every pair of techniques either runs together or is refused with a reason from one table
(turbollm/engine_config.py: `TECHNIQUES`, `REFUSALS`), and each group of engine arguments checks itself.

The fast tier builds `EngineArgs` for every pair (no model); the full tier also runs an engine on a tiny
model for every pair that is not refused, a few greedy tokens each, under the executor the pair asks for.
"""

from __future__ import annotations

import itertools
import tempfile

import pytest

from quant_tiny import build_tiny
from turbollm.engine_args import EngineArgs
from turbollm.engine_config import REFUSALS, TECHNIQUES, CacheArgs, ModelArgs, ParallelArgs, SchedulerArgs
from turbollm.errors import InvalidRequestError

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "adaptive": False}
DRAFT = "DRAFT"  # replaced by the tiny model drafting for itself

#: one setting per technique: every TECHNIQUES entry, and techniques no refusal names
EXAMPLES: dict[str, dict] = {
    "quantized K/V (kv_cache_dtype int8 / int4)": {"kv_cache_dtype": "int8", "kv_recent_window": 16},
    "kv_policy 'streaming'": {"kv_policy": "streaming", "kv_window": 32},
    "an evicting kv_policy (h2o, snapkv)": {"kv_policy": "h2o", "kv_budget": 64},
    "speculative decoding": {"speculative_config": NGRAM},
    "a draft model": {"speculative_config": DRAFT},
    "pipeline parallelism (pipeline_parallel_size > 1)": {"pipeline_parallel_size": 2},
    "tensor or pipeline parallelism": {"tensor_parallel_size": 2},
    "quantization 'int8'": {"quantization": "int8"},
    "int8-rtn weights": {"quantization": "int8-rtn"},
    "a worker process": {"distributed_executor_backend": "mp"},
    "no prefix caching": {"enable_prefix_caching": False},
    "bfloat16 dense weights": {"dtype": "bfloat16"},
    "a KV connector (kv_transfer_config, kv_store_path)": {"kv_transfer_config": {
        "kv_connector": "store", "kv_store_path": tempfile.mkdtemp(prefix="turbollm-kvs-")}},
    "the block store (kv_connector 'store')": {"kv_store_path": tempfile.mkdtemp(prefix="turbollm-kvs-")},
    "prefill/decode hand-off (kv_connector 'p2p')": {"kv_transfer_config": {
        "kv_connector": "p2p", "kv_buffer_path": tempfile.mkdtemp(prefix="turbollm-kvp-")}},
}
REASONS = [r.reason for r in REFUSALS]


def pairs():
    for a, b in itertools.combinations(EXAMPLES, 2):
        if not set(EXAMPLES[a]) & set(EXAMPLES[b]):  # (two settings of one argument are not a pair)
            yield a, b


def _kwargs(a: str, b: str, draft: str) -> dict:
    kw = {**EXAMPLES[a], **EXAMPLES[b]}
    if kw.get("speculative_config") == DRAFT:
        kw["speculative_config"] = {"method": "draft_model", "model": draft, "num_speculative_tokens": 2,
                                    "adaptive": False}
    return kw


def _verdict(model: str, kw: dict) -> str | None:
    """None when EngineArgs takes the pair; else the refusal's message, which must carry a table reason."""
    try:
        EngineArgs(model=model, **kw)
    except InvalidRequestError as e:
        assert any(reason in str(e) for reason in REASONS), f"refused without a table reason: {e}"
        return str(e)
    return None


def test_the_table_names_known_techniques_and_every_rule_is_reached():
    assert set(EXAMPLES) >= set(TECHNIQUES)
    assert all(r.first in TECHNIQUES and r.second in TECHNIQUES and r.reason for r in REFUSALS)
    messages = [m for a, b in pairs() if (m := _verdict("no-such-model", _kwargs(a, b, "d")))]
    for r in REFUSALS:  # no dead rule: some pair meets each
        assert any(f"{r.first} does not take {r.second}: {r.reason}" in m for m in messages), r


@pytest.mark.parametrize("group,bad,message", [
    (ModelArgs, dict(model="m", dtype="float16"), "dtype 'float16'.*use bfloat16"),
    (ModelArgs, dict(model="m", qmatmul="q9"), "qmatmul 'q9'"),
    (CacheArgs, dict(block_size=24), "power of two"),
    (CacheArgs, dict(kv_recent_window=8), "kv_recent_window applies"),
    (CacheArgs, dict(kv_policy="h3o"), "kv_policy 'h3o'"),
    (ParallelArgs, dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1"),
    (ParallelArgs, dict(pp_steps_in_flight=2), "pp_steps_in_flight takes pipeline stages"),
    (SchedulerArgs, dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
])
def test_each_group_checks_itself(group, bad, message):
    with pytest.raises(InvalidRequestError, match=message):
        group(**bad).check()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(build_tiny("llama", tmp_path_factory.mktemp("pairs")))


@pytest.mark.slow  # worker processes for the parallel pairs
@pytest.mark.parametrize("a,b", list(pairs()), ids=lambda t: t.split(" ")[0] + t.split(" ")[-1][:6])
def test_every_pair_runs_or_is_refused_with_its_reason(tiny, a, b):
    from turbollm import LLM, SamplingParams

    kw = _kwargs(a, b, tiny)
    if _verdict(tiny, kw) is not None:
        return  # refused, with the table's reason (checked in _verdict)
    llm = LLM(tiny, kv_cache_memory=1 << 23, threads=2, **kw)
    try:
        out = llm.generate([{"prompt_token_ids": list(range(5, 45))}],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 6 and out[0].outputs[0].finish_reason == "length"
    finally:
        llm.engine.shutdown()
