"""Every selection theorem, once: how selecting among private candidates transforms their privacy.

Each class is a frozen dataclass describing one theorem as data (see ``docs/architecture.md``).
Given the guarantee of ONE candidate (every candidate must satisfy it; take the worst case over the
search space), it returns the guarantee of the whole selection procedure, which releases only the
selected candidate (or nothing):

* ``pure_dp(epsilon)``: eps-DP candidates -> total eps (pure DP).
* ``rdp(orders, rdp, *, delta_for_epsilon=None)``: the candidate's RDP curve ``rdp[i]`` at Rényi
  order ``orders[i]`` -> the selection's RDP curve at the same orders (``inf`` where no bound
  applies).
* ``approx_dp(epsilon, delta)``: (eps, delta)-DP candidates -> (eps, delta) total.

A method that a theorem does not provide raises ``NotImplementedError`` saying which theorem is
missing; invalid inputs raise ``ValueError`` naming the value. ``NotPrivate`` (the leaky "train all,
release the best" practice) returns ``inf`` everywhere so that it can never yield a finite privacy
number.

References (theorem numbers as in these versions):

* [LT] Liu & Talwar, "Private Selection from Private Candidates", STOC 2019, arXiv:1811.07971.
* [PS] Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022,
  arXiv:2110.03620v2.
* [DR] Dwork & Roth, "The Algorithmic Foundations of Differential Privacy", 2014.
* [M17] Mironov, "Rényi Differential Privacy", CSF 2017.
* [vEH14] van Erven & Harremoës, "Rényi Divergence and Kullback-Leibler Divergence", IEEE T-IT 2014.

The privacy-profile bounds that ``profile_bound()`` returns live in ``selection.profiles``. How
each theorem was checked (independent implementations, exact enumeration, audits, and what could
not be checked against the paper) is in ``docs/selection.md``, "What was verified, and how".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from selection.checks import (
    check_cap,
    check_count,
    check_curve,
    check_delta,
    check_epsilon,
    check_positive,
    monotone_envelope,
    set_frozen,
)
from selection.counts import TnbParameters, TruncatedNegativeBinomial
from selection.profiles import (
    HardCappedRandomStoppingProfile,
    PoissonStoppingProfile,
    ProfileSelectionBound,
    RandomStoppingProfile,
    profile_approx_dp,
    profile_pure_dp,
)

#: A candidate's delta as a function of epsilon (input of the Poisson theorem).
DeltaFn = Callable[[float], float]

__all__ = [
    "PrivacyTransform",
    "RandomStoppingPrivacy",
    "PoissonStoppingPrivacy",
    "ThresholdingPrivacy",
    "HardCappedRandomStoppingPrivacy",
    "BestOfKPrivacy",
    "PercentileSparseVectorPrivacy",
    "AccuracyFirstPrivacy",
    "StabilityValidationPrivacy",
    "SingleRunPrivacy",
    "NotPrivate",
]


class PrivacyTransform:
    """Interface of a selection theorem (all subclasses are frozen dataclasses).

    Attributes (properties): ``name`` (e.g. ``"random_stopping/logarithmic"``), ``theorem`` (paper +
    theorem number), ``is_private`` (False only for `NotPrivate`).
    """

    name: str
    theorem: str
    is_private: bool = True

    def params(self) -> dict:
        """Every input of the theorem, JSON-safe (floats, ints, strings; ``"inf"`` for infinity):
        by default the dataclass's fields."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def pure_dp(self, epsilon: float) -> float:
        """Total epsilon of the selection when every candidate is ``epsilon``-DP."""
        raise NotImplementedError(f"{self.name}: {self.theorem} gives no pure-DP statement")

    def rdp(
        self,
        orders: Sequence[float],
        rdp: Sequence[float],
        *,
        delta_for_epsilon: Callable[[float], float] | None = None,
    ) -> np.ndarray:
        """Total RDP epsilons at ``orders`` given one candidate's RDP epsilons ``rdp`` there.

        The curve is checked (`check_curve`) before a subclass's `_rdp` sees it; a theorem with no
        RDP statement raises NotImplementedError before that.
        """
        if type(self)._rdp is PrivacyTransform._rdp:
            raise NotImplementedError(f"{self.name}: {self.theorem} gives no RDP statement")
        o, r = check_curve(orders, rdp)
        return self._rdp(o, r, delta_for_epsilon)

    def _rdp(self, o: np.ndarray, r: np.ndarray, delta_for_epsilon: DeltaFn | None) -> np.ndarray:
        """`rdp` on a checked curve: orders ``o`` and RDP epsilons ``r``, 1-D of one length."""
        raise NotImplementedError

    def approx_dp(self, epsilon: float, delta: float) -> tuple[float, float]:
        """Total (epsilon, delta) when every candidate is (``epsilon``, ``delta``)-DP."""
        raise NotImplementedError(
            f"{self.name}: {self.theorem} gives no (epsilon, delta) statement"
        )

    def profile_bound(self) -> ProfileSelectionBound:
        """The delta(eps) bound of this selection, given one candidate's privacy profile."""
        raise NotImplementedError(f"{self.name}: no privacy-profile bound is implemented")

    def describe(self) -> dict:
        """``name``, ``theorem``, ``is_private`` and ``params()`` in one JSON-safe dict."""
        return {
            "name": self.name,
            "theorem": self.theorem,
            "is_private": self.is_private,
            "params": self.params(),
        }


# --------------------------------------------------------------------------------------------------
# random stopping


@dataclass(frozen=True)
class RandomStoppingPrivacy(TnbParameters, PrivacyTransform):
    """Best of K ~ D_{eta,gamma} candidates (PS Def. 1); only the best is released.

    * RDP: PS Thm 2. If each candidate is (lambda, eps)- and (lambda_hat, eps_hat)-RDP, the
      selection is (lambda, eps')-RDP with ``eps' = eps + (1 + eta)(1 - 1/lambda_hat) eps_hat + (1 +
      eta) log(1/gamma)/lambda_hat + log(E[K])/(lambda - 1)``. lambda_hat is minimised over the
      given order grid, then the monotone envelope in the order is taken, exactly as dp_accounting
      0.6.0 ``_compute_rdp_repeat_and_select`` does (which accepts eta >= 0 only; here eta in (-1,
      0) is accepted too, as PS Def. 1 and Thm 2 allow).
    * Pure DP: PS Cor. 3, ``(2 + eta) eps``. eta = 1 (geometric) is LT Thm 3.2 (3 eps), eta = 0
      gives 2 eps.

    Args:
      shape: eta in (-1, inf).
      gamma: in (0, 1]. Build from a target mean with `from_mean` or `from_count`.
    """

    @classmethod
    def from_mean(cls, mean: float, shape: float) -> RandomStoppingPrivacy:
        """From E[K] = ``mean`` (>= 1); gamma solved to ~1e-13 relative (`selection.counts`)."""
        count = TruncatedNegativeBinomial.from_mean(mean, shape)
        return cls(count.shape, count.gamma)

    @classmethod
    def from_count(cls, count: TruncatedNegativeBinomial) -> RandomStoppingPrivacy:
        return cls(count.shape, count.gamma)

    @property
    def mean(self) -> float:
        """E[K], the expected number of candidates trained."""
        return self.count.mean

    @property
    def name(self) -> str:
        return f"random_stopping/{self.count.name}"

    @property
    def theorem(self) -> str:
        extra = "; eta=1 is Liu & Talwar 2019, Thm 3.2" if self.shape == 1.0 else ""
        return (
            f"Papernot & Steinke 2022, Thm 2 (RDP) and Cor. 3 (pure DP), "
            f"truncated negative binomial "
            f"eta={self.shape:g}{extra}"
        )

    def params(self) -> dict:
        return {"shape": self.shape, "gamma": self.gamma, "mean": self.mean}

    def profile_bound(self) -> RandomStoppingProfile:
        return RandomStoppingProfile(self.shape, self.gamma)

    def pure_dp(self, epsilon: float) -> float:
        # PS Cor. 3: eps-DP candidates => ((2 + eta) eps)-DP selection (lambda, lambda_hat -> inf in
        # Thm 2).
        return (2.0 + self.shape) * check_epsilon(epsilon)

    def _rdp(self, o: np.ndarray, r: np.ndarray, delta_for_epsilon: DeltaFn | None) -> np.ndarray:
        del delta_for_epsilon  # Thm 2 needs only the RDP curve
        eta, log_mean = self.shape, math.log(self.mean)
        # PS Thm 2, the lambda_hat terms: (1 - 1/lambda_hat) eps_hat + log(1/gamma)/lambda_hat,
        # minimised over the grid. At lambda_hat = 1 the first term is 0 * eps_hat; an infinite
        # eps_hat there means no bound (inf).
        with np.errstate(invalid="ignore"):
            terms = (1.0 - 1.0 / o) * r - math.log(self.gamma) / o
        terms = np.where(np.isinf(r), np.inf, terms)
        c = (1.0 + eta) * np.min(terms)
        out = np.full(o.shape, np.inf)
        above_one = o > 1.0  # Thm 2 needs lambda > 1
        out[above_one] = r[above_one] + log_mean / (o[above_one] - 1.0) + c
        return monotone_envelope(o, out)


@dataclass(frozen=True)
class PoissonStoppingPrivacy(PrivacyTransform):
    """Best of K ~ Poisson(mean) candidates, nothing released when K = 0 (PS Thm 6).

    If each candidate is (lambda, eps)-RDP and (eps_hat, delta_hat)-DP with e^eps_hat <= 1 +
    1/(lambda - 1), the selection is (lambda, eps + mean * delta_hat + log(mean)/(lambda - 1))-RDP.
    As in dp_accounting 0.6.0, eps_hat = log1p(1/(lambda - 1)) (the largest allowed) and delta_hat =
    ``delta_for_epsilon(eps_hat)``, which the caller supplies from the candidate's RDP curve or,
    tighter, from its PLD. No pure-DP statement exists.

    Args:
      mean: E[K] >= 1 (dp_accounting's domain; the log(mean) term is what PS Thm 6 states).
    """

    mean: float

    name = "random_stopping/poisson"
    theorem = "Papernot & Steinke 2022, Thm 6 (Poisson number of candidates)"

    def __post_init__(self) -> None:
        mean = float(self.mean)
        if not (math.isfinite(mean) and mean >= 1.0):
            raise ValueError(f"Poisson mean must be a finite number >= 1, got {self.mean}")
        set_frozen(self, mean=mean)

    @property
    def shape(self) -> float:
        return math.inf

    def params(self) -> dict:
        return {"mean": self.mean, "shape": "inf"}

    def profile_bound(self) -> PoissonStoppingProfile:
        return PoissonStoppingProfile(self.mean)

    def pure_dp(self, epsilon: float) -> float:
        raise NotImplementedError(
            "random_stopping/poisson has no pure-DP statement "
            "(Papernot & Steinke 2022, Thm 6 is RDP only); "
            "use rdp() with the candidate's RDP curve and delta_for_epsilon"
        )

    def _rdp(self, o: np.ndarray, r: np.ndarray, delta_for_epsilon: DeltaFn | None) -> np.ndarray:
        if delta_for_epsilon is None:
            raise ValueError(
                "random_stopping/poisson (Papernot & Steinke 2022, Thm 6) needs delta_for_epsilon: "
                "the single candidate's delta as a function of epsilon "
                "(e.g. dp_accounting.rdp.compute_delta or a PLD)"
            )
        out = np.full(o.shape, np.inf)
        for i, order in enumerate(o):
            if order <= 1.0:
                continue  # Thm 6 needs lambda > 1
            eps_hat = math.log1p(1.0 / (order - 1.0))
            delta_hat = float(delta_for_epsilon(eps_hat))
            if not (0.0 <= delta_hat <= 1.0):
                raise ValueError(
                    f"delta_for_epsilon({eps_hat}) returned {delta_hat}, not a delta in [0, 1]"
                )
            # PS Thm 6. No monotone envelope: dp_accounting applies none, and we reproduce it
            # exactly.
            out[i] = r[i] + self.mean * delta_hat + math.log(self.mean) / (order - 1.0)
        return out


@dataclass(frozen=True)
class HardCappedRandomStoppingPrivacy(PrivacyTransform):
    """LT Alg. 2 (geometric random stopping, stop probability gamma) with a hard cap of T: when T
    candidates have been tried, the best of them is released. K = min(G, T), G ~ Geometric(gamma).

    Every statement here is OURS (derived in this module, tested against exact enumeration of the
    capped procedure in ``tests/selection/test_capped_enumeration.py``), not Liu & Talwar's Thm 3.4
    / 3.5, whose constants could not be read (module docstring):

    * pure DP: ``min(eps + b_max, T eps)`` (`profile_pure_dp` on the capped count's pgf weights;
      T eps is basic composition of the at most T runs, Dwork & Roth 2014, Thm 3.16);
    * (eps1, delta1)-DP candidates: ``(eps1 + b_max(eps1, delta1), E[K] delta1)``
      (`profile_approx_dp`), or composition ``(T eps1, T delta1)`` when its epsilon is smaller;
    * candidates with a privacy profile (a PLD): the profile bound (*) (`profile_bound`).

    Args:
      gamma: stop probability after each candidate, in (0, 1]; E[K] <= 1/gamma.
      max_trials: the cap T >= 1.
    """

    gamma: float
    max_trials: int

    name = "random_stopping/geometric_capped"
    theorem = (
        "best of min(K, T), K geometric: weight-bonus bounds derived in selection.privacy "
        "(pgf representation of Koskela, Redberg & Wang 2024, arXiv:2402.06701), or basic "
        "composition of T runs (Dwork & Roth 2014, Thm 3.16), whichever is smaller"
    )

    def __post_init__(self) -> None:
        gamma, cap = check_cap(self.gamma, self.max_trials)
        set_frozen(self, gamma=gamma, max_trials=cap)

    def profile_bound(self) -> HardCappedRandomStoppingProfile:
        return HardCappedRandomStoppingProfile(self.gamma, self.max_trials)

    def pure_dp(self, epsilon: float) -> float:
        eps = check_epsilon(epsilon)
        return min(profile_pure_dp(self.profile_bound(), eps), self.max_trials * eps)

    def approx_dp(self, epsilon: float, delta: float) -> tuple[float, float]:
        eps1, delta1 = check_epsilon(epsilon), check_delta(delta)
        eps_a, delta_a = profile_approx_dp(self.profile_bound(), eps1, delta1)
        t = self.max_trials
        if t * eps1 < eps_a:  # basic composition of the at most T runs
            return t * eps1, min(1.0, t * delta1)
        return eps_a, delta_a


# --------------------------------------------------------------------------------------------------
# thresholding


@dataclass(frozen=True)
class ThresholdingPrivacy(PrivacyTransform):
    """LT Alg. 1 (thresholding): release the first candidate with score >= threshold.

    Candidates run in order; after each miss, stop (release nothing) with probability gamma;
    optionally release nothing after T candidates.

    * Pure DP: LT Thm 3.1(b): eps1-DP candidates => (2 eps1 + eps0)-DP, for any integer cap T >=
      max(ln(2/eps0)/gamma, 1 + 1/(e gamma)); with no cap, eps0 = 0. Given T we take the smallest
      eps0 the condition allows, eps0 = 2 exp(-gamma T), and reject caps T < 1 + 1/(e gamma)
      (theorem does not apply).
    * RDP (no cap only): PS App. C, Cor. 16 (conditioning a mechanism on an event S),
      ``D_a(Q_S||Q'_S) <= D_a(Q||Q') + ((a - 2)/(a - 1)) D_{a-1}(Q'||Q) + (2/(a - 1)) log(1/Q(S))``.
      Derived application (as in OpenDP): one round maps the candidate's output and an independent
      gamma-coin to "release (x, q)" if q >= threshold, "stop" on a miss with probability gamma,
      "continue" otherwise; this is post-processing of the candidate, so it inherits its RDP curve,
      and Alg. 1 outputs that round conditioned on S = {not continue}, with Q(S) >= gamma on every
      dataset. D_{a-1} is bounded by the candidate's RDP at the smallest grid order >= a - 1
      (monotonicity in the order, [vEH14, Thm 3]; the order a itself always qualifies), and the
      reverse direction D(Q'||Q) by the same curve, since an RDP guarantee holds for every ordered
      pair of neighbours. Orders a < 2 (a - 1 < 1) get no direct bound: they inherit the value of
      the next higher order through the monotone envelope, or inf when the grid has no order >= 2.

    Args:
      gamma: stop probability after each miss, in (0, 1].
      max_trials: optional cap T (integer >= 1 + 1/(e gamma)); None = no cap.
    """

    gamma: float
    max_trials: int | None = None

    theorem = (
        "Liu & Talwar 2019, Thm 3.1(b) (pure DP); "
        "Papernot & Steinke 2022, App. C, Cor. 16 with Q(S) >= gamma (RDP, uncapped only)"
    )

    def __post_init__(self) -> None:
        gamma = float(self.gamma)
        if not (0.0 < gamma <= 1.0):
            raise ValueError(f"gamma (stop probability) must be in (0, 1], got {self.gamma}")
        set_frozen(self, gamma=gamma)
        if self.max_trials is not None:
            if int(self.max_trials) != self.max_trials or self.max_trials < 1:
                raise ValueError(
                    f"max_trials must be None or an integer >= 1, got {self.max_trials}"
                )
            t = int(self.max_trials)
            minimum = 1.0 + 1.0 / (math.e * gamma)
            if t < minimum:
                raise ValueError(
                    f"max_trials={t} is below 1 + 1/(e*gamma) = {minimum:.4g}: Liu & Talwar 2019, "
                    f"Thm 3.1 needs T >= max(ln(2/eps0)/gamma, 1 + 1/(e*gamma)); "
                    f"use max_trials >= {math.ceil(minimum)} or None"
                )
            set_frozen(self, max_trials=t)

    @property
    def eps0(self) -> float:
        """Price of the cap: eps0 = 2 exp(-gamma T), from T >= ln(2/eps0)/gamma (LT Thm 3.1)."""
        if self.max_trials is None:
            return 0.0
        return 2.0 * math.exp(-self.gamma * self.max_trials)

    @property
    def name(self) -> str:
        return "thresholding" if self.max_trials is None else "thresholding/capped"

    def params(self) -> dict:
        t = self.max_trials
        return {"gamma": self.gamma, "max_trials": t if t is not None else "inf", "eps0": self.eps0}

    def pure_dp(self, epsilon: float) -> float:
        # LT Thm 3.1(b): 2 eps1 + eps0.
        return 2.0 * check_epsilon(epsilon) + self.eps0

    def _rdp(self, o: np.ndarray, r: np.ndarray, delta_for_epsilon: DeltaFn | None) -> np.ndarray:
        del delta_for_epsilon
        if self.max_trials is not None:
            raise NotImplementedError(
                "thresholding/capped: no RDP statement for the hard cap "
                "(PS App. C, Cor. 16 covers the uncapped "
                "Alg. 1); use max_trials=None or pure_dp"
            )
        log_inv_q = -math.log(self.gamma)
        out = np.full(o.shape, np.inf)
        for i, a in enumerate(o):
            if a < 2.0:
                continue  # a - 1 < 1: no RDP order to bound D_{a-1}; filled by the envelope below
            # Smallest grid order >= a - 1; never empty, since a itself qualifies.
            higher = np.nonzero(o >= a - 1.0)[0]
            j = higher[np.argmin(o[higher])]
            coef = (a - 2.0) / (a - 1.0)
            reverse = 0.0 if coef == 0.0 else coef * r[j]  # avoid 0 * inf at a = 2
            out[i] = r[i] + reverse + 2.0 * log_inv_q / (a - 1.0)
        return monotone_envelope(o, out)


# --------------------------------------------------------------------------------------------------
# generalized sparse vector


@dataclass(frozen=True)
class PercentileSparseVectorPrivacy(PrivacyTransform):
    """LT §4.1 (Alg. "gensparse0", Thm 4.1): sparse vector over private candidates (exact oracle).

    Candidate i is an eps-DP mechanism Q_i; its percentile p_i(D) = P[score of Q_i(D) >= tau] is
    given exactly (the oracle of LT §4.1). The method tests, in order, ``logit(p_i(D)) + nu_i >=
    logit(target) + rho`` with rho ~ Lap(beta) (drawn once) and nu_i ~ Lap(2 beta), stops at the
    first pass (at most T tests) and releases the index and one sample of Q_i(D) for that index.

    Pure DP, ``(4/beta + 1) eps``, derived as follows (LT's own constants for Thm 4.1(a) are not
    legible in the project's text extraction, so the number is OURS, from two cited results):

    * eps-DP of Q_i gives p(D) <= e^eps p(D') and 1 - p(D) <= e^eps (1 - p(D')), so logit(p_i) =
      log p_i - log(1 - p_i) has sensitivity Delta = 2 eps (LT §4.1: "the difference of two
      eps-Lipschitz functions"; tight at p(D') = 1/(1 + e^eps)).
    * LT §4.1 (proof sketch of Thm 4.1): viewing logit(p_i) as the i-th query and logit(target) as
      the threshold, this IS AboveThreshold, which with threshold noise Lap(2 Delta/e') and query
      noise Lap(4 Delta/e') is e'-DP [DR, Thm 3.23]. With beta = 2 Delta/e': e' = 4 eps / beta.
    * The released sample of Q_i(D) for the selected i is eps-DP given i: adaptive composition
      [DR, Thm 3.16] adds eps.

    The candidates must be PURE eps-DP (the logit argument fails with delta > 0; LT §4.2-4.3 treat
    approximate oracles, Thm 4.4/4.6, whose constants we could not read): no RDP or approx-DP
    statement.

    Args:
      noise_scale: beta > 0, the Laplace scale of the threshold noise in logit units (the query
        noise has scale 2 beta).
      max_trials: T >= 1, the most candidates tested; nothing is released after T misses. T does
        not enter the bound (AboveThreshold's guarantee holds for any number of queries).
    """

    noise_scale: float
    max_trials: int

    name = "sparse_vector"
    theorem = (
        "Liu & Talwar 2019, §4.1 (Alg. gensparse0, Thm 4.1: reduction to AboveThreshold on "
        "logit percentiles, sensitivity 2 eps) with Dwork & Roth 2014, Thm 3.23 and Thm 3.16 "
        "(constants: our derivation)"
    )

    def __post_init__(self) -> None:
        set_frozen(
            self,
            noise_scale=check_positive(self.noise_scale, "noise_scale (beta)"),
            max_trials=check_count(self.max_trials, "max_trials"),
        )

    def index_epsilon(self, epsilon: float) -> float:
        """eps' of the stopping index alone: AboveThreshold with Delta = 2 eps, 4 eps / beta."""
        return 4.0 * check_epsilon(epsilon) / self.noise_scale

    def pure_dp(self, epsilon: float) -> float:
        # AboveThreshold [DR Thm 3.23] on logits (Delta = 2 eps, LT §4.1) + one eps-DP sample
        # of the selected candidate [DR Thm 3.16].
        return self.index_epsilon(epsilon) + check_epsilon(epsilon)


@dataclass(frozen=True)
class AccuracyFirstPrivacy(PrivacyTransform):
    """Ligett, Neel, Roth, Waggoner & Wu 2017 ("Accuracy First", arXiv:1705.10829): an
    InteractiveAboveThreshold test (their Alg. 2, budget eps_A) over a sequence of T private
    hypotheses, releasing the first that passes (and its level) or nothing.

    Ex-post privacy (their Def. 2.2-2.3, Lemma 2.8): the outcome "stopped at level t" has ex-post
    loss ``eps_A + eps(prefix 1..t)``, where eps(prefix) is the DP guarantee of the first t
    hypotheses together. Ex-post privacy is NOT differential privacy at the realised level (their
    remark after Def. 2.3); the only eps-DP statement of the procedure is the maximum over all
    outcomes, ``eps_A + eps(prefix 1..T)``, and that worst case is what ``pure_dp`` / ``rdp``
    return and what dptune charges to a ledger: the ledger reserves a run's charge before any
    private computation, and it composes (eps, delta) guarantees of any runs (Dwork & Roth 2014,
    Thm 3.16), for which the paper gives no ex-post analogue (their Remark 2.9); a refund to the
    realised loss would need a privacy-filter argument that only a pure-DP-only ledger has.

    The prefix guarantee depends on how the hypotheses were made (``sequence``):

    * ``"noise_reduction"``: Laplace noise reduction (their Alg. 1, Thm 2.7): the prefix up to t is
      eps_t-DP, so ``epsilon`` (the candidates' guarantee given to `pure_dp`) is the LAST level
      eps_T and the total is eps_A + eps_T; `ex_post` takes the realised eps_t.
    * ``"independent"``: T independent eps-DP candidates (e.g. DP-SGD runs at a growing budget, or
      any candidate of ``selection``): the prefix up to t is t eps-DP by basic composition [DR Thm
      3.16], so the ex-post loss is eps_A + t eps and the worst case eps_A + T eps. This worst
      case needs no ex-post argument: releasing all T candidates and then running IAT (which IS
      AboveThreshold, [DR Alg. 1, Thm 3.23], eps_A-DP) on them composes adaptively, so it also
      holds in RDP, ``T rdp + eps_A`` at every order (RDP composition [M17, Prop. 1]; an eps_A-DP
      mechanism is (alpha, eps_A)-RDP at every order alpha: its order-infinity divergence is eps_A
      and the Rényi divergence is non-decreasing in the order [vEH14, Thm 3]). That is the route
      for DP-SGD candidates; the ex-post reading (Lemma 2.8) is for pure-DP candidates.

    Args:
      iat_epsilon: eps_A > 0 of the test (threshold noise Lap(2 Delta/eps_A), query noise
        Lap(4 Delta/eps_A) for scores of l1 sensitivity Delta).
      num_levels: T >= 1, the number of hypotheses tested.
      sequence: ``"independent"`` or ``"noise_reduction"`` (see above).
    """

    iat_epsilon: float
    num_levels: int
    sequence: str = "independent"

    def __post_init__(self) -> None:
        e = check_positive(self.iat_epsilon, "iat_epsilon")
        t = check_count(self.num_levels, "max_trials (levels T)")
        if self.sequence not in ("independent", "noise_reduction"):
            raise ValueError(
                f"sequence must be 'independent' or 'noise_reduction', got {self.sequence!r}"
            )
        set_frozen(self, iat_epsilon=e, num_levels=t)

    @property
    def name(self) -> str:
        return f"accuracy_first/{self.sequence}"

    @property
    def theorem(self) -> str:
        if self.sequence == "noise_reduction":
            return (
                "Ligett et al. 2017, Lemma 2.8 (IAT, ex-post eps_A + eps_t) with Thm 2.7 (noise "
                "reduction: prefix eps_t-DP); charged: the worst case eps_A + eps_T"
            )
        return (
            "Ligett et al. 2017, Alg. 2 (IAT = AboveThreshold, Dwork & Roth 2014, Thm 3.23) "
            "composed with the T candidates (Dwork & Roth Thm 3.16; Mironov 2017, Prop. 1); "
            "ex-post eps_A + (t+1) eps for pure-DP candidates (Ligett et al. Lemma 2.8); "
            "charged: the worst case over stopping levels"
        )

    def ex_post(self, epsilon: float, level: int | None) -> float:
        """Realised ex-post loss (Lemma 2.8) of stopping at 0-based ``level`` (None: nothing
        passed, every test ran: the worst case).

        ``epsilon``: for ``"independent"``, each candidate's eps; for ``"noise_reduction"``, the
        realised level's eps_t (with ``level=None``: eps_T)."""
        eps = check_epsilon(epsilon)
        if level is not None and not (0 <= int(level) < self.num_levels):
            raise ValueError(f"level must be in [0, {self.num_levels}), got {level}")
        if self.sequence == "noise_reduction":
            return self.iat_epsilon + eps
        tested = self.num_levels if level is None else int(level) + 1
        return self.iat_epsilon + tested * eps

    def pure_dp(self, epsilon: float) -> float:
        # max over outcomes of Lemma 2.8's ex-post loss (see the class docstring)
        return self.ex_post(epsilon, None)

    def _rdp(self, o: np.ndarray, r: np.ndarray, delta_for_epsilon: DeltaFn | None) -> np.ndarray:
        del delta_for_epsilon
        if self.sequence == "noise_reduction":
            raise NotImplementedError(
                f"{self.name}: noise reduction (Ligett et al. 2017, Thm 2.7) is stated for pure "
                "eps-DP only; give the last level's eps to pure_dp"
            )
        # composition of T candidates [M17 Prop. 1] + the eps_A-DP test at every order
        return self.num_levels * r + self.iat_epsilon


@dataclass(frozen=True)
class StabilityValidationPrivacy(PrivacyTransform):
    """Chaudhuri & Vinterbo 2013 ("A Stability-based Validation Procedure for Differentially
    Private Machine Learning", NeurIPS 2013), Thm 1 and Thm 2: train k candidates (one per
    hyperparameter theta_i, each alpha1-DP), score each EXACTLY on the validation set, release
    ``i* = argmax_i q(h_i, V) + Z_i`` with Z_i ~ Exponential(scale 2 beta / alpha2), and h_{i*}.

    Stability (their Definition; reconstructed from the proofs in their App. 6.4-6.6, the main text
    is not in the project's paper folder): q is (beta1, beta2, delta)-stable for the training
    procedure F(T, theta, alpha1, R) (R ~ G its randomness) when, for R in a set Sigma, a change of
    one training record moves q(F(T, theta, alpha1, R), V) by at most beta1/n and a change of one
    validation record moves it by at most beta2/m; beta = max(beta1/n, beta2/m) (proof of Lemma 1:
    "<= 2 beta1/n <= 2 beta"). Every theorem in their appendix (Thm 4, Thm 6) shows
    P[R_i not in Sigma] <= delta/k per candidate and takes the union over the k candidates.

    * Thm 1 (Lemmas 1-2): given stability, i* is (alpha2, delta)-DP w.r.t. one change in the
      training OR the validation set: conditioned on all R_i in Sigma the score differences move by
      at most 2 beta, and P[Z > g] / P[Z > g + 2 beta] = e^(alpha2) for the exponential noise of
      rate alpha2 / (2 beta) (so the noise scale 2 beta / alpha2 is forced by the proof).
    * Thm 2: the end-to-end procedure (Alg. 2), which also releases h_{i*}, is
      (alpha1 + alpha2, delta)-DP, by composition with the alpha1-DP training (their proof of
      Thm 2). The total does NOT grow with k (only delta does, through the union bound).

    Here ``stability_delta`` is the per-candidate probability P[R_i not in Sigma] and the total
    delta is ``min(1, k * stability_delta)`` (the union bound of their proofs; equal to their delta
    when the per-candidate bound is delta/k, as in their Thm 4 and Thm 6).

    Args:
      validation_epsilon: alpha2 > 0.
      k: number of candidates (hyperparameter values), >= 1.
      stability_delta: per-candidate probability in [0, 1) that the stability bounds fail.
    """

    validation_epsilon: float
    k: int
    stability_delta: float = 0.0

    name = "stability_validation"
    theorem = (
        "Chaudhuri & Vinterbo 2013, Thm 2 (Alg. 2: Thm 1's (alpha2, delta)-DP selection with "
        "exponential noise of scale 2 beta/alpha2, composed with alpha1-DP training); "
        "algorithm and stability definition as reconstructed from their App. 6.4 proofs"
    )

    def __post_init__(self) -> None:
        a = check_positive(self.validation_epsilon, "validation_epsilon (alpha2)")
        d = float(self.stability_delta)
        if not (0.0 <= d < 1.0):
            raise ValueError(f"stability_delta must be in [0, 1), got {self.stability_delta}")
        set_frozen(self, validation_epsilon=a, k=check_count(self.k, "k"), stability_delta=d)

    @property
    def delta(self) -> float:
        """The procedure's delta: the union bound over the k candidates."""
        return min(1.0, self.k * self.stability_delta)

    def selection_dp(self) -> tuple[float, float]:
        """Thm 1: (alpha2, delta) of the selected index alone."""
        return self.validation_epsilon, self.delta

    def pure_dp(self, epsilon: float) -> float:
        if self.stability_delta > 0.0:
            raise NotImplementedError(
                f"{self.name}: with stability_delta > 0 {self.theorem} gives (eps, delta); use "
                "approx_dp(epsilon, 0)"
            )
        return check_epsilon(epsilon) + self.validation_epsilon

    def approx_dp(self, epsilon: float, delta: float) -> tuple[float, float]:
        if check_delta(delta) > 0.0:
            raise NotImplementedError(
                f"{self.name}: Chaudhuri & Vinterbo 2013, Thm 2 assumes alpha1-DP (pure) training"
            )
        return check_epsilon(epsilon) + self.validation_epsilon, self.delta

    def utility_gap(self, beta: float, failure_probability: float) -> float:
        """Thm 3: with probability >= 1 - failure_probability (and stability), the released
        candidate's score is within ``2 beta log(k / failure_probability) / alpha2`` of the best
        (union bound over P[Z_j > t] = exp(-alpha2 t / (2 beta)))."""
        if not (0.0 < failure_probability < 1.0) or not beta > 0:
            raise ValueError("need beta > 0 and failure_probability in (0, 1)")
        return 2.0 * beta * math.log(self.k / failure_probability) / self.validation_epsilon


# --------------------------------------------------------------------------------------------------
# baselines


@dataclass(frozen=True)
class BestOfKPrivacy(PrivacyTransform):
    """Release the best of a fixed number k of candidates, priced by composition over all k.

    Pure and approx DP: basic composition [DR, Thm 3.16]: (k eps, k delta). RDP: composition [M17,
    Prop. 1]: k * rdp. Releasing only the best does not help in the worst case: LT App. B.1 shows
    the k eps bound is tight.
    """

    k: int

    name = "best_of_k"
    theorem = (
        "basic composition (Dwork & Roth 2014, Thm 3.16); "
        "RDP composition (Mironov 2017, Prop. 1); "
        "tight for best-of-k by Liu & Talwar 2019, App. B.1"
    )

    def __post_init__(self) -> None:
        set_frozen(self, k=check_count(self.k, "k"))

    def pure_dp(self, epsilon: float) -> float:
        return self.k * check_epsilon(epsilon)

    def _rdp(self, o: np.ndarray, r: np.ndarray, delta_for_epsilon: DeltaFn | None) -> np.ndarray:
        del delta_for_epsilon
        return self.k * r

    def approx_dp(self, epsilon: float, delta: float) -> tuple[float, float]:
        return self.k * check_epsilon(epsilon), min(1.0, self.k * check_delta(delta))


@dataclass(frozen=True)
class SingleRunPrivacy(PrivacyTransform):
    """One candidate, released as is: the identity transform (no selection)."""

    name = "single_run"
    theorem = "identity (a single candidate; no selection)"

    def pure_dp(self, epsilon: float) -> float:
        return check_epsilon(epsilon)

    def _rdp(self, o: np.ndarray, r: np.ndarray, delta_for_epsilon: DeltaFn | None) -> np.ndarray:
        del delta_for_epsilon
        return r.copy()

    def approx_dp(self, epsilon: float, delta: float) -> tuple[float, float]:
        return check_epsilon(epsilon), check_delta(delta)


@dataclass(frozen=True)
class NotPrivate(PrivacyTransform):
    """Train several candidates and release the best, with their number or scores visible.

    NOT differentially private as a procedure (LT App. B.1: even best-of-k is not better than k eps,
    and revealing the scores or k leaks more). Every method returns infinity, so no finite privacy
    number can come from it.
    """

    is_private: bool = False

    name = "not_private"
    theorem = "none: not differentially private (Liu & Talwar 2019, App. B.1)"

    def __post_init__(self) -> None:
        if self.is_private:
            raise ValueError("NotPrivate cannot be constructed with is_private=True")

    def params(self) -> dict:
        return {}

    def pure_dp(self, epsilon: float) -> float:
        check_epsilon(epsilon)
        return math.inf

    def _rdp(self, o: np.ndarray, r: np.ndarray, delta_for_epsilon: DeltaFn | None) -> np.ndarray:
        del delta_for_epsilon
        return np.full(o.shape, np.inf)

    def approx_dp(self, epsilon: float, delta: float) -> tuple[float, float]:
        check_epsilon(epsilon)
        check_delta(delta)
        return math.inf, 1.0
