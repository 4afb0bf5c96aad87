"""A short profile of the real engine: the step-cost model's data and the model's runtime memory.

`profile(args)` runs, in a fresh process (`python -m turbollm.planner.profile ARGS.json`, so its memory
readings are its own), the engine built from `args` through its public step path on scratch requests of
random tokens (no prefix-cache hits):

- decode batches of R = 1, 2, 4 ... up to max_num_seqs (at most 64) sequences (context ~32, 7 steps each),
  their prefill step too;
- decode batches of 1 and 8 sequences at a long context (~480 tokens);
- single prompts of 16 ... max_num_batched_tokens tokens (one prefill step each);

every step timed with its shape (`benchmarks/step_stats.StepRecorder`), after one untimed warm-up
request. Its KV pool is just large enough and written once first (`prefault_kv`), so no step pays the first
touch of its pages. Memory: the process's resident set before the engine is built (`base`), after (less the
weights the engine reports: `model_runtime`), and its growth over the largest single-prompt step, run first
(`activation_bytes_per_token`: the heap keeps what a step used). The result is cached by model file, engine
arguments that change a step's cost, CPU and turbollm version (`~/.cache/turbollm/plans/`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from turbollm.errors import TurboLLMError
from turbollm.procfs import rss_bytes
from turbollm.planner.cost_model import StepCostModel, StepShape, fit

# the engine arguments that do not change a step's cost (the KV pool's size and the scheduler's limits
# change which steps happen, not what one costs)
NOT_COST = {"max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "enable_prefix_caching", "seed",
            "max_model_len", "kv_transfer_config", "kv_store_path"}
PROFILE_VERSION = 5


@dataclass
class Profile:
    key: str
    cost: StepCostModel
    base_bytes: int  # resident set before the engine is built (the interpreter, torch, turbollm)
    model_runtime_bytes: int  # after it is built, less `base_bytes` and the weights
    weight_bytes: int  # the weights as the engine holds them (measured; the planner predicts its own)
    seconds: float  # the profile's wall time
    cpu: str
    threads: int
    first_touch_gbps: float | None  # the KV pool's pages written for the first time (None: not measured)
    activation_bytes_per_token: float | None  # the profile's resident growth past its KV pool, per token of its
    # largest step (the sampled rows' logits taken out): tensors, and what the allocator keeps of them
    steps: list = dataclasses.field(default_factory=list)  # [new tokens per seq, computed per seq, seconds]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["cost"] = self.cost.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        return cls(**{**d, "cost": StepCostModel.from_dict(d["cost"])})


def plans_dir() -> Path:
    from turbollm.hub.catalog import turbollm_home

    return turbollm_home() / "plans"


def profile_key(args) -> str:
    """What the cost of a step depends on: the model file, the cost-changing arguments, CPU, version."""
    from turbollm import __version__
    from turbollm.hub.resolve import resolve_model
    from turbollm.kernels import cpu_flags
    from turbollm.loader.model_loader import pick_linear_method

    resolved = resolve_model(args.model)
    path = resolved.path
    stat = path.stat()
    fields = {k: v for k, v in dataclasses.asdict(args).items() if k not in NOT_COST}
    fields["speculative_config"] = repr(args.speculative_config)
    # the names "auto" and None stand for: the same engine whichever way it was asked for
    method = pick_linear_method(args.quantization, resolved.format, path)[0]
    fields.update(quantization=method, kv_cache_dtype=str(args.kv_torch_dtype(method)))
    blob = json.dumps([str(path), stat.st_size, int(stat.st_mtime), fields, cpu_flags(), os.cpu_count(),
                       __version__, PROFILE_VERSION], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def cached_profile(args) -> Profile | None:
    path = plans_dir() / f"profile-{profile_key(args)}.json"
    try:
        return Profile.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None


def profile(args, refresh: bool = False, log=print) -> Profile:
    """The cached profile for `args`, or a fresh one (run in a child process, a few seconds to minutes)."""
    if not refresh:
        hit = cached_profile(args)
        if hit is not None:
            return hit
    key = profile_key(args)
    out = plans_dir() / f"profile-{key}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = plans_dir() / f"profile-{key}.args.json"
    spec.write_text(json.dumps(_args_dict(args)))
    log(f"profiling {args.model}, weights {args.quantization or 'as the file'}, K/V {args.kv_cache_dtype}, block "
        f"{args.block_size} (decode batches up to {min(args.max_num_seqs, 64)} sequences, prompts up to "
        f"{args.max_num_batched_tokens} tokens; cached in {out})")
    try:  # the child's progress on our stderr (inherited when ours is not a file: a test's capture)
        sys.stderr.fileno()
        err = sys.stderr
    except (AttributeError, OSError, ValueError):
        err = None
    proc = subprocess.run([sys.executable, "-m", "turbollm.planner.profile", str(spec), str(out), key],
                          stdout=err, stderr=err)
    if proc.returncode != 0 or not out.exists():
        raise TurboLLMError(f"the profile of {args.model} failed (exit code {proc.returncode}); see the log above")
    return Profile.from_dict(json.loads(out.read_text()))


def _args_dict(args) -> dict:
    d = dataclasses.asdict(args)
    if args.speculative_config is not None:
        d["speculative_config"] = dataclasses.asdict(args.speculative_config)
    return d


def measure_base() -> int:
    """The resident set of a fresh interpreter that has imported torch and turbollm (the engine's floor)."""
    code = "import torch, turbollm, turbollm.procfs as p; print(p.rss_bytes())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return int(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise TurboLLMError(f"could not measure the interpreter's memory: {out.stderr[-500:]}") from None


def _shapes(max_seqs: int, budget: int, model_len: int) -> list[tuple[int, int, int]]:
    """(sequences, prompt tokens, new tokens) of each profiled batch."""
    runs = []
    r = 1
    while r <= min(max_seqs, 64):
        if r * 32 <= budget:
            runs.append((r, 32, 8))
        r *= 2
    long_ctx = min(480, model_len - 8)
    runs += [(r, long_ctx, 4) for r in (1, 8) if r <= max_seqs and long_ctx > 64]
    t = 16
    while t <= min(budget, model_len - 2):
        runs.append((1, t, 1))
        t *= 4 if t < 256 else 2
    return runs


PROFILE_TOKENS = 5120  # the KV pool the profile's engine gets (its largest batch: 8 x 484 tokens)


def prefault_kv(engine) -> tuple[int, float]:
    """Write zeros over an in-process engine's whole KV pool, so that no step pays the first touch of its pages
    (a VM returns freed pages to its host: touching one again costs a fault each); (bytes, seconds), or
    (0, 0.0) when the workers are other processes."""
    worker = getattr(engine.executor, "worker", None)
    caches = getattr(getattr(worker, "runner", None), "kv_caches", None)
    if not caches:
        return 0, 0.0
    t0, total, seen = time.perf_counter(), 0, set()
    for c in caches:
        for t in (getattr(c, "k", None), getattr(c, "v", None), getattr(c, "k_scale", None), getattr(c, "v_scale", None)):
            if t is not None and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                t.zero_()
                total += t.untyped_storage().nbytes()
    return total, time.perf_counter() - t0


def profile_args(args):
    """`args` with a KV pool just large enough for the profile's batches (its pages then prefaulted)."""
    from turbollm.core.kv_sizing import batched_tokens, default_kv_budget
    from turbollm.loader.model_loader import describe_model

    desc = describe_model(args.model, quantization=args.quantization)
    seqs = min(args.max_num_seqs, 64)
    spec = args.speculative_config
    budget = default_kv_budget(desc.config, args.kv_torch_dtype(desc.quantization), args.block_size,
                               -(-PROFILE_TOKENS // seqs), seqs, args.kv_policy_config(), batched_tokens(args),
                               spec.num_speculative_tokens if spec is not None else 0, args.kv_recent_window or 0)
    model_len = min(desc.config.max_position_embeddings, args.max_num_batched_tokens + 64)
    return dataclasses.replace(args, max_num_seqs=seqs, max_model_len=model_len,
                               kv_cache_memory=budget * args.tensor_parallel_size)


def run_profile(args) -> Profile:
    """In this process: build the engine, run the profile's batches, fit the model."""
    import torch

    from turbollm.benchmarks.datasets import random_prompt_ids
    from turbollm.benchmarks.kernel_bench import cpu_name
    from turbollm.benchmarks.step_stats import StepRecorder
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.sampling_params import SamplingParams

    base = rss_bytes()
    t0 = time.perf_counter()
    args = profile_args(args)
    engine = LLMEngine.from_engine_args(args)
    weights = int(engine.footprint.weight_bytes)
    runtime = rss_bytes() - base - weights
    touched, touch_seconds = prefault_kv(engine)
    gen = torch.Generator().manual_seed(0)
    tok = engine.tokenizer
    budget = min(args.max_num_batched_tokens, engine.max_model_len - 8)  # (room for the decode steps)

    def run(r: int, prompt: int, new: int, tag: str) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        for i in range(r):
            engine.add_request(random_prompt_ids(tok, prompt, gen), params, request_id=f"profile-{tag}-{i}")
        while engine.has_unfinished_requests():
            engine.step()

    runs = _shapes(args.max_num_seqs, budget, engine.max_model_len)
    longest = max(p for r, p, n in runs if r == 1 and n == 1)
    runs.remove((1, longest, 1))
    before = rss_bytes()  # the KV pool committed: what grows now is the steps' tensors
    run(1, min(256, budget), 4, "warm")
    shapes, seconds = [], []
    with StepRecorder(engine) as rec:
        # first the largest step, one sequence: the heap keeps what a step used, so the growth now is its need
        run(1, longest, 1, "longest")
        grown = rss_bytes() - before
        for n, (r, prompt, new) in enumerate(runs):
            run(r, prompt, new, str(n))
            print(f"  profile {n + 1}/{len(runs)}: {r} x {prompt} tokens", file=sys.stderr, flush=True)
    for s in rec.records:
        if s.new_lens:
            shapes.append(StepShape(s.new_lens, tuple(c - n for c, n in zip(s.context_lens, s.new_lens))))
            seconds.append(s.seconds)
    engine.shutdown()
    from turbollm.planner.memory import logits_bytes

    # its bytes a token, less its one row's logits (its K/V went to the pool, committed before)
    per_token = max(0, grown - logits_bytes(engine.config, 1)) / longest if touched else None
    return Profile("", fit(shapes, seconds), base, runtime, weights, time.perf_counter() - t0, cpu_name(),
                   torch.get_num_threads(), touched / touch_seconds / 1e9 if touched else None, per_token,
                   [[list(s.new), list(s.computed), t] for s, t in zip(shapes, seconds)])


def main(argv: list[str]) -> int:
    from turbollm.engine_args import EngineArgs

    spec, out, key = argv
    args = EngineArgs(**json.loads(Path(spec).read_text()))
    prof = run_profile(args)
    prof.key = key
    tmp = Path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(prof.to_dict(), indent=1))
    os.replace(tmp, out)
    Path(spec).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
