"""Tensor parallelism on `torch.distributed`: joining the group, the collectives a step needs, and
the checks a model must pass before its ranks start.

Each rank is a worker process holding its shard of every weight (`layers/linear.py`: column-parallel
QKV and gate/up split by heads and rows, row-parallel o_proj and down_proj split along their input;
`layers/embedding.py`: embedding and LM head split by vocabulary rows). Per layer, the partial sums
of the row-parallel projections are summed by an all-reduce at the step's `LayerHooks` points
(after the attention output projection and after the MLP down projection), which the module path
and the fused C++ step both call; the embedding's rows are all-reduced (each rank looks up the ids
in its range) and the LM head's logits all-gathered, so every rank holds the same logits and samples
the same tokens (the ranks' samplers share one seed: their draws stay in step).
"""

from __future__ import annotations

import datetime
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from turbollm.distributed import ParallelState, get_tp, set_tp
from turbollm.errors import InvalidRequestError

JOIN_TIMEOUT_S = 300  # ranks joining the group (each spawned and importing torch)
# A step's collectives: the ranks do the same work, so one that keeps the others waiting this long has
# died or hung; theirs then fail, and the executor names the rank that did not answer (within 10 s).
STEP_TIMEOUT_S = 6
# ranks that wait for each other sleep: those still on a step that used less CPU time than this in STEP_TIMEOUT_S are
# stuck (a rank computing uses ~30x that; executor/multiproc.py `_Stall`, heartbeat.py `HangWatch`)
ACTIVE_CPU_S = 0.2

_GROUP: list = [None]  # the step's process group (a shorter timeout than the joining one)
_SHM: list = [None]  # ranks on one host: the shared-memory exchange (distributed/shm_comm.py), or None


_LOOKUP_GROUP: list = [None]  # the first and the last stage's ranks of this TP rank: the tied table's rows


def init_lookup_groups(rank: int, tp: int, pp: int) -> None:
    """One group per TP rank of (its first-stage rank, its last-stage rank), every rank creating each in the
    same order: the rows of a tied table go through it, sent from a thread of their own on the last stage
    (its own gloo context: no op of the main thread's groups is in its way)."""
    for r in range(tp):
        group = dist.new_group([r, (pp - 1) * tp + r], timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
                               backend="gloo")
        if rank in (r, (pp - 1) * tp + r):
            _LOOKUP_GROUP[0] = group


def lookup_group():
    """This TP rank's (first stage, last stage) group (`init_lookup_groups`; None without pipeline stages)."""
    return _LOOKUP_GROUP[0]


def init_parallel(rank: int, tp: int, init_method: str, shm_files=None, pp: int = 1,
                  layers: range | None = None) -> None:
    """Join the gloo group of `tp` × `pp` ranks (global rank = stage × tp + tp rank) and make this process
    that rank: its stage's tensor-parallel group (a shorter timeout), its pipeline stage and `layers`.
    `shm_files` (one `ShmFiles` per stage, created by the engine): collectives that fit go through
    shared memory."""
    world = tp * pp
    if not dist.is_initialized():  # (ranks torchrun started have joined already: distributed/launch.py)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S))
    elif dist.get_world_size() != world:
        raise RuntimeError(f"{dist.get_world_size()} processes joined, but tensor_parallel_size {tp} x "
                           f"pipeline_parallel_size {pp} needs {world}")
    stage, tp_rank = divmod(rank, tp)
    if pp > 1:
        init_lookup_groups(rank, tp, pp)
    for s in range(pp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(s * tp, (s + 1) * tp)), timeout=datetime.timedelta(seconds=STEP_TIMEOUT_S),
                               backend="gloo")
        if s == stage:
            _GROUP[0] = group
    if shm_files is not None and tp > 1:
        from turbollm.distributed.shm_comm import ShmComm
        from turbollm.kernels import get_kernels

        kernels = get_kernels()
        if kernels is None:
            raise RuntimeError("the shared-memory all-reduce needs the C++ kernels, which did not build")
        _SHM[0] = ShmComm(shm_files[stage], tp_rank, kernels, STEP_TIMEOUT_S)
    set_tp(ParallelState(tp, tp_rank, pp_size=pp, pp_rank=stage, layer_start=layers.start if layers else 0,
                         layer_end=layers.stop if layers else None))


@dataclass
class CommStats:
    """This rank's time in collectives and pipeline sends since it started (what the benchmarks report)."""

    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0  # payload bytes handed to the collectives (each rank's own tensor)
    send_seconds: float = 0.0  # pipeline: starting sends and waiting for them to finish
    sends: int = 0
    send_bytes: int = 0
    recv_seconds: float = 0.0  # pipeline: waiting for the stage before (its compute included)
    recvs: int = 0


COMM = CommStats()


def _timed(fn, t: torch.Tensor) -> None:
    t0 = time.perf_counter()
    fn()
    COMM.seconds += time.perf_counter() - t0
    COMM.calls += 1
    COMM.bytes += t.numel() * t.element_size()


def all_reduce(t: torch.Tensor) -> None:
    """Sum `t` over the ranks, in place (every rank gets the same values)."""
    shm = _SHM[0]
    if shm is not None and shm.fits(t):
        _timed(lambda: shm.all_reduce(t), t)
    else:
        _timed(lambda: dist.all_reduce(t, group=_GROUP[0]), t)


def all_reduce_hook(layer: int, t: torch.Tensor) -> None:
    """The `LayerHooks` entry (attn_out and mlp_out) of a rank: sum the ranks' partial outputs in place."""
    all_reduce(t)


def all_gather_last(t: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's `t` along its last dimension, in rank order."""
    shm = _SHM[0]
    if shm is not None and shm.fits(t):
        out = []
        _timed(lambda: out.append(shm.all_gather_last(t)), t)
        return out[0]
    parts = [torch.empty_like(t) for _ in range(get_tp().tp_size)]
    t = t.contiguous()
    _timed(lambda: dist.all_gather(parts, t, group=_GROUP[0]), t)
    return torch.cat(parts, dim=-1)


def check_tensor_parallel(cfg, size: int) -> None:
    """Refuse a split the model cannot take (naming the flag), before any rank starts."""
    if size < 1:
        raise InvalidRequestError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    problems = []
    if cfg.num_heads % size:
        problems.append(f"its {cfg.num_heads} attention heads")
    if cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        problems.append(f"its {cfg.num_kv_heads} KV heads (nor do they divide it)")
    if cfg.vocab_size % size:
        problems.append(f"its vocabulary of {cfg.vocab_size}")
    if problems:
        raise InvalidRequestError(f"tensor_parallel_size {size} does not divide {', '.join(problems)}")


def comm_stats() -> dict:
    """This rank's `CommStats` as plain data."""
    return asdict(COMM)
