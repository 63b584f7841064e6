"""Classical private learners as dptune candidates (NumPy + SciPy, no JAX): the candidates of
Ligett et al. 2017 and Chaudhuri & Vinterbo 2013.

* `ridge`: ridge regression by covariance perturbation (sufficient-statistics perturbation): the
  upper triangle of X^T X and X^T y, released with Laplace (rows clipped to ||x||_1 <= 1, |y| <= 1:
  l1 sensitivity 2) or Gaussian noise (rows clipped to ||x||_2 <= 1: l2 sensitivity sqrt(2));
  then theta = (A_hat + lambda n I)^-1 b_hat (post-processing).
* `logistic_output_perturbation`: L2-regularised logistic regression, exact minimiser w* of
  lambda/2 ||w||^2 + (1/n) sum log(1 + exp(-y w.x)) with ||x||_2 <= 1, plus noise
  (Chaudhuri, Monteleoni & Sarwate 2011, §3, Alg. 1: the l2 sensitivity of w* is 2/(n lambda) for
  a 1-Lipschitz loss, a lambda-strongly convex objective and ||x|| <= 1, as Chaudhuri & Vinterbo
  2013 App. 6.5 Eq. 14 also use; with the PUBLIC n in the objective, adding or removing a record
  moves w* by even less, 1/(n lambda), by the same strong-convexity argument; we use 2/(n lambda)).
  DEVIATION, on the safe side: CMS add noise with density proportional to exp(-eps ||b||_2 /
  Delta_2); we add i.i.d. Laplace per coordinate calibrated to the l1 bound sqrt(d) Delta_2, so that
  the mechanism IS a Laplace mechanism and dp_accounting's LaplaceDpEvent describes it exactly
  (an arbitrary eps-DP mechanism can have a larger Rényi divergence than Laplace's at the same eps,
  e.g. randomised response, so declaring CMS's noise as a Laplace event would be wrong in RDP).
* `histogram_density`: Chaudhuri & Vinterbo 2013, Alg. 5: counts of 1/h equal bins on [0, 1) plus
  Laplace noise, clipped at 0, normalised to a density. Adding or removing one sample moves one
  count by 1 (l1 sensitivity 1).

`ridge_trainer`, `logistic_trainer`, `histogram_trainer` wrap them as `FunctionTrainer`s (their
``train`` and ``val`` must be split per record, e.g. by ``dptune.Dataset.from_arrays``, not by
position: a positional cut moves a record across when one is added before it): the
candidate's privacy is a dp_accounting event (training on the training split; the validation
score, privatised with Laplace noise on the validation split, in parallel: per-record disjoint
splits), ``privacy_fields`` and ``calibrated_field`` are declared, and sizes are PUBLIC (nominal)
sizes. Hyperparameter ``noise_multiplier`` is the noise scale in units of the sensitivity
(Laplace: scale / Delta_1, eps = 1 / noise_multiplier; Gaussian: std / Delta_2).

Adjacency: add/remove one record (dptune's default). The trainers refuse replace-one
(`check_adjacency`): the constants above are for add/remove. A record with a NaN or infinite
feature or label (which no clipping bounds) is left out on its own, by the mechanisms and the
trainers alike (a per-record filter: adding or removing one record changes nothing else); labels
are read as ``y > 0`` (+1) or not (-1), so {-1, +1}, {0, 1} and booleans all work.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import sys
from collections.abc import Mapping
from typing import Any, ClassVar, NoReturn

import numpy as np
from dp_accounting import dp_event
from scipy import optimize

import dptune
from dptune import space
from dptune.accounting.events import EventCandidate
from dptune.data import MNIST_10K_DIR, MNIST_10K_NUM_TRAIN
from dptune.errors import TuningConfigError
from dptune.learners.fisher import flat_rows
from dptune.trainer_protocol import FunctionTrainer, public_size
from selection import RandomStopping
from selection.checks import check_positive

log = logging.getLogger("dptune")

__all__ = [
    "clip_rows",
    "histogram_density",
    "histogram_score",
    "histogram_trainer",
    "logistic_output_perturbation",
    "logistic_sensitivity",
    "logistic_trainer",
    "ridge",
    "ridge_statistics",
    "ridge_trainer",
]

#: ||x||_1 <= 1, |y| <= 1: sum_{i<=j} |x_i x_j| <= ||x||_1^2 <= 1, plus ||x y||_1 <= 1.
RIDGE_L1_SENSITIVITY = 2.0
#: ||x||_2 <= 1, |y| <= 1: ||upper(x x^T)||_2 <= ||x||_2^2 <= 1, plus ||x y||_2 <= 1, in quadrature.
RIDGE_L2_SENSITIVITY = math.sqrt(2.0)


def finite_records(x: np.ndarray, y: np.ndarray | None = None) -> np.ndarray:
    """(n,) bool: record i's features (and label) are all finite. Record i's entry depends on
    record i alone, so keeping only these records is a per-record filter (no privacy cost)."""
    keep = np.isfinite(flat_rows(x)).all(axis=1)
    if y is not None:
        keep &= np.isfinite(np.asarray(y, dtype=np.float64))
    return keep


def clip_rows(x: np.ndarray, norm: str) -> np.ndarray:
    """Rows scaled down to l1 (``"l1"``) or l2 (``"l2"``) norm <= 1 (a per-record map: no
    privacy cost)."""
    x = np.asarray(x, dtype=np.float64)
    n = np.abs(x).sum(axis=1) if norm == "l1" else np.linalg.norm(x, axis=1)
    return x / np.maximum(n, 1.0)[:, None]


def ridge_statistics(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """[upper triangle of X^T X (row-major, diagonal included), X^T y] of already clipped rows and
    labels in [-1, 1]; a sum over records, so one record adds its own term."""
    d = x.shape[1]
    iu = np.triu_indices(d)
    return np.concatenate([(x.T @ x)[iu], x.T @ np.clip(y, -1.0, 1.0)])


def _solve_ridge(stats: np.ndarray, d: int, reg: float, n_public: int) -> np.ndarray:
    iu = np.triu_indices(d)
    a = np.zeros((d, d))
    a[iu] = stats[: len(iu[0])]
    a = a + np.triu(a, 1).T
    b = stats[len(iu[0]) :]
    try:
        return np.linalg.solve(a + reg * n_public * np.eye(d), b)
    except np.linalg.LinAlgError:
        return np.full(d, np.nan)


def ridge(
    x: np.ndarray,
    y: np.ndarray,
    noise_multiplier: float,
    regularization: float,
    n_public: int,
    rng: np.random.Generator,
    mechanism: str = "laplace",
) -> np.ndarray:
    """Ridge regression by covariance perturbation; returns theta (shape (d,)).

    ``mechanism="laplace"``: rows clipped to l1 <= 1, Laplace(noise_multiplier x 2) per statistic:
    (1/noise_multiplier)-DP (Laplace mechanism, Dwork, McSherry, Nissim & Smith 2006).
    ``"gaussian"``: rows clipped to l2 <= 1, N(0, (noise_multiplier x sqrt 2)^2): the Gaussian
    mechanism with noise multiplier ``noise_multiplier``.
    """
    keep = finite_records(x, y)  # no clipping bounds a NaN record: it is left out on its own
    x, y = np.asarray(x, dtype=np.float64)[keep], np.asarray(y, dtype=np.float64)[keep]
    if mechanism == "laplace":
        xc = clip_rows(x, "l1")
        s = ridge_statistics(xc, y)
        s = s + rng.laplace(0.0, noise_multiplier * RIDGE_L1_SENSITIVITY, size=s.shape)
    elif mechanism == "gaussian":
        xc = clip_rows(x, "l2")
        s = ridge_statistics(xc, y)
        s = s + rng.normal(0.0, noise_multiplier * RIDGE_L2_SENSITIVITY, size=s.shape)
    else:
        raise ValueError(f"mechanism must be 'laplace' or 'gaussian', got {mechanism!r}")
    return _solve_ridge(s, x.shape[1], regularization, n_public)


def _logistic_minimiser(x: np.ndarray, y: np.ndarray, reg: float, n_public: int) -> np.ndarray:
    """argmin_w reg/2 ||w||^2 + (1/n_public) sum_i log(1 + exp(-y_i w.x_i)) (strongly convex)."""

    def f(w):
        m = y * (x @ w)
        loss = np.logaddexp(0.0, -m).sum() / n_public + 0.5 * reg * w @ w
        grad = -(x.T @ (y * 0.5 * (1.0 - np.tanh(0.5 * m)))) / n_public + reg * w
        return loss, grad

    res = optimize.minimize(
        f, np.zeros(x.shape[1]), jac=True, method="L-BFGS-B", options={"gtol": 1e-10, "ftol": 0}
    )
    return res.x


def logistic_sensitivity(regularization: float, n_public: int, dim: int) -> float:
    """l1 sensitivity bound sqrt(d) x 2/(n lambda) of the minimiser (CMS 2011 §3: l2 bound
    2/(n lambda) for a 1-Lipschitz loss and ||x|| <= 1; l1 <= sqrt(d) l2)."""
    return math.sqrt(dim) * 2.0 / (n_public * regularization)


def logistic_output_perturbation(
    x: np.ndarray, y: np.ndarray, noise_multiplier: float, regularization: float, n_public: int,
    rng: np.random.Generator,
) -> np.ndarray:  # fmt: skip
    """w* + Laplace(noise_multiplier x `logistic_sensitivity`) per coordinate; rows clipped to
    ||x||_2 <= 1, labels read as y > 0 (+1) or not (-1), records with a non-finite feature or
    label left out: (1/noise_multiplier)-DP."""
    keep = finite_records(x, y)
    x, y = np.asarray(x, dtype=np.float64)[keep], np.asarray(y, dtype=np.float64)[keep]
    xc = clip_rows(x, "l2")
    yy = np.where(np.asarray(y) > 0, 1.0, -1.0)
    w = _logistic_minimiser(xc, yy, regularization, n_public)
    scale = noise_multiplier * logistic_sensitivity(regularization, n_public, x.shape[1])
    return w + rng.laplace(0.0, scale, size=w.shape)


def histogram_density(
    z: np.ndarray, bins: int, noise_multiplier: float, rng: np.random.Generator
) -> np.ndarray:
    """Chaudhuri & Vinterbo 2013, Alg. 5: density values (shape (bins,)) on [0, 1): counts +
    Laplace(noise_multiplier), clipped at 0, normalised (a uniform density if all are 0).
    (1/noise_multiplier)-DP for add/remove (Alg. 5's 2R/alpha is noise_multiplier = 2/alpha).
    Values are clipped to [0, 1); a NaN value is left out on its own."""
    z = _unit_values(z)
    counts = np.bincount((z * bins).astype(int), minlength=bins).astype(np.float64)
    noisy = np.maximum(counts + rng.laplace(0.0, noise_multiplier, size=bins), 0.0)
    total = noisy.sum()
    return noisy / total * bins if total > 0 else np.ones(bins)


def _unit_values(z: np.ndarray) -> np.ndarray:
    """The values of ``z`` (n,) clipped to [0, 1) (infinities to the ends; NaN left out,
    each value on its own)."""
    z = np.asarray(z, dtype=np.float64).reshape(-1)
    return np.clip(z[~np.isnan(z)], 0.0, np.nextafter(1.0, 0.0))


def histogram_score(density: np.ndarray, v: np.ndarray) -> float:
    """Chaudhuri & Vinterbo 2013, Eq. 6: -int f^2 + (2/m) sum_j f(v_j) (higher is better)."""
    bins = len(density)
    v = _unit_values(v)
    return float(-np.sum(density**2) / bins + 2.0 * np.mean(density[(v * bins).astype(int)]))


# --------------------------------------------------------------------------------------------------
# dptune trainers


def _refuse_replace_one(adjacency: str) -> None:
    if adjacency != "add_remove":
        raise TuningConfigError(
            f"the classical trainers' sensitivities are for add/remove adjacency; got {adjacency!r}"
        )


def _float_array(arg: str, a: Any, what: str) -> np.ndarray:
    """``a`` as a float64 array; strings or objects that are not numbers are one
    TuningConfigError naming ``arg`` (a check of the data's schema, not of its records)."""
    a = np.asarray(a)
    if a.dtype.kind not in "biuf":
        try:
            a = a.astype(np.float64)
        except (TypeError, ValueError):
            raise TuningConfigError(
                f"{arg}: the {what} have dtype {a.dtype}, not numbers; encode them as numbers "
                "(labels: y > 0 is the positive class, anything else the negative one)"
            ) from None
    return a.astype(np.float64)


def _xy(arg: str, xy: Any, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A factory's ``train=`` / ``val=``: ``(x (n, d), y (n,))`` as float64 arrays; a malformed
    one is one TuningConfigError naming ``arg`` and the fix (dtype, ndim, width and equal lengths
    are the data's schema: checking them depends on no single record)."""
    if not (isinstance(xy, (tuple, list)) and len(xy) == 2):
        raise TuningConfigError(
            f"{arg}= must be a pair (x, y) of arrays (x of shape (n, d), y of shape (n,)), got "
            f"{type(xy).__name__}"
        )
    x, y = _float_array(arg, xy[0], "features x"), _float_array(arg, xy[1], "labels y")
    if x.ndim != 2:
        raise TuningConfigError(
            f"{arg}=(x, y): x has shape {x.shape}; it must be (n, d), one row per record "
            "(x.reshape(len(x), -1) flattens images, x[:, None] makes one feature a column)"
        )
    if y.ndim != 1 or len(y) != len(x):
        raise TuningConfigError(
            f"{arg}=(x, y): y has shape {y.shape} and x {x.shape}; y must be (n,), one label per "
            "row of x"
        )
    if width is not None and x.shape[1] != width:
        raise TuningConfigError(
            f"val=(x, y): x has {x.shape[1]} features per row, the training rows {width}; "
            "both splits must hold the same features"
        )
    return x, y


def _values(arg: str, z: Any) -> np.ndarray:
    """A histogram factory's ``train=`` / ``val=``: values (n,) in [0, 1], float64."""
    z = _float_array(arg, z, "values")
    if z.ndim != 1:
        raise TuningConfigError(
            f"{arg}= has shape {z.shape}: the histogram takes one value per record, shape (n,) "
            "(z.ravel() if it is a column)"
        )
    return z


def _positive(arg: str, v: Any, what: str) -> float:
    """``v`` as a finite float > 0 (``selection.checks.check_positive``, a bool or a string
    refused too); anything else is one TuningConfigError naming ``arg``."""
    try:
        if not isinstance(v, (bool, str)):
            return check_positive(v, arg)
    except ValueError:
        pass
    raise TuningConfigError(f"{arg}={v!r} must be a finite number > 0 ({what})")


def _kept(x: np.ndarray, y: np.ndarray | None, split: str, dropped: dict[str, int]):
    """The records of one split with every feature (and label) finite, each judged on its own;
    the number left out goes to ``dropped`` (PRIVATE: the curator's view, never released)."""
    keep = finite_records(x, y) if x.ndim == 2 else ~np.isnan(x)
    if not keep.all():
        dropped[f"non_finite_{split}_records"] = int((~keep).sum())
        # no count on the console (a statistic of the private records): the curator's view has it
        log.warning("%s records with a NaN or infinite feature or label are left out, each on "
                    "its own (how many: the curator's view, `dptune inspect`)", split)  # fmt: skip
    return (x[keep], None if y is None else y[keep])


def _accuracy_score(w, xv, yv, score_noise: float, m_public: int, rng) -> float:
    """Validation accuracy count + Laplace(score_noise) (count sensitivity 1), / public m."""
    if not np.all(np.isfinite(w)):
        return math.nan
    correct = float(np.sum(np.sign(xv @ w) == np.where(yv > 0, 1.0, -1.0)))
    return (correct + rng.laplace(0.0, score_noise)) / m_public


@dataclasses.dataclass
class _Trainer(FunctionTrainer):
    #: the hyperparameters ``fn`` reads besides ``noise_multiplier`` (checked before any run)
    fields: tuple[str, ...] = ()
    #: records left out, by reason (PRIVATE counts: ``dptune inspect`` only)
    sanitized: dict[str, int] = dataclasses.field(default_factory=dict)
    #: the factory's keyword of the validation count's Laplace noise (refusals name it)
    score_noise_field: ClassVar[str] = "score_noise_multiplier"

    def check_adjacency(self, adjacency: str) -> None:
        _refuse_replace_one(adjacency)

    def check_inputs(self, hparams: Mapping[str, Any]) -> None:
        """Refuses, before any private computation, a space whose candidates ``fn`` cannot train:
        a missing or unknown field, ``regularization`` not > 0, ``bins`` not an integer >= 1."""
        takes = ("noise_multiplier", *self.fields)
        unknown = sorted(set(hparams) - set(takes))
        if unknown:
            raise TuningConfigError(
                f"{self.name} takes the hyperparameters {', '.join(takes)}; remove "
                f"{', '.join(unknown)} from the space"
            )
        for name in self.fields:
            if name not in hparams:
                example = ("space.choice(8, 16, 32)" if name == "bins"
                           else "space.log_uniform(1e-3, 1.0)")  # fmt: skip
                raise TuningConfigError(
                    f"{self.name} needs {name} in the space, e.g. {name}={example}"
                )
        if "regularization" in self.fields:
            _positive("regularization", hparams["regularization"], "the L2 penalty lambda")
        if "bins" in self.fields:
            b = hparams["bins"]
            try:
                ok = not isinstance(b, (bool, str)) and int(b) == b and b >= 1
            except (TypeError, ValueError, OverflowError):  # None, NaN, inf
                ok = False
            if not ok:
                raise TuningConfigError(f"bins={b!r} must be an integer >= 1 (the bin count)")

    def curator_view(self) -> dict[str, int]:
        return dict(self.sanitized)

    def privacy_checks(self) -> list[str]:
        """dptune's own learner: nothing is taken on a user's word."""
        return [
            f"{self.name} is dptune's own code (dptune/learners/classical.py): noise calibrated "
            "to the stated sensitivities of clipped records (tests/dptune/learners), and a "
            "Laplace-noised validation count on a disjoint validation split"
        ]

    def taken_on_word(self) -> list[str]:
        return []


def _privacy_of(label: str, score_noise_multiplier: float, mechanism: str = "laplace"):
    """``hp -> EventCandidate``: the training mechanism (Laplace or Gaussian with the drawn
    ``noise_multiplier``, a noise scale in units of the sensitivity: module docstring) in
    parallel with the Laplace noisy validation score (the disjoint validation split)."""

    def privacy(hp: Mapping[str, Any]) -> EventCandidate:
        if "noise_multiplier" not in hp:
            raise TuningConfigError(
                f"{label} needs noise_multiplier in the space: 'auto' (calibrated to the budget) "
                "or a number > 0"
            )
        nm = _positive("noise_multiplier", hp["noise_multiplier"],
                       "the noise scale in units of the sensitivity, or 'auto'")  # fmt: skip
        ev = dp_event.LaplaceDpEvent(nm) if mechanism == "laplace" else dp_event.GaussianDpEvent(nm)
        return EventCandidate(ev, (dp_event.LaplaceDpEvent(score_noise_multiplier),), label=label)

    return privacy


def _fingerprint(*splits: tuple[np.ndarray, np.ndarray | None]) -> str:
    """The private data's id in the budget ledger: its records as a multiset (sha256 of the
    sorted per-record digests of features and label, float64), so neither another order nor
    another train/validation split of the same records opens a fresh budget."""
    digests: list[bytes] = []
    for x, y in splits:
        rows = flat_rows(x)
        if y is not None:
            rows = np.concatenate([rows, y.reshape(len(y), 1)], axis=1)
        digests += [hashlib.sha256(np.ascontiguousarray(r).tobytes()).digest() for r in rows]
    h = hashlib.sha256(b"dptune/classical/v2")
    for d in sorted(digests):
        h.update(d)
    return h.hexdigest()


def _make(fn, privacy, n_train: int, name: str, fields: tuple[str, ...], data: tuple,
          dropped: dict[str, int]) -> FunctionTrainer:  # fmt: skip
    return _Trainer(
        fn,
        privacy,
        num_examples=n_train,
        fingerprint=_fingerprint(*data),
        name=name,
        privacy_fields=("noise_multiplier",),
        calibrated_field="noise_multiplier",
        score_kind="covered",  # the Laplace-noised validation count is a parallel branch
        fields=fields,
        sanitized=dropped,
    )


def _common(n_public: Any, m_public: Any, score_noise_multiplier: Any) -> tuple[int, float, float]:
    """The factories' public sizes and score noise, checked (one TuningConfigError each)."""
    n = public_size(n_public, "n_public")
    # an expected size may be fractional (Dataset.public_num_val = fraction x declared size)
    m = _positive("m_public", m_public, "the PUBLIC expected number of validation records")
    s = _positive("score_noise_multiplier", score_noise_multiplier,
                  "the Laplace scale, in counts, of the noise on the validation count")  # fmt: skip
    return n, m, s


def _labelled(train: Any, val: Any) -> tuple[tuple, tuple, tuple, dict[str, int]]:
    """Checked ``(train, val)`` of a labelled factory, their finite records, their raw records
    (for the fingerprint) and what was left out."""
    xt, yt = _xy("train", train)
    xv, yv = _xy("val", val, xt.shape[1])
    dropped: dict[str, int] = {}
    return _kept(xt, yt, "train", dropped), _kept(xv, yv, "val", dropped), \
        ((xt, yt), (xv, yv)), dropped  # fmt: skip


def ridge_trainer(
    train: tuple[np.ndarray, np.ndarray],
    val: tuple[np.ndarray, np.ndarray],
    n_public: int,
    m_public: int,
    score_noise_multiplier: float,
    mechanism: str = "laplace",
) -> FunctionTrainer:
    """Ridge by covariance perturbation as a dptune trainer for binary labels (read as y > 0:
    +1, else -1; hyperparameters: ``noise_multiplier``, ``regularization``); score: noisy
    validation accuracy. Privacy: the Laplace (or Gaussian) mechanism on the statistics, in
    parallel with Laplace(score_noise_multiplier) on the validation count."""
    if mechanism not in ("laplace", "gaussian"):
        raise TuningConfigError(f"mechanism={mechanism!r} must be 'laplace' or 'gaussian'")
    n, m, snm = _common(n_public, m_public, score_noise_multiplier)
    (xt, yt), (xv, yv), raw, dropped = _labelled(train, val)
    yt = np.where(yt > 0, 1.0, -1.0)
    xv_c = clip_rows(xv, "l1" if mechanism == "laplace" else "l2")

    privacy = _privacy_of(f"ridge/{mechanism}", snm, mechanism)

    def fn(hp, rng):
        w = ridge(xt, yt, hp["noise_multiplier"], hp["regularization"], n, rng, mechanism)
        return _accuracy_score(w, xv_c, yv, snm, m, rng), {"w": w}

    return _make(fn, privacy, n, f"ridge covariance perturbation ({mechanism})",
                 ("regularization",), raw, dropped)  # fmt: skip


def logistic_trainer(
    train: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray], n_public: int,
    m_public: int, score_noise_multiplier: float,
) -> FunctionTrainer:  # fmt: skip
    """Logistic regression by output perturbation as a dptune trainer for binary labels (read as
    y > 0: +1, else -1; hyperparameters: ``noise_multiplier``, ``regularization``); score: noisy
    validation accuracy."""
    n, m, snm = _common(n_public, m_public, score_noise_multiplier)
    (xt, yt), (xv, yv), raw, dropped = _labelled(train, val)
    xv_c = clip_rows(xv, "l2")

    privacy = _privacy_of("logistic output perturbation", snm)

    def fn(hp, rng):
        w = logistic_output_perturbation(
            xt, yt, hp["noise_multiplier"], hp["regularization"], n, rng
        )
        return _accuracy_score(w, xv_c, yv, snm, m, rng), {"w": w}

    return _make(fn, privacy, n, "logistic output perturbation", ("regularization",), raw,
                 dropped)  # fmt: skip


def histogram_trainer(
    train: np.ndarray, val: np.ndarray, n_public: int, m_public: int, score_noise_multiplier: float
) -> FunctionTrainer:
    """DP histogram density (Chaudhuri & Vinterbo Alg. 5) as a dptune trainer on values (n,) in
    [0, 1] (hyperparameters: ``noise_multiplier``, ``bins``). Score: Eq. 6 with Laplace noise on
    sum_j f(v_j), whose sensitivity is max f <= bins (a density of mass 1 on bins of width
    1/bins)."""
    n, m, snm = _common(n_public, m_public, score_noise_multiplier)
    zt, zv = _values("train", train), _values("val", val)
    dropped: dict[str, int] = {}
    raw = ((zt, None), (zv, None))
    zt, zv = _kept(zt, None, "train", dropped)[0], _unit_values(_kept(zv, None, "val", dropped)[0])

    privacy = _privacy_of("histogram density", snm)

    def fn(hp, rng):
        bins = int(hp["bins"])
        f = histogram_density(zt, bins, hp["noise_multiplier"], rng)
        total = f[(zv * bins).astype(int)].sum() + rng.laplace(0.0, snm * bins)
        return float(-np.sum(f**2) / bins + 2.0 * total / m), {"density": f}

    return _make(fn, privacy, n, "histogram density", ("bins",), raw, dropped)


# ------------------------------------------------------------------------------------------------
# command line: one private tuning run of a classical learner on the shipped MNIST-10k


def _refuse(message: str) -> NoReturn:
    """The command's refusal: one ``dptune: refused:`` line on stderr, exit code 2."""
    print(f"dptune: refused: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m dptune.learners.classical [--learner=logistic|ridge] [--epsilon=1] [--seed=N]``.

    Tunes the learner's regularisation (log-uniform on [1e-3, 1]) with random stopping
    (logarithmic count, mean 4; Papernot & Steinke 2022) on the shipped MNIST-10k, binary task
    digits 0-4 (+1) vs 5-9 (-1), 49 features (4x4 average-pooled pixels), for a total budget
    (epsilon, 1e-5); ``noise_multiplier`` is calibrated to it (tightest valid route). Prints
    the released hyperparameters, the released (noisy) validation score and the privacy
    statement, nothing else. Randomness from OS entropy unless ``--seed`` is given. Returns the
    printed dict.
    """
    # heavy (JAX): the per-record split of the shipped data comes with the DP-SGD learner, the one
    # dptune module that reaches trainers/; only this command line needs it
    from dptune.learners.dpsgd import load_dataset

    ap = argparse.ArgumentParser(
        prog="python -m dptune.learners.classical", description=main.__doc__
    )
    ap.add_argument("--learner", choices=("logistic", "ridge"), default="logistic")
    ap.add_argument("--epsilon", type=float, default=1.0, help="total epsilon (delta = 1e-5)")
    ap.add_argument("--seed", type=int, default=None, help="debugging only: a fixed seed")
    ap.error = _refuse  # type: ignore[method-assign]  # one line, not argparse's usage + error
    args = ap.parse_args(argv)
    if not (math.isfinite(args.epsilon) and args.epsilon > 0):
        _refuse(f"--epsilon={args.epsilon} must be a finite number > 0 (the total budget)")
    d = load_dataset(
        "mnist", str(MNIST_10K_DIR), validation_size=1000, source="idx",
        num_examples=MNIST_10K_NUM_TRAIN,
    )  # fmt: skip

    def features(x: np.ndarray) -> np.ndarray:
        return x.reshape(-1, 7, 4, 7, 4).mean(axis=(2, 4)).reshape(-1, 49).astype(np.float64)

    def labels(y: np.ndarray) -> np.ndarray:
        return np.where(y < 5, 1.0, -1.0)

    train = (features(d.train_x), labels(d.train_y))
    val = (features(d.val_x), labels(d.val_y))
    n, m = int(d.public_num_train), int(d.public_num_val)
    if args.learner == "logistic":
        trainer = logistic_trainer(train, val, n, m, score_noise_multiplier=10.0)
    else:
        trainer = ridge_trainer(train, val, n, m, score_noise_multiplier=10.0)
    try:
        release = dptune.tune(
            trainer,
            {"regularization": space.log_uniform(1e-3, 1.0), "noise_multiplier": "auto"},
            RandomStopping.logarithmic(4),
            (args.epsilon, 1e-5),
            seed=args.seed,
            progress=False,
        )
    except dptune.Refused as e:  # e.g. an --epsilon no noise meets; nothing ran or was charged
        _refuse(str(e))
    out = {
        "learner": args.learner,
        "released": release.released,
        "hparams": release.hparams,
        "validation_score": release.validation_score,
        "total_epsilon": release.privacy["total_epsilon"],
        "delta": release.privacy["delta"],
        "theorem": release.privacy["theorem"],
    }
    print(json.dumps(out, default=float))
    return out


if __name__ == "__main__":
    main()
