"""Perplexity on WikiText-2 and the KL divergence of a quantized model against a reference.

Windows (non-overlapping). The whole text is tokenized once without special tokens. When the
tokenizer adds a BOS by default (`add_bos_token`), every window is ``[BOS] + ctx - 1`` text
tokens and the windows advance by ``ctx - 1`` text tokens, so each text token appears in
exactly one window; otherwise a window is ``ctx`` text tokens and they advance by ``ctx``. The
BOS (or, without one, the window's first text token) is context only, never a target.

Scoring rule (which next-token predictions of a window count):
- ``all`` (default): every position but the last predicts the next token: ``ctx - 1`` scored
  tokens per window.
- ``half``: like llama.cpp's ``llama-perplexity``: only positions ``ctx // 2 .. ctx - 2``, so
  every scored token has at least half a window of context: ``ctx - 1 - ctx // 2`` per window.
`max_tokens` caps the scored tokens: the last window is cut short in what it scores (never in
what it sees), so the count is exactly ``min(max_tokens, available)``.

Against a reference (llama.cpp's ``--kl-divergence``): per scored token, KL(P_ref || P_q) over
the full vocabulary in float64 (log_softmax of both models' logits); we report its mean,
median, 99th percentile and maximum, top-1 agreement (both argmaxes equal, %), and the
perplexities of both on the same tokens. Every model's mean predictive entropy (nats per scored
token) is reported too, and against a reference the difference: a positive ``entropy_delta``
means the candidate's distributions are flatter than the reference's, a negative one sharper.
Perplexity and KLD can disagree through it: where the reference is over-confident on the text,
an error that flattens is partly rewarded by perplexity while KLD counts it as error.
Both models run window by window in this process; only per-token scalars are kept, never the
logits of more than one batch of windows.

The forward pass is the plain flat prefill of `eval.parity` (fresh paged KV cache per batch of
windows, no scheduler, no sampler), so it is the same code path the engine's prefill runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from turbollm.errors import TurboLLMError
from turbollm.eval.parity import flat_prefill_batch
from turbollm.loader import LoadedModel
from turbollm.quantization.base import set_qmatmul

WIKITEXT = Path("wikitext-2-raw") / "wiki.test.raw"
SCORING = {
    "all": "every position of a window except the last predicts its next token (ctx - 1 scored tokens per window)",
    "half": "only positions ctx//2 .. ctx-2 of a window are scored (ctx - 1 - ctx//2 tokens per window), "
            "like llama.cpp's llama-perplexity",
}
QMATMUL_MODES = ("auto", "fast", "q8", "q8x2", "q16", "dequant")  # turbollm.kernels.quant's paths
ROW_CHUNK = 128  # rows of logits turned into float64 log-probs at a time (bounds memory on big vocabularies)


class EvalError(TurboLLMError):
    """An evaluation that cannot run as asked (missing data file, impossible window sizes)."""


def default_data_path() -> Path:
    """wiki.test.raw in `shared/data` beside the repository, else under the working directory's parent."""
    here = Path(__file__).resolve().parents[3] / "shared" / "data" / WIKITEXT
    candidates = [here, Path.cwd().parent / "shared" / "data" / WIKITEXT, Path.cwd() / "shared" / "data" / WIKITEXT]
    return next((p for p in candidates if p.is_file()), here)


def load_text(path: str | Path | None = None) -> str:
    """The evaluation text (default: WikiText-2 raw test split); a clear error if it is missing."""
    p = Path(path) if path is not None else default_data_path()
    if not p.is_file():
        raise EvalError(f"evaluation text not found: {p} (expected ../shared/data/{WIKITEXT} beside the "
                        "repository; pass --data PATH)")
    text = p.read_text(encoding="utf-8")
    if not text.strip():
        raise EvalError(f"evaluation text {p} is empty")
    return text


@dataclass
class WindowPlan:
    """The windows to run and which of their positions are scored."""

    windows: list[list[int]]  # input ids, each exactly ctx long
    ctx: int
    first: int  # first scored (predicting) position of every window
    counts: list[int]  # scored positions of each window, from `first` on
    bos: bool  # whether each window starts with a BOS that is not part of the text
    text_tokens: int  # tokens of the whole text
    scoring: str

    @property
    def tokens(self) -> int:
        return sum(self.counts)

    def targets(self, i: int) -> list[int]:
        w, f = self.windows[i], self.first
        return w[f + 1:f + 1 + self.counts[i]]


def check_window_args(ctx: int, scoring: str = "all", max_tokens: int | None = None, batch: int = 1) -> int:
    """Validate the window flags before anything is loaded; return the scored tokens per full window."""
    if scoring not in SCORING:
        raise EvalError(f"unknown scoring rule {scoring!r}; choose from {', '.join(SCORING)}")
    if ctx < 2:
        raise EvalError(f"--ctx must be at least 2 (one context token and one scored token), got {ctx}")
    per = ctx - 1 - (ctx // 2 if scoring == "half" else 0)
    if per < 1:
        raise EvalError(f"--ctx {ctx} leaves no scored token under the {scoring!r} rule; use --ctx >= 4")
    if max_tokens is not None and max_tokens < per:
        raise EvalError(f"--max-tokens {max_tokens} is less than one window's {per} scored tokens "
                        f"(--ctx {ctx}, scoring {scoring!r}); raise it or lower --ctx")
    if batch < 1:
        raise EvalError(f"--batch must be >= 1, got {batch}")
    return per


def plan_windows(ids: Sequence[int], ctx: int, bos_id: int | None = None, scoring: str = "all",
                 max_tokens: int | None = None) -> WindowPlan:
    """Cut the token stream `ids` into non-overlapping windows (see the module docstring)."""
    per = check_window_args(ctx, scoring, max_tokens)
    stride = ctx - 1 if bos_id is not None else ctx
    available = len(ids) // stride
    if available == 0:
        raise EvalError(f"the text has {len(ids)} tokens, fewer than one window of --ctx {ctx}")
    total = available * per if max_tokens is None else min(available * per, max_tokens)
    n = -(-total // per)
    head = [bos_id] if bos_id is not None else []
    windows = [head + list(ids[i * stride:(i + 1) * stride]) for i in range(n)]
    counts = [per] * (n - 1) + [total - (n - 1) * per]
    return WindowPlan(windows, ctx, ctx - 1 - per, counts, bos_id is not None, len(ids), scoring)


def tokenize_text(tokenizer, text: str) -> tuple[list[int], int | None]:
    """The whole text's ids (no special tokens) and the BOS id to prepend to each window (None: none)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    return ids, bos


@contextmanager
def qmatmul_mode(mode: str | None) -> Iterator[None]:
    """Make `mode` the kernels' default quantized-matmul path for the duration (what a model built
    inside takes at load, e.g. int8 equalization's passes); None leaves it alone. The models scored
    get their path per model (`evaluate(qmatmul=...)`, `set_qmatmul`)."""
    if mode is None:
        yield
        return
    if mode not in QMATMUL_MODES:
        raise EvalError(f"unknown --qmatmul {mode!r}; choose from {', '.join(QMATMUL_MODES)}")
    from turbollm.kernels import quant

    old, quant.DEFAULT_PATH = quant.DEFAULT_PATH, mode
    try:
        yield
    finally:
        quant.DEFAULT_PATH = old


@torch.inference_mode()
def scored_logits(loaded: LoadedModel, plan: WindowPlan, idx: Sequence[int],
                  kv_dtype: torch.dtype = torch.float32, kv_recent_window: int = 128) -> torch.Tensor:
    """Logits [rows, vocab] of the scored positions of windows `idx`, run as one flat prefill batch
    (K/V stored in `kv_dtype` and read back from there, as the engine's cache does; a quantized format
    keeps each window's last `kv_recent_window` tokens in float16)."""
    batch, qsl = flat_prefill_batch(loaded, [plan.windows[i] for i in idx], kv_dtype=kv_dtype,
                                    kv_recent_window=kv_recent_window)
    hidden = loaded.model(batch)
    rows = torch.cat([torch.arange(qsl[j] + plan.first, qsl[j] + plan.first + plan.counts[i])
                      for j, i in enumerate(idx)])
    return loaded.model.compute_logits(hidden[rows])


class _Acc:
    """Running sums of one model's NLL, and (candidates) its KL/top-1 against the reference."""

    def __init__(self) -> None:
        self.nll = self.nll2 = 0.0
        self.n = 0
        self.top1 = 0
        self.kl_sum = 0.0
        self.kl: list[torch.Tensor] = []  # float64 per scored token
        self.batch_nll: list[float] = []  # NLL summed over each batch of windows (paired comparisons)
        self.batch_kl: list[float] = []
        self.batch_n: list[int] = []
        self.ent = 0.0  # summed entropy of the predicted distributions (nats)
        self.batch_ent: list[float] = []

    def add(self, logits: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None = None) -> None:
        nll0, kl0, ent0 = self.nll, self.kl_sum, self.ent
        self._add(logits, targets, ref)
        self.batch_nll.append(self.nll - nll0)
        self.batch_kl.append(self.kl_sum - kl0)
        self.batch_ent.append(self.ent - ent0)
        self.batch_n.append(len(targets))

    def _add(self, logits: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None) -> None:
        for s in range(0, len(targets), ROW_CHUNK):
            lq = logits[s:s + ROW_CHUNK]
            lpq = lq.double().log_softmax(-1)
            nll = -lpq.gather(1, targets[s:s + ROW_CHUNK, None]).squeeze(1)
            self.nll += float(nll.sum())
            self.nll2 += float((nll * nll).sum())
            self.n += len(nll)
            self.ent -= float((lpq.exp() * lpq).sum())
            if ref is not None:
                lr = ref[s:s + ROW_CHUNK]
                lpr = lr.double().log_softmax(-1)
                kl = (lpr.exp() * (lpr - lpq)).sum(-1)
                self.kl.append(kl)
                self.kl_sum += float(kl.sum())
                self.top1 += int((lq.argmax(-1) == lr.argmax(-1)).sum())
            del lpq

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.n)

    def ppl_stderr(self) -> float:
        """Standard error of the perplexity (delta method on the mean NLL, as llama.cpp reports it)."""
        if self.n < 2:
            return float("nan")
        mean = self.nll / self.n
        var = max(self.nll2 / self.n - mean * mean, 0.0)
        return self.ppl * math.sqrt(var / (self.n - 1))


def _kl_summary(acc: _Acc) -> dict:
    kl = torch.cat(acc.kl)
    return {"kld_mean": acc.kl_sum / acc.n, "kld_median": float(kl.median()),
            "kld_p99": float(torch.quantile(kl, 0.99)), "kld_max": float(kl.max()),
            "top1_agreement": 100.0 * acc.top1 / acc.n}


def evaluate(candidates: Sequence[LoadedModel], plan: WindowPlan, reference: LoadedModel | None = None, *,
             batch: int = 1, qmatmul: str | None = None, progress: bool = True,
             kv_dtype: torch.dtype = torch.float32, ref_kv_dtype: torch.dtype = torch.float32,
             kv_recent_window: int = 128) -> list[dict]:
    """Perplexity of each candidate on `plan`'s windows, and KL/top-1/Δppl against `reference` if given.

    The reference runs once per batch of windows (K/V stored in `ref_kv_dtype`), then each candidate
    (with their quantized-matmul path set to `qmatmul` and K/V stored in `kv_dtype`; a quantized one with
    its last `kv_recent_window` tokens in float16). The reference
    may be one of the candidates (the same weights, another K/V storage).
    Returns one dict per candidate.
    """
    if not candidates:
        raise EvalError("no model to evaluate")
    check_window_args(plan.ctx, plan.scoring, None, batch)
    models = [*candidates, *([reference] if reference is not None else [])]
    vocab = {m.config.vocab_size for m in models}
    if len(vocab) > 1:
        raise EvalError(f"the models have different vocabularies ({sorted(vocab)}); KL needs the same tokens")
    for m in models:
        if plan.ctx > m.config.max_position_embeddings:
            raise EvalError(f"--ctx {plan.ctx} exceeds {m.resolved.name}'s context of "
                            f"{m.config.max_position_embeddings} tokens")
    if qmatmul is not None:
        if qmatmul not in QMATMUL_MODES:
            raise EvalError(f"unknown --qmatmul {qmatmul!r}; choose from {', '.join(QMATMUL_MODES)}")
        for cand in candidates:
            set_qmatmul(cand.model, qmatmul)
    accs, ref_acc = [_Acc() for _ in candidates], _Acc()
    bar = _progress(len(plan.windows), progress)
    t0 = time.perf_counter()
    for s in range(0, len(plan.windows), batch):
        idx = list(range(s, min(s + batch, len(plan.windows))))
        targets = torch.tensor([t for i in idx for t in plan.targets(i)])
        ref = None
        if reference is not None:
            ref = scored_logits(reference, plan, idx, ref_kv_dtype)
            ref_acc.add(ref, targets)
        for acc, cand in zip(accs, candidates):
            acc.add(scored_logits(cand, plan, idx, kv_dtype, kv_recent_window), targets, ref)
        del ref
        if bar is not None:
            post = {"ppl": f"{accs[0].ppl:.4f}"}
            if reference is not None:
                post["kld"] = f"{accs[0].kl_sum / accs[0].n:.5f}"
            bar.set_postfix(post, refresh=False)
            bar.update(len(idx))
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    out = []
    for acc in accs:
        r = {"windows": len(plan.windows), "tokens": acc.n, "ppl": acc.ppl, "ppl_stderr": acc.ppl_stderr(),
             "seconds": round(seconds, 2), "tokens_per_s": round(acc.n / seconds, 2),
             "entropy": acc.ent / acc.n, "batch_tokens": acc.batch_n, "batch_nll": acc.batch_nll,
             "batch_entropy": acc.batch_ent}
        if reference is not None:
            r.update(ref_ppl=ref_acc.ppl, delta_ppl=acc.ppl - ref_acc.ppl,
                     delta_ppl_pct=100.0 * (acc.ppl - ref_acc.ppl) / ref_acc.ppl, **_kl_summary(acc),
                     batch_kl=acc.batch_kl, ref_entropy=ref_acc.ent / ref_acc.n)
            r["ln_ppl_ratio"], r["ln_ppl_ratio_stderr"] = paired_difference(acc.batch_nll, ref_acc.batch_nll,
                                                                            acc.batch_n)
            r["entropy_delta"], r["entropy_delta_stderr"] = paired_difference(acc.batch_ent, ref_acc.batch_ent,
                                                                              acc.batch_n)
        out.append(r)
    return out


def paired_difference(a: Sequence[float], b: Sequence[float], counts: Sequence[int]) -> tuple[float, float]:
    """Mean per-token difference of two per-batch sums over the same scored tokens, and its standard error.

    `a` and `b` hold, per batch of windows, a quantity summed over that batch's `counts` scored
    tokens (NLL or KL) for two models on identical tokens. The mean is ``Σ(a−b) / Σcounts``; its
    standard error treats the batches (not the tokens, which are correlated within a window) as
    the independent units: ``sqrt(B/(B−1) · Σ_b (d_b − n_b·mean)²) / Σn`` (a ratio estimator over
    clusters). For NLL the mean is ``ln(PPL(a)/PPL(b))``. NaN error with fewer than two batches.
    """
    if not (len(a) == len(b) == len(counts)) or not counts:
        raise EvalError("paired comparison needs per-batch sums over the same batches")
    n = float(sum(counts))
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / n
    nb = len(d)
    if nb < 2:
        return mean, float("nan")
    var = nb / (nb - 1) * sum((di - ni * mean) ** 2 for di, ni in zip(d, counts))
    return mean, math.sqrt(var) / n


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="window", desc="eval ppl", dynamic_ncols=True)
