"""`turbollm eval ppl`: perplexity on WikiText-2 and KL divergence against the fp32 reference.

The window layout, scoring rule and statistics are described in `turbollm/eval/perplexity.py`.
"""

from __future__ import annotations

import argparse
import datetime
import time

from turbollm.cli.eval_long_cmd import add_chunk_flag, add_streaming_flags, check_recent_window
from turbollm.engine_args import DEFAULT_RECENT_WINDOW, DENSE_DTYPES, KV_CACHE_DTYPES, QUANTIZED_KV, kv_cache_torch_dtype
from turbollm.kernels.forms import FORMS, resolve_form
from turbollm.quantization.base import set_kernel_form
from turbollm.quantization.dense_dtype import resolve_dtype, set_dtype

SCORE_RULES = ("all", "half")  # turbollm.eval.perplexity.SCORING (not imported here: keeps the CLI start light)
QMATMUL_MODES = ("auto", "fast", "q8", "q8x2", "q16", "dequant")  # as turbollm.eval.perplexity (kept import-light)

PPL_HELP = """\
Perplexity of MODEL on WikiText-2 (raw, test split), in non-overlapping windows of --ctx tokens.
The text is tokenized once; if the tokenizer adds a BOS by default, each window is BOS + ctx-1
text tokens (the BOS is never scored), else ctx text tokens (the first is context only).
Scoring (--score): 'all' scores every next-token prediction of a window (ctx-1 tokens);
'half' only the second half, like llama.cpp's llama-perplexity (ctx-1-ctx//2 tokens).
Against the reference (default: the same checkpoint with --reference none, i.e. its weights in
fp32): mean / median / p99 / max of KL(P_ref || P_q) per token, top-1 agreement and delta-ppl,
like llama.cpp's --kl-divergence. With --qmatmul the candidate's quantized-matmul path is forced:
in the default (auto) mode decode runs q16 (16-bit activations; q8x2, two int8 levels, for the
types without 16-bit kernels) and a prefill of many tokens the exact dequantize path, so measure
the decode path's KL with --qmatmul q16 (and llama.cpp's single-level scheme, the 'fast' mode's
decode path, with --qmatmul q8)."""


def add_ppl(esub: argparse._SubParsersAction) -> None:
    p = esub.add_parser("ppl", help="perplexity on WikiText-2 and KL divergence against the fp32 reference",
                        description=PPL_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="catalog name, GGUF file, HF folder or hub id")
    p.add_argument("--quantization", default=None, help="quantization of the evaluated model (default: the "
                                                        "checkpoint's own: 'gguf' block types for a GGUF file)")
    p.add_argument("--reference", default="none", metavar="Q",
                   help="quantization of the reference (default: none = the checkpoint's weights in fp32)")
    p.add_argument("--reference-model", default=None, metavar="M",
                   help="checkpoint of the reference (default: MODEL; e.g. the original of an exported GGUF)")
    p.add_argument("--no-reference", action="store_true", help="perplexity only: no reference, no KL")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window, BOS included (default 512)")
    p.add_argument("--score", choices=list(SCORE_RULES), default="all", help="which positions of a window are scored")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on scored tokens (default: the whole text)")
    p.add_argument("--batch", type=int, default=1, help="windows per forward pass (default 1)")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="text file (default: ../shared/data/wikitext-2-raw/wiki.test.raw beside the repository)")
    p.add_argument("--qmatmul", choices=list(QMATMUL_MODES), default=None,
                   help="force the candidate's quantized-matmul path (at load and when scored)")
    p.add_argument("--kernel-form", choices=list(FORMS), default=None,
                   help="the candidate's CPU kernel form (default: $TURBOLLM_KERNEL_FORM, else avx512_vnni where the CPU has it; "
                        "avx512_vnni repacks its GGML weights and multiplies them with one numerics at every size)")
    p.add_argument("--dtype", choices=list(DENSE_DTYPES), default="float32",
                   help="the evaluated model's dense weights: float32 (default), bfloat16 or auto (the engine's "
                        "--dtype); the reference keeps float32")
    p.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), nargs="+", default=None,
                   help="K/V storage of the evaluated model (the reference keeps float32; default auto = float32); "
                        "with --stream, several run in turn")
    p.add_argument("--kv-recent-window", type=int, default=None,
                   help=f"with --kv-cache-dtype int8/int4: each window's newest tokens kept in float16 (default "
                        f"{DEFAULT_RECENT_WINDOW})")
    p.add_argument("--reference-kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=None,
                   help="K/V storage of the reference (default float32): e.g. float16 to measure a quantized K/V "
                        "format against float16 K/V; with the same weights the candidate's model is reused")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", metavar="FILE", default=None, help="write the result to FILE")
    p.add_argument("--stream", action="store_true",
                   help="score the first --ctx tokens as one request through the engine (its KV policy and K/V "
                        "storage), reporting perplexity by position and the K/V memory (no reference)")
    p.add_argument("--kv-policy", nargs="+", default=None, help="with --stream: KV policies to run in turn")
    add_streaming_flags(p)
    p.add_argument("--bucket", type=int, default=None, help="with --stream: positions per bucket (default ctx/16)")
    p.add_argument("--segments", type=int, default=1,
                   help="with --stream: consecutive segments of --ctx tokens scored, one request each (default 1)")
    p.add_argument("--plot", metavar="PNG", default=None, help="with --stream: perplexity against position")
    add_chunk_flag(p)
    p.set_defaults(func=run_ppl_cmd)


def set_eval_threads(threads: int | None) -> None:
    """Apply an eval command's ``--threads`` (None: torch's default, all cores)."""
    import torch

    from turbollm.eval.perplexity import EvalError

    if threads is not None:
        if threads < 1:
            raise EvalError(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def check_same_tokens(cand, ref, text: str) -> None:
    """EvalError unless the candidate's and the reference's tokenizers agree on (the start of) `text`."""
    from turbollm.eval.perplexity import EvalError

    sample = text[:20000]
    if cand.tokenizer.encode(sample, add_special_tokens=False) != ref.tokenizer.encode(sample,
                                                                                     add_special_tokens=False):
        raise EvalError(f"{cand.resolved.name} and the reference {ref.resolved.name} tokenize the text differently")


def eval_ppl(ns: argparse.Namespace) -> dict:
    """Run `eval ppl` as the flags say; print and return the result record."""
    import torch

    from turbollm.benchmarks.report import print_block, write_json
    from turbollm.eval.perplexity import (SCORING, check_window_args, default_data_path, evaluate, load_text,
                                          plan_windows, qmatmul_mode, tokenize_text)
    from turbollm.hub.resolve import resolve_model
    from turbollm.loader import load_model

    check_window_args(ns.ctx, ns.score, ns.max_tokens, ns.batch)
    set_eval_threads(ns.threads)
    data = ns.data or str(default_data_path())
    text = load_text(data)
    with qmatmul_mode(ns.qmatmul):
        cand = load_model(ns.model, quantization=ns.quantization)
    form = resolve_form(ns.kernel_form)
    set_kernel_form(cand.model, form)
    dense_dtype = resolve_dtype(ns.dtype, cand.model)
    set_dtype(cand.model, dense_dtype)
    ids, bos = tokenize_text(cand.tokenizer, text)
    plan = plan_windows(ids, ns.ctx, bos, ns.score, ns.max_tokens)

    kv_name = ns.kv_cache_dtype[0] if ns.kv_cache_dtype else "auto"
    kv_dtype = kv_cache_torch_dtype(kv_name)  # "auto": float32 here (the weights alone are measured)
    ref_kv_name = ns.reference_kv_cache_dtype or "float32"
    ref_kv = kv_cache_torch_dtype(ref_kv_name)
    ref, note, ref_model = None, None, ns.reference_model or ns.model
    same_weights = (resolve_model(ref_model).path == cand.resolved.path and cand.quantization == ns.reference
                    and dense_dtype == torch.float32)
    if ns.no_reference:
        note = "no reference (--no-reference)"
    elif same_weights and kv_dtype == ref_kv:
        note = "the candidate is the reference: KL 0 and top-1 100% by definition, not measured"
    elif same_weights:  # the K/V storage alone differs: the candidate's own weights score the reference
        ref = cand
        print(f"reference: the candidate's weights with {ref_kv_name} K/V")
    else:
        t0 = time.perf_counter()
        ref = load_model(ref_model, quantization=ns.reference)
        print(f"reference {ref_model} ({ns.reference}) loaded in {time.perf_counter() - t0:.1f} s")
        check_same_tokens(cand, ref, text)
    print(f"{plan.text_tokens} text tokens -> {len(plan.windows)} windows of {ns.ctx} "
          f"({'BOS + ' if plan.bos else ''}text), {plan.tokens} scored ({ns.score})")
    recent = ns.kv_recent_window if ns.kv_recent_window is not None else DEFAULT_RECENT_WINDOW
    res = evaluate([cand], plan, ref, batch=ns.batch, qmatmul=ns.qmatmul, progress=not ns.no_progress,
                   kv_dtype=kv_dtype, ref_kv_dtype=ref_kv, kv_recent_window=recent)[0]
    if ref is None and not ns.no_reference:
        res.update(ref_ppl=res["ppl"], delta_ppl=0.0, delta_ppl_pct=0.0, kld_mean=0.0, kld_median=0.0,
                   kld_p99=0.0, kld_max=0.0, top1_agreement=100.0, ref_entropy=res["entropy"], entropy_delta=0.0)
    record = {
        "model": ns.model, "model_path": str(cand.resolved.path), "quantization": cand.quantization,
        "kernel_form": form, "dtype": str(dense_dtype).removeprefix("torch."),
        "weights_storage": cand.weights_storage, "weight_MB": round(cand.weight_bytes / 1e6, 2),
        "reference": None if ns.no_reference else ns.reference,
        "reference_model": None if ns.no_reference else ref_model,
        "reference_weight_MB": round(ref.weight_bytes / 1e6, 2) if ref is not None else None,
        "reference_note": note, "qmatmul": ns.qmatmul, "kv_cache_dtype": kv_name,
        "kv_recent_window": recent if kv_name in QUANTIZED_KV else None,
        "reference_kv_cache_dtype": None if ns.no_reference else ref_kv_name,
        "data": str(data), "ctx": ns.ctx, "batch": ns.batch, "bos_per_window": plan.bos,
        "scoring": {"rule": ns.score, "description": SCORING[ns.score]}, "text_tokens": plan.text_tokens,
        **res, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print_block("eval ppl", {k: (round(v, 6) if isinstance(v, float) else v) for k, v in record.items()
                             if k not in ("scoring", "data", "model_path") and not k.startswith("batch_")})
    write_json(ns.json, record)
    return record


def run_ppl_cmd(ns: argparse.Namespace) -> int:
    from turbollm.eval.perplexity import EvalError

    if ns.stream:
        from turbollm.cli.eval_long_cmd import run_stream_ppl

        ignored = [flag for flag, given in (("--max-tokens", ns.max_tokens is not None), ("--batch", ns.batch != 1),
                                            ("--score", ns.score != "all"), ("--no-reference", ns.no_reference),
                                            ("--reference", ns.reference != "none"),
                                            ("--reference-kv-cache-dtype", ns.reference_kv_cache_dtype is not None))
                   if given]
        if ignored:
            raise EvalError(f"{', '.join(ignored)} do(es) not apply to --stream (every position of one request "
                            "is scored through the engine; no reference)")
        set_eval_threads(ns.threads)
        check_recent_window(ns)
        return run_stream_ppl(ns)
    if (ns.kv_policy is not None or ns.plot is not None or ns.bucket is not None
            or ns.max_num_batched_tokens is not None or ns.attention_sinks is not None or ns.kv_window is not None
            or ns.kv_budget is not None or ns.segments != 1):
        raise EvalError("--kv-policy, --attention-sinks, --kv-window, --kv-budget, --segments, --bucket, --plot and "
                        "--max-num-batched-tokens "
                        "apply to --stream only")
    if ns.kv_cache_dtype is not None and len(ns.kv_cache_dtype) > 1:
        raise EvalError("several --kv-cache-dtype values need --stream")
    check_recent_window(ns)
    eval_ppl(ns)
    return 0
