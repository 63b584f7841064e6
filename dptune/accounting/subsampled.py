"""Accounting of subsampled tuning: tune on a per-record Poisson subset, retrain once on all data.

The procedure (Koskela & Kulkarni 2023, "Practical Differentially Private Hyperparameter Tuning
with Subsampling", arXiv:2301.11989, [KK]): draw a subset X_1 of the private data, each record
independently with probability ``fraction``; run a private selection over candidates trained on
X_1 only; train the selected hyperparameters h once more on all of X and release that model and h.
The whole is the adaptive composition of T(X) = Tune(X_1) and F_h(X). The structure is [KK]'s; the
bound is assembled from the results below, not from a formula of [KK]:

1. **Tune on X_1**: the selection theorem (``total_privacy``, its tightest route) on the
   candidates' privacy with respect to X_1: (eps_T, delta_T)-DP for one record of X_1.
2. **Amplification by Poisson subsampling** (Balle, Barthe & Gaboardi 2018, arXiv:1807.01647,
   Thm 8, add/remove): (eps, delta)-DP on a rate-f Poisson subsample is
   (log(1 + f (e^eps - 1)), f delta)-DP (:func:`amplify`). It needs each record's membership to
   be an independent, secret Bernoulli(f) draw, unchanged for every other record when one is
   added or removed: ``trainers.data.record_subset_mask``.
3. **Adaptive composition by PLD**: an (eps', delta')-DP mechanism is dominated by the four-point
   pair of dp_accounting's ``from_privacy_parameters`` (Kairouz, Oh & Viswanath 2015), and
   adaptive composition of f-DP mechanisms is f-DP for the tensor product of their trade-off
   functions (Dong, Roth & Su 2022, "Gaussian Differential Privacy", Thm 3.2): the composition of
   their dominating PLDs. F_h must be dominated for every h T may output: a single candidate, or
   the dominating DP-SGD run of the grid (``dominating_dpsgd_candidate``). F's branches act on
   disjoint splits, so the total is the maximum over branches of T composed with the branch
   (:func:`composed_epsilon`).

The tuning phase gets ``TUNING_DELTA_SHARE`` of the total delta with respect to X (delta_T = that /
f on the subset); the composition is evaluated at the full delta (the delta' atom is inside the
composed PLD, so nothing is counted twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dp_accounting.pld import common as pld_common
from dp_accounting.pld import privacy_loss_distribution

from dptune.accounting import calibration
from dptune.accounting import epsilon as single
from dptune.accounting.events import adjacency_of, as_candidates, dominating_candidate
from dptune.accounting.statement import PrivacyStatement, _candidate_text
from dptune.accounting.totals import total_privacy

#: Share of the total delta that the tuning phase gets (with respect to the full data).
TUNING_DELTA_SHARE = 0.1

#: Name of the procedure in statements (``PrivacyStatement.method`` is ``subsampled/<tuning>``).
THEOREM = (
    "subsampled tuning (Koskela & Kulkarni 2023, arXiv:2301.11989: tune on a Poisson subset, "
    "retrain once on all data), bounded by: the selection theorem on the subset; amplification by "
    "Poisson subsampling (Balle, Barthe & Gaboardi 2018, Thm 8); adaptive composition (Dong, "
    "Roth & Su 2022, Thm 3.2) of dominating PLDs by dp_accounting"
)


def _check_fraction(fraction: float) -> float:
    f = fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1:
        raise ValueError(f"fraction={f!r} must be a number in (0, 1) (1 would be no subsampling)")
    return float(fraction)


def amplify(epsilon: float, delta: float, fraction: float) -> tuple[float, float]:
    """(eps', delta') of an (``epsilon``, ``delta``)-DP mechanism run on a Poisson subsample with
    rate ``fraction``: (log(1 + f (e^eps - 1)), f delta) (Balle, Barthe & Gaboardi 2018, Thm 8;
    add/remove adjacency)."""
    f = _check_fraction(fraction)
    return math.log1p(f * math.expm1(epsilon)), f * delta


def subset_epsilon(epsilon_full: float, fraction: float) -> float:
    """The epsilon on the subset whose amplification (:func:`amplify`) is ``epsilon_full``: the
    inverse of eps -> log(1 + f (e^eps - 1)), i.e. log(1 + (e^eps' - 1) / f)."""
    return math.log1p(math.expm1(epsilon_full) / _check_fraction(fraction))


def final_candidate(candidates: Any) -> Any:
    """One candidate whose PLD dominates the final run for every setting the tuning phase may
    select (``dominating_candidate``; ValueError for heterogeneous user events: none is known)."""
    dom = dominating_candidate(candidates)
    if dom is None:
        raise ValueError(
            "subsampled tuning composes the tuning phase with ONE final run whose settings the "
            "tuning chose, so it needs one PLD dominating every final setting: these candidates "
            "are not all DP-SGD runs (or mix adjacencies); search no privacy-relevant field"
        )
    return dom


def composed_epsilon(
    final_candidates: Any, tuning_epsilon: float, tuning_delta: float, delta: float, *,
    discretization: float = single.PLD_DISCRETIZATION,
) -> float:  # fmt: skip
    """epsilon at ``delta`` of an (``tuning_epsilon``, ``tuning_delta``)-DP mechanism adaptively
    composed with the final run (step 3 of the module docstring): the maximum over the final
    run's branches of ``from_privacy_parameters(eps', delta')`` composed with the branch's PLD."""
    delta = single.check_delta(delta)
    if not 0 <= tuning_delta < delta:
        raise ValueError(f"tuning delta {tuning_delta:g} must be in [0, {delta:g})")
    final = final_candidate(final_candidates)
    tuning = privacy_loss_distribution.from_privacy_parameters(
        pld_common.DifferentialPrivacyParameters(float(tuning_epsilon), float(tuning_delta)),
        value_discretization_interval=discretization,
    )
    out = 0.0
    for branch in final.branches():
        pld = single._event_pld(branch, discretization)
        out = max(out, float(pld.compose(tuning).get_epsilon_for_delta(delta)))
    return out


@dataclass(frozen=True)
class SubsampledTuning:
    """The privacy parameters of subsampled tuning, before anything runs.

    Attributes:
      fraction: the Poisson subsampling rate f of the tuning subset, in (0, 1).
      tuning_epsilon, tuning_delta: the tuning phase's budget with respect to the FULL data
        (eps', delta'), amplification included.
      subset_epsilon, subset_delta: the same budget on the subset (eps_T, delta_T): what the
        selection over the subset's candidates is calibrated to.
    """

    fraction: float
    tuning_epsilon: float
    tuning_delta: float
    subset_epsilon: float
    subset_delta: float

    @classmethod
    def from_budget(cls, fraction: float, tuning_epsilon: float, delta: float) -> SubsampledTuning:
        """The tuning phase's share of a total ``delta``, and its epsilon on the subset."""
        f = _check_fraction(fraction)
        d_full = TUNING_DELTA_SHARE * single.check_delta(delta)
        return cls(f, float(tuning_epsilon), d_full, subset_epsilon(tuning_epsilon, f), d_full / f)


def subsampled_statement(
    final_candidates: Sequence[Any], tuning: PrivacyStatement, fraction: float, delta: float, *,
    seeded: bool = False, notes: Sequence[str] = (),
) -> PrivacyStatement:  # fmt: skip
    """The statement of the whole procedure: ``tuning`` (the selection's statement on the subset)
    amplified by ``fraction`` and composed with the final run (``final_candidates``: every setting
    the final run may have) at the total ``delta``."""
    eps_t, delta_t = amplify(tuning.total_epsilon, tuning.delta, fraction)
    cands = as_candidates(final_candidates)
    total = composed_epsilon(cands, eps_t, delta_t, delta)
    one = total_privacy(cands, None, delta, "auto")
    route = (
        f"tuning phase: {tuning.method} on a per-record Poisson subset (rate {fraction:g}), "
        f"({tuning.total_epsilon:.4g}, {tuning.delta:.3g})-DP on the subset by "
        f"{tuning.theorem} ({tuning.accountant}), amplified to ({eps_t:.4g}, {delta_t:.3g}) "
        "on the full data; composed with the final run's PLD (max over its branches)"
    )
    selection = {
        "fraction": float(fraction), "tuning_epsilon": eps_t, "tuning_delta": delta_t,
        "subset_epsilon": float(tuning.total_epsilon), "subset_delta": float(tuning.delta),
        **{f"tuning_{k}": v for k, v in tuning.selection.items()},
    }  # fmt: skip
    # A note names the tuning candidates' privacy on the subset (public inputs, as to_text lists).
    listed = " ".join(_candidate_text(c) for c in tuning.candidates[:4])
    more = f" And {len(tuning.candidates) - 4} more." if len(tuning.candidates) > 4 else ""
    d = float(delta)
    return PrivacyStatement(
        total, d, one.single_run_epsilon, d, f"subsampled/{tuning.method}", THEOREM, "pld", route,
        candidates=one.candidates, selection=selection, seeded=seeded,
        notes=(*notes, f"Tuning candidates (on the subset): {listed}{more}"),
        adjacency=adjacency_of(cands),
    )  # fmt: skip


def calibrate_final(
    make_candidates: Callable[[float], Any], tuning_epsilon: float, tuning_delta: float,
    target_epsilon: float, delta: float, *, rtol: float = 1e-3,
) -> float:  # fmt: skip
    """The smallest noise multiplier (within ``rtol``, rounded up) of the final run for which the
    tuning phase (``tuning_epsilon``, ``tuning_delta``) composed with it is within
    ``target_epsilon`` at ``delta`` (ValueError when none in [0.05, 1e4] is), searched coarse to
    fine as ``dptune.accounting.calibrate`` does."""

    def eps_fn(disc: float) -> Callable[[float], float]:
        return lambda sigma: composed_epsilon(
            make_candidates(sigma), tuning_epsilon, tuning_delta, delta, discretization=disc
        )

    target, fine = float(target_epsilon), eps_fn(single.PLD_DISCRETIZATION)
    sigma = calibration._solve(eps_fn(calibration.COARSE_DISCRETIZATION), target, 1.0, rtol)
    if not calibration._tight(fine(sigma), target, rtol):
        sigma = calibration._solve(fine, target, sigma, rtol, 1.005)
    return sigma
