"""Running a peer engine's runner script in the peer's own interpreter (vLLM, OpenVINO GenAI): the request as
JSON in an empty temporary folder, a copy of the runner beside it (so that the script's own folder,
turbollm/benchmarks with its `datasets.py`, is not first on the peer's import path), the result read back, and a
failure reported with the end of the peer's stderr."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from turbollm.errors import BenchmarkError

STDERR_TAIL_CHARS = 4000


def check_python(path: str | None, flag: str, needed_by: str, install: str) -> Path:
    """The peer's interpreter given by `flag`, or a BenchmarkError saying what is wrong with it (and, when none is
    given, how to make one: `install`)."""
    if not path:
        raise BenchmarkError(f"{needed_by} needs {flag} PATH: the python of a virtual environment holding {install}")
    p = Path(path).expanduser()
    if not p.is_file() or not os.access(p, os.X_OK):
        raise BenchmarkError(f"{flag} {path}: not an executable file")
    return p


def tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= STDERR_TAIL_CHARS else "..." + text[-STDERR_TAIL_CHARS:]


def run_runner(peer: str, python: Path, runner: Path, request: dict, env: dict[str, str],
               timeout_s: float | None) -> dict:
    """`python runner request.json result.json` for `request`; the result (BenchmarkError naming `peer` else)."""
    with tempfile.TemporaryDirectory(prefix="turbollm-peer-") as tmp:
        tmp_path = Path(tmp)
        req_file, res_file = tmp_path / "request.json", tmp_path / "result.json"
        req_file.write_text(json.dumps(request), encoding="utf-8")
        copy = tmp_path / runner.name
        shutil.copyfile(runner, copy)
        try:
            proc = subprocess.run([str(python), str(copy), str(req_file), str(res_file)], cwd=tmp, env=env,
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
            raise BenchmarkError(f"{peer} ({python}) did not finish within {timeout_s} s; its stderr ends with:\n"
                                 f"{tail(err)}") from None
        if proc.returncode != 0 or not res_file.is_file():
            raise BenchmarkError(f"{peer} ({python}) failed with exit status {proc.returncode}; its stderr ends "
                                 f"with:\n{tail(proc.stderr or proc.stdout)}")
        try:
            return json.loads(res_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise BenchmarkError(f"{peer}'s runner wrote an unreadable result ({e})") from None
