"""Total privacy of a tuning run: the candidates' guarantee pushed through a selection theorem.

The selection theorems live in ``selection.privacy`` (one ``PrivacyTransform`` each); this module
feeds them the candidates' privacy (dp_accounting) along every route the theorem admits:

* ``pure``: pure epsilon-DP (Laplace) candidates -> ``transform.pure_dp(eps)``; delta = 0.
* ``rdp``: the worst-case RDP curve -> ``transform.rdp(orders, curve, ...)`` -> epsilon at delta
  (arXiv:2004.00010 Prop. 12). A theorem that needs an (eps-hat, delta-hat) statement of one run
  (Papernot & Steinke 2022, Thm 6, Poisson) gets delta-hat from the same RDP curve: this
  reproduces dp_accounting's ``RepeatAndSelectDpEvent`` exactly.
* ``pld``: the same with delta-hat from the run's PLD (tighter). Thm 6 assumes an
  (eps-hat, delta-hat)-DP base algorithm, whatever the statement came from, and a pessimistic
  PLD's delta(eps) is one (our derivation: the theorem as stated, with a tighter input; about
  4.00 -> 3.25 at sigma=1.1, q=256/60000, 7032 steps, mean 10). One run and naive best-of-k are
  composed by PLD directly. Theorems for (eps, delta)-DP candidates (``transform.approx_dp``,
  e.g. the capped geometric count's (eps1 + b_max, E[K] delta1)) get eps(delta_1) from the PLD
  (or RDP), delta_1 chosen to minimise the total; a ``transform.profile_bound()`` gets the
  candidates' PLD privacy profile.

``accountant="auto"`` tries every route and keeps the smallest epsilon (each is a valid bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dp_accounting import privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dptune.accounting import epsilon as single
from dptune.accounting.events import Candidate, adjacency_of, as_candidates, pure_epsilon
from dptune.accounting.statement import PrivacyStatement
from selection.privacy import BestOfKPrivacy, SingleRunPrivacy
from selection.profiles import CandidateProfile

#: Accepted values of ``accountant``.
ACCOUNTANTS = ("auto", "pld", "rdp")


#: What ``total_privacy`` needs of a ``selection.privacy`` transform (docs/architecture.md).
_CONTRACT = ("name", "theorem", "is_private", "params", "pure_dp", "rdp", "approx_dp")


class _NoRoute(Exception):
    """This route does not apply to these candidates and this transform."""


@dataclass(frozen=True)
class Route:
    """One way of computing the total, and what it gave."""

    accountant: str  # "pure" | "rdp" | "pld"
    epsilon: float
    delta: float
    description: str
    rdp_order: float | None = None
    theorem: str | None = None  # set when the route uses another theorem than the transform's


def composition_count(transform: Any) -> int | None:
    """k when the transform is plain composition of k runs (single run: 1), else None."""
    if transform is None or isinstance(transform, SingleRunPrivacy):
        return 1
    return transform.k if isinstance(transform, BestOfKPrivacy) else None


def _pure_route(cands: tuple[Candidate, ...], transform, delta: float = 0.0) -> Route:
    epsilons = [pure_epsilon(b) for c in cands for b in c.branches()]
    if any(e is None for e in epsilons):
        raise _NoRoute("a candidate is not pure epsilon-DP")
    eps = max(epsilons)
    if transform is None:
        return Route("pure", eps, 0.0, "pure epsilon-DP of one run")
    try:
        total = float(transform.pure_dp(eps))
    except (NotImplementedError, ValueError) as e:
        # Pure-DP candidates, but a theorem whose total has a delta of its own (e.g. Chaudhuri &
        # Vinterbo 2013, Thm 2 with a stability failure probability): its (eps, 0) form.
        try:
            total, total_delta = (float(v) for v in transform.approx_dp(eps, 0.0))
        except (NotImplementedError, ValueError):
            raise _NoRoute(str(e)) from e
        if not total_delta <= delta:
            raise _NoRoute(
                f"{transform.name}: its delta {total_delta:.3g} with pure candidates exceeds "
                f"{delta:g}"
            ) from e
        desc = f"(eps, delta) form of the theorem at pure candidate epsilon {eps:.6g}"
        return Route("pure", total, total_delta, desc)
    return Route("pure", total, 0.0, f"pure-DP form of the theorem at candidate epsilon {eps:.6g}")


def _delta_from_rdp(orders: np.ndarray, curve: np.ndarray) -> Callable[[float], float]:
    """delta(eps) of one run from its RDP curve (arXiv:2004.00010 Prop. 12), as dp_accounting;
    its ``.called`` records whether the theorem used it."""

    def fn(e: float) -> float:  # the theorems call it with one eps-hat at a time
        fn.called = True
        return rdp_privacy_accountant.compute_delta(orders, curve, float(e))[0]

    fn.called = False
    return fn


def _through(transform, orders, curve, dfe, delta: float) -> tuple[float, float]:
    """(epsilon at ``delta``, optimal order) of the theorem's RDP form over ``curve``. A NaN in it
    stops the computation: dp_accounting's ``compute_epsilon`` would pick the NaN entry as the
    optimum and report epsilon 0 (``max(0, nan)``)."""
    total_rdp = np.asarray(transform.rdp(orders, curve, delta_for_epsilon=dfe), dtype=np.float64)
    if np.any(np.isnan(total_rdp)):
        raise ValueError(
            f"selection {getattr(transform, 'name', transform)!r} returned a NaN RDP value; "
            "refusing to convert it (dp_accounting would report epsilon 0)"
        )
    eps, order = rdp_privacy_accountant.compute_epsilon(orders, total_rdp, delta)
    return float(eps), float(order)


#: Half-width (in grid orders) of the window of orders on which a PLD delta-hat is evaluated.
_PLD_WINDOW = 6


def _rdp_route(
    cands, transform, delta: float, orders: np.ndarray, delta_source: str, disc: float
) -> Route:
    curve = single.rdp_curve(cands, orders)
    if transform is None:
        eps, order = rdp_privacy_accountant.compute_epsilon(orders, curve, delta)
        return Route("rdp", float(eps), delta, "RDP of one run", float(order))
    dfe = _delta_from_rdp(orders, curve)
    try:
        eps, order = _through(transform, orders, curve, dfe, delta)
    except NotImplementedError as e:
        raise _NoRoute(str(e)) from e
    desc = "candidate RDP curve through the theorem's RDP form"
    if delta_source == "rdp":
        if dfe.called:
            desc += "; delta-hat(eps-hat) of one run from its RDP"
        return Route("rdp", eps, delta, desc, order)
    if not dfe.called:
        raise _NoRoute("the theorem takes no (eps-hat, delta-hat) input: PLD adds nothing")
    # delta-hat from a PLD costs 1-5 ms per order (dp_accounting's scalar hockey-stick), so it is
    # evaluated on a window of orders around the RDP route's optimum, widened while the optimum
    # sits at the window's edge.  The theorem holds on any grid of orders, so every window gives a
    # valid bound; in practice the same as the full grid.
    pld_dfe = lambda e: single.pld_delta(cands, e, discretization=disc)  # noqa: E731
    n = len(orders)
    i_opt = int(np.flatnonzero(orders == order)[0])
    lo, hi = max(0, i_opt - _PLD_WINDOW), min(n, i_opt + _PLD_WINDOW + 1)
    while True:
        eps, order = _through(transform, orders[lo:hi], curve[lo:hi], pld_dfe, delta)
        j = lo + int(np.flatnonzero(orders[lo:hi] == order)[0])
        wider = (max(0, lo - _PLD_WINDOW) if j - lo < 2 else lo,
                 min(n, hi + _PLD_WINDOW) if hi - 1 - j < 2 else hi)  # fmt: skip
        if wider == (lo, hi):
            break
        lo, hi = wider
    desc += (
        f"; delta-hat(eps-hat) of one run from its PLD (orders {orders[lo]:g}..{orders[hi - 1]:g})"
        " (our derivation: the theorem takes any valid (eps-hat, delta-hat) statement)"
    )
    return Route("pld", eps, delta, desc, order)


def _pld_composition_route(cands, transform, delta: float, disc: float) -> Route:
    k = composition_count(transform)
    if k is None:
        raise _NoRoute("PLD composition applies only to one run or best-of-k")
    try:
        if k == 1:
            eps = single.pld_epsilon(cands, delta, discretization=disc)
        else:
            eps = single.composed_pld_epsilon(cands, k, delta, discretization=disc)
    except (ValueError, privacy_accountant.UnsupportedEventError) as e:
        raise _NoRoute(str(e)) from e
    what = "one run" if k == 1 else f"{k} runs composed"
    return Route("pld", float(eps), delta, f"PLD of {what}")


#: Number of epsilons at which a candidate's privacy profile is evaluated for the profile route.
_PROFILE_POINTS = 600


def _profile_route(cands, transform, delta: float, disc: float) -> Route:
    """The selection's privacy-profile bound (``transform.profile_bound()``) fed with the
    candidates' PLD profile delta(eps) on ``_PROFILE_POINTS`` epsilons from 0 to 1.5 x the one-run
    epsilon at delta * 1e-3 / E[K] (beyond, the last, negligible delta: an upper bound). The bound
    reads the profile at the grid point below: at most one step (~0.3%) of epsilon."""
    try:
        bound = transform.profile_bound()
    except (NotImplementedError, AttributeError) as e:
        raise _NoRoute(str(e)) from e
    try:
        e_hi = single.pld_epsilon(cands, delta * 1e-3 / max(1.0, bound.mean), discretization=disc)
    except (ValueError, privacy_accountant.UnsupportedEventError) as e:
        raise _NoRoute(str(e)) from e
    if not math.isfinite(e_hi):
        raise _NoRoute("the candidates' PLD has no finite epsilon at the profile grid's end")
    grid = np.linspace(0.0, 1.5 * max(e_hi, 1e-3), _PROFILE_POINTS)
    deltas = single.pld_profile(cands, grid, discretization=disc)
    eps = bound.epsilon(delta, CandidateProfile(grid, deltas))
    desc = (
        f"privacy profile delta(eps) of one run from its PLD ({_PROFILE_POINTS} epsilons in "
        f"[0, {grid[-1]:.3g}]) through the selection's profile bound"
    )
    return Route("pld", float(eps), delta, desc, theorem=bound.theorem)


def _approx_route(
    cands, transform, delta: float, source: str, orders: np.ndarray, disc: float
) -> Route:
    """Theorems for (eps_1, delta_1)-DP candidates (``transform.approx_dp(eps_1, delta_1) ->
    (eps, delta_total)``): delta_1 scanned on a log grid below ``delta``, the smallest total eps
    with delta_total <= delta kept."""

    def eps_of(d1: float) -> float:
        if source == "pld":
            return single.pld_epsilon(cands, d1, discretization=disc)
        return single.rdp_epsilon(cands, d1, orders)[0]

    try:
        transform.approx_dp(1.0, delta * 1e-6)
    except NotImplementedError as e:
        raise _NoRoute(str(e)) from e
    best: tuple[float, float, float] | None = None  # (total eps, delta total, delta_1)
    smallest_delta = math.inf
    for d1 in delta * np.logspace(-14, 0, 29):
        if d1 >= 1:
            continue
        eps1 = eps_of(float(d1))
        try:
            eps_t, delta_t = transform.approx_dp(eps1, float(d1))
        except ValueError:
            continue
        smallest_delta = min(smallest_delta, delta_t)
        if not math.isfinite(eps_t):
            continue  # e.g. a PLD's truncated tail mass exceeds delta_1
        if delta_t <= delta and (best is None or eps_t < best[0]):
            best = (float(eps_t), float(delta_t), float(d1))
    if best is None:
        raise _NoRoute(
            f"no per-run delta_1 keeps the total delta within {delta:g} (the smallest total delta "
            f"of {transform.name} with these candidates is {smallest_delta:.3g})"
        )
    desc = f"(eps_1, delta_1) form of the theorem, delta_1 = {best[2]:.3g} by {source.upper()}"
    return Route(source, best[0], best[1], desc)


def routes(
    candidates, transform: Any, delta: float, accountant: str = "auto", *,
    orders: Sequence[float] = single.DEFAULT_ORDERS,
    discretization: float = single.PLD_DISCRETIZATION, reasons: list[str] | None = None,
) -> list[Route]:  # fmt: skip
    """Every route valid for ``accountant`` with the epsilon it gives (see module docstring).

    ``discretization`` is the PLD's loss discretisation (nats); coarser is faster and looser.
    ``reasons``, if given, receives why each route that does not apply does not.
    """
    cands = as_candidates(candidates)
    orders = single.check_orders(orders)
    disc = float(discretization)
    # For plain composition (one run, best-of-k) PLD composition is exact up to discretisation, so
    # the (eps_1, delta_1) and delta-hat routes cannot beat it and are skipped.
    is_composition = composition_count(transform) is not None
    attempts: list[Callable[[], Route]] = []
    if accountant == "auto":
        attempts.append(lambda: _pure_route(cands, transform, delta))
    if accountant in ("auto", "rdp"):
        attempts.append(lambda: _rdp_route(cands, transform, delta, orders, "rdp", disc))
        if not is_composition:
            attempts.append(lambda: _approx_route(cands, transform, delta, "rdp", orders, disc))
    if accountant in ("auto", "pld"):
        attempts.append(lambda: _pld_composition_route(cands, transform, delta, disc))
        if not is_composition:
            attempts.append(lambda: _rdp_route(cands, transform, delta, orders, "pld", disc))
            attempts.append(lambda: _approx_route(cands, transform, delta, "pld", orders, disc))
            attempts.append(lambda: _profile_route(cands, transform, delta, disc))
    found: list[Route] = []
    for attempt in attempts:
        try:
            found.append(attempt())
        except (_NoRoute, privacy_accountant.UnsupportedEventError) as e:
            if reasons is not None:
                reasons.append(str(e))
    return found


def check_accountant(accountant: str) -> str:
    """Returns ``accountant`` or raises ValueError naming the accepted values."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(
            f"accountant={accountant!r} must be one of {', '.join(ACCOUNTANTS)} "
            "('auto' takes the tightest valid route)."
        )
    return accountant


def check_transform(transform) -> Any:
    """None -> ``SingleRunPrivacy()``; otherwise checks the ``selection.privacy`` contract."""
    if transform is None:
        return SingleRunPrivacy()
    if missing := [a for a in _CONTRACT if not hasattr(transform, a)]:
        raise ValueError(
            f"transform={transform!r} is not a selection.privacy transform "
            f"(missing {', '.join(missing)})."
        )
    return transform


def _best_route(cands, transform, delta: float, accountant: str, orders) -> Route:
    """The tightest route of ``accountant`` (lowest epsilon, then delta); ValueError naming the
    accountants that would have one when it has none."""
    reasons: list[str] = []
    found = routes(cands, transform, delta, accountant, orders=orders, reasons=reasons)
    if not found:
        others = [a for a in ACCOUNTANTS if a != accountant]
        why = "; ".join(dict.fromkeys(r for r in reasons if r))
        hint = (
            f"try accountant={others[0]!r} or {others[1]!r}"
            if accountant != "auto"
            else "no accountant has one"
        )
        raise ValueError(
            f"accountant={accountant!r} has no route for selection {transform.name!r} "
            f"({transform.theorem}) with these candidates ({why}); {hint}."
        )
    return min(found, key=lambda r: (r.epsilon, r.delta))


def total_privacy(
    candidates, transform: Any = None, delta: float = 1e-5, accountant: str = "auto", *,
    seeded: bool = False, orders: Sequence[float] = single.DEFAULT_ORDERS,
) -> PrivacyStatement:  # fmt: skip
    """The privacy of a whole tuning run, as a ``PrivacyStatement``.

    Args:
      candidates: anything ``as_candidates`` takes (every candidate the sampler can draw; the
        bound is their worst case).
      transform: a ``selection.privacy`` transform (the selection theorem); None for one run.
      delta: the target total delta, in (0, 1).
      accountant: ``"auto"`` (tightest valid route), ``"pld"`` or ``"rdp"`` (dp_accounting's RDP
        route, reproduced exactly).
      seeded: True when the run's randomness comes from a fixed seed (the statement says so).
      orders: Renyi orders for the RDP routes (dp_accounting's defaults).

    Raises:
      ValueError: invalid delta/accountant/candidates, or no route of ``accountant`` applies (the
        message says which accountant would).
    """
    delta = single.check_delta(delta)
    accountant = check_accountant(accountant)
    transform = check_transform(transform)
    cands = as_candidates(candidates)  # orders are checked by routes()
    common = dict(
        method=transform.name, candidates=tuple(c.params() for c in cands),
        selection=dict(transform.params()), seeded=seeded, adjacency=adjacency_of(cands),
    )  # fmt: skip
    one_run = routes(cands, None, delta, accountant, orders=orders)
    single_eps = min((r.epsilon for r in one_run if r.accountant != "pure"), default=math.inf)
    if not transform.is_private:
        route = "no guarantee: the selection is not private"
        return PrivacyStatement(
            math.inf, delta, single_eps, delta, theorem=transform.theorem, accountant=accountant,
            route=route, private=False, **common,
        )  # fmt: skip

    best = _best_route(cands, transform, delta, accountant, orders)
    pure = best.accountant == "pure"
    if pure:
        single_eps = _pure_route(cands, None).epsilon
    notes = () if len(cands) == 1 else (
        f"Worst case over {len(cands)} candidate settings (pointwise max of RDP curves; "
        "max of delta(eps) or a dominating run for PLD).",
    )  # fmt: skip
    return PrivacyStatement(
        best.epsilon, best.delta if pure else delta, single_eps, 0.0 if pure else delta,
        theorem=best.theorem or transform.theorem, accountant=best.accountant,
        route=best.description, rdp_order=best.rdp_order, notes=notes, **common,
    )  # fmt: skip
