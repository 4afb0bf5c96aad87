"""Schema-driven fuzzing of the server: requests generated from the OpenAPI schema the app serves
(schemathesis on hypothesis), valid and invalid, against every operation; no answer may be a 5xx, and
the server is healthy and serves a normal request afterwards.

The app runs in process on a tiny random llama (tests/quant_tiny.py) with a 64-token context, so
generation requests stay cheap; about a minute in all (FUZZ_EXAMPLES per operation, derandomized
so a failure reproduces).
"""

from __future__ import annotations


import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402

from quant_tiny import add_chat_template, build_tiny  # noqa: E402

pytestmark = pytest.mark.slow  # hundreds of generated requests: the full tier (`make test`), not `make test-fast`

FUZZ_EXAMPLES = 150
NAME = "tiny"


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory):
    from turbollm.engine_args import EngineArgs
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.entrypoints.async_engine import AsyncLLMEngine
    from turbollm.server.app import ServerSettings, build_app

    path = add_chat_template(build_tiny("llama", tmp_path_factory.mktemp("tiny-llama-fuzz")))
    aengine = AsyncLLMEngine(LLMEngine(EngineArgs(model=str(path), threads=1, max_model_len=64, max_num_seqs=16)))
    app = build_app(aengine, ServerSettings(served_model_names=[NAME], max_waiting_requests=64,
                                            max_request_bytes=1 << 20))
    yield app
    aengine.shutdown_sync(timeout=10)


@pytest.fixture(scope="module")
def api_schema(fuzz_app):
    return schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)


def test_no_server_errors(fuzz_app, api_schema):
    """Each operation of the schema, FUZZ_EXAMPLES generated requests (hypothesis drives the strategies that
    schemathesis derives from the schema; its pytest plugin is not used)."""
    from hypothesis import given

    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    failures: list[str] = []
    statuses: dict[tuple[str, int], int] = {}
    for operation, mode in [(op, m) for op in operations for m in schemathesis.GenerationMode]:
        @given(case=operation.as_strategy(mode))
        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            if isinstance(case.body, dict) and case.operation.path.startswith("/v1/") and len(repr(case.body)) % 2:
                case.body["model"] = NAME  # half the time a served model, so generation is reached, not only 404
            response = case.call()
            key = (case.operation.path, response.status_code)
            statuses[key] = statuses.get(key, 0) + 1
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r}"[:800]
                                + f" -> {response.status_code} {response.text[:400]}")

        try:
            run()
        except Unsatisfiable:  # negative mode on an operation with nothing to make invalid (GET /health)
            assert mode == schemathesis.GenerationMode.NEGATIVE and operation.method == "get", operation.path
    assert not failures, "\n".join(failures[:10])
    for path in ("/v1/completions", "/v1/chat/completions"):  # generation ran, and refusals were exercised
        assert statuses.get((path, 200), 0) >= 10 and statuses.get((path, 400), 0) >= 10, statuses
    # healthy afterwards (checked here: schemathesis ends the app's lifespan, and so the engine, after the test)
    health = api_schema["/health"]["GET"].Case().call()
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    ok = api_schema["/v1/completions"]["POST"].Case(body={"model": NAME, "prompt": "w5 w6 w7", "max_tokens": 3,
                                                           "ignore_eos": True}).call()
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    engine = fuzz_app.state.ctx.engine
    assert not engine.requests and engine.kv_manager.num_free == engine.kv_manager.num_blocks
