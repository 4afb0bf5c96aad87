"""`turbollm serve MODEL --disaggregate P:D`: P prefill and D decode instances on this host, each pinned to its
own cores, and the proxy in front of them (prefill/decode disaggregation, turbollm/server/proxy.py).

Each instance is its own `turbollm serve` process on a loopback port, its command line naming its role
(`--kv-transfer-config '{"kv_connector": "p2p", "kv_role": "kv_producer" | "kv_consumer", ...}'`), so an operator
can find it; this process runs the proxy on `--host`/`--port` once every instance answers /health, and stops them
all when it stops (SIGTERM, Ctrl-C, or an instance that dies at start-up, whose exit is reported).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from turbollm.cli.proxy_cmd import wait_for_instances
from turbollm.errors import TurboLLMError
from turbollm.log import init_logger

logger = init_logger()
STARTUP_TIMEOUT = 900.0  # an instance may build its kernels on first use


def parse_split(value: str) -> tuple[int, int]:
    try:
        p, d = (int(x) for x in value.split(":"))
    except ValueError:
        raise TurboLLMError(f"--disaggregate {value!r}: expected P:D, the prefill and decode instances (e.g. 1:1)")
    if p < 1 or d < 1:
        raise TurboLLMError(f"--disaggregate {value!r}: at least one prefill and one decode instance")
    return p, d


def core_groups(cores: list[int], n: int) -> list[list[int]]:
    """`cores` cut into `n` groups as even as they come (each instance its own cores)."""
    if len(cores) < n:
        raise TurboLLMError(f"--disaggregate: {n} instances need at least {n} cores; this process may use {len(cores)}")
    size, extra = divmod(len(cores), n)
    out, at = [], 0
    for i in range(n):
        k = size + (i < extra)
        out.append(cores[at:at + k])
        at += k
    return out


def _instance_argv(argv: list[str]) -> list[str]:
    """The `serve` arguments each instance shares: the command line minus what the launcher sets per instance."""
    own = {"--disaggregate": 1, "--port": 1, "--host": 1, "--threads": 1, "--kv-transfer-config": 1}
    out, skip = [], 0
    for a in argv:
        if skip:
            skip -= 1
            continue
        name = a.split("=", 1)[0]
        if name in own:
            skip = 0 if "=" in a else own[name]
            continue
        out.append(a)
    return out[out.index("serve") + 1:] if "serve" in out else out


def run_disaggregated(ns: argparse.Namespace, argv: list[str]) -> int:
    import uvicorn

    from turbollm.cli.engine_flags import engine_args_from
    from turbollm.executor.multiproc import free_port
    from turbollm.server.proxy import build_proxy_app

    if ns.kv_transfer_config or ns.kv_store_path:
        raise TurboLLMError("--disaggregate sets each instance's --kv-transfer-config itself; drop yours")
    num_p, num_d = parse_split(ns.disaggregate)
    buf = tempfile.mkdtemp(prefix="turbollm-pd-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p2p = {"kv_connector": "p2p", "kv_buffer_path": buf}
    ns.kv_transfer_config = json.dumps({**p2p, "kv_role": "kv_consumer"})
    engine_args_from(ns)  # every engine flag checked here, with the hand-off, before any process starts
    groups = core_groups(sorted(os.sched_getaffinity(0)), num_p + num_d)
    shared = _instance_argv(argv)
    procs: list[tuple[str, subprocess.Popen]] = []
    urls: dict[str, list[str]] = {"--prefill": [], "--decode": []}

    def stop(*_):
        for _, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    try:
        for i, cores in enumerate(groups):
            role, flag = ("kv_producer", "--prefill") if i < num_p else ("kv_consumer", "--decode")
            port = free_port()
            cmd = [sys.executable, "-m", "turbollm", "serve", *shared, "--host", "127.0.0.1", "--port", str(port),
                   "--threads", str(len(cores)), "--kv-transfer-config", json.dumps({**p2p, "kv_role": role})]
            name = f"{'prefill' if i < num_p else 'decode'} instance {i if i < num_p else i - num_p} (cores "\
                   f"{','.join(map(str, cores))}, port {port})"
            logger.info("starting the %s", name)
            procs.append((name, subprocess.Popen(cmd, preexec_fn=lambda c=tuple(cores): os.sched_setaffinity(0, c))))
            urls[flag].append(f"http://127.0.0.1:{port}")
        _wait(procs, urls)
        app = build_proxy_app(urls["--prefill"], urls["--decode"])
        logger.info("proxy on http://%s:%d: %d prefill and %d decode instance(s)", ns.host, ns.port, num_p, num_d)
        signal.signal(signal.SIGTERM, lambda *_: None)  # (uvicorn stops on it; the instances are stopped below)
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level)
    finally:
        stop()
        shutil.rmtree(buf, ignore_errors=True)  # (hand-off files no decode instance took)
    return 0


def _wait(procs, urls) -> None:
    """Every instance answers /health; an instance that exits first is an error naming it."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while True:
        for name, p in procs:
            if p.poll() is not None:
                raise TurboLLMError(f"the {name} exited with code {p.returncode} while starting")
        try:
            wait_for_instances(urls, 1.0)
            return
        except TurboLLMError:
            if time.monotonic() > deadline:
                raise

