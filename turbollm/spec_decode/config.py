"""`speculative_config`: what `LLM(..., speculative_config={...})` and `--speculative-config '{json}'`
take, with vLLM's field names, checked before anything is loaded.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 24}
    {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4}

`num_speculative_tokens` (K) is at most `MAX_SPECULATIVE_TOKENS` = 7: a verification step then
brings at most 8 tokens of a sequence, the decode kernel's small-query range (kernels/limits.py), in
which the decode path is row-invariant and greedy speculation therefore token-exact. `adaptive`
(default true) lets the engine choose K per step from measured acceptance and step costs, down to 0;
false pins K. Every error names the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turbollm.errors import InvalidRequestError, json_object
from turbollm.kernels.limits import SMALL_QUERY_MAX

METHODS = ("ngram", "suffix", "draft_model")
#: the last sampled token plus K drafts stay within the decode kernel's small-query range
MAX_SPECULATIVE_TOKENS = SMALL_QUERY_MAX - 1
_SUFFIX_FIELDS = {"suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                  "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"}
_DRAFT_FIELDS = {"quantization", "draft_vocab_size"}
_FIELDS = ({"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "adaptive"}
           | _SUFFIX_FIELDS | _DRAFT_FIELDS)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2  # ngram: shortest suffix of the sequence looked up
    prompt_lookup_max: int = 4  # ngram: longest (tried first)
    model: str | None = None  # draft_model: the draft checkpoint or catalog name
    adaptive: bool = True
    # draft_model: the draft's weights quantized at load (vLLM's name; None: the checkpoint's own)
    quantization: str | None = None
    # draft_model (our own field): the draft's LM head covers token ids 0..N-1 only, so a draft step
    # reads N rows of it instead of the whole vocabulary. BPE vocabularies are numbered in merge
    # order, so the first ids are the most frequent pieces; a target token outside them is a rejected
    # draft, never a wrong output. None: the whole vocabulary.
    draft_vocab_size: int | None = None
    # suffix (vLLM's names): the trees index every substring up to this many tokens
    suffix_decoding_max_tree_depth: int = 24
    # finished requests whose outputs the global tree keeps, oldest evicted first (0: per-request trees
    # only). vLLM's default is 10000; ours is lower because each indexed token costs up to depth
    # Python nodes
    suffix_decoding_max_cached_requests: int = 1000
    # drafts per step at most this times the matched pattern's length
    suffix_decoding_max_spec_factor: float = 1.0
    # drafting stops when the continuation's estimated probability (product of count ratios) falls below
    suffix_decoding_min_token_prob: float = 0.1


def _int_field(d: dict, name: str, default: int | None, low: int, high: int | None) -> int:
    value = d.get(name, default)
    if value is None:
        raise InvalidRequestError(f"speculative_config: {name!r} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"speculative_config: {name!r} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise InvalidRequestError(f"speculative_config: {name!r} must be {bound}, got {value}")
    return value


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """A `SpeculativeConfig` from a dict, its JSON text, an existing config, or None (no speculation)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = json_object(value, "speculative_config")
    unknown = sorted(set(value) - _FIELDS)
    if unknown:
        raise InvalidRequestError(f"speculative_config: unknown field(s) {', '.join(map(repr, unknown))}; "
                                  f"known: {', '.join(sorted(_FIELDS))}")
    method = value.get("method")
    if method not in METHODS:
        raise InvalidRequestError(f"speculative_config: 'method' must be one of {', '.join(METHODS)}, got {method!r}")
    k = _int_field(value, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    lo = _int_field(value, "prompt_lookup_min", SpeculativeConfig.prompt_lookup_min, 1, None)
    hi = _int_field(value, "prompt_lookup_max", max(lo, SpeculativeConfig.prompt_lookup_max), 1, None)
    if lo > hi:
        raise InvalidRequestError(f"speculative_config: 'prompt_lookup_min' ({lo}) is above 'prompt_lookup_max' ({hi})")
    model = value.get("model")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise InvalidRequestError("speculative_config: 'model' (the draft checkpoint) is required for draft_model")
    elif model is not None:
        raise InvalidRequestError(f"speculative_config: 'model' is only for draft_model, not {method}")
    adaptive = value.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise InvalidRequestError(f"speculative_config: 'adaptive' must be true or false, got {adaptive!r}")
    suffix = {name: value[name] for name in _SUFFIX_FIELDS if name in value}
    if suffix and method != "suffix":
        raise InvalidRequestError(f"speculative_config: {', '.join(map(repr, sorted(suffix)))} only for suffix, "
                                  f"not {method}")
    if suffix:
        _int_field(suffix, "suffix_decoding_max_tree_depth", SpeculativeConfig.suffix_decoding_max_tree_depth, 2, 1024)
        _int_field(suffix, "suffix_decoding_max_cached_requests", SpeculativeConfig.suffix_decoding_max_cached_requests,
                   0, None)
        for name, low, high in (("suffix_decoding_max_spec_factor", 0.0, None),
                                ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            v = suffix.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= low
                                  or (high is not None and v > high) or (name.endswith("factor") and v == 0)):
                bound = "in [0, 1]" if high is not None else "> 0"
                raise InvalidRequestError(f"speculative_config: {name!r} must be a number {bound}, got {v!r}")
            if v is not None:
                suffix[name] = float(v)
    draft = {name: value[name] for name in _DRAFT_FIELDS if name in value}
    if draft and method != "draft_model":
        raise InvalidRequestError(f"speculative_config: {', '.join(map(repr, sorted(draft)))} only for draft_model, "
                                  f"not {method}")
    if "draft_vocab_size" in draft:
        _int_field(draft, "draft_vocab_size", None, 256, None)
    q = draft.get("quantization")
    if q is not None and (not isinstance(q, str) or not q):
        raise InvalidRequestError(f"speculative_config: 'quantization' must be a method name, got {q!r}")
    return SpeculativeConfig(method, k, lo, hi, model, adaptive, **draft, **suffix)
