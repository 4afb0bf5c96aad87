"""`turbollm eval ppl --stream` (perplexity by position through the engine) and `turbollm eval passkey`
(turbollm/eval/long_context.py): each KV policy / K/V dtype given runs in turn, same text, same keys."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from dataclasses import dataclass

PASSKEY_HELP = """\
A 5-digit number hidden at a chosen depth of filler text (0 = start, 1 = just before the question),
asked for at the end; greedy decoding must produce it within 8 tokens. Prints the accuracy by
context length and depth for each --kv-policy / --kv-cache-dtype given, with the K/V bytes per token
and the peak K/V memory of the longest prompts."""


def add_passkey(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("passkey", help="passkey retrieval by context length and depth, per KV policy / dtype",
                        description=PASSKEY_HELP)
    p.add_argument("model", help="catalog name, GGUF file, HF folder or hub id")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096], help="prompt tokens (about)")
    p.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--trials", type=int, default=3, help="random keys per (length, depth)")
    p.add_argument("--seed", type=int, default=0)
    add_kv_settings(p)
    p.add_argument("--json", metavar="FILE", default=None)
    p.set_defaults(func=run_passkey_cmd)


def add_kv_settings(p: argparse.ArgumentParser) -> None:
    from turbollm.engine_args import KV_CACHE_DTYPES

    p.add_argument("--kv-policy", nargs="+", default=None, help="KV policies to run in turn (default: auto)")
    p.add_argument("--kv-cache-dtype", nargs="+", default=None, choices=list(KV_CACHE_DTYPES),
                   help="K/V storage dtypes to run in turn (default: auto)")
    p.add_argument("--quantization", default=None, help="weights' linear method (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--kv-recent-window", type=int, default=None,
                   help="with --kv-cache-dtype int8/int4: each sequence's newest tokens kept in float16 (default 128)")
    add_chunk_flag(p)
    add_streaming_flags(p)


def add_streaming_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention-sinks", type=int, nargs="+", default=None,
                   help="with --kv-policy streaming: sink counts to run in turn (default 4; 0: the window alone)")
    p.add_argument("--kv-window", type=int, default=None, help="with --kv-policy streaming: tokens each layer keeps")
    p.add_argument("--kv-budget", type=int, default=None,
                   help="with --kv-policy h2o / snapkv: tokens each sequence keeps (its least-attended blocks evicted)")


DEFAULT_CHUNK = 2048


def add_chunk_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"prefill chunk (tokens per step, default {DEFAULT_CHUNK}; a sliding layer holds window + "
                        "chunk while one runs)")


def chunk(ns: argparse.Namespace) -> int:
    return ns.max_num_batched_tokens or DEFAULT_CHUNK


@dataclass(frozen=True)
class KVSetting:
    """One run's KV policy (with its sinks and window) and K/V storage."""

    policy: str
    dtype: str
    sinks: int | None = None
    window: int | None = None
    recent: int | None = None  # a quantized dtype's recent window (None: the engine's default)
    budget: int | None = None  # an eviction policy's tokens per sequence

    @property
    def sink_count(self) -> int:
        from turbollm.core.kv_policy import KVPolicyConfig

        return KVPolicyConfig(self.policy, self.sinks, self.window).sink_count

    @property
    def label(self) -> str:
        if self.budget is not None:
            return f"{self.policy}(budget={self.budget}) / {self.dtype}"
        if self.window is None:
            return f"{self.policy} / {self.dtype}"
        return f"{self.policy}(sinks={self.sink_count}, window={self.window}) / {self.dtype}"

    def engine_kwargs(self) -> dict:
        return {"kv_policy": self.policy, "kv_cache_dtype": self.dtype, "attention_sinks": self.sinks,
                "kv_window": self.window, "kv_recent_window": self.recent, "kv_budget": self.budget}

    def record(self) -> dict:
        return {"kv_policy": self.policy, "kv_cache_dtype": self.dtype,
                **({"attention_sinks": self.sink_count, "kv_window": self.window}
                   if self.window is not None else {}),
                **({"kv_budget": self.budget} if self.budget is not None else {})}


def check_recent_window(ns: argparse.Namespace) -> None:
    """--kv-recent-window needs an int8/int4 --kv-cache-dtype and a value >= 0 (EvalError otherwise)."""
    from turbollm.engine_args import QUANTIZED_KV
    from turbollm.eval.perplexity import EvalError

    if ns.kv_recent_window is None:
        return
    if not set(ns.kv_cache_dtype or []) & set(QUANTIZED_KV):
        raise EvalError("--kv-recent-window applies to --kv-cache-dtype int8 or int4")
    if ns.kv_recent_window < 0:
        raise EvalError(f"--kv-recent-window must be >= 0, got {ns.kv_recent_window}")


def kv_setting(policy: str, dtype: str, sinks: int | None = None, window: int | None = None,
               recent: int | None = None, budget: int | None = None) -> KVSetting:
    """`policy` and `dtype` with the options that apply to them (sinks, window, budget to a policy that
    takes them, the recent window to a quantized dtype); the others dropped."""
    from turbollm.engine_args import QUANTIZED_KV
    from turbollm.core.kv_policy import get_kv_policy

    takes = get_kv_policy(policy).options
    return KVSetting(policy, dtype, sinks if "sinks" in takes else None, window if "window" in takes else None,
                     recent if dtype in QUANTIZED_KV else None, budget if "budget" in takes else None)


def settings(ns: argparse.Namespace) -> list[KVSetting]:
    """Each policy × dtype; a policy that takes sinks and a window (streaming) once per --attention-sinks."""
    from turbollm.core.kv_policy import get_kv_policy

    out = []
    for policy, dtype in itertools.product(ns.kv_policy or ["auto"], ns.kv_cache_dtype or ["auto"]):
        sinks = (ns.attention_sinks or [None]) if "sinks" in get_kv_policy(policy).options else [None]
        out += [kv_setting(policy, dtype, s, ns.kv_window, ns.kv_recent_window, ns.kv_budget) for s in sinks]
    return out


def _llm(ns: argparse.Namespace, setting: KVSetting, max_model_len: int, shorter_ok: bool = False):
    """An engine for one sequence of `max_model_len` tokens; EvalError if the model's context is shorter
    (unless `shorter_ok`: the caller uses what the engine takes)."""
    from turbollm import LLM
    from turbollm.eval.perplexity import EvalError

    llm = LLM(ns.model, quantization=ns.quantization, max_num_seqs=1, max_model_len=max_model_len,
              threads=ns.threads, max_num_batched_tokens=chunk(ns), **setting.engine_kwargs())
    if llm.engine.max_model_len < max_model_len and not shorter_ok:
        raise EvalError(f"{ns.model} takes {llm.engine.max_model_len} tokens of context (its own, or what the KV "
                        f"cache holds; --kv-policy streaming runs past it); this run needs {max_model_len}")
    return llm


def _check_settings(ns: argparse.Namespace) -> None:
    """Every policy, its options and dtype checked before any model loads."""
    from turbollm.engine_args import EngineArgs
    from turbollm.core.kv_policy import get_kv_policy
    from turbollm.eval.perplexity import EvalError

    for name in ns.kv_policy or ["auto"]:
        get_kv_policy(name)  # unknown: the error lists the choices
    check_recent_window(ns)
    if (ns.attention_sinks is not None or ns.kv_window is not None) and \
            not any(s.window is not None or s.sinks is not None for s in settings(ns)):
        raise EvalError("--attention-sinks and --kv-window apply to --kv-policy streaming")
    if ns.kv_budget is not None and not any(s.budget is not None for s in settings(ns)):
        raise EvalError("--kv-budget applies to --kv-policy h2o or snapkv")
    for setting in settings(ns):
        EngineArgs(model=ns.model, **setting.engine_kwargs())


def run_stream_ppl(ns: argparse.Namespace) -> int:
    """`eval ppl --stream`: the first --ctx tokens of the text scored as one request, per setting (with
    --segments N: N consecutive segments of --ctx tokens, one request each, pooled by position)."""
    import torch

    from turbollm.benchmarks.report import write_json
    from turbollm.eval.long_context import merge_segments, plot_by_position, stream_score
    from turbollm.eval.perplexity import EvalError, default_data_path, load_text, tokenize_text

    for flag, value in (("--reference-model", ns.reference_model), ("--qmatmul", ns.qmatmul)):
        if value is not None:
            raise EvalError(f"{flag} does not apply to --stream (one request through the engine, no reference)")
    if ns.ctx < 2:
        raise EvalError(f"--ctx must be >= 2 with --stream, got {ns.ctx}")
    if ns.segments < 1:
        raise EvalError(f"--segments must be >= 1, got {ns.segments}")
    _check_settings(ns)
    text = load_text(ns.data or str(default_data_path()))
    bucket = ns.bucket or max(1, ns.ctx // 16)
    record = {"model": ns.model, "stream_tokens": ns.ctx, "segments": ns.segments, "bucket": bucket,
              "quantization": ns.quantization,
              "max_num_batched_tokens": chunk(ns),
              "threads": ns.threads or torch.get_num_threads(), "results": [],
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print("setting: " + json.dumps({k: v for k, v in record.items() if k != "results"}))
    curves, ids = {}, None
    for setting in settings(ns):
        # a setting that cannot run past the model's context (every policy but streaming) scores the
        # stream's first max_model_len - 1 tokens, and says so
        llm = _llm(ns, setting, ns.ctx + 1, shorter_ok=True)
        if ids is None:  # every setting runs the same model: the text is tokenized once
            text_ids, bos = tokenize_text(llm.engine.tokenizer, text)
            head = [bos] if bos is not None else []
            per = ns.ctx - len(head)  # text tokens per segment
            ids = [head + text_ids[i * per:(i + 1) * per] for i in range(ns.segments)]
            if len(ids[-1]) < ns.ctx:
                raise EvalError(f"the text has {len(text_ids)} tokens, fewer than {ns.segments} segments of {per} "
                                f"need (--segments × --ctx, less a BOS per segment)")
        n = min(ns.ctx, llm.engine.max_model_len - 1)
        if n < ns.ctx:
            print(f"  {setting.label}: the first {n} tokens only (the model's context, or what the KV cache holds; "
                  f"--kv-policy streaming runs past it)")
        res = merge_segments([stream_score(llm, seg[:n]) for seg in ids])
        row = {**setting.record(), **res.summary(bucket)}
        record["results"].append(row)
        curves[setting.label] = res.by_position(bucket)
        print(f"  {setting.label}  tokens={row['tokens']}  ppl={row['ppl']}  "
              f"peak_kv_MiB={row['peak_kv_MiB']}  kv_bytes_per_token={row['kv_bytes_per_token']}  "
              f"kv_pool_MiB={row['kv_pool_MiB']}")
        print("    ppl by position: " + ", ".join(f"{a}-{b}: {p:.2f}" for a, b, p in row["ppl_by_position"]))
        del llm
    if ns.plot:
        ok = plot_by_position(curves, ns.plot, f"{ns.model}: perplexity by position ({ns.ctx} tokens)")
        print(f"plot written to {ns.plot}" if ok else "no plot: matplotlib is not installed (pip install 'turbollm[bench]')")
    write_json(ns.json, record)
    return 0


def run_passkey_cmd(ns: argparse.Namespace) -> int:
    import torch

    from turbollm.benchmarks.report import write_json
    from turbollm.eval.long_context import passkey
    from turbollm.eval.perplexity import EvalError

    if ns.trials < 1 or min(ns.lengths) < 64 or not all(0.0 <= d <= 1.0 for d in ns.depths):
        raise EvalError("--trials must be >= 1, every --lengths >= 64 and every --depths within [0, 1]")
    _check_settings(ns)
    record = {"model": ns.model, "lengths": ns.lengths, "depths": ns.depths, "trials": ns.trials, "seed": ns.seed,
              "max_num_batched_tokens": chunk(ns),
              "quantization": ns.quantization, "threads": ns.threads or torch.get_num_threads(), "results": [],
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    print("setting: " + json.dumps({k: v for k, v in record.items() if k != "results"}))
    for setting in settings(ns):
        llm = _llm(ns, setting, max(ns.lengths) + 64)
        cells = passkey(llm, sorted(ns.lengths), ns.depths, ns.trials, ns.seed)
        stats = llm.engine.stats()
        longest = max(c.length for c in cells)
        row = {**setting.record(),
               "accuracy": sum(c.correct for c in cells) / sum(c.trials for c in cells),
               "peak_kv_MiB": round(stats["kv_cache_bytes_peak"] / (1 << 20), 2),
               "kv_bytes_per_token": round(stats["kv_cache_bytes_peak"] / (longest + 8)),
               "cells": [{"length": c.length, "depth": c.depth, "correct": c.correct, "trials": c.trials} for c in cells]}
        record["results"].append(row)
        print(f"  {setting.label}  accuracy={row['accuracy']:.3f}  "
              f"peak_kv_MiB={row['peak_kv_MiB']}  kv_bytes_per_token={row['kv_bytes_per_token']}")
        lengths = sorted({c.length for c in cells})
        print("    length \\ depth " + " ".join(f"{d:>6.2f}" for d in ns.depths))
        for n in lengths:
            print(f"    {n:>14} " + " ".join(f"{c.correct:>3}/{c.trials:<2}" for c in cells if c.length == n))
        del llm
    write_json(ns.json, record)
    return 0
