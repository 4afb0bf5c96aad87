"""The kernel build lock: a killed build never blocks later ones, concurrent builds serialise."""

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from turbollm.kernels import locked_build_dir


def test_stale_torch_baton_is_removed(tmp_path):
    folder = tmp_path / "mod"
    folder.mkdir()
    (folder / "lock").touch()  # what torch leaves behind when a build is killed mid-way
    with locked_build_dir("mod", root=tmp_path) as build_dir:
        assert build_dir == folder
        assert not (folder / "lock").exists()


def _holder(tmp_path, body: str) -> subprocess.Popen:
    """A process running `body` (after `import time` and `from pathlib import Path`), returned once it has
    touched tmp_path / "held"."""
    script = "import time\nfrom pathlib import Path\n" + textwrap.dedent(body)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 60
        while not (tmp_path / "held").exists():
            assert time.time() < deadline and proc.poll() is None, "the holder process never got ready"
            time.sleep(0.05)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def test_lock_of_a_killed_process_is_released(tmp_path):
    proc = _holder(tmp_path, f"""
        from turbollm.kernels import locked_build_dir
        with locked_build_dir("mod", root=Path({str(tmp_path)!r})):
            (Path({str(tmp_path)!r}) / "held").touch()
            time.sleep(600)
    """)
    proc.kill()
    proc.wait()
    got = []

    def take():
        with locked_build_dir("mod", root=tmp_path) as build_dir:
            got.append(build_dir)

    worker = threading.Thread(target=take, daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert got == [tmp_path / "mod"]


def test_second_builder_waits_for_the_first(tmp_path):
    order = []

    def second():
        with locked_build_dir("mod", root=tmp_path):
            order.append("second")

    with locked_build_dir("mod", root=tmp_path):
        worker = threading.Thread(target=second)
        worker.start()
        time.sleep(0.3)
        order.append("first")
    worker.join(timeout=30)
    assert order == ["first", "second"]


def _sources(folder, text="int f() { return 1; }\n"):
    folder.mkdir(parents=True)
    (folder / "a.cpp").write_text(text)
    (folder / "b.h").write_text("#pragma once\n")
    return [folder / "a.cpp", folder / "b.h"]


def test_build_key_follows_content_not_location(tmp_path):
    """Two checkouts of the same sources share a build; a changed byte or flag gets its own."""
    from turbollm.kernels import build_key

    one, two = _sources(tmp_path / "one"), _sources(tmp_path / "two")
    assert build_key(one, ["-O3"]) == build_key(two, ["-O3"])
    assert build_key(one, ["-O3"]) != build_key(one, ["-O2"])
    (two[1]).write_text("#pragma once\n// changed\n")
    assert build_key(one, ["-O3"]) != build_key(two, ["-O3"])


def test_build_key_separates_torch_installs(tmp_path, monkeypatch):
    """torch's include and library paths are in every compile command: another venv, another build."""
    import torch

    from turbollm.kernels import build_key

    files = _sources(tmp_path / "src")
    here, real = build_key(files, ["-O3"]), Path(torch.__file__).parent
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
    assert build_key(files, ["-O3"]) != here
    # a symlink to this venv is another path in every compile command too: its own build, not a shared folder
    # whose ninja commands would change (and rebuild everything) at each switch
    (tmp_path / "linked-venv").symlink_to(real.parent, target_is_directory=True)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "linked-venv" / real.name / "__init__.py"))
    assert build_key(files, ["-O3"]) != here


def test_stage_sources_copies_and_refreshes(tmp_path):
    from turbollm.kernels import stage_sources

    files = _sources(tmp_path / "checkout")
    build = tmp_path / "build"
    build.mkdir()
    staged = stage_sources(files, build)
    assert [p.name for p in staged] == ["a.cpp", "b.h"]
    assert all(p.parent == build / "src" and p.read_bytes() == f.read_bytes() for p, f in zip(staged, files))
    stamp = staged[1].stat().st_mtime_ns
    files[0].write_text("int f() { return 2; }\n")
    time.sleep(0.01)
    stage_sources(files, build)
    assert staged[0].read_text() == "int f() { return 2; }\n"
    assert staged[1].stat().st_mtime_ns == stamp  # unchanged files are not rewritten (no rebuild)


def _aged_builds(root, n: int) -> list:
    """n build folders mod-0.. whose last use is 1000 + i seconds after the epoch (the oldest first)."""
    import os

    folders = []
    for i in range(n):
        with locked_build_dir(f"mod-{i:016x}", root=root) as folder:
            folders.append(folder)
        os.utime(folder / ".turbollm-build.lock", (1000 + i, 1000 + i))
    return folders


def test_prune_keeps_recent_builds_and_skips_busy_ones(tmp_path):
    import os

    from turbollm.kernels import prune_builds

    folders = _aged_builds(tmp_path, 5)
    (tmp_path / "mod").mkdir()  # a folder from before builds were keyed
    (tmp_path / "other-0").mkdir()
    with locked_build_dir("mod-0000000000000000", root=tmp_path) as busy:  # in use, though oldest
        os.utime(busy / ".turbollm-build.lock", (1000, 1000))
        removed = prune_builds("mod", tmp_path, keep=2)
    assert sorted(removed) == sorted([folders[1], folders[2], tmp_path / "mod"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "mod-0000000000000000", "mod-0000000000000003", "mod-0000000000000004", "other-0"]


def test_build_key_separates_cpus(tmp_path, monkeypatch):
    """Builds use -march=native: a cache shared between machines must not hand one CPU's build to another
    (before: the key had no CPU in it, and an AVX-512 build would SIGILL on an AVX2 machine)."""
    import turbollm.kernels as kernels

    files = _sources(tmp_path / "src")
    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx avx2 fma\n")
    avx512 = tmp_path / "avx512"
    avx512.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n")
    assert kernels.cpu_flags(avx2) == "avx avx2 fma fpu sse2"
    monkeypatch.setattr(kernels, "CPUINFO", avx2)
    on_avx2 = kernels.build_key(files, ["-O3"])
    monkeypatch.setattr(kernels, "CPUINFO", avx512)
    assert kernels.build_key(files, ["-O3"]) != on_avx2
    monkeypatch.setattr(kernels, "CPUINFO", tmp_path / "missing")  # no /proc: machine and processor names
    assert kernels.cpu_flags() and kernels.build_key(files, ["-O3"]) != on_avx2


def test_prune_never_removes_a_build_another_process_has_loaded(tmp_path):
    """A live process's mapped module keeps its folder (before: the oldest folder went, in use or not)."""
    import os

    from turbollm.kernels import prune_builds

    folders = _aged_builds(tmp_path, 3)
    proc = _holder(tmp_path, f"""
        from turbollm.kernels import mark_in_use
        mark_in_use(Path({str(folders[0])!r}))
        (Path({str(tmp_path)!r}) / "held").touch()
        time.sleep(600)
    """)
    try:
        assert prune_builds("mod", tmp_path, keep=1) == [folders[1]]  # the oldest is loaded elsewhere
        assert folders[0].exists()
    finally:
        proc.kill()
        proc.wait()
    assert prune_builds("mod", tmp_path, keep=1) == [folders[0]]  # its holder is gone


def test_kernels_build_in_strict_mode():
    """The one place a failed kernel build is reported in full: in strict mode (CI=true,
    TURBOLLM_STRICT_TESTS=1, `make test`) this fails with the compiler's diagnostics
    (`build_error()`); outside it, it is skipped with the first line, as the engine falls back to
    the PyTorch paths. TURBOLLM_NO_KERNELS=1 (kernels off on purpose) skips in either mode."""
    from conftest import require_kernels

    assert require_kernels(full_output=True) is not None
