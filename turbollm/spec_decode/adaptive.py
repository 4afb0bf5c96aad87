"""Adaptive speculation: how many drafts each decode verifies this step, from measured costs and acceptance.

A step that verifies drafts costs the target's step at its number of rows, V(R), plus the proposer's
time per draft token, D; it yields, per speculating sequence, 1 + sum over j of P(drafts 0..j all
accepted). `StepCosts` holds V as a line a + b·R fitted to measured decode-shaped steps (profiled at
start-up by `engine/step_profile.py`, then every decode/verification step the engine runs updates the
mean of its row count), and D as a moving average of the proposer's measured time per draft.
`Acceptance` estimates, per sequence and position j, the chance that draft j is accepted once
drafts 0..j-1 were (counts of the sequence, smoothed toward the counts of all sequences).

`AdaptivePlanner.plan` starts every candidate at 0 drafts and adds one draft at a time to the
sequence whose next draft is most likely accepted, while the gain in expected tokens per second
of the whole step is positive; so K falls to 0 when speculation would not pay (a busy batch, where
another row costs about as much as a token, or a sequence whose drafts are rejected), and each
sequence still verifies a single draft every `PROBE_EVERY` steps to keep its estimate alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: a sequence planned at 0 drafts for this many steps is given one, to measure its acceptance again
PROBE_EVERY = 16
#: the weight (in verification steps) of all sequences' acceptance in one sequence's estimate
PRIOR_WEIGHT = 4.0
#: the acceptance assumed before anything was measured
PRIOR_ACCEPTANCE = 0.6


@dataclass
class StepCosts:
    """Seconds of a target step by rows (a fitted line over measured means) and of a draft token."""

    max_rows: int
    sums: dict[int, float] = field(default_factory=dict)  # rows -> decayed sum of seconds
    weights: dict[int, float] = field(default_factory=dict)  # rows -> decayed count
    draft_seconds: float = 0.0  # per draft token (moving average)
    decay: float = 0.9  # each new measurement of a row count weighs as much as the last ~10 together
    _fit: tuple[float, float] | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if not 1 <= rows <= self.max_rows:
            return
        self.sums[rows] = self.sums.get(rows, 0.0) * self.decay + seconds
        self.weights[rows] = self.weights.get(rows, 0.0) * self.decay + 1.0
        self._fit = None

    def observe_draft(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            per = seconds / num_tokens
            self.draft_seconds = per if self.draft_seconds == 0.0 else 0.8 * self.draft_seconds + 0.2 * per

    def line(self) -> tuple[float, float]:
        """(a, b) of V(R) = a + b·R, least squares over the row counts measured (weighted by their counts);
        b >= 0; (0, 0) before any measurement."""
        if self._fit is None:
            pts = [(r, self.sums[r] / w, w) for r, w in self.weights.items() if w > 0]
            if not pts:
                return 0.0, 0.0
            sw = sum(w for _, _, w in pts)
            mr = sum(r * w for r, _, w in pts) / sw
            mt = sum(t * w for _, t, w in pts) / sw
            var = sum(w * (r - mr) ** 2 for r, _, w in pts)
            b = max(0.0, sum(w * (r - mr) * (t - mt) for r, t, w in pts) / var) if var > 0 else 0.0
            self._fit = (mt - b * mr, b)
        return self._fit

    def step_seconds(self, rows: int) -> float:
        a, b = self.line()
        return a + b * rows


@dataclass
class Acceptance:
    """Per position j: verification steps that reached draft j (drafts 0..j-1 accepted) and accepted it."""

    max_k: int
    reached: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> per position
    accepted: dict[int, list[int]] = field(default_factory=dict)
    all_reached: list[int] = field(default_factory=list)
    all_accepted: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_reached, self.all_accepted = [0] * self.max_k, [0] * self.max_k

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        reached = self.reached.setdefault(seq_id, [0] * self.max_k)
        accepted = self.accepted.setdefault(seq_id, [0] * self.max_k)
        for j in range(min(num_accepted + 1, num_drafts)):
            hit = int(j < num_accepted)
            reached[j] += 1
            accepted[j] += hit
            self.all_reached[j] += 1
            self.all_accepted[j] += hit

    def rates(self, seq_id: int) -> list[float]:
        """P(draft j accepted | drafts before it accepted), j = 0..max_k-1."""
        reached = self.reached.get(seq_id, [0] * self.max_k)
        accepted = self.accepted.get(seq_id, [0] * self.max_k)
        out = []
        for j in range(self.max_k):
            n = self.all_reached[j]
            prior = (self.all_accepted[j] + PRIOR_ACCEPTANCE) / (n + 1.0)
            out.append((accepted[j] + PRIOR_WEIGHT * prior) / (reached[j] + PRIOR_WEIGHT))
        return out

    def forget(self, seq_id: int) -> None:
        self.reached.pop(seq_id, None)
        self.accepted.pop(seq_id, None)


class AdaptivePlanner:
    def __init__(self, max_k: int, max_rows: int):
        self.costs = StepCosts(max_rows)
        self.acceptance = Acceptance(max_k)
        self.idle_steps: dict[int, int] = {}  # seq_id -> steps in a row planned at 0 drafts
        self.profile_seq_id: int | None = None  # the start-up profile's scratch sequence

    def plan(self, limits: dict[int, int], base_rows: int) -> dict[int, int]:
        """Drafts per sequence (seq_id -> k <= its limit) for a step that has `base_rows` rows without them."""
        rates = {sid: self.acceptance.rates(sid) for sid, lim in limits.items() if lim > 0}
        ks = dict.fromkeys(limits, 0)
        reach = dict.fromkeys(rates, 1.0)  # P(every planned draft of the sequence is accepted)
        rows, tokens = base_rows, float(len(limits))
        seconds = self.costs.step_seconds(rows)
        while rates:
            sid = max(rates, key=lambda s: reach[s] * rates[s][ks[s]])
            gain = reach[sid] * rates[sid][ks[sid]]
            more = self.costs.step_seconds(rows + 1) - self.costs.step_seconds(rows) + self.costs.draft_seconds
            if seconds <= 0 or (tokens + gain) * seconds <= tokens * (seconds + more):
                break
            ks[sid] += 1
            reach[sid] = gain
            rows, tokens, seconds = rows + 1, tokens + gain, seconds + more
            if ks[sid] >= limits[sid]:
                del rates[sid]
        for sid, k in ks.items():  # a sequence idle for long verifies one draft, to measure it again
            idle = 0 if k else self.idle_steps.get(sid, 0) + 1
            if idle >= PROBE_EVERY and limits[sid] > 0:
                ks[sid], idle = 1, 0
            self.idle_steps[sid] = idle
        return ks

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        self.acceptance.record(seq_id, num_drafts, num_accepted)

    def forget(self, seq_id: int) -> None:
        self.acceptance.forget(seq_id)
        self.idle_steps.pop(seq_id, None)
