"""Strict mode (tests/conftest.py): where a plain run skips for want of a compiler or a network, a CI
run (CI=true) or `make test` (TURBOLLM_STRICT_TESTS=1) fails with the reason; deliberate choices
(TURBOLLM_NO_KERNELS=1, TURBOLLM_TEST_OFFLINE=1, download=False) skip in both.

The kernel build is made to fail by replacing torch's extension loader with one that raises what a
compiler error looks like, against a fresh kernel state and cache folder; the download by replacing
the catalog pull with one that raises ModelDownloadError, against an empty model cache. Nothing is
compiled or downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import conftest
from conftest import catalog_model_path, require_kernels, strict_mode

COMPILER_ERROR = "fused_ops.cpp:12:5: error: 'vfoo' was not declared in this scope"


def fake_load(**kwargs):
    """torch.utils.cpp_extension.load as it fails when the compiler rejects a source."""
    raise RuntimeError(f"Error building extension 'turbollm_kernels'\n[1/2] c++ -O3 fused_ops.cpp\n"
                       f"FAILED: fused_ops.o\n{COMPILER_ERROR}\nninja: build stopped: subcommand failed.")


@pytest.fixture
def env(monkeypatch):
    """A clean slate: neither strict-mode variable nor the deliberate switches set."""
    for name in ("CI", "TURBOLLM_STRICT_TESTS", "TURBOLLM_NO_KERNELS", "TURBOLLM_TEST_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def broken_build(env, tmp_path):
    """The kernels fail to build in this process (for this test): a fresh `_state`, an empty cache."""
    import torch.utils.cpp_extension

    import turbollm.kernels as kernels

    env.setattr(kernels, "_state", {})
    env.setenv("TURBOLLM_KERNEL_CACHE", str(tmp_path / "kernel-cache"))
    env.setattr(torch.utils.cpp_extension, "load", fake_load)
    return env


@pytest.fixture
def broken_download(env, tmp_path):
    """An empty model cache and a pull that fails as an unreachable index does."""
    import importlib

    from turbollm.errors import ModelDownloadError

    def fail(name, *args, **kwargs):
        raise ModelDownloadError(f"could not download {name}: package index unreachable")

    env.setenv("TURBOLLM_HOME", str(tmp_path / "home"))
    env.setattr(importlib.import_module("turbollm.hub.pull"), "pull", fail)  # turbollm.hub.pull is a function too
    return env


@pytest.mark.parametrize(("variables", "strict"), [
    ({}, False), ({"CI": "true"}, True), ({"CI": "1"}, True), ({"CI": "false"}, False), ({"CI": "0"}, False),
    ({"TURBOLLM_STRICT_TESTS": "1"}, True), ({"TURBOLLM_STRICT_TESTS": "0", "CI": "true"}, False),
])
def test_strict_mode_switch(env, variables, strict):
    for name, value in variables.items():
        env.setenv(name, value)
    assert strict_mode() is strict


@pytest.mark.parametrize("variable", ["CI", "TURBOLLM_STRICT_TESTS"])
def test_failed_build_fails_in_strict_mode_with_the_compiler_error(broken_build, variable):
    broken_build.setenv(variable, "1")
    with pytest.raises(pytest.fail.Exception, match="vfoo' was not declared") as info:
        require_kernels()
    assert "could not be built" in str(info.value) and "test_kernels_build_in_strict_mode" in str(info.value)
    # the session-level test (tests/test_kernel_build.py) reports the whole summary, headline included
    with pytest.raises(pytest.fail.Exception, match="(?s)Error building extension.*vfoo' was not declared"):
        require_kernels(full_output=True)


def test_failed_build_skips_outside_strict_mode(broken_build):
    with pytest.raises(pytest.skip.Exception, match="could not be built here.*vfoo' was not declared"):
        require_kernels()


def test_kernels_disabled_on_purpose_skip_in_strict_mode(env):
    import turbollm.kernels as kernels

    env.setattr(kernels, "_state", {})
    env.setenv("TURBOLLM_NO_KERNELS", "1")
    env.setenv("CI", "true")
    with pytest.raises(pytest.skip.Exception, match="TURBOLLM_NO_KERNELS=1"):
        require_kernels()


def test_failed_download_fails_in_strict_mode(broken_download):
    broken_download.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="package index unreachable"):
        catalog_model_path("smollm2-135m")


def test_failed_download_skips_outside_strict_mode(broken_download):
    with pytest.raises(pytest.skip.Exception, match="package index unreachable"):
        catalog_model_path("smollm2-135m")


def test_unknown_model_fails_in_strict_mode(env):
    env.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no-such-model"):
        catalog_model_path("no-such-model")


@pytest.mark.parametrize("how", ["offline", "optional"])
def test_not_cached_on_purpose_skips_in_strict_mode(broken_download, how):
    """TURBOLLM_TEST_OFFLINE=1 and download=False never download; a model not cached then skips."""
    broken_download.setenv("CI", "true")
    if how == "offline":
        broken_download.setenv("TURBOLLM_TEST_OFFLINE", "1")
    with pytest.raises(pytest.skip.Exception, match="not cached"):
        catalog_model_path("smollm2-135m", download=None if how == "offline" else False)


@pytest.mark.parametrize("strict", [True, False])
def test_a_session_reports_the_failed_build(tmp_path, strict):
    """End to end: a pytest run of a kernel test whose build fails ends with `1 failed` and the
    compiler's error in strict mode, `1 skipped` with the reason otherwise."""
    (tmp_path / "test_tiny.py").write_text(textwrap.dedent('''
        import torch.utils.cpp_extension
        from conftest import require_kernels
        from test_strict_mode import fake_load
        torch.utils.cpp_extension.load = fake_load

        def test_needs_kernels():
            require_kernels()
    '''))
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "TURBOLLM_STRICT_TESTS", "TURBOLLM_NO_KERNELS", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=os.pathsep.join([str(Path(conftest.__file__).parent), env.get("PYTHONPATH", "")]),
               TURBOLLM_KERNEL_CACHE=str(tmp_path / "kernel-cache"), **({"CI": "true"} if strict else {}))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "test_tiny.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    if strict:
        assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout + run.stderr
        assert COMPILER_ERROR in run.stdout, run.stdout
    else:
        assert run.returncode == 0 and "1 skipped" in run.stdout, run.stdout + run.stderr
        assert "could not be built here" in run.stdout, run.stdout
