"""Step time as a function of the step's shape, fitted to steps of the real engine.

A step runs T new tokens of S sequences; sequence i brings n_i new tokens on top of c_i already in its
K/V. The model has four parts, each the shape of a cost the forward pass pays:

- `L(T)`: the linear layers (weights read once per step, then 2 x params FLOPs a token): piecewise
  linear in T between knots on a doubling grid (the kernels change path with the row count, so one
  straight line does not fit 1 row and 512 rows);
- `per_seq x S`: what each sequence costs whatever its tokens (its logits row, sampling, metadata);
- `decode_kv x sum(c_i + 1)` over one-token rows: K/V bytes the decode kernel reads;
- `prefill_attn x sum(n_i x (c_i + n_i / 2))` over many-token rows: query-key pairs of the tiled kernel.

All coefficients are fitted at once by non-negative least squares on relative error (each step's row
divided by its measured time, so a 5 ms decode step counts as much as a 500 ms prefill). The knots
without a profiled step near them are dropped, and T past the last knot extends the last segment.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

KNOT_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class StepShape:
    """One step: per sequence, its new tokens and the tokens already computed before them."""

    new: tuple[int, ...]
    computed: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.new)

    @property
    def num_seqs(self) -> int:
        return len(self.new)

    @classmethod
    def decode(cls, contexts: list[int] | tuple[int, ...]) -> "StepShape":
        """One new token for each sequence, after `contexts[i]` tokens."""
        return cls(tuple(1 for _ in contexts), tuple(contexts))


@dataclass
class StepCostModel:
    knots: list[int]
    linear: list[float]  # seconds of L(T) at each knot
    per_seq: float
    decode_kv: float  # seconds per K/V token a decode row reads
    prefill_attn: float  # seconds per query-key pair of a many-token row
    fit_steps: int = 0
    fit_error: dict = field(default_factory=dict)  # median / p90 relative error on the profile's own steps

    def linear_time(self, tokens: int) -> float:
        return float(np.dot(_interp_weights(self.knots, tokens), self.linear))

    def predict(self, shape: StepShape) -> float:
        return float(np.dot(features(self.knots, shape), self.coefficients()))

    def coefficients(self) -> np.ndarray:
        return np.array([*self.linear, self.per_seq, self.decode_kv, self.prefill_attn])

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "StepCostModel":
        return cls(**d)


def _interp_weights(knots: list[int], t: float) -> np.ndarray:
    """Weights of each knot's value in L(t): linear interpolation, the end segments extended."""
    w = np.zeros(len(knots))
    if len(knots) == 1:
        w[0] = t / knots[0]  # one knot: a line through the origin
        return w
    j = int(np.searchsorted(knots, t))
    j = min(max(j, 1), len(knots) - 1)
    lo, hi = knots[j - 1], knots[j]
    f = (t - lo) / (hi - lo)
    w[j - 1], w[j] = 1.0 - f, f
    return w


def features(knots: list[int], shape: StepShape) -> np.ndarray:
    kv = sum(c + 1 for n, c in zip(shape.new, shape.computed) if n == 1)
    pairs = sum(n * (c + n / 2) for n, c in zip(shape.new, shape.computed) if n > 1)
    return np.concatenate([_interp_weights(knots, shape.num_tokens), [shape.num_seqs, kv, pairs]])


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 500) -> np.ndarray:
    """min ||a x - b|| with x >= 0 (Lawson and Hanson's active-set method)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    for _ in range(iters):
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * max(1.0, np.abs(w).max()):
            break
        j = np.argmax(np.where(passive, -np.inf, w))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def fit(shapes: list[StepShape], seconds: list[float]) -> StepCostModel:
    """The model fitted to measured steps (at least a few, of more than one token count)."""
    if len(shapes) != len(seconds) or len(shapes) < 4:
        raise ValueError(f"a step-cost fit needs 4 or more timed steps, got {len(shapes)}")
    counts = sorted({s.num_tokens for s in shapes})
    knots = [k for k in KNOT_GRID if counts[0] <= k <= counts[-1]]
    knots = sorted({counts[0], *knots, counts[-1]})
    knots = _supported(knots, counts)
    y = np.asarray(seconds, dtype=float)
    x = np.stack([features(knots, s) for s in shapes])
    scale = x.max(axis=0)  # columns of unit size: the solver's tolerances see every coefficient alike
    scale[scale == 0] = 1.0
    coef = nnls((x / scale) / y[:, None], np.ones(len(y))) / scale
    rel = np.abs(x @ coef - y) / y
    k = len(knots)
    return StepCostModel(knots, [float(v) for v in coef[:k]], float(coef[k]), float(coef[k + 1]),
                         float(coef[k + 2]), len(y),
                         {"median": float(np.median(rel)), "p90": float(np.quantile(rel, 0.9))})


def _supported(knots: list[int], counts: list[int]) -> list[int]:
    """Knots with a measured token count between them and each neighbour (else their value is free)."""
    keep = [knots[0]]
    for k in knots[1:]:
        if any(keep[-1] < c <= k for c in counts):
            keep.append(k)
    return keep
