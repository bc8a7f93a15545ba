"""Online calibration of the runtime predictor: plain Python, no jax, no numpy.

The engine gives `Calibrator.observe` every step's chunk shapes (the busiest KVP rank's slowest micro-batch in
flight, as `Predictor.step_time` costs it) and the step's measured seconds. Every `refit_every` samples the
calibrator refits the predictor's efficiency factors to a window of the latest `window` samples and installs
them in the predictor in place (`Predictor.set_profile`), so adaptive chunking and ILRS slack use them from the
next step on.

The fit is linear in the predictor's own features. With the profile the engine started from (the *base*),
`Predictor.breakdown` splits a step into components; the calibrated step time is

    a_linear x (linear + lm_head) + a_attention x attention + step_s + token_s x tokens
        + request_s x chunks + row_s x padded_rows + collectives

and each coefficient is exactly a factor of a profile: `a_linear` divides both linear efficiencies (a roofline
`max(f / e1, b / e2)` scales by `a` when both efficiencies are divided by `a`), `a_attention` divides the three
attention efficiencies and multiplies `attn_block_overhead_s`, the others are the four overheads themselves;
collectives keep the base factors. So the calibrated profile predicts exactly what the fit does, and it saves
and loads like any profile. The offline fit (`mnemojax.bench.profile_predictor.fit`, Nelder-Mead over all
factors, seconds per fit) shapes the roofline from plans built to span it; this streaming fit only rescales it,
in a few milliseconds, from whatever the server happens to run.

The fit minimises the squared *relative* error (weights 1 / measured^2), with a weak ridge pull (`ridge`, relative
to each feature's weight in the window) toward the base, so a factor the window cannot tell apart from the others
stays where the base put it. Coefficients are bounded (efficiencies change by at most `max_scale` either way;
overheads are in [0, 1] s; a negative one is held at its bound and the rest refitted). Outliers are dropped: after
a first fit, samples whose measured / predicted ratio is further than `outlier` (in log) from 1 and than 4 median
absolute deviations are excluded and the fit repeated. The engine itself leaves out steps that compiled a new
shape and steps whose measurement is incomplete (see `LLMEngine.step`).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
from collections.abc import Sequence

from mnemojax.scheduling.buckets import bucket
from mnemojax.scheduling.predictor import ChunkShape, Predictor, Profile

logger = logging.getLogger(__name__)

COEFFICIENTS = ("linear", "attention", "step_overhead_s", "per_token_overhead_s", "per_request_overhead_s",
                "per_row_overhead_s")
"""What the online fit moves: two scales of the base roofline, four overheads."""


@dataclasses.dataclass(frozen=True)
class Sample:
    features: tuple[float, ...]  # one per COEFFICIENTS
    fixed: float  # seconds the fit does not move (collectives)
    measured: float  # seconds
    predicted: float  # seconds the predictor said before this sample was fitted


class Calibrator:
    """Refits `predictor`'s profile from measured steps (see the module docstring).

    Args:
      predictor: the predictor the scheduler asks; its current profile is the base.
      window: samples kept for the fit.
      refit_every: samples between refits (after the first at `min_samples`, refits at doubling counts); a
        sample predicted further off than `outlier` refits at once (at most every 4 samples).
      min_samples: samples before the first refit.
      ridge: pull toward the base, relative to each feature's weight in the window.
      outlier: log ratio measured / predicted beyond which a sample may be dropped as an outlier.
      max_scale: the linear and attention efficiencies change by at most this factor either way.
    """

    def __init__(self, predictor: Predictor, *, window: int = 256, refit_every: int = 16, min_samples: int = 1,
                 ridge: float = 1e-3, outlier: float = math.log(1.5), max_scale: float = 1e5):
        self.predictor = predictor
        self.base: Profile = predictor.profile
        self._base_predictor = predictor.copy()  # keeps the base profile
        b = self.base
        self.prior = (1.0, 1.0, b.step_overhead_s, b.per_token_overhead_s, b.per_request_overhead_s,
                      b.per_row_overhead_s)
        self.coef = self.prior
        self.samples: collections.deque[Sample] = collections.deque(maxlen=window)
        self.refit_every, self.min_samples, self.ridge = refit_every, min_samples, ridge
        self.outlier, self.max_scale = outlier, max_scale
        self.num_observed = 0
        self.num_refits = 0
        self._next_refit = min_samples
        self._last_refit_at = 0
        predictor.calibrating = True  # until `settled`

    # ---------------------------------------------------------------- samples in
    def features(self, chunks: Sequence[ChunkShape]) -> tuple[tuple[float, ...], float]:
        """(features, fixed seconds) of one step's chunks, from the base profile's breakdown."""
        bd = self._base_predictor.breakdown(chunks)
        tokens = sum(ch.query_tokens for ch in chunks)
        rows = bucket(len(chunks), self.base.pad_rows_min)
        fixed = bd["tp_allreduce"] + bd["kvp_merge"] + bd["spp_send"]
        return (bd["linear"] + bd["lm_head"], bd["attention"], 1.0, float(tokens), float(len(chunks)),
                float(rows)), fixed

    def observe(self, chunks: Sequence[ChunkShape], measured_s: float) -> bool:
        """Records one step; refits when due. Returns True when the predictor's profile changed."""
        if not chunks or not 0 < measured_s < math.inf:  # NaN and inf too
            return False
        x, fixed = self.features(chunks)
        predicted = self.predictor.step_time(chunks)
        self.samples.append(Sample(x, fixed, measured_s, predicted))
        self.num_observed += 1
        surprise = (abs(math.log(predicted / measured_s)) > self.outlier if predicted > 0 else True) and \
            self.num_observed - self._last_refit_at >= 4  # a refit costs ~1 ms: not on every step of a noisy run
        if self.predictor.calibrating and self.settled():
            self.predictor.calibrating = False
        if self.num_observed < self._next_refit and not (surprise and self.num_observed >= self.min_samples):
            return False
        self._last_refit_at = self.num_observed
        self._next_refit = (self.num_observed + self.refit_every if self.num_observed >= self.refit_every
                            else 2 * self.num_observed)
        return self.refit()

    # ---------------------------------------------------------------- the fit
    def refit(self) -> bool:
        """Fits the window, installs the profile in the predictor. False when there is nothing to fit."""
        samples = list(self.samples)
        if not samples:
            return False
        coef = self._solve(samples)
        kept = self._inliers(samples, coef)
        if len(kept) < len(samples) and kept:
            coef = self._solve(kept)
        self.coef = coef
        self.predictor.set_profile(self.profile())
        self.num_refits += 1
        logger.debug("predictor recalibrated from %d steps (%d outliers): %s", len(kept),
                     len(samples) - len(kept), dict(zip(COEFFICIENTS, (f"{c:.3g}" for c in coef))))
        return True

    def _inliers(self, samples: list[Sample], coef: Sequence[float]) -> list[Sample]:
        logs = [math.log(max(_dot(coef, s.features) + s.fixed, 1e-12) / s.measured) for s in samples]
        mad = statistics.median(abs(v) for v in logs)
        limit = max(self.outlier, 4 * mad)
        return [s for s, v in zip(samples, logs) if abs(v) <= limit]

    def _bounds(self) -> list[tuple[float, float]]:
        return [(1 / self.max_scale, self.max_scale)] * 2 + [(0.0, 1.0)] * 4

    def _solve(self, samples: list[Sample]) -> tuple[float, ...]:
        """Bounded weighted ridge least squares: coefficients at a bound are held there and the rest refitted."""
        n = len(COEFFICIENTS)
        bounds = self._bounds()
        held: dict[int, float] = {}
        coef = list(self.prior)
        for _ in range(n + 1):
            free = [k for k in range(n) if k not in held]
            if not free:
                break
            A = [[0.0] * len(free) for _ in free]
            rhs = [0.0] * len(free)
            for s in samples:
                w = 1.0 / (s.measured * s.measured)
                r = s.measured - s.fixed - sum(v * s.features[k] for k, v in held.items())
                for i, ki in enumerate(free):
                    xi = s.features[ki] * w
                    rhs[i] += xi * r
                    for j, kj in enumerate(free):
                        A[i][j] += xi * s.features[kj]
            for i, ki in enumerate(free):  # the ridge pull toward the base, scaled to the feature's weight
                lam = self.ridge * A[i][i] if A[i][i] > 0 else 1.0
                A[i][i] += lam
                rhs[i] += lam * self.prior[ki]
            sol = _solve_linear(A, rhs)
            for ki, v in zip(free, sol):
                coef[ki] = v
            out = [(ki, v) for ki, v in zip(free, sol) if not bounds[ki][0] <= v <= bounds[ki][1]]
            if not out:
                break
            for ki, v in out:
                held[ki] = min(max(v, bounds[ki][0]), bounds[ki][1])
        for k, v in held.items():
            coef[k] = v
        return tuple(min(max(v, lo), hi) for v, (lo, hi) in zip(coef, bounds))

    def profile(self) -> Profile:
        """The base profile with the fitted coefficients (exactly what the fit predicts)."""
        a_lin, a_attn, step, tok, req, row = self.coef
        b = self.base
        return dataclasses.replace(
            b, linear_flops_eff=b.linear_flops_eff / a_lin, linear_bw_eff=b.linear_bw_eff / a_lin,
            attn_flops_eff=b.attn_flops_eff / a_attn, attn_bw_eff=b.attn_bw_eff / a_attn,
            attn_gather_bw_eff=b.attn_gather_bw_eff / a_attn, attn_block_overhead_s=b.attn_block_overhead_s * a_attn,
            step_overhead_s=step, per_token_overhead_s=tok, per_request_overhead_s=req, per_row_overhead_s=row)

    # ---------------------------------------------------------------- how well it predicts
    def settled(self) -> bool:
        """Enough steps seen to trust the predictions: 32 predicted within 15% (median), or 256 whatever the error."""
        return self.num_observed >= 256 or (self.num_observed >= 32 and self.recent_error(32) < 0.15)

    def recent_error(self, n: int = 64) -> float | None:
        """Median |predicted / measured - 1| over the last `n` samples, each predicted before it was fitted
        (the error the scheduler acted on); None before any sample."""
        recent = list(self.samples)[-n:]
        if not recent:
            return None
        return statistics.median(abs(s.predicted / s.measured - 1) for s in recent)


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


def _solve_linear(A: list[list[float]], b: list[float]) -> list[float]:
    """Solves the small symmetric positive definite system A x = b (Gaussian elimination, partial pivoting)."""
    n = len(b)
    M = [row[:] + [v] for row, v in zip(A, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        M[c], M[p] = M[p], M[c]
        if M[c][c] == 0.0:
            continue
        for r in range(c + 1, n):
            f = M[r][c] / M[c][c]
            if f:
                for k in range(c, n + 1):
                    M[r][k] -= f * M[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = M[r][n] - sum(M[r][k] * x[k] for k in range(r + 1, n))
        x[r] = s / M[r][r] if M[r][r] else 0.0
    return x
