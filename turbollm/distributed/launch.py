"""Ranks started by `torchrun`, on one host or several: the engine on global rank 0, workers elsewhere.

Every node runs the same command under torchrun (`turbollm serve MODEL -tp 2`, or a script that builds
`LLM(...)`), e.g. two nodes with one process each:

    node 0: torchrun --nnodes 2 --node-rank 0 --nproc-per-node 1 --master-addr 10.0.0.1 --master-port 29500 \\
                -m turbollm serve qwen2.5-coder-0.5b -tp 2
    node 1: the same with --node-rank 1

The process of global rank 0 is the engine (the server, the script) and also rank 0's worker; every
other process, on reaching the engine's constructor, becomes a worker instead
(`executor/torchrun.py: run_worker`) and exits when the engine shuts down. All join torchrun's
rendezvous (`env://`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) and a control group in which rank 0
broadcasts, once, the engine's arguments, KV layout and sampler seed, then each step's
`SchedulerOutput`; every rank answers each message through a gather to rank 0 (the step's output from
the first rank of the last pipeline stage, or a traceback). A rank that dies ends the engine as soon as
its connections close, one that hangs within 10 s (rank 0 reads every rank's heartbeat in torchrun's
store meanwhile: executor/heartbeat.py); the gathers' own `REPLY_TIMEOUT` is the last resort.
Collectives and sends between ranks are the same as on one host, over gloo (no shared memory: the
ranks may be on different hosts).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist

from turbollm.distributed.tensor_parallel import JOIN_TIMEOUT_S

# the control group waits between steps for as long as the server is idle; the replies come within a step
# (with pipeline stages, after the last stage's compute: a long prefill on a slow host takes a while)
CONTROL_TIMEOUT = datetime.timedelta(days=365)
REPLY_TIMEOUT = datetime.timedelta(seconds=JOIN_TIMEOUT_S)


def torchrun_rank() -> int | None:
    """This process's global rank when torchrun started it with more than one process, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    return int(os.environ["RANK"])


def join_control_group():
    """Join torchrun's rendezvous (env://) and the control groups (all ranks create them in the same order):
    (broadcasts from rank 0, replies to it)."""
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    ranks = list(range(dist.get_world_size()))
    return (dist.new_group(ranks, timeout=CONTROL_TIMEOUT, backend="gloo"),
            dist.new_group(ranks, timeout=REPLY_TIMEOUT, backend="gloo"))


def broadcast(obj, groups):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=groups[0])
    return box[0]


def gather(obj, groups) -> list | None:
    """Every rank's `obj` on rank 0 (in rank order), None elsewhere."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=groups[1])
    return out
