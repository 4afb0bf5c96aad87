"""`turbollm generate`: complete one or many prompts and print the text (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from turbollm.cli.engine_flags import add_engine_flags, engine_args_from
from turbollm.errors import InvalidRequestError


def add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts")
    add_engine_flags(p)
    p.add_argument("--prompt", "-p", action="append", default=[], help="a prompt (repeat for several)")
    p.add_argument("--prompts-file", default=None, help="a file with one prompt per line ('-' for stdin)")
    p.add_argument("--max-tokens", "-n", type=int, default=64)
    p.add_argument("--temperature", "-t", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--prompt-logprobs", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=run_generate)


def run_generate(ns: argparse.Namespace) -> int:
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.entrypoints.llm import LLM
    from turbollm.sampling_params import SamplingParams

    prompts = list(ns.prompt)
    if ns.prompts_file:
        f = sys.stdin if ns.prompts_file == "-" else open(ns.prompts_file, encoding="utf-8")
        prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("turbollm generate: give at least one --prompt or --prompts-file", file=sys.stderr)
        return 2
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:  # checked before the model and its KV cache load, not after
        raise InvalidRequestError(f"prompt {empty[0] + 1} is empty; give some text to complete")
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            min_p=ns.min_p, stop=ns.stop, logprobs=ns.logprobs, prompt_logprobs=ns.prompt_logprobs,
                            ignore_eos=ns.ignore_eos, seed=ns.seed)
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine.from_engine_args(engine_args_from(ns))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not ns.json)
    dt = time.perf_counter() - t0
    n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        c = o.outputs[0]
        if ns.json:
            rec = {"prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids, "text": c.text,
                   "token_ids": c.token_ids, "finish_reason": c.finish_reason}
            if c.logprobs is not None:
                rec["logprobs"] = [{str(k): asdict(v) for k, v in pos.items()} for pos in c.logprobs]
            if o.prompt_logprobs is not None:
                rec["prompt_logprobs"] = [None if pos is None else {str(k): asdict(v) for k, v in pos.items()}
                                          for pos in o.prompt_logprobs]
            print(json.dumps(rec, ensure_ascii=False))
        else:
            print(c.text if len(outs) == 1 else f"--- {o.prompt!r}\n{c.text}")
    if not ns.json:
        print(f"[{n_gen} tokens in {dt:.2f} s, {n_gen / dt:.1f} tok/s]", file=sys.stderr)
    return 0
