"""Ranks started by torchrun (issue 32, item 3): two torchrun launches on this machine acting as two nodes
over loopback (`--nnodes 2 --node-rank 0|1`), the engine on rank 0, a worker on rank 1; the same greedy
tokens as one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import free_port
from quant_tiny import build_tiny
from turbollm import LLM, SamplingParams

pytestmark = pytest.mark.slow  # torchrun processes: the full tier (`make test`), not `make test-fast`

PROMPTS = [[5, 9, 17, 33, 65], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [100, 50, 25]]
SCRIPT = textwrap.dedent("""
    import json, sys
    from turbollm import LLM, SamplingParams

    if __name__ == "__main__":
        model, out, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        llm = LLM(model, threads=2, **kw)  # on rank 1 this is where the worker runs, then the process exits
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[4])], params, use_tqdm=False)
        footprints = [f.weight_bytes for f in llm.engine.executor.call("footprint")]
        with open(out, "w") as f:
            json.dump({"tokens": [list(o.outputs[0].token_ids) for o in outs],
                       "logprobs": [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in outs],
                       "backend": llm.engine.args.distributed_executor_backend, "footprints": footprints}, f)
        llm.engine.shutdown()
""")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny("qwen2", tmp_path_factory.mktemp("torchrun") / "qwen2")


def _two_nodes(script, *args: str) -> list[subprocess.Popen]:
    """Two torchrun launches of `script` on this machine as two nodes (one process each, over loopback), each in
    a session of its own (a test can kill a launcher with its rank)."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                              "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                              str(script), *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
            for node in (0, 1)]


def _kill(procs: list[subprocess.Popen]) -> None:
    """Each launcher with its rank (their sessions)."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
def test_two_torchrun_nodes_give_one_process_tokens(tiny, tmp_path, kw):
    script = tmp_path / "gen.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    procs = _two_nodes(script, str(tiny), str(out), json.dumps(kw), json.dumps(PROMPTS))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            _kill(procs)
            pytest.fail("torchrun did not finish within 300 s:\n" + "\n".join(q.communicate()[0][-3000:] for q in procs))
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(log[-3000:] for log in logs)
    got = json.loads(out.read_text())
    assert got["backend"] == "torchrun" and len(got["footprints"]) == 2
    one = LLM(str(tiny), threads=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    ref = one.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    whole = one.engine.executor.footprint.weight_bytes
    for o, tokens, lps in zip(ref, got["tokens"], got["logprobs"]):
        assert list(o.outputs[0].token_ids) == tokens
        assert max(abs(next(iter(d.values())).logprob - b) for d, b in zip(o.outputs[0].logprobs, lps)) < 1e-4
    assert all(b < 0.85 * whole for b in got["footprints"]), (got["footprints"], whole)


KILL_SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    from pathlib import Path
    from turbollm import LLM, SamplingParams
    from turbollm.executor.base import WorkerDiedError

    if __name__ == "__main__":
        model, out, kw = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
        (out.parent / f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
        llm = LLM(model, threads=2, **kw)  # rank 1: its worker, until it is killed
        engine = llm.engine
        engine.add_request({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(5):  # mid-request: the prompt is done and tokens are coming
            engine.step()
        os.kill(int((out.parent / "pid1").read_text()), getattr(signal, sys.argv[4]))
        t0 = time.monotonic()
        try:
            while engine.has_unfinished_requests():
                engine.step()
            error = None
        except WorkerDiedError as e:
            error = str(e)
        took = time.monotonic() - t0
        try:
            engine.step()  # the engine stays dead: every later step says why at once
            again = None
        except WorkerDiedError as e:
            again = str(e)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"error": error, "seconds": took, "again": again}))
        tmp.rename(out)  # whole, at once: the test reads it as soon as it is there
        engine.shutdown()
""")


@pytest.mark.parametrize("kw", [dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)])
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSTOP"])
def test_a_torchrun_rank_killed_or_stopped_mid_request_ends_the_engine_within_10_s(tiny, tmp_path, kw, sig):
    """Rank 1 (the other "node") killed, or stopped (a hang), while rank 0 generates: rank 0's next step raises
    WorkerDiedError within 10 s naming it (killed: its gloo connections close, or its beats stop while its process
    ends; stopped: its heartbeats stop),
    and every later step says the ranks are out of step."""
    script = tmp_path / "kill.py"
    script.write_text(KILL_SCRIPT)
    out = tmp_path / "out.json"
    procs = _two_nodes(script, str(tiny), str(out), json.dumps(kw), sig)
    # rank 0's script writes its result and ends; its torchrun agent then waits at its exit barrier for the
    # other node's agent (gone with its rank) for minutes: the test does not wait for the launchers
    try:
        deadline = time.monotonic() + 240
        while not out.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.5)
    finally:
        _kill(procs)
        for rank in (0, 1):  # torchrun's agents start their ranks in sessions of their own
            pid = tmp_path / f"pid{rank}"
            if pid.exists():
                try:
                    os.kill(int(pid.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    logs = [p.communicate()[0] for p in procs]
    assert out.exists(), "\n----\n".join(log[-3000:] for log in logs)
    got = json.loads(out.read_text())
    assert got["error"] is not None and got["seconds"] < 10, got
    assert "rank 1 (pid" in got["error"], got
    assert ("is gone" if sig == "SIGKILL" else "stopped answering (hung)") in got["error"], got
    assert got["again"] is not None and "out of step" in got["again"], got
