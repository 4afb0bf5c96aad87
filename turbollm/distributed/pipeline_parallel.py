"""Pipeline parallelism on `torch.distributed`: the layers cut into stages, and the hidden states a
stage hands the next.

A stage is a group of `tensor_parallel_size` ranks (global rank = stage × tp + tp rank) holding a
contiguous range of decoder layers and their KV caches; the first stage also embeds the tokens,
the last one holds the final norm and the LM head and samples. A table tied to the LM head is held by
the last stage alone: it looks the tokens up and sends the rows to the first (`send_embedded`, from a
thread of its own as soon as a step reaches a worker process, when the step starts under torchrun;
through a group of its own: `tensor_parallel.init_lookup_groups`). Every rank gets every step's
`SchedulerOutput` (its sequences' state stays in step with no further messages); a stage receives
(block output, residual stream) of each micro-batch from the same TP rank of the stage before and
sends its own to the next (`send_hidden` / `recv_hidden`, gloo point-to-point, timed in the rank's
`CommStats`).

`partition_layers` balances the stages by the parameters a token is multiplied with: each layer's
linears, and on the last stage the LM head (for a small model with a large vocabulary the head
weighs as much as several layers). The embedding is a lookup and weighs nothing here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from turbollm.distributed import get_tp
from turbollm.distributed.tensor_parallel import COMM, lookup_group
from turbollm.errors import InvalidRequestError


def layer_params(cfg) -> int:
    """Parameters of one decoder layer's linears (what each token is multiplied with)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return cfg.hidden_size * (2 * q + 2 * kv) + 3 * cfg.hidden_size * cfg.intermediate_size


def parse_partition(text) -> list[int] | None:
    """`pp_layer_partition` as given ("12,12", a list, or None)."""
    if text is None or isinstance(text, (list, tuple)):
        return None if text is None else [int(n) for n in text]
    try:
        return [int(n) for n in str(text).split(",")]
    except ValueError:
        raise InvalidRequestError(f"pp_layer_partition {text!r}: give the layers of each stage, e.g. '12,12'") from None


def partition_layers(cfg, pp: int, given: list[int] | None = None) -> list[range]:
    """Each stage's layers: `given` (layers per stage, checked), or balanced by parameters. More stages
    than layers are refused."""
    n = cfg.num_layers
    if pp > n:
        raise InvalidRequestError(f"pipeline_parallel_size {pp} is more stages than the model's {n} layers")
    if given is not None:
        if len(given) != pp or any(k < 1 for k in given) or sum(given) != n:
            raise InvalidRequestError(f"pp_layer_partition {','.join(map(str, given))}: give {pp} positive layer "
                                      f"counts summing to the model's {n} layers")
        counts = list(given)
    elif pp == 1:
        counts = [n]
    else:
        layer, head = layer_params(cfg), cfg.vocab_size * cfg.hidden_size

        def cost(k: int) -> float:  # the slowest stage with k layers on the last one
            rest = n - k
            return max(-(-rest // (pp - 1)) * layer, k * layer + head)

        last = min(range(1, n - pp + 2), key=cost)
        base, extra = divmod(n - last, pp - 1)
        counts = [base + (s < extra) for s in range(pp - 1)] + [last]
    out, start = [], 0
    for k in counts:
        out.append(range(start, start + k))
        start += k
    return out


# Tokens a micro-batch needs before cutting a step pays: a decode micro-batch of a few rows reads every
# weight of its stage as the whole batch would (decode is bound by memory bandwidth), so cutting a
# decode step in M makes each stage read its weights M times; a prefill chunk is bound by compute, and
# its micro-batches let the stages work at once (docs/BENCHMARKS.md).
MIN_MICROBATCH_TOKENS = 64


def split_microbatches(token_counts: list[int], m: int, min_tokens: int = 1) -> list[range]:
    """Consecutive sequences cut into at most `m` non-empty micro-batches of about equal tokens, each of
    about `min_tokens` or more (fewer micro-batches otherwise)."""
    total = sum(token_counts)
    m = max(1, min(m, len(token_counts), total // max(1, min_tokens)))
    out, start, acc = [], 0, 0
    for i, n in enumerate(token_counts):
        acc += n
        left = len(token_counts) - i - 1  # sequences after this one
        want = len(out) + 1  # the micro-batch being filled
        if want < m and (acc >= total * want / m or left == m - want):
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, len(token_counts)))
    return [r for r in out if len(r)]


def _rank(stage: int) -> int:
    """The global rank of this TP rank's peer in `stage`."""
    st = get_tp()
    return stage * st.tp_size + st.tp_rank


def _isend(payload: torch.Tensor, stage: int, group=None):
    """Start sending `payload` to this TP rank's peer in `stage`, timed and counted in `COMM`."""
    t0 = time.perf_counter()
    work = dist.isend(payload, dst=_rank(stage), group=group)
    COMM.send_seconds += time.perf_counter() - t0
    COMM.sends += 1
    COMM.send_bytes += payload.numel() * payload.element_size()
    return work, payload


def _recv(shape: tuple[int, ...], stage: int, group=None) -> torch.Tensor:
    """A tensor from this TP rank's peer in `stage` (blocks until it comes), the wait timed in `COMM`."""
    buf = torch.empty(shape)
    t0 = time.perf_counter()
    dist.recv(buf, src=_rank(stage), group=group)
    COMM.recv_seconds += time.perf_counter() - t0
    COMM.recvs += 1
    return buf


def send_hidden(x: torch.Tensor, residual: torch.Tensor):
    """Start sending a micro-batch's (block output, residual stream) to the next stage; returns the
    request to wait on (the tensor it sends stays alive with it)."""
    return _isend(torch.stack([x, residual]), get_tp().pp_rank + 1)


def recv_hidden(num_tokens: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's (block output, residual stream) from the stage before (blocks until it comes:
    the time counts the previous stage's compute too)."""
    buf = _recv((2, num_tokens, hidden), get_tp().pp_rank - 1)
    return buf[0], buf[1]


def send_embedded(x: torch.Tensor) -> None:
    """The last stage, holding a tied table (from its lookup thread): send a micro-batch's looked-up rows to
    the first stage (this rank's share of them under tensor parallelism: the first stage sums the shares);
    returns once the first stage has taken them."""
    work, _ = _isend(x.contiguous(), 0, lookup_group())
    t0 = time.perf_counter()
    work.wait()
    COMM.send_seconds += time.perf_counter() - t0


def recv_embedded(num_tokens: int, hidden: int) -> torch.Tensor:
    """The first stage: a micro-batch's looked-up rows from the last stage (which holds the tied table); with
    tensor parallelism each rank receives its peer's vocabulary share and the stage's ranks sum them."""
    buf = _recv((num_tokens, hidden), get_tp().pp_size - 1, lookup_group())
    if get_tp().tp_size > 1:
        from turbollm.distributed.tensor_parallel import all_reduce

        all_reduce(buf)
    return buf


def wait_sends(pending: list) -> None:
    if not pending:  # (the last stage: its lookup thread may be adding to the same counter)
        return
    t0 = time.perf_counter()
    for work, _ in pending:
        work.wait()
    COMM.send_seconds += time.perf_counter() - t0
