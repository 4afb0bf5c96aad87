"""`turbollm quantize`: write a quantized checkpoint (GPTQ/AWQ safetensors folder, or a GGUF file).

    turbollm quantize MODEL --method {int8,int4,gptq,awq,gguf} --out PATH
        [--bits 4|3|8] [--group-size 32|64|128] [--act-order]
        [--calib-samples N] [--calib-seq-len L] [--calib-data FILE] [--awq-clip] [--[no-]fit-logit-scale]
        [--no-equalize] [--type T] [--threads N]

int8 / int4 round to nearest (int8 after a calibration-free channel equalization unless
--no-equalize); gptq / awq calibrate on ShareGPT prompts (default 128 windows of 512 tokens);
awq (and gptq with --fit-logit-scale) then fits one factor on the logits against the float model.
The folder loads back with ``turbollm generate DIR`` / ``LLM(model=DIR)``, the method read from
its config.json.
``--method gguf --type Q4_K_M --out FILE.gguf`` writes a llama.cpp-style GGUF.
"""

from __future__ import annotations

import argparse


# Kept literal so `turbollm --help` needs no torch import; tests hold them equal to the registries
# (`quantize.methods.QUANTIZE_METHODS`, `GGUF_TYPES`).
METHODS = ("int8", "int4", "gptq", "awq", "gguf")
GGUF_TYPES = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "Q3_K_M", "Q2_K")
METHOD_HELP = ("int8: channel equalization, then round-to-nearest per output channel; "
               "int4: round-to-nearest, group-wise (4 or 3 bits); "
               "gptq: Hessian-based error feedback from calibration activations; awq: activation-aware scales "
               "folded into the preceding ops, then rounding (clipping with --awq-clip); gguf: llama.cpp block types (--type)")


def add_quantize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="quantize a model offline (GPTQ, AWQ, RTN int4/int8, GGUF)",
                       description="Quantize MODEL and write the result to --out (a folder in the AutoGPTQ/AutoAWQ "
                                   "safetensors layouts, or a .gguf file for --method gguf).")
    p.add_argument("model", help="catalog name, GGUF file or Hugging Face folder (float weights)")
    p.add_argument("--method", required=True, choices=METHODS, help=METHOD_HELP)
    p.add_argument("--out", required=True, help="output folder (or .gguf file); must not exist")
    p.add_argument("--bits", type=int, default=None, help="int4: 4|3; gptq: 4|3|8 (8: per channel); awq: 4")
    p.add_argument("--group-size", type=int, default=None, help="32, 64 or 128 (default 128); must divide every "
                   "layer's input width")
    p.add_argument("--act-order", action="store_true", help="gptq: quantize columns by decreasing Hessian diagonal")
    p.add_argument("--calib-samples", type=int, default=None, help="gptq/awq: calibration windows (default 128)")
    p.add_argument("--calib-seq-len", type=int, default=None, help="gptq/awq: tokens per window (default 512)")
    p.add_argument("--calib-data", default=None, help="gptq/awq: calibration text (ShareGPT-style .json, .jsonl or "
                   ".txt; default: ../shared/data/sharegpt prompts)")
    p.add_argument("--damp", type=float, default=0.01, help="gptq: dampening, fraction of the mean Hessian diagonal")
    p.add_argument("--awq-search-tokens", type=int, default=2048,
                   help="awq: tokens the scale and clipping searches measure errors on (default 2048)")
    clip = p.add_mutually_exclusive_group()
    clip.add_argument("--awq-clip", dest="awq_clip", action="store_const", const=True, default=None,
                      help="awq: also search a clipping ratio per weight group (off by default: it helped "
                           "smollm2-135m a little and hurt qwen2.5-coder-0.5b badly; see docs/AWQ_QWEN.md)")
    clip.add_argument("--awq-no-clip", dest="awq_clip", action="store_const", const=False,
                      help="awq: keep each group's full range (the default)")
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--fit-logit-scale", dest="logit_scale", action="store_const", const=True, default=None,
                       help="gptq/awq: after quantizing, fit one factor on the logits (folded into the final norm) "
                            "that minimizes the KL divergence to the float model on calibration windows "
                            "(default for awq; see docs/QUANTIZATION.md)")
    scale.add_argument("--no-fit-logit-scale", dest="logit_scale", action="store_const", const=False,
                       help="gptq/awq: leave the final norm as it is (the default for gptq)")
    p.add_argument("--no-equalize", dest="equalize", action="store_const", const=False, default=None,
                   help="int8: round the weights as loaded (by default the decoder's input channels are first "
                        "equalized, calibration-free and function-preserving; see docs/QUANTIZATION.md)")
    p.add_argument("--type", dest="gguf_type", default=None, choices=GGUF_TYPES, help="gguf: the file type")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run_quantize_cmd)


def run_quantize_cmd(ns: argparse.Namespace) -> int:
    import torch

    from turbollm.quantize.methods import QuantizeOptions
    from turbollm.quantize.runner import run_quantize

    if ns.threads:
        torch.set_num_threads(ns.threads)
    opts = QuantizeOptions(ns.model, ns.method, ns.out, bits=ns.bits, group_size=ns.group_size,
                           act_order=ns.act_order, calib_samples=ns.calib_samples, calib_seq_len=ns.calib_seq_len,
                           calib_data=ns.calib_data, damp=ns.damp, awq_search_tokens=ns.awq_search_tokens,
                           awq_clip=ns.awq_clip, equalize=ns.equalize, logit_scale=ns.logit_scale,
                           gguf_type=ns.gguf_type, progress=not ns.no_progress)
    s = run_quantize(opts)
    per_layer = f", {sum(s.layer_seconds) / len(s.layer_seconds):.1f} s per layer" if s.layer_seconds else ""
    print(f"wrote {s.out} ({s.out_bytes / 1e6:.1f} MB) in {s.seconds:.0f} s "
          f"(quantization {s.quantize_seconds:.0f} s{per_layer})")
    return 0
