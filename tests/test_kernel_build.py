"""The kernel build lock: a killed build never blocks later ones, concurrent builds serialise."""

import subprocess
import sys
import textwrap
import threading
import time

from turbollm.kernels import locked_build_dir


def test_stale_torch_baton_is_removed(tmp_path):
    folder = tmp_path / "mod"
    folder.mkdir()
    (folder / "lock").touch()  # what torch leaves behind when a build is killed mid-way
    with locked_build_dir("mod", root=tmp_path) as build_dir:
        assert build_dir == folder
        assert not (folder / "lock").exists()


def test_lock_of_a_killed_process_is_released(tmp_path):
    holder = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from turbollm.kernels import locked_build_dir
        with locked_build_dir("mod", root=Path({str(tmp_path)!r})):
            (Path({str(tmp_path)!r}) / "held").touch()
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder])
    try:
        deadline = time.time() + 60
        while not (tmp_path / "held").exists():
            assert time.time() < deadline and proc.poll() is None, "holder never took the lock"
            time.sleep(0.05)
    finally:
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
