"""Privacy of one run (one candidate, or the worst case over a set of candidates) by dp_accounting:

* RDP: ``RdpAccountant`` (Mironov 2017, "Renyi Differential Privacy", Prop. 3 composition; Mironov,
  Talwar & Zhang 2019, "Renyi Differential Privacy of the Sampled Gaussian Mechanism", Sec. 3.3 for
  the Poisson-subsampled Gaussian), converted to (epsilon, delta) by ``compute_epsilon`` /
  ``compute_delta`` (Canonne, Kamath & Steinke 2020, arXiv:2004.00010, Prop. 12).
* PLD: ``PLDAccountant`` (Meiser & Mohammadi 2018; Koskela, Jalko & Honkela 2020; Doroshenko et al.
  2022, "Connect the dots"), pessimistic discretisation, the maximum over the add and the remove
  direction.

A set of candidates is accounted by its worst case (the pointwise maximum of the RDP curves, of
the ``delta(epsilon)`` curves for PLD), a bound uniform over the set, as the selection theorems and
parallel composition (``events``) need.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from dp_accounting import dp_event
from dp_accounting import privacy_accountant as privacy_accountant_lib
from dp_accounting.pld import pld_pmf, pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

from dptune.accounting.events import (
    Candidate,
    ReplaceOneDpEvent,
    as_candidates,
    dominating_candidate,
    doubled_sensitivity,
    pareto_candidates,
)

_ADD_REMOVE = privacy_accountant_lib.NeighboringRelation.ADD_OR_REMOVE_ONE
_REPLACE_ONE = privacy_accountant_lib.NeighboringRelation.REPLACE_ONE

#: dp_accounting's default RDP orders: 1.1 ... 10.9 by 0.1, 11 ... 63, 128, 256, 512, 1024 (156).
DEFAULT_ORDERS: np.ndarray = np.asarray(rdp_privacy_accountant.DEFAULT_RDP_ORDERS, dtype=np.float64)

#: dp_accounting's default PLD discretisation of the privacy loss (nats).
PLD_DISCRETIZATION: float = 1e-4


def check_delta(delta: float) -> float:
    """``delta`` as a float; ValueError saying why when it is not a valid target delta."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float, np.floating)):
        raise ValueError(f"delta={delta!r} must be a number in (0, 1).")
    if not (0 < delta < 1):
        raise ValueError(
            f"delta={delta!r} must be in (0, 1): it is the probability the epsilon guarantee "
            "may fail (typically below 1/number of training examples)."
        )
    return float(delta)


def check_orders(orders: Sequence[float]) -> np.ndarray:
    """``orders`` as a 1-d float64 array, each finite and > 1 (else ValueError): dp_accounting's
    ``compute_epsilon`` turns an infinite order into a NaN epsilon that ``max(0, nan)`` reports
    as epsilon 0; at order 1 the subsampled Gaussian's RDP is NaN."""
    o = np.asarray(orders, dtype=np.float64)
    if o.ndim != 1 or o.size == 0:
        raise ValueError(f"orders must be a non-empty 1-d sequence of Renyi orders, got {orders!r}")
    if (bad := o[~(np.isfinite(o) & (o > 1.0))]).size:
        raise ValueError(
            f"every Renyi order must be a finite number > 1, got {bad[0]!r} "
            "(dp_accounting's default orders are accounting.DEFAULT_ORDERS)"
        )
    return o


def _rdp_of(event: dp_event.DpEvent, orders, relation=_ADD_REMOVE) -> np.ndarray:
    """dp_accounting's ``RdpAccountant`` curve (nats, at ``orders``) of ``event``."""
    accountant = rdp_privacy_accountant.RdpAccountant(list(orders), relation)
    accountant.compose(event)
    return np.array(accountant.rdp, dtype=np.float64)


def _unwrap_replace_one(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """SelfComposed(ReplaceOne(x), k) -> ReplaceOne(SelfComposed(x, k)) (composition of k runs
    of a replace-one candidate is k-fold composition under the same relation)."""
    if isinstance(event, dp_event.SelfComposedDpEvent) and isinstance(
        event.event, ReplaceOneDpEvent
    ):
        return ReplaceOneDpEvent(dp_event.SelfComposedDpEvent(event.event.event, event.count))
    return event


@functools.lru_cache(maxsize=1024)
def _event_rdp(event: dp_event.DpEvent, orders: tuple[float, ...]) -> np.ndarray:
    event = _unwrap_replace_one(event)
    if isinstance(event, ReplaceOneDpEvent):
        rdp = _replace_one_rdp(event.event, orders)
    elif isinstance(event, dp_event.SelfComposedDpEvent) and _is_dpsgd_step(event.event):
        # What RdpAccountant computes for this event (its rdp starts at 0 and adds count * the
        # step's curve), from a cached step curve: runs of different lengths (a candidate after
        # each epoch, the released curve) share it. Bitwise equal (tests/dptune/accounting/
        # test_step_pld_cache.py).
        step = event.event
        rdp = event.count * _step_rdp(
            step.event.noise_multiplier, step.sampling_probability, orders
        )
    else:
        rdp = _rdp_of(event, orders)
    rdp.setflags(write=False)  # cached: callers must not mutate it
    return rdp


@functools.lru_cache(maxsize=256)
def _step_rdp(
    noise_multiplier: float, sampling_prob: float, orders: tuple[float, ...]
) -> np.ndarray:
    """The RDP curve (nats, at ``orders``) of one Poisson-subsampled Gaussian step under add/remove,
    by dp_accounting's ``RdpAccountant`` (Mironov, Talwar & Zhang 2019, Sec. 3.3)."""
    step = dp_event.PoissonSampledDpEvent(sampling_prob, dp_event.GaussianDpEvent(noise_multiplier))
    rdp = _rdp_of(step, orders)
    rdp.setflags(write=False)  # cached: callers must not mutate it
    return rdp


def _replace_one_rdp(event: dp_event.DpEvent, orders: tuple[float, ...]) -> np.ndarray:
    """RDP curve of ``event`` (described under add/remove) under replace-one adjacency, by the rule
    of ``dptune.accounting.events`` (the query moves by up to twice the add/remove sensitivity).

    * Gaussian(sigma), Laplace(b): the exact add/remove RDP of Gaussian(sigma / 2), Laplace(b / 2)
      (as dp_accounting's PLD accountant under ``REPLACE_ONE``; its RDP accountant keeps shift 1).
    * Sampling without replacement (replace-one only): dp_accounting's ``REPLACE_ONE`` RDP (Wang,
      Balle & Kasiviswanathan 2019, Thm 27) with the Gaussian's sigma halved.
    * The Poisson-subsampled Gaussian (DP-SGD): a replacement is a removal then an addition, which
      Mironov 2017 ("Renyi Differential Privacy"), Prop. 11 (weak triangle inequality, p = q = 2)
      bounds from the add/remove curve eps(.) (loose, about twice it; ``auto`` takes the PLD's):

          D_a(P || R) <= (a - 1/2) / (a - 1) * eps(2a) + eps(2a - 1).

    * Compositions: the sum of their parts' curves (RDP composition for one neighbouring pair);
      the triangle bound is linear in eps(.), so summing it per part equals applying it to the sum.

    Raises ``UnsupportedEventError`` for any other event.
    """
    a = np.asarray(orders, dtype=np.float64)
    if isinstance(event, dp_event.NoOpDpEvent):
        return np.zeros_like(a)
    if isinstance(event, dp_event.ComposedDpEvent):
        return sum((_replace_one_rdp(e, orders) for e in event.events), np.zeros_like(a))
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return event.count * _replace_one_rdp(event.event, orders)
    if isinstance(event, (dp_event.GaussianDpEvent, dp_event.LaplaceDpEvent)):
        return _rdp_of(doubled_sensitivity(event), orders)
    if isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        return _rdp_of(doubled_sensitivity(event), orders, _REPLACE_ONE)
    if isinstance(event, dp_event.PoissonSampledDpEvent):
        both = _rdp_of(event, np.concatenate([2 * a, 2 * a - 1]))
        eps_2a, eps_2a_1 = both[: len(a)], both[len(a) :]
        return (a - 0.5) / (a - 1.0) * eps_2a + eps_2a_1
    raise privacy_accountant_lib.UnsupportedEventError(
        f"no replace-one RDP for {type(event).__name__} (dptune.accounting.events)"
    )


def _branches(candidates: Sequence[Candidate]) -> list[dp_event.DpEvent]:
    out: list[dp_event.DpEvent] = []
    for c in pareto_candidates(as_candidates(candidates)):
        for b in c.branches():
            if b not in out:
                out.append(b)
    return out


def rdp_curve(candidates, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """Worst-case RDP curve (nats, a new float64 array of shape ``(len(orders),)``) of one run:
    max over candidates and branches. ``UnsupportedEventError`` when dp_accounting has none."""
    key = tuple(float(a) for a in check_orders(orders))
    curves = [_event_rdp(b, key) for b in _branches(candidates)]
    return np.max(np.stack(curves), axis=0)


def rdp_epsilon(
    candidates, delta: float, orders: Sequence[float] = DEFAULT_ORDERS
) -> tuple[float, float]:
    """(epsilon, optimal order) of one run at ``delta`` from its RDP curve (arXiv:2004.00010
    Prop. 12, dp_accounting's ``compute_epsilon``)."""
    delta = check_delta(delta)
    eps, order = rdp_privacy_accountant.compute_epsilon(
        orders, rdp_curve(candidates, orders), delta
    )
    return float(eps), float(order)


def _is_dpsgd_step(event: dp_event.DpEvent) -> bool:
    return isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(
        event.event, dp_event.GaussianDpEvent
    )


@functools.lru_cache(maxsize=256)
def _step_pld(sigma: float, q: float, disc: float, relation=_ADD_REMOVE):
    """The PLD of one Poisson-subsampled Gaussian step, as ``PLDAccountant`` builds it. Cached:
    building it costs 0.3-0.7 s, composing it ``steps`` times 0.1-0.2 s, and runs of different
    lengths (a candidate after each epoch, the released curve) share it."""
    return privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=disc, neighboring_relation=relation
    )


@functools.lru_cache(maxsize=256)
def _event_pld(event: dp_event.DpEvent, discretization: float, relation=_ADD_REMOVE):
    """The ``PrivacyLossDistribution`` of ``event`` (pessimistic, add and remove directions) under
    ``relation`` (a :class:`ReplaceOneDpEvent` under ``REPLACE_ONE``), as ``PLDAccountant`` builds
    it, but k DP-SGD runs (or steps) are the cached one-run (one-step) PLD composed k times, so
    best-of-k does not rebuild the 0.3 s PLD of one run. ``UnsupportedEventError`` for an event
    with no guarantee (``NonPrivateDpEvent``), whose accountant PLD would read as epsilon 0.
    """
    event = _unwrap_replace_one(event)
    if isinstance(event, ReplaceOneDpEvent):
        return _event_pld(event.event, discretization, _REPLACE_ONE)
    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner = event.event
        if isinstance(inner, dp_event.SelfComposedDpEvent) and _is_dpsgd_step(inner.event):
            return _event_pld(inner, discretization, relation).self_compose(event.count)
        if _is_dpsgd_step(inner) and inner.sampling_probability > 0:
            sigma, q = inner.event.noise_multiplier, inner.sampling_probability
            return _step_pld(sigma, q, discretization, relation).self_compose(event.count)
    accountant = pld_privacy_accountant.PLDAccountant(relation, discretization)
    accountant.compose(event)
    if accountant._contains_non_dp_event:
        raise privacy_accountant_lib.UnsupportedEventError(
            f"{type(event).__name__} contains a non-private event: no PLD guarantee"
        )
    return accountant._pld  # what its get_epsilon / get_delta read


@functools.lru_cache(maxsize=65536)
def _event_pld_epsilon(event: dp_event.DpEvent, discretization: float, delta: float) -> float:
    """The PLD's epsilon at ``delta``, cached: a statement asks for it more than once (single-run
    epsilon and route), each a Python pass over the PLD (10-20 ms)."""
    return float(_event_pld(event, discretization).get_epsilon_for_delta(delta))


def pld_epsilon(candidates, delta: float, *, discretization: float = PLD_DISCRETIZATION) -> float:
    """epsilon of one run at ``delta`` by PLD: the max over candidates and parallel branches."""
    delta = check_delta(delta)
    return max(_event_pld_epsilon(b, discretization, delta) for b in _branches(candidates))


@functools.lru_cache(maxsize=65536)
def _event_pld_delta(event: dp_event.DpEvent, discretization: float, epsilon: float) -> float:
    return float(_event_pld(event, discretization).get_delta_for_epsilon(epsilon))


def pld_delta(
    candidates, epsilon: float | Sequence[float], *, discretization: float = PLD_DISCRETIZATION
) -> float | np.ndarray:
    """delta (hockey-stick divergence) of one run at ``epsilon`` (scalar or 1-d array) by PLD, max
    over candidates and branches, capped at 1. Scalar calls, cached (dp_accounting's vectorised
    ``get_delta_for_epsilon`` loops in Python and is slower than a few hundred of them)."""
    eps = np.atleast_1d(np.asarray(epsilon, dtype=np.float64))
    out = np.zeros_like(eps)
    for b in _branches(candidates):
        out = np.maximum(out, [_event_pld_delta(b, discretization, float(e)) for e in eps])
    out = np.minimum(out, 1.0)
    return float(out[0]) if np.ndim(epsilon) == 0 else out


def _dense_deltas(pmf: Any, epsilons: np.ndarray) -> np.ndarray:
    """dp_accounting's ``DensePLDPmf.get_delta_for_epsilon(epsilons)`` for sorted ``epsilons``,
    vectorised: delta(eps) = inf_mass + sum over losses l > eps of p(l) - e^eps * sum of p(l) e^-l.
    dp_accounting walks the PMF from its largest loss down in a Python loop (0.1-0.5 s for 600
    epsilons); both running sums here are accumulated in the same order (``np.cumsum`` adds
    sequentially) on the same float64 values, so the result is bitwise the same (tested)."""
    losses = (np.arange(pmf.size) + pmf._lower_loss) * pmf._discretization
    probs = np.asarray(pmf._probs, dtype=np.float64)
    inf_mass = pmf._infinity_mass
    upper = np.cumsum(np.concatenate(([inf_mass], probs[::-1])))
    lower = np.cumsum(np.concatenate(([0.0], probs[::-1] * np.exp(-losses[::-1]))))
    above = len(probs) - np.searchsorted(losses, epsilons, side="right")  # losses > eps
    out = upper[above] - np.exp(epsilons) * lower[above]
    out[np.isposinf(epsilons)] = inf_mass
    return out


def _profile_of(pld: privacy_loss_distribution.PrivacyLossDistribution, epsilons: np.ndarray):
    """``pld.get_delta_for_epsilon(epsilons)`` (the max of the remove and add directions), with
    dense PMFs through :func:`_dense_deltas`; anything else through dp_accounting."""
    pmfs = [pld._pmf_remove] if pld._symmetric else [pld._pmf_remove, pld._pmf_add]
    if not all(isinstance(p, pld_pmf.DensePLDPmf) for p in pmfs):
        return np.asarray(pld.get_delta_for_epsilon(epsilons), dtype=np.float64)
    out = _dense_deltas(pmfs[0], epsilons)
    return out if len(pmfs) == 1 else np.maximum(out, _dense_deltas(pmfs[1], epsilons))


@functools.lru_cache(maxsize=256)
def _event_pld_profile(
    event: dp_event.DpEvent, discretization: float, epsilons: tuple[float, ...]
) -> np.ndarray:
    out = _profile_of(_event_pld(event, discretization), np.asarray(epsilons))
    out.setflags(write=False)  # cached
    return out


def pld_profile(
    candidates, epsilons: Sequence[float], *, discretization: float = PLD_DISCRETIZATION
) -> np.ndarray:
    """The privacy profile delta(eps) of one run at each of ``epsilons`` (sorted ascending), by
    PLD: the max over candidates, branches and the add/remove directions, capped at 1 (one
    vectorised pass per branch and direction, :func:`_dense_deltas`)."""
    key = tuple(float(e) for e in epsilons)
    if np.any(np.diff(np.asarray(key)) < 0):
        raise ValueError("epsilons must be sorted in ascending order")
    out = np.zeros(len(key))
    for b in _branches(candidates):
        out = np.maximum(out, _event_pld_profile(b, discretization, key))
    return np.minimum(out, 1.0)


def composed_pld_epsilon(
    candidates, count: int, delta: float, *, discretization: float = PLD_DISCRETIZATION
) -> float:
    """epsilon at ``delta`` of ``count`` runs composed (naive best-of-k), by PLD, of the run that
    dominates every candidate (``dominating_candidate``; ValueError when there is none). Each
    run's branches act on disjoint splits, fixed across runs, so the k-fold composition is the max
    over branches of each branch composed k times (basic composition per split, parallel across).
    """
    delta = check_delta(delta)
    dom = dominating_candidate(candidates)
    if dom is None:
        raise ValueError(
            "composition by PLD needs one candidate that dominates all others; these "
            "candidates are heterogeneous user DpEvents: use accountant='rdp' (pointwise "
            "max of RDP curves)."
        )
    composed = [dp_event.SelfComposedDpEvent(b, int(count)) for b in dom.branches()]
    return max(_event_pld_epsilon(e, discretization, delta) for e in composed)


def clear_caches() -> None:
    """Forgets the cached RDP curves, PLDs and PLD deltas (benchmarks time cold calls)."""
    for cached in (_event_rdp, _step_rdp, _event_pld, _event_pld_epsilon, _step_pld,
                   _event_pld_delta, _event_pld_profile):  # fmt: skip
        cached.cache_clear()
