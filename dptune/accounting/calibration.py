"""Calibration: the DP-SGD noise multiplier that makes the *whole* tuning run meet a total budget.

Every route's total epsilon falls as sigma grows (more noise is post-processing), so the smallest
sufficient sigma is a root of ``total_epsilon(sigma) - target``, found by Brent's method on
log(sigma) and rounded up until the target holds. PLD evaluations at the default discretisation
are slow (0.3-3 s at 7000 steps), so the RDP route gives a start and the PLD search runs ten times
coarser (1e-3 nats): a pessimistic PLD is a valid bound at any discretisation, so its answer meets
the target (0.1-0.3% above the default's). The statement is computed at the default
discretisation, and the search repeated there, near the coarse answer, when the statement is not
within ``5 * rtol`` below the target.

A ``memo`` (:class:`FileMemo`) remembers the answer under a digest of everything the search
depends on; a later identical calibration starts from it, but the statement is still computed at
that sigma and must pass the same test, so a remembered value can only save the search.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
from scipy import optimize

from dptune.accounting import totals
from dptune.accounting.epsilon import PLD_DISCRETIZATION, check_delta
from dptune.accounting.events import DpSgdCandidate, as_candidates
from dptune.accounting.statement import PrivacyStatement
from selection.privacy import BestOfKPrivacy, SingleRunPrivacy

#: sigma is searched in [SIGMA_MIN, SIGMA_MAX]; beyond, the target is called unreachable.
SIGMA_MIN, SIGMA_MAX = 0.05, 1e4

#: PLD discretisation (nats) of the coarse search; the answer is then refined at the default.
COARSE_DISCRETIZATION = 1e-3

#: Above this target epsilon (a sanity run with "almost no noise"), ``accountant="auto"``
#: calibrates with RDP alone: the PLD of so little noise spans thousands of nats (minutes and GB
#: to build) and its delta(epsilon) overflows float64 past epsilon ~ 709, while RDP stays exact
#: and fast; tightness does not matter there. ``"pld"`` is refused above it.
PLD_MAX_EPSILON = 100.0


@dataclass(frozen=True)
class Calibration:
    """The calibrated noise multiplier, its statement, and what simpler procedures would need.

    Attributes:
      noise_multiplier: the smallest sigma found (within ``rtol``, rounded up) for which the whole
        tuning run is (target_epsilon, delta)-DP; ``statement`` is the statement at it.
      untuned_noise_multiplier: sigma for ONE run (no tuning) to meet the same budget.
      naive_noise_multiplier: sigma for naive best-of-``naive_trials`` (composition; k the
        selection's expected number of trials, rounded up), None for a single run.
    """

    noise_multiplier: float
    statement: PrivacyStatement
    target_epsilon: float
    delta: float
    untuned_noise_multiplier: float | None = None
    naive_noise_multiplier: float | None = None
    naive_trials: int | None = None


def naive_trials(transform) -> int | None:
    """k for the naive baseline: the transform's expected number of candidates, rounded up.

    Random stopping: E[K] (``mean``); thresholding and capped random stopping: 1/gamma, the
    expected number of trials when no candidate passes (LT Alg. 1/2); best-of-k: k; one run: None.
    """
    k = totals.composition_count(transform)
    if k is not None:
        return None if k == 1 else k
    mean = getattr(transform, "mean", None)
    if mean is None and getattr(transform, "gamma", None):
        mean = 1.0 / transform.gamma
    return None if mean is None else max(1, math.ceil(mean - 1e-9))


def _solve(
    eps: Callable[[float], float], target: float, start: float, rtol: float, ratio: float = 1.25
) -> float:
    """Smallest sigma (within rtol, rounded up) with eps(sigma) <= target; eps decreasing.

    The bracket is found by walking from ``start`` in steps of ``ratio`` (doubling in log space).
    """

    @functools.cache
    def gap(log_sigma: float) -> float:  # no guarantee (inf) as a large finite gap: Brent needs one
        return min(eps(math.exp(log_sigma)) - target, 1e300)

    step = math.log(ratio)
    hi = math.log(min(max(start, SIGMA_MIN), SIGMA_MAX))
    while gap(hi) > 0:  # walk up until feasible
        if hi >= math.log(SIGMA_MAX):
            raise ValueError(
                f"target_epsilon={target:g} is unreachable: even noise_multiplier={SIGMA_MAX:g} "
                f"gives epsilon={gap(hi) + target:.4g} (a fixed score noise may already cost "
                "more than the target)."
            )
        hi = min(hi + step, math.log(SIGMA_MAX))
        step *= 2
    lo = hi
    step = math.log(ratio)
    while True:  # walk down until infeasible
        lo = lo - step
        if lo <= math.log(SIGMA_MIN):
            lo = math.log(SIGMA_MIN)
            if gap(lo) <= 0:
                return SIGMA_MIN
            break
        if gap(lo) > 0:
            break
        hi = lo
        step *= 2
    root = optimize.brentq(gap, lo, hi, xtol=rtol / 2, rtol=rtol / 4)
    sigma = root + rtol / 2
    while gap(sigma) > 0:  # Brent's root is within xtol: round up until the target holds
        sigma += rtol / 2
    return math.exp(sigma)


def _tight(epsilon: float, target: float, rtol: float) -> bool:
    """Whether ``epsilon`` meets ``target`` within ``5 * rtol`` below it (else searched again)."""
    return target * (1 - 5 * rtol) <= epsilon <= target


def calibrate(
    make_candidates: Callable[[float], Any], transform=None, target_epsilon: float = 1.0,
    delta: float = 1e-5, accountant: str = "auto", *, seeded: bool = False, compare: bool = True,
    rtol: float = 1e-3, memo: MutableMapping[str, float] | None = None,
) -> Calibration:  # fmt: skip
    """The noise multiplier sigma for which the whole tuning run is (target_epsilon, delta)-DP.

    Args:
      make_candidates: sigma -> the candidates (anything ``total_privacy`` accepts, e.g. every
        DP-SGD setting of a search space with that noise multiplier). Their privacy must fall as
        sigma grows.
      transform, delta, accountant, seeded: as for ``total_privacy``.
      target_epsilon: the total budget's epsilon (> 0), for everything released.
      compare: also calibrate one untuned run and naive composition (about 2x the time).
      rtol: relative tolerance on sigma (the answer is rounded up, so always within budget).
      memo: remembered answers (module docstring): the main answer is read from and written to
        it; the statement is computed and checked at a remembered sigma as at a searched one.

    Raises:
      ValueError: invalid inputs, or a target no sigma in [0.05, 1e4] reaches.
    """
    t = target_epsilon
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
        raise ValueError(f"target_epsilon={target_epsilon!r} must be a finite number > 0.")
    delta = check_delta(delta)
    totals.check_accountant(accountant)
    if target_epsilon > PLD_MAX_EPSILON and accountant != "rdp":
        if accountant == "pld":
            raise ValueError(
                f"target_epsilon={target_epsilon:g} is above {PLD_MAX_EPSILON:g}, beyond what the "
                "PLD accountant computes (its numbers overflow); accountant='rdp' or 'auto' "
                "calibrates it"
            )
        accountant = "rdp"  # "auto": its one route that computes here (PLD_MAX_EPSILON)
    transform = totals.check_transform(transform)
    if not transform.is_private:
        raise ValueError(
            f"selection {transform.name!r} is not private: no noise multiplier meets a budget."
        )

    search = _Search(make_candidates, float(target_epsilon), delta, accountant, rtol, seeded, memo)
    described = (make_candidates, transform, target_epsilon, delta, accountant, rtol)
    key = None if memo is None else _memo_key(*described)
    sigma, statement = search.final(transform, key)
    k = naive_trials(transform)
    untuned = search.final(SingleRunPrivacy())[0] if compare else None
    naive = search.final(BestOfKPrivacy(k))[0] if compare and k is not None else None
    return Calibration(sigma, statement, float(target_epsilon), delta, untuned, naive, k)


@dataclass(frozen=True)
class _Search:
    """``calibrate``'s search for one budget, for any selection theorem ``tr``."""

    make_candidates: Callable[[float], Any]
    target_epsilon: float
    delta: float
    accountant: str
    rtol: float
    seeded: bool
    memo: MutableMapping[str, float] | None

    def solve(self, tr, acc: str, start: float, disc: float, ratio: float) -> float:
        def eps(sigma: float) -> float:
            # So little noise that the privacy loss is beyond float64 (exp(epsilon) overflows past
            # epsilon ~ 709, e.g. while a target of 1000 is searched): the accountant's answer is
            # not a number, read as "no guarantee at this sigma" (infinite epsilon), never as one
            # that holds. The inputs were checked before the search, so a ValueError here is that.
            cands = self.make_candidates(sigma)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                try:
                    found = totals.routes(cands, tr, self.delta, acc, discretization=disc)
                except ValueError:
                    return math.inf
            if not found:
                raise ValueError(
                    f"accountant={acc!r} has no route for selection "
                    f"{getattr(tr, 'name', tr)!r}; try accountant='auto'."
                )
            best = min(r.epsilon for r in found)
            return best if math.isfinite(best) else math.inf

        return _solve(eps, self.target_epsilon, start, self.rtol, ratio)

    def statement(self, tr, sigma: float) -> PrivacyStatement:
        return totals.total_privacy(
            self.make_candidates(sigma), tr, self.delta, self.accountant, seeded=self.seeded
        )

    def final(self, tr, key: str | None = None) -> tuple[float, PrivacyStatement]:
        """sigma and the statement at it, within ``5 * rtol`` below the target (a remembered
        sigma under ``key`` is used only if its statement passes that same test)."""
        try:  # ``key`` is set only with a memo; a value it cannot hold reads as none
            remembered = float(self.memo[key]) if key is not None else math.nan
        except (KeyError, TypeError, ValueError):
            remembered = math.nan
        if SIGMA_MIN <= remembered <= SIGMA_MAX:
            statement = self.statement(tr, remembered)
            if _tight(statement.total_epsilon, self.target_epsilon, self.rtol):
                return remembered, statement
        # The RDP route's sigma, then (unless accountant="rdp") the coarse PLD's from there.
        try:
            sigma = self.solve(tr, "rdp", 1.0, PLD_DISCRETIZATION, 1.25)
        except ValueError:
            if self.accountant == "rdp":
                raise
            sigma = 1.0
        if self.accountant != "rdp":
            sigma = self.solve(tr, self.accountant, sigma, COARSE_DISCRETIZATION, 1.05)
        statement = self.statement(tr, sigma)
        if not _tight(statement.total_epsilon, self.target_epsilon, self.rtol):
            # The coarse PLD was too loose (long compositions), or -- never seen -- looser than
            # the default one: search again at the default discretisation, near the coarse answer.
            sigma = self.solve(tr, self.accountant, sigma, PLD_DISCRETIZATION, 1.005)
            statement = self.statement(tr, sigma)
        if key is not None:
            self.memo[key] = sigma
        return sigma, statement


def _memo_key(make_candidates, transform, target_epsilon, delta, accountant, rtol) -> str:
    """A digest of everything the search depends on: the candidates (at sigma = 1 and 2), the
    theorem and its parameters, the budget, the accountant, rtol, dptune's and dp_accounting's
    versions."""
    try:
        versions = [metadata.version("dp-accounting"), metadata.version("dptune")]
    except metadata.PackageNotFoundError:
        versions = ["unknown"]
    described = [
        _MEMO_FORMAT, versions, transform.name, transform.params(), float(target_epsilon),
        float(delta), accountant, float(rtol),
        [[c.params() for c in as_candidates(make_candidates(s))] for s in (1.0, 2.0)],
    ]  # fmt: skip
    text = json.dumps(described, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


_MEMO_FORMAT = "dptune-calibration-1"


class FileMemo(MutableMapping):
    """Remembered calibrations in a JSON file (atomic rewrites; a damaged file reads as empty and
    is replaced). Not a privacy input: ``calibrate`` checks every value it reads."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def _read(self) -> dict[str, float]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def __getitem__(self, key: str) -> float:
        return self._read()[key]

    def __setitem__(self, key: str, value: float) -> None:
        data = self._read()
        data[key] = float(value)
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, self.path)
        except OSError:  # a memo is a convenience: the run goes on without it
            pass

    def __delitem__(self, key: str) -> None:
        data = self._read()
        del data[key]
        self.path.write_text(json.dumps(data))

    def __iter__(self):
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


#: Environment variable: the folder of JAX's compilation cache, or "off" (no warm starts: no
#: compiled steps and no remembered calibrations are read or written).
COMPILATION_CACHE_ENV = "DPTUNE_COMPILATION_CACHE"
OFF_WORDS = ("off", "false", "no", "none", "0")


def cache_root() -> Path:
    """dptune's cache folder: ``$DPTUNE_CACHE``, else the user cache folder + ``dptune``
    (``$XDG_CACHE_HOME`` or ``~/.cache``; ``~/Library/Caches`` on macOS; dptune's workdir lock
    needs POSIX). It holds only public values: the memo below and JAX's compiled steps
    (``dptune.learners.dpsgd.use_compilation_cache``)."""
    if os.environ.get("DPTUNE_CACHE"):
        return Path(os.environ["DPTUNE_CACHE"])
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "dptune"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dptune"


def default_memo() -> FileMemo | None:
    """The remembered calibrations (``cache_root()/calibration.json``), or None when warm starts
    are off (``$DPTUNE_COMPILATION_CACHE=off``)."""
    if os.environ.get(COMPILATION_CACHE_ENV, "").strip().lower() in OFF_WORDS:
        return None
    return FileMemo(cache_root() / "calibration.json")


def calibrate_noise(
    sampling_rate: float, steps: int, transform=None, target_epsilon: float = 1.0,
    delta: float = 1e-5, accountant: str = "auto", score_noise_std: float | None = None, *,
    seeded: bool = False, compare: bool = True, rtol: float = 1e-3,
) -> Calibration:  # fmt: skip
    """``calibrate`` for one DP-SGD setting: Poisson rate ``sampling_rate`` in (0, 1], ``steps``
    (>= 1) and a fixed private-score noise ``score_noise_std`` (counts; None = public validation).
    """
    DpSgdCandidate(sampling_rate, steps, 1.0, score_noise_std)  # validates before any search
    return calibrate(
        lambda sigma: DpSgdCandidate(sampling_rate, steps, sigma, score_noise_std), transform,
        target_epsilon, delta, accountant, seeded=seeded, compare=compare, rtol=rtol,
    )  # fmt: skip
