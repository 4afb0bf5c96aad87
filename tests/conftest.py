"""Shared test helpers: catalog models (pulled on first use), the C++ kernels, and the shared data folder.

Strict mode (`strict_mode()`: ``CI`` set to true/1, or ``TURBOLLM_STRICT_TESTS=1``, which ``make test``
sets) turns what would be an environment skip into a failure with the reason: a C++ kernel build that
failed (`require_kernels`), a catalog model that could not be downloaded (`catalog_model_path`), and a
missing module of the `test` extra that tests `importorskip` (`TEST_EXTRA_MODULES`, checked once when the
session starts; optional peers such as llama_cpp are not in it and still skip).
Deliberate choices still skip in strict mode: ``TURBOLLM_NO_KERNELS=1`` (kernels off),
``TURBOLLM_TEST_OFFLINE=1`` (no downloads) and optional models asked for with ``download=False``.
Outside strict mode a machine without a compiler or network gets skips and one summary line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
STRICT_HOW = "strict mode: CI=true or TURBOLLM_STRICT_TESTS=1, as `make test` sets"
FULL_OUTPUT_TEST = "tests/test_kernel_build.py::test_kernels_build_in_strict_mode"


def strict_mode() -> bool:
    """Whether an unavailable kernel build or model download fails the test instead of skipping it.

    ``TURBOLLM_STRICT_TESTS`` decides when set (1/true on, 0/false off); otherwise ``CI`` set to
    true or 1 (what CI services export) turns it on.
    """
    explicit = os.environ.get("TURBOLLM_STRICT_TESTS", "").strip().lower()
    if explicit:
        return explicit in ("1", "true", "yes")
    return os.environ.get("CI", "").strip().lower() in ("1", "true")


def catalog_model_path(name: str, download: bool | None = None) -> Path:
    """The GGUF file of catalog model `name`, pulled if missing.

    Set TURBOLLM_TEST_OFFLINE=1 to skip model tests instead of downloading; pass
    download=False for optional models that are only checked when already cached. Both skip
    when the model is not cached, in strict mode too. A failed download (or an unknown name) skips
    outside strict mode and fails in it, with the resolver's error.
    """
    from turbollm.errors import ModelDownloadError, UnknownModelError
    from turbollm.hub.catalog import CATALOG
    from turbollm.hub.resolve import resolve_model

    if download is None:
        download = os.environ.get("TURBOLLM_TEST_OFFLINE") != "1"
    try:
        return resolve_model(name, download=download).path
    except (UnknownModelError, ModelDownloadError) as e:
        reason = f"model {name} is not available: {e}"
        not_cached_on_purpose = not download and name in CATALOG
        if strict_mode() and not not_cached_on_purpose:
            pytest.fail(f"{reason}\n({STRICT_HOW}; TURBOLLM_TEST_OFFLINE=1 skips model tests on purpose)",
                        pytrace=False)
        pytest.skip(reason)


def first_diagnostic(build_error: str) -> str:
    """The line of a kernel build error that says what went wrong: the first after the headline that
    mentions an error (a compiler diagnostic), else the headline."""
    lines = build_error.splitlines() or [""]
    return next((line for line in lines[1:] if "error" in line.lower()), lines[0])


def require_kernels(full_output: bool = False):
    """The compiled C++ kernel module; when it is unavailable, skip the calling test, or fail it in
    strict mode with the build's error (`turbollm.kernels.build_error()`, a summary of the compiler's
    output): its first diagnostic line, or all of it with `full_output` (the one test that reports
    it in full: tests/test_kernel_build.py::test_kernels_build_in_strict_mode).

    ``TURBOLLM_NO_KERNELS=1`` switches the kernels off on purpose: that skips in strict mode too.
    """
    from turbollm.kernels import build_error, get_kernels

    module = get_kernels()
    if module is not None:
        return module
    if os.environ.get("TURBOLLM_NO_KERNELS") == "1":
        pytest.skip("C++ kernels disabled on purpose (TURBOLLM_NO_KERNELS=1)")
    reason = build_error() or "no reason recorded"
    first = first_diagnostic(reason)
    if strict_mode():
        detail = f":\n{reason}" if full_output else f": {first} (full output: {FULL_OUTPUT_TEST})"
        pytest.fail(f"the C++ kernels could not be built ({STRICT_HOW}){detail}", pytrace=False)
    pytest.skip(f"C++ kernels could not be built here (the PyTorch reference path is used): {first}")


@pytest.fixture
def needs_kernels():
    """`require_kernels()` as a fixture: ``pytestmark = pytest.mark.usefixtures("needs_kernels")``."""
    return require_kernels()


#: modules of pyproject's `test` extra that test files `pytest.importorskip`: `make test` installs them,
#: so in strict mode their absence is a broken environment, not a reason to skip
TEST_EXTRA_MODULES = ("transformers", "httpx", "openai", "schemathesis")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(args: list[str], port: int, log_path: Path, env: dict | None = None, timeout: float = 180):
    """`python -m turbollm serve ARGS --port PORT` in a process, logging to `log_path` (a file, not a pipe: a full
    pipe would block the server), returned once /health answers 200; fails the test if it exits or times out."""
    import subprocess
    import sys
    import time

    import httpx

    with open(log_path, "a") as log:
        proc = subprocess.Popen([sys.executable, "-m", "turbollm", "serve", *args, "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log_text = lambda: log_path.read_text()[-3000:]
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}:\n{proc.log_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the server did not become healthy in {timeout:.0f} s")
        time.sleep(0.25)


def step_after_signal(engine, rank: int, sig: int, match: str) -> None:
    """Send `sig` to the engine's worker process `rank`, then run a step: it must raise `WorkerDiedError`
    matching `match` within 10 s (a dead or hung worker is named, never waited on)."""
    import time

    from turbollm import SamplingParams
    from turbollm.executor.base import WorkerDiedError

    os.kill(engine.executor._procs[rank].pid, sig)
    engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), "r")
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match=match):
        engine.step()
    assert time.monotonic() - t0 < 10


def greedy_tokens(llm, prompts, max_tokens: int = 16) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy tokens and their logprobs (parallel engines against one process)."""
    from turbollm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
            for o in outs]


def drafter(llm):
    """The worker-side speculation of an engine whose worker runs in this process (`Drafter`: its proposer)."""
    return llm.engine.executor.worker.drafter


def proposer_state_gone(llm, per_seq: dict) -> bool:
    """A proposer's per-sequence state `per_seq` (seq_id -> ...) holds only sequences whose end the workers
    have not heard of yet (they hear at the next step: `SchedulerOutput.finished_seq_ids`)."""
    return set(per_seq) <= set(llm.engine.scheduler._finished_ids)


def check_equal(ref, got, tol: float) -> None:
    """The same tokens, and logprobs within `tol`."""
    assert len(ref) == len(got)
    for (t0, lp0), (t1, lp1) in zip(ref, got):
        assert t1 == t0
        assert max(abs(a - b) for a, b in zip(lp0, lp1)) < tol


def pytest_sessionstart(session):
    if not strict_mode():
        return
    import importlib

    missing = []
    for name in TEST_EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            missing.append(f"{name} ({e})")
    if missing:
        pytest.exit(f"the test extra is not installed: {', '.join(missing)}; pip install -e '.[test]' "
                    f"({STRICT_HOW})", returncode=1)


def pytest_report_header(config):
    return (f"turbollm strict tests: {'on' if strict_mode() else 'off'} (CI=true or TURBOLLM_STRICT_TESTS=1, "
            "as `make test` sets, turns kernel-build and model-download skips into failures)")


def pytest_terminal_summary(terminalreporter):
    """One line when the kernels were tried and are unavailable: disabled on purpose, or (outside strict
    mode, where their tests were skipped) a failed build."""
    kernels = sys.modules.get("turbollm.kernels")
    error = kernels.build_error() if kernels is not None else None
    if not error:
        return
    if os.environ.get("TURBOLLM_NO_KERNELS") == "1":
        terminalreporter.write_line("turbollm: C++ kernel tests skipped: kernels disabled by TURBOLLM_NO_KERNELS=1")
    elif not strict_mode():
        terminalreporter.write_line(f"turbollm: C++ kernel tests skipped, the build failed: {first_diagnostic(error)} "
                                    f"(this fails the run in {STRICT_HOW})")


# the browser tests' session fixtures: one server and one chromium for test_webui_browser.py and test_webui_failures.py
from webui_harness import chromium, ui, webui_server  # noqa: E402,F401
