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

`ridge_trainer`, `logistic_trainer`, `histogram_trainer` wrap them as `FunctionTrainer`s: the
candidate's privacy is a dp_accounting event (training on the training split; the validation
score, privatised with Laplace noise on the validation split, in parallel: per-record disjoint
splits), ``privacy_fields`` and ``calibrated_field`` are declared, and sizes are PUBLIC (nominal)
sizes. Hyperparameter ``noise_multiplier`` is the noise scale in units of the sensitivity
(Laplace: scale / Delta_1, eps = 1 / noise_multiplier; Gaussian: std / Delta_2).

Adjacency: add/remove one record (dptune's default). The trainers refuse replace-one
(`check_adjacency`): the constants above are for add/remove.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from dp_accounting import dp_event
from scipy import optimize

import dptune
from dptune import space
from dptune.accounting.events import EventCandidate
from dptune.data import MNIST_10K_DIR, MNIST_10K_NUM_TRAIN
from dptune.errors import TuningConfigError
from dptune.trainer_protocol import FunctionTrainer
from selection import RandomStopping

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
    ||x||_2 <= 1, labels in {-1, +1}: (1/noise_multiplier)-DP."""
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
    (1/noise_multiplier)-DP for add/remove (Alg. 5's 2R/alpha is noise_multiplier = 2/alpha)."""
    z = np.clip(np.asarray(z, dtype=np.float64), 0.0, np.nextafter(1.0, 0.0))
    counts = np.bincount((z * bins).astype(int), minlength=bins).astype(np.float64)
    noisy = np.maximum(counts + rng.laplace(0.0, noise_multiplier, size=bins), 0.0)
    total = noisy.sum()
    return noisy / total * bins if total > 0 else np.ones(bins)


def histogram_score(density: np.ndarray, v: np.ndarray) -> float:
    """Chaudhuri & Vinterbo 2013, Eq. 6: -int f^2 + (2/m) sum_j f(v_j) (higher is better)."""
    bins = len(density)
    v = np.clip(np.asarray(v, dtype=np.float64), 0.0, np.nextafter(1.0, 0.0))
    return float(-np.sum(density**2) / bins + 2.0 * np.mean(density[(v * bins).astype(int)]))


# --------------------------------------------------------------------------------------------------
# dptune trainers


def _refuse_replace_one(adjacency: str) -> None:
    if adjacency != "add_remove":
        raise TuningConfigError(
            f"the classical trainers' sensitivities are for add/remove adjacency; got {adjacency!r}"
        )


def _accuracy_score(w, xv, yv, score_noise: float, m_public: int, rng) -> float:
    """Validation accuracy count + Laplace(score_noise) (count sensitivity 1), / public m."""
    if not np.all(np.isfinite(w)):
        return math.nan
    correct = float(np.sum(np.sign(xv @ w) == np.where(yv > 0, 1.0, -1.0)))
    return (correct + rng.laplace(0.0, score_noise)) / m_public


class _Trainer(FunctionTrainer):
    def check_adjacency(self, adjacency: str) -> None:
        _refuse_replace_one(adjacency)

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
        nm = float(hp["noise_multiplier"])
        ev = dp_event.LaplaceDpEvent(nm) if mechanism == "laplace" else dp_event.GaussianDpEvent(nm)
        return EventCandidate(ev, (dp_event.LaplaceDpEvent(score_noise_multiplier),), label=label)

    return privacy


def _fingerprint(*arrays: Any) -> str:
    """The private data's id in the budget ledger: sha256 of the arrays (dtype, shape, bytes)."""
    h = hashlib.sha256(b"dptune/classical/v1")
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _make(fn, privacy, n_train: int, name: str, data: tuple) -> FunctionTrainer:
    return _Trainer(
        fn,
        privacy,
        num_examples=n_train,
        fingerprint=_fingerprint(*data),
        name=name,
        privacy_fields=("noise_multiplier",),
        calibrated_field="noise_multiplier",
        score_kind="covered",  # the Laplace-noised validation count is a parallel branch
    )


def ridge_trainer(
    train: tuple[np.ndarray, np.ndarray],
    val: tuple[np.ndarray, np.ndarray],
    n_public: int,
    m_public: int,
    score_noise_multiplier: float,
    mechanism: str = "laplace",
) -> FunctionTrainer:
    """Ridge by covariance perturbation as a dptune trainer for binary labels y in {-1, +1}
    (hyperparameters: ``noise_multiplier``, ``regularization``); score: noisy validation
    accuracy. Privacy: the Laplace (or Gaussian) mechanism on the statistics, in parallel with
    Laplace(score_noise_multiplier) on the validation count."""
    (xt, yt), (xv, yv) = train, val

    privacy = _privacy_of(f"ridge/{mechanism}", score_noise_multiplier, mechanism)

    def fn(hp, rng):
        w = ridge(xt, yt, hp["noise_multiplier"], hp["regularization"], n_public, rng, mechanism)
        xv_c = clip_rows(xv, "l1" if mechanism == "laplace" else "l2")
        return _accuracy_score(w, xv_c, yv, score_noise_multiplier, m_public, rng), {"w": w}

    return _make(fn, privacy, n_public, f"ridge covariance perturbation ({mechanism})",
                 (xt, yt, xv, yv))  # fmt: skip


def logistic_trainer(
    train: tuple[np.ndarray, np.ndarray], val: tuple[np.ndarray, np.ndarray], n_public: int,
    m_public: int, score_noise_multiplier: float,
) -> FunctionTrainer:  # fmt: skip
    """Logistic regression by output perturbation as a dptune trainer (hyperparameters:
    ``noise_multiplier``, ``regularization``); score: noisy validation accuracy."""
    (xt, yt), (xv, yv) = train, val

    privacy = _privacy_of("logistic output perturbation", score_noise_multiplier)

    def fn(hp, rng):
        w = logistic_output_perturbation(
            xt, yt, hp["noise_multiplier"], hp["regularization"], n_public, rng
        )
        score = _accuracy_score(w, clip_rows(xv, "l2"), yv, score_noise_multiplier, m_public, rng)
        return score, {"w": w}

    return _make(fn, privacy, n_public, "logistic output perturbation", (xt, yt, xv, yv))


def histogram_trainer(
    train: np.ndarray, val: np.ndarray, n_public: int, m_public: int, score_noise_multiplier: float
) -> FunctionTrainer:
    """DP histogram density (Chaudhuri & Vinterbo Alg. 5) as a dptune trainer (hyperparameters:
    ``noise_multiplier``, ``bins``). Score: Eq. 6 with Laplace noise on sum_j f(v_j), whose
    sensitivity is max f <= bins (a density of mass 1 on bins of width 1/bins)."""

    privacy = _privacy_of("histogram density", score_noise_multiplier)

    def fn(hp, rng):
        bins = int(hp["bins"])
        f = histogram_density(train, bins, hp["noise_multiplier"], rng)
        v = np.clip(np.asarray(val, dtype=np.float64), 0.0, np.nextafter(1.0, 0.0))
        total = f[(v * bins).astype(int)].sum() + rng.laplace(0.0, score_noise_multiplier * bins)
        return float(-np.sum(f**2) / bins + 2.0 * total / m_public), {"density": f}

    return _make(fn, privacy, n_public, "histogram density", (train, val))


# ------------------------------------------------------------------------------------------------
# command line: one private tuning run of a classical learner on the shipped MNIST-10k


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
    args = ap.parse_args(argv)
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
    release = dptune.tune(
        trainer,
        {"regularization": space.log_uniform(1e-3, 1.0), "noise_multiplier": "auto"},
        RandomStopping.logarithmic(4),
        (args.epsilon, 1e-5),
        seed=args.seed,
        progress=False,
    )
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
