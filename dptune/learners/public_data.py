"""Oracle-efficient private learning with public unlabelled data, as a dptune trainer.

Block, Bun, Desai, Shetty & Wu, "Oracle-Efficient Differentially Private Learning with Public
Data", NeurIPS 2024
(text: ``shared/papers/oracle-efficient-private-learning-with-public-data.txt``).
We implement its Algorithm 3 (regularised ERM, then Algorithm 1 "Perturb") for the convex class

    F = { x -> <w, phi(x)> : ||w||_2 <= 1 },   ||phi(x)||_2 <= 1   (so F maps into [-1, 1]),

one-vs-rest for K classes, with the loss ``l(p, y) = (p - y)^2 / 4`` for y in {-1, +1}: convex,
1-Lipschitz in p on [-1, 1] and valued in [0, 1], as the paper's Theorem 3 requires.

* Public data: m unlabelled records Z_1..Z_m, declared public (the first part of the dataset's test
  file, :func:`public_pool`; audited disjoint from the private records by :func:`shared_images`).
  The feature map phi (PCA on the public records, scaled by a public constant and clipped to norm
  1 per record) depends on public data only.
* ERM oracle: :func:`ball_least_squares`, the exact minimiser of a quadratic over the ball
  (the trust-region subproblem: scipy ``eigh`` + ``brentq`` on the secular equation). Both the
  regularised ERM of Alg. 3 (``sum_i l(f(X_i), Y_i) + eta ||f||_m^2``) and the projection of
  Alg. 1 (``argmin_f ||f - f_bar - gamma zeta||_m``) are such quadratics.

Privacy (one place: :func:`public_data_event`):

1. Stability (the paper's Lemma 2, re-derived with the exact constant). The objective L is convex
   plus ``eta ||f||_m^2``, a quadratic whose second-order term is ``eta ||f - g||_m^2``; so at the
   minimiser f_bar over the convex F, ``L(f) - L(f_bar) >= eta ||f - f_bar||_m^2`` for every f in F.
   For add/remove neighbours D = D' + {(x, y)}, adding this inequality for L at f_bar' and for L'
   at f_bar gives ``2 eta ||f_bar - f_bar'||_m^2 <= l(f_bar'(x), y) - l(f_bar(x), y) <= 1`` (the
   loss lies in [0, 1]), i.e. ``rho = sqrt(1 / (2 eta))`` (:func:`stability_radius`).
2. Perturb is the Gaussian mechanism (the paper's Lemma 9): its output is a function of the public
   data and of ``f_bar(Z) + gamma zeta`` in R^m, zeta ~ N(0, I_m), and
   ``||f_bar(Z) - f_bar'(Z)||_2 = sqrt(m) ||f_bar - f_bar'||_m <= sqrt(m) rho``. With
   ``gamma = z sqrt(m) rho`` this is the Gaussian mechanism of noise multiplier z.
3. K one-vs-rest problems on the same records compose: ``SelfComposedDpEvent(Gaussian(z), K)``,
   accounted exactly by dp_accounting (PLD) instead of the paper's Lemma 11 bound.

The validation score is a noisy count on the per-record validation split (in parallel, McSherry
2009, Thm 4), as for every dptune candidate. The privacy assumes exact minimisers (the paper's
oracle model); :func:`ball_least_squares` solves the subproblem to float precision and the tests
check its optimality conditions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from dp_accounting import dp_event
from scipy import linalg, optimize

from dptune.accounting.events import EventCandidate
from dptune.errors import TuningConfigError
from dptune.learners.fisher import check_dataset, flat_rows
from dptune.trainer_protocol import DatasetTrainer, ReleaseView

__all__ = [
    "PUBLIC_DATA_PRIVACY_FIELDS",
    "FeatureMap",
    "PublicDataHyperparams",
    "PublicDataTrainer",
    "PublicPool",
    "ball_least_squares",
    "fit_private_public",
    "image_digests",
    "perturb_noise_std",
    "public_data_event",
    "public_pool",
    "shared_images",
    "stability_radius",
]

#: Fields that change the declared privacy.
PUBLIC_DATA_PRIVACY_FIELDS = ("noise_multiplier", "score_noise_std")


def stability_radius(eta: float) -> float:
    """rho: ``||f_bar(D) - f_bar(D')||_m <= rho`` for add/remove neighbours (Block et al. 2024,
    Lemma 2; constant re-derived in the module docstring: ``2 eta rho^2 <= 1``, loss in [0, 1])."""
    if not eta > 0:
        raise ValueError(f"eta={eta!r} must be > 0")
    return math.sqrt(1.0 / (2.0 * eta))


def perturb_noise_std(noise_multiplier: float, num_public: int, eta: float) -> float:
    """gamma, the std of Perturb's noise on each public prediction: ``z sqrt(m) rho`` makes Perturb
    the Gaussian mechanism of multiplier z on an R^m vector of L2 sensitivity ``sqrt(m) rho``."""
    return float(noise_multiplier) * math.sqrt(num_public) * stability_radius(eta)


def public_data_event(noise_multiplier: float, num_classes: int) -> dp_event.DpEvent:
    """THE privacy of one run on the private training split (add/remove one record): K Gaussian
    mechanisms of multiplier z (Block et al. 2024, Lemma 2 + Lemma 9 per class; composed by
    dp_accounting rather than Lemma 11's closed-form bound)."""
    return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(noise_multiplier), num_classes)


# ---------------------------------------------------------------------------------------------
# Public data


def image_digests(x: np.ndarray) -> np.ndarray:
    """sha256 of each image's float32 bytes (labels ignored: the public pool is unlabelled)."""
    x = np.ascontiguousarray(flat_rows(x, np.float32))
    return np.array([hashlib.sha256(r.tobytes()).digest() for r in x], dtype=object)


@dataclasses.dataclass(frozen=True)
class PublicPool:
    """Unlabelled records declared public, and the test records left for evaluation.

    Attributes:
      x: (m, p) public images (flattened, float32); never labelled.
      test_x, test_y: the test file's records from ``test_from`` on (disjoint from ``x``), for the
        released accuracy.
      source: where the public records come from (for the statement).
    """

    x: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    source: str


def public_pool(data: Any, num_public: int, test_from: int | None = None) -> PublicPool:
    """The first ``num_public`` records of the dataset's TEST file (a published file, not part of
    the private training file), labels dropped, declared public; the test records from
    ``test_from`` (default ``num_public``; a fixed value keeps one test set across pool sizes)
    stay for evaluation.

    The pool never depends on the private data (the paper's public samples are independent of D): it
    is not filtered against the private records, because a filter would make the public set, and so
    the mechanism, a function of D. That no public image is also a private record is an audit of the
    shipped files (:func:`shared_images`, ``tests/dptune/learners/test_public_data.py``).
    """
    n_test = len(data.test_x)  # the test file is public: its size may decide a refusal
    test_from = num_public if test_from is None else test_from
    for name, v in (("num_public", num_public), ("test_from", test_from)):
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise TuningConfigError(f"{name}={v!r} must be an integer (a number of test records)")
    if not 0 < num_public <= test_from < n_test:
        raise TuningConfigError(
            f"num_public={num_public!r} (test_from={test_from!r}) must satisfy 0 < num_public <= "
            f"test_from < {n_test}, the number of records in {data.name!r}'s public test split: "
            "the public pool is its first num_public records and the rest measure the test "
            "accuracy"
            + (
                "; this dataset has no test split (Dataset.from_arrays(..., x_test=, y_test=))"
                if n_test == 0
                else ""
            )
        )
    return PublicPool(
        x=np.ascontiguousarray(data.test_x[:num_public].reshape(num_public, -1), dtype=np.float32),
        test_x=data.test_x[test_from:],
        test_y=data.test_y[test_from:],
        source=f"{data.name} test file, records [0, {num_public})",
    )


def shared_images(public_x: np.ndarray, data: Any) -> int:
    """How many public images also occur among the private records (training and validation
    splits): the disjointness audit (0 for the shipped MNIST-10k and Fashion-MNIST pools)."""
    private = set(image_digests(data.train_x)) | set(image_digests(data.val_x))
    return int(sum(d in private for d in image_digests(public_x)))


@dataclasses.dataclass(frozen=True)
class FeatureMap:
    """phi(x) = clip_1((x - mean) @ components / scale): PCA of the public records only."""

    mean: np.ndarray
    components: np.ndarray  # (p, d)
    scale: float

    @classmethod
    def from_public(cls, z: np.ndarray, dim: int) -> FeatureMap:
        z = flat_rows(z)
        mean = z.mean(axis=0)
        zc = z - mean
        k = min(dim, *zc.shape)
        # top-k right singular vectors via the smaller Gram matrix (cheaper than a full SVD)
        if zc.shape[0] >= zc.shape[1]:
            _, v = linalg.eigh(zc.T @ zc, subset_by_index=[zc.shape[1] - k, zc.shape[1] - 1])
            comps = v[:, ::-1]
        else:
            s2, u = linalg.eigh(zc @ zc.T, subset_by_index=[zc.shape[0] - k, zc.shape[0] - 1])
            comps = (zc.T @ u / np.sqrt(np.maximum(s2, 1e-12)))[:, ::-1]
        proj = (z - mean) @ comps
        # a public constant: most public records keep their direction and length ratio
        scale = float(np.quantile(np.linalg.norm(proj, axis=1), 0.95)) or 1.0
        return cls(mean, comps, scale)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = flat_rows(x)
        f = (x - self.mean) @ self.components / self.scale
        norms = np.linalg.norm(f, axis=1, keepdims=True)
        return f / np.maximum(norms, 1.0)  # per-record clip to norm 1: ||phi(x)|| <= 1 always


# ---------------------------------------------------------------------------------------------
# The ERM oracle


def ball_least_squares(a: np.ndarray, b: np.ndarray, radius: float = 1.0) -> np.ndarray:
    """Exact ``argmin_{||w|| <= radius} w^T a w - 2 b^T w`` for symmetric PSD a (d, d) and one or
    several right-hand sides b (d,) or (d, K) (the trust-region subproblem; More & Sorensen 1983):
    the unconstrained minimiser if it is inside the ball, else ``(a + nu I)^-1 b`` with nu > 0 the
    root of ``||(a + nu I)^-1 b|| = radius`` (brentq). Columns are solved independently."""
    evals, evecs = linalg.eigh((a + a.T) / 2)
    evals = np.maximum(evals, 0.0)
    bb = np.asarray(b, dtype=np.float64)
    cols = bb[:, None] if bb.ndim == 1 else bb
    out = np.empty_like(cols)
    for k in range(cols.shape[1]):
        c = evecs.T @ cols[:, k]

        def norm_at(nu: float, c=c) -> float:
            return float(np.linalg.norm(c / (evals + nu)))

        tiny = 1e-12 * max(float(evals.max()), 1.0)
        if evals.min() > tiny and norm_at(0.0) <= radius:
            nu = 0.0
        else:
            hi = max(float(np.linalg.norm(c)) / radius, tiny)
            while norm_at(hi) > radius:
                hi *= 2
            lo = 0.0 if evals.min() > tiny else tiny
            if norm_at(lo) <= radius:  # singular a, b outside its range's trouble: take lo
                nu = lo
            else:
                nu = optimize.brentq(lambda v, c=c: norm_at(v, c) - radius, lo, hi, xtol=1e-14,
                                     rtol=1e-12)  # fmt: skip
        out[:, k] = evecs @ (c / (evals + nu))
    return out[:, 0] if bb.ndim == 1 else out


# ---------------------------------------------------------------------------------------------
# Algorithm 3 + Algorithm 1


@dataclasses.dataclass(frozen=True)
class PublicDataHyperparams:
    """Attributes:
    eta: the regulariser's weight (stability rho = 1/sqrt(2 eta)).
    pca_dim: d, the dimension of phi (PCA of the public records).
    noise_multiplier: z, Perturb's Gaussian noise multiplier per class (calibrated by dptune).
    score_noise_std: std (counts) of the noise on the validation count; None for public validation.
    """

    eta: float = 1000.0
    pca_dim: int = 30
    noise_multiplier: float = 1.0
    score_noise_std: float | None = 10.0

    def __post_init__(self) -> None:
        for name in ("eta", "noise_multiplier"):
            v = float(getattr(self, name))
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} must be a finite number > 0")
        if isinstance(self.pca_dim, bool) or int(self.pca_dim) != self.pca_dim or self.pca_dim < 1:
            raise ValueError(f"pca_dim={self.pca_dim!r} must be an integer >= 1")
        if self.score_noise_std is not None and not 0 < float(self.score_noise_std) < math.inf:
            raise ValueError(
                f"score_noise_std={self.score_noise_std!r} must be a finite number > 0, or None"
            )


def fit_private_public(
    x: np.ndarray,
    y: np.ndarray,
    num_classes: int,
    z_public: np.ndarray,
    hp: PublicDataHyperparams,
    rng: np.random.Generator,
) -> dict[str, Any]:
    """Algorithm 3 (regularised ERM) then Algorithm 1 (Perturb) for each class, one-vs-rest.

    Args:
      x: (n, p) private training features; y: (n,) labels; z_public: (m, p) public unlabelled.
    Returns:
      ``{"phi": FeatureMap, "w": (d, K)}``; a function of the public data and of the K noisy
      vectors ``f_bar_k(Z) + gamma zeta_k`` only.
    """
    phi = FeatureMap.from_public(z_public, hp.pca_dim)
    px, pz = phi(x), phi(z_public)
    m = len(pz)
    targets = np.where(np.arange(num_classes)[None, :] == np.asarray(y)[:, None], 1.0, -1.0)
    gram_pub = pz.T @ pz / m
    # Alg. 3, line 2: sum_i (<w, phi_i> - y_ik)^2 / 4 + eta ||f||_m^2  (a quadratic in w)
    a = px.T @ px / 4.0 + hp.eta * gram_pub
    w_bar = ball_least_squares(a, px.T @ targets / 4.0)
    # Alg. 1 (Perturb): project f_bar(Z) + gamma zeta onto F in ||.||_m
    gamma = perturb_noise_std(hp.noise_multiplier, m, hp.eta)
    noisy = pz @ w_bar + gamma * rng.standard_normal((m, num_classes))
    w = ball_least_squares(gram_pub, pz.T @ noisy / m)
    return {"phi": phi, "w": w}


def predict(model: Mapping[str, Any], x: np.ndarray) -> np.ndarray:
    return np.argmax(model["phi"](x) @ model["w"], axis=1)


class PublicDataTrainer(DatasetTrainer):
    """The public-data-assisted candidate family for ``dptune.tune``.

    Args:
      data: a ``trainers.data.Dataset`` (private training and validation splits; test file).
      num_public: how many records of the test file become the public unlabelled pool.
      base: default hyperparameters.
    Searchable: ``eta``, ``pca_dim``; ``noise_multiplier="auto"`` is calibrated by dptune.
    """

    hyperparams_class = PublicDataHyperparams
    kind = "public-data"

    privacy_fields = PUBLIC_DATA_PRIVACY_FIELDS
    calibrated_field = "noise_multiplier"
    #: noisy validation count accounted in its privacy (or exact on public validation data)
    score_kind = "covered"

    def __init__(
        self,
        data: Any,
        num_public: int,
        base: Mapping[str, Any] | None = None,
        test_from: int | None = None,
    ) -> None:
        check_dataset(data, "PublicDataTrainer")
        self.data = data
        self.pool = public_pool(data, num_public, test_from)
        self.base = dict(base or {})
        self.num_examples = int(data.public_num_train)

    def privacy(self, hparams: Mapping[str, Any]) -> EventCandidate:
        hp = self.hyperparams(hparams)
        if hp.score_noise_std is None and not self.data.validation_public:
            raise TuningConfigError("score_noise_std=None needs a validation set declared public")
        parallel = (
            () if hp.score_noise_std is None else (dp_event.GaussianDpEvent(hp.score_noise_std),)
        )
        return EventCandidate(
            public_data_event(hp.noise_multiplier, self.data.num_classes),
            parallel,
            label="public-data oracle-efficient learner",
        )

    def __call__(self, hparams: Mapping[str, Any], rng: np.random.Generator) -> tuple[float, Any]:
        hp = self.hyperparams(hparams)
        d = self.data
        try:
            model = fit_private_public(d.train_x, d.train_y, d.num_classes, self.pool.x, hp, rng)
        except (np.linalg.LinAlgError, ValueError):
            return float("nan"), None
        correct = float(np.sum(predict(model, d.val_x) == d.val_y))
        if hp.score_noise_std is None:
            return correct / max(len(d.val_y), 1), model
        return (correct + hp.score_noise_std * rng.standard_normal()) / d.public_num_val, model

    def release_view(self, hparams: Mapping[str, Any], payload: Any) -> ReleaseView:
        if payload is None:
            return ReleaseView(None)
        acc = float(np.mean(predict(payload, self.pool.test_x) == self.pool.test_y))
        return ReleaseView(payload, acc)

    def privacy_notes(self) -> list[str]:
        return [
            self.data.describe_split() + ".",
            f"Public unlabelled data: the {len(self.pool.x)} records of the {self.pool.source}, "
            "declared public and independent of the private data; test accuracy is measured on "
            "other records of the test file.",
        ]

    def privacy_checks(self) -> list[str]:
        """What dptune's own code guarantees (the statement's "Checked by dptune")."""
        return [
            "the public-data learner is dptune's own code (dptune/learners/public_data.py): "
            "regularised ERM perturbed by the Gaussian mechanism at the stability radius (tests/"
            "dptune/learners), and the noisy validation count on the per-record split"
        ]

    def check_adjacency(self, adjacency: str) -> None:
        if adjacency != "add_remove":
            raise TuningConfigError("the public-data learner's stability is for add/remove only")

    def describe(self) -> dict[str, Any]:
        return {"kind": "public-data", "dataset": self.data.name, "num_public": len(self.pool.x)}
