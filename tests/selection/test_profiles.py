"""Privacy-profile (delta(eps)) bounds of random stopping (`profiles.ProfileSelectionBound`).

Independent references:

* exact enumeration: for a candidate with finitely many ordered outputs (probabilities p_X, p_Y),
  "best of K draws, K ~ the count" outputs the j-th output with probability phi(F_j + p_j) -
  phi(F_j), F_j = P[output < j], and "nothing" with probability phi(0). phi (the pgf) is summed
  here from `selection.counts`' pmf, not from the closed forms the bound uses. Its hockey-stick
  divergence is then exact and the bound, fed the candidate's exact profile, must dominate it;
* the reordered PLD pair: the outputs of a pessimistic PLD (its privacy losses, with P_X = pmf
  and P_Y = pmf * e^-loss) form a candidate whose profile is the PLD's; ordering its outputs
  adversarially (the most Y-favouring first, then the most X-favouring) gives a candidate the
  bound must cover, with an exactly computable tuned profile;
* dp_accounting's RDP route (Papernot & Steinke 2022, Thm 2 and 6), which the profile route must
  never exceed on a grid of DP-SGD settings.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from dptune import accounting
from dptune.accounting import totals
from selection import privacy as sp
from selection import profiles
from selection.counts import Poisson, TruncatedNegativeBinomial

# ----------------------------------------------------------------------------------- enumeration


def _pgf(count, z: np.ndarray, kmax: int = 4000) -> np.ndarray:
    """phi(z) = sum_k P[K = k] z^k from the count's pmf (independent of the bound's closed form)."""
    p = count.pmf(np.arange(0, kmax))
    assert 1.0 - p.sum() < 1e-12  # kmax covers the distribution
    return np.polynomial.polynomial.polyval(np.asarray(z, dtype=np.float64), p)


def _tuned(count, p: np.ndarray) -> np.ndarray:
    """Output distribution of best-of-K over ordered outputs (index = score), plus 'nothing'."""
    below = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    upto = np.minimum(below + p, 1.0)
    probs = _pgf(count, upto) - _pgf(count, below)
    return np.append(np.maximum(probs, 0.0), _pgf(count, np.zeros(1))[0])


def _hockey(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.sum(np.maximum(p - math.exp(eps) * q, 0.0)))


def _profile(p: np.ndarray, q: np.ndarray, eps: np.ndarray) -> np.ndarray:
    """Exact profile of the pair, max over both directions."""
    return np.array([max(_hockey(p, q, e), _hockey(q, p, e)) for e in eps])


def _exact_tuned_delta(count, p: np.ndarray, q: np.ndarray, eps: float) -> float:
    a, b = _tuned(count, p), _tuned(count, q)
    return max(_hockey(a, b, eps), _hockey(b, a, eps))


COUNTS = {
    "logarithmic3": TruncatedNegativeBinomial.from_mean(3.0, 0.0),
    "logarithmic10": TruncatedNegativeBinomial.from_mean(10.0, 0.0),
    "geometric10": TruncatedNegativeBinomial.from_mean(10.0, 1.0),
    "tnb-0.5": TruncatedNegativeBinomial.from_mean(5.0, -0.5),  # light enough tail for _pgf
    "tnb2": TruncatedNegativeBinomial.from_mean(5.0, 2.0),
    "poisson5": Poisson(5.0),
}


def _bound_of(count) -> profiles.ProfileSelectionBound:
    if isinstance(count, Poisson):
        return sp.PoissonStoppingPrivacy(count.mean).profile_bound()
    return sp.RandomStoppingPrivacy(count.shape, count.gamma).profile_bound()


def _adversarial_order(p: np.ndarray, q: np.ndarray, split: float) -> np.ndarray:
    """Scores ranking the most q-favouring outputs (a ``split`` fraction of q's mass) on top, then
    the most p-favouring, then the rest: the ordering that makes S_X fall behind S_Y first and
    then leaks (see ProfileSelectionBound's docstring)."""
    loss = np.log(p) - np.log(q)
    up = np.argsort(loss)  # most q-favouring first
    top = up[: max(1, int(np.searchsorted(np.cumsum(q[up]), split)))]
    rest = [i for i in np.argsort(-loss) if i not in set(top)]
    order = list(top) + rest  # best first
    return np.asarray(order[::-1])  # index 0 = worst score


def _toy_pairs(rng: np.random.Generator):
    for n, scale in [(4, 0.5), (8, 1.0), (12, 2.0)]:
        p = rng.dirichlet(np.ones(n))
        q = p * np.exp(rng.uniform(-scale, scale, n))
        q /= q.sum()
        yield p, q


@pytest.mark.parametrize("name", sorted(COUNTS))
def test_bound_dominates_exact_tuned_profile_on_toy_candidates(name):
    count, bound = COUNTS[name], _bound_of(COUNTS[name])
    rng = np.random.default_rng(11)
    epsilons = np.array([0.0, 0.2, 0.5, 1.0, 2.0, 4.0])
    checked = 0
    for p, q in _toy_pairs(rng):
        grid = np.linspace(0.0, 1.05 * np.max(np.abs(np.log(p / q))), 400)
        profile = profiles.CandidateProfile(grid, _profile(p, q, grid))
        bounds = bound.deltas(epsilons, profile)
        orders = [rng.permutation(p.size), np.argsort(np.log(p / q))]
        orders += [_adversarial_order(p, q, s) for s in (0.2, 0.5)]
        for order in orders:
            a, b = _tuned(count, p[order]), _tuned(count, q[order])
            for eps, bnd in zip(epsilons, bounds, strict=True):
                exact = max(_hockey(a, b, eps), _hockey(b, a, eps))
                assert bnd >= exact - 1e-12, (eps, exact)
                checked += 1
    assert checked == 3 * 4 * 6


@pytest.mark.parametrize("shape", [0.0, 1.0, 2.0])
def test_one_candidate_always_is_exact(shape):
    # gamma = 1 means K = 1: the bound must return the candidate's own profile (the theorem is
    # tight there), at every grid epsilon.
    rng = np.random.default_rng(3)
    p, q = next(_toy_pairs(rng))
    grid = np.linspace(0.0, 1.0, 101)
    profile = profiles.CandidateProfile(grid, _profile(p, q, grid))
    bound = profiles.RandomStoppingProfile(shape, 1.0)
    assert bound.mean == 1.0
    for i in range(0, 101, 10):
        exact = _exact_tuned_delta(TruncatedNegativeBinomial(shape, 1.0), p, q, grid[i])
        assert bound.delta(grid[i], profile) == pytest.approx(exact, rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0])
def test_pure_dp_candidates_give_at_most_the_papernot_steinke_multiple(shape):
    # eps0-DP candidate (ratios within e^{+-eps0}): PS Cor. 3 says ((2 + eta) eps0, 0); the profile
    # bound must not be looser (up to the grid step, 0.002), and not below the exact tuned profile.
    eps0 = 0.5
    p = np.array([0.2, 0.3, 0.5])
    q = np.array([0.2 * math.exp(-eps0), 0.3, 0.0])
    q[2] = 1.0 - q[:2].sum()
    grid = np.linspace(0.0, 2.0, 1001)
    profile = profiles.CandidateProfile(grid, _profile(p, q, grid))
    assert profile.delta(eps0 + 1e-9)[0] == 0.0
    count = TruncatedNegativeBinomial.from_mean(10.0, shape)
    bound = _bound_of(count)
    eps = bound.epsilon(1e-12, profile)
    assert eps <= (2.0 + shape) * eps0 + 0.004
    assert _exact_tuned_delta(count, p, q, eps) <= 1e-12
    assert _exact_tuned_delta(count, p, q, 0.5 * eps) > 1e-6  # the bound is not vacuous


def _pld_pair(pld) -> tuple[np.ndarray, np.ndarray]:
    """(P_X, P_Y) over the PLD's finite losses (remove direction), plus an output only X has (the
    PLD's infinity mass, loss +inf) and one only Y has (Y's missing mass, loss -inf);
    dp_accounting's PMF as a dense array."""
    pmf = pld._pmf_remove.to_dense_pmf()
    losses = (np.arange(pmf.size) + pmf._lower_loss) * pmf._discretization
    keep = pmf._probs > 0
    px, losses = pmf._probs[keep], losses[keep]
    py = px * np.exp(-losses)
    px = np.append(px, [pmf._infinity_mass, 0.0])
    py = np.append(py, [0.0, max(0.0, 1.0 - py.sum())])
    return px, py


@pytest.mark.parametrize("name", ["logarithmic10", "geometric10", "poisson5"])
def test_bound_dominates_exact_tuned_profile_on_reordered_pld_pair(name):
    # Subsampled Gaussian (sigma 2, q 0.2, 10 steps): a PLD of ~4000 losses.
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        2.0, sampling_prob=0.2, value_discretization_interval=2e-3, use_connect_dots=True
    ).self_compose(10)
    px, py = _pld_pair(pld)
    grid = np.linspace(0.0, 4.0, 800)
    # The pair's own profile (exact), not the PLD's, so the comparison is self-contained.
    profile = profiles.CandidateProfile(grid, _profile(px, py, grid))
    count = COUNTS[name]
    bound = _bound_of(count)
    with np.errstate(divide="ignore", invalid="ignore"):
        loss = np.log(px) - np.log(py)
    loss = np.nan_to_num(loss, neginf=-1e9, posinf=1e9)
    beyond_naive = False
    epsilons = np.array([1.0, 1.5, 2.0])
    bounds = bound.deltas(epsilons, profile)
    for split in (0.0, 0.05, 0.1, 0.3):
        up = np.argsort(loss)
        n_top = int(np.searchsorted(np.cumsum(py[up]), split))
        top, rest = up[:n_top], np.argsort(-loss)
        rest = rest[~np.isin(rest, top)]
        order = np.concatenate([top, rest])[::-1]
        a, b = _tuned(count, px[order]), _tuned(count, py[order])
        for eps, bnd in zip(epsilons, bounds, strict=True):
            exact = max(_hockey(a, b, eps), _hockey(b, a, eps))
            assert bnd >= exact - 1e-12, (split, eps)
            # the ordering matters: "E[K] delta_Q(eps)" alone would not be a valid bound
            beyond_naive |= exact > count.mean * profile.delta(eps)[0]
    assert beyond_naive


# ------------------------------------------------------------------------ against the RDP route

GRID = [  # (sigma, q, steps)
    (0.8, 0.01, 200),
    (1.1, 256 / 60000, 1000),
    (2.0, 0.02, 500),
    (5.0, 0.05, 100),
]


@pytest.mark.parametrize("sigma,q,steps", GRID)
def test_profile_route_never_looser_than_rdp_route(sigma, q, steps):
    cand = accounting.DpSgdCandidate(q, steps, sigma)
    cands = accounting.as_candidates(cand)
    for mean in (2.0, 10.0, 100.0):
        for delta in (1e-5, 1e-8):
            for tr in (
                sp.RandomStoppingPrivacy.from_mean(mean, 0.0),
                sp.RandomStoppingPrivacy.from_mean(mean, 1.0),
                sp.PoissonStoppingPrivacy(mean),
            ):
                rdp = min(r.epsilon for r in accounting.routes(cand, tr, delta, "rdp"))
                # coarse PLD (1e-3 nats): still a valid bound, 10x faster
                prof = totals._profile_route(cands, tr, delta, 1e-3)
                assert prof.epsilon <= rdp, (mean, delta, tr.name)
                assert "Koskela" in prof.theorem


# ----------------------------------------------------------------------- the README setting

README = accounting.DpSgdCandidate(256 / 60000, 7032, 1.1)


def test_readme_setting_logarithmic_takes_the_profile_route():
    tr = sp.RandomStoppingPrivacy.from_mean(10.0, 0.0)
    auto = accounting.total_privacy(README, tr, 1e-5, "auto")
    rdp = accounting.total_privacy(README, tr, 1e-5, "rdp")
    assert rdp.total_epsilon == pytest.approx(3.051, abs=2e-3)  # today's auto (PS Thm 2 by RDP)
    assert auto.total_epsilon == pytest.approx(2.393, abs=5e-3)  # docs/selection.md
    assert auto.total_epsilon <= 0.9 * rdp.total_epsilon  # the target: >= 10% lower
    assert "Koskela" in auto.theorem and "profile" in auto.route


def test_readme_setting_poisson_keeps_the_tighter_thm6_route():
    tr = sp.PoissonStoppingPrivacy(10.0)
    found = accounting.routes(README, tr, 1e-5, "pld")
    profile = [r for r in found if r.theorem and "Koskela" in r.theorem]
    thm6 = [r for r in found if r.theorem is None and r.rdp_order is not None]
    assert len(profile) == 1 and len(thm6) == 1
    assert profile[0].epsilon == pytest.approx(3.27, abs=0.01)  # docs/selection.md
    assert thm6[0].epsilon == pytest.approx(3.245, abs=0.005)
    assert min(r.epsilon for r in found) == thm6[0].epsilon


# ----------------------------------------------------------------------------- input checks


def test_candidate_profile_validates_and_is_monotone():
    with pytest.raises(ValueError, match="start at 0"):
        profiles.CandidateProfile([0.1, 0.2], [0.1, 0.0])
    with pytest.raises(ValueError, match="1-d"):
        profiles.CandidateProfile([0.0], [0.1])
    prof = profiles.CandidateProfile([0.0, 1.0, 2.0], [0.5, 0.6, -1e-15])
    np.testing.assert_array_equal(prof.deltas, [0.6, 0.6, 0.0])  # running max from the right
    # read at the grid point below; negative eps through the complement identity
    assert prof.delta(1.5)[0] == 0.6
    assert prof.delta(-1.0)[0] == pytest.approx(1.0 - math.exp(-1.0) * 0.4)
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        profiles.PoissonStoppingProfile(3.0).delta(-0.1, prof)
    with pytest.raises(ValueError, match="Poisson mean"):
        profiles.PoissonStoppingProfile(0.0)
    with pytest.raises(NotImplementedError, match="profile"):
        sp.ThresholdingPrivacy(0.1).profile_bound()
