"""`turbollm serve` / `turbollm proxy` processes for the measurement scripts (pd_parity.py, pd_sweep.py): start one
and wait until it answers, stop it, read its /metrics."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx


def start(args: list[str], port: int, command: str = "serve", settle: float = 0.0) -> subprocess.Popen:
    """`turbollm COMMAND ARGS --port PORT` (quiet; a server without its web page), healthy, then `settle` seconds."""
    from turbollm.cli.proxy_cmd import wait_for_instances

    extra = ["--no-webui"] if command == "serve" else []
    proc = subprocess.Popen([sys.executable, "-m", "turbollm", command, *args, "--port", str(port), *extra,
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_instances({command: [f"http://127.0.0.1:{port}"]}, 900)
        time.sleep(settle)
    except BaseException:
        proc.kill()
        raise
    return proc


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (a launcher stops its instances), killed after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def metric_sums(port: int, prefix: str) -> dict[str, float]:
    """Each metric of the server's /metrics whose name starts with `prefix`: its samples summed over labels."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            name = line.split("{")[0].split()[0]
            out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out
