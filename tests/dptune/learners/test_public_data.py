"""The oracle-efficient private learner with public unlabelled data
(dptune/learners/public_data.py): the public pool is disjoint from the private per-record split, the
ERM oracle is exact, the stability bound holds, the privacy matches an independent closed form, and
dptune tunes it."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from scipy import optimize

import dptune
from dptune import accounting, space
from dptune.errors import TuningConfigError
from dptune.learners import public_data as pdl
from selection import RandomStopping
from tests.dptune.learners.test_fisher import analytic_gaussian_epsilon
from tests.paths import mnist_10k, shared_data
from trainers.data import record_digests, record_split_uniforms


def test_public_pool_is_disjoint_from_the_private_split(mnist):
    """The private records are exactly those the per-record hash split of trainers/data.py put in
    training or validation (recomputed here from the raw file); no public image is among them, the
    pool is the first test records whatever the private data, and it is disjoint from the
    evaluation records."""
    from trainers.data import _load_idx

    pool = pdl.public_pool(mnist, 1000)
    raw_x, raw_y, test_x, _ = _load_idx(mnist_10k())
    u = record_split_uniforms(record_digests(raw_x, raw_y), 0)
    in_val = u < mnist.split["fraction"]
    assert in_val.sum() == len(mnist.val_y) and (~in_val).sum() == len(mnist.train_y)
    private_images = set(pdl.image_digests(raw_x))  # every private record, either split
    assert not private_images & set(pdl.image_digests(pool.x))
    assert pdl.shared_images(pool.x, mnist) == 0
    assert np.array_equal(pool.x, test_x[:1000].reshape(1000, -1))
    assert np.array_equal(pool.test_x, test_x[1000:])  # evaluation records are not in the pool
    assert not set(pdl.image_digests(pool.x)) & set(pdl.image_digests(pool.test_x))
    # the audit is not vacuous: private images offered as public are counted
    leaky = dataclasses.replace(mnist, test_x=np.concatenate([mnist.train_x[:3], mnist.test_x]))
    assert pdl.shared_images(pdl.public_pool(leaky, 1000).x, mnist) == 3


def test_fashion_mnist_public_pool_is_disjoint_from_its_private_records():
    """The Fashion-MNIST pool of docs/reproductions/public-data-amount.md (test records [0, 5000))
    shares no image with the 60,000-record private training file."""
    folder = shared_data("fashion-mnist")
    if folder is None:
        pytest.skip("Fashion-MNIST is not beside the checkout (../shared/data/fashion-mnist)")
    from trainers.data import _load_idx

    train_x, _, test_x, _ = _load_idx(folder)
    private = set(pdl.image_digests(train_x))
    assert not private & set(pdl.image_digests(test_x[:5000]))


@pytest.mark.parametrize("z,k", [(2.0, 10), (5.0, 10), (1.0, 2)])
def test_event_matches_one_gaussian_closed_form(z, k):
    """K Gaussian mechanisms of multiplier z = one of multiplier z / sqrt(K) (GDP, Dong-Roth-Su
    2019 Cor. 3.3), eps from Balle-Wang 2018 Thm 8 with scipy: independent of dp_accounting."""
    got = accounting.pld_epsilon(accounting.EventCandidate(pdl.public_data_event(z, k)), 1e-5)
    want = analytic_gaussian_epsilon(math.sqrt(k) / z, 1e-5)
    assert got == pytest.approx(want, rel=2e-3, abs=2e-3)


@pytest.mark.parametrize("seed", range(4))
def test_ball_least_squares_is_the_exact_minimiser(seed):
    """Against scipy's SLSQP on the same constrained problem (an independent solver), inside and on
    the boundary of the ball, and the KKT conditions."""
    rng = np.random.default_rng(seed)
    d = 6
    m = rng.normal(size=(20, d))
    a = m.T @ m / 20 + (0.0 if seed == 3 else 0.1) * np.eye(d)
    b = rng.normal(size=d) * (0.05 if seed == 0 else 3.0)  # seed 0: interior solution
    w = pdl.ball_least_squares(a, b, 1.0)

    def obj(v):
        return v @ a @ v - 2 * b @ v

    ref = optimize.minimize(
        obj, np.zeros(d), jac=lambda v: 2 * a @ v - 2 * b, method="SLSQP",
        constraints=[{"type": "ineq", "fun": lambda v: 1 - v @ v, "jac": lambda v: -2 * v}],
        options={"ftol": 1e-14, "maxiter": 500},
    )  # fmt: skip
    assert np.linalg.norm(w) <= 1 + 1e-9
    assert obj(w) <= obj(ref.x) + 1e-8
    assert np.allclose(w, ref.x, atol=1e-5)
    grad = 2 * a @ w - 2 * b
    if np.linalg.norm(w) < 1 - 1e-9:
        assert np.linalg.norm(grad) < 1e-8
    else:  # the gradient points into the ball: -grad = 2 nu w with nu >= 0
        nu = -(grad @ w) / 2
        assert nu >= -1e-9 and np.allclose(-grad, 2 * nu * w, atol=1e-7)


def _f_bar(px, y, pz, eta, k=10):
    targets = np.where(np.arange(k)[None, :] == y[:, None], 1.0, -1.0)
    a = px.T @ px / 4.0 + eta * pz.T @ pz / len(pz)
    return pdl.ball_least_squares(a, px.T @ targets / 4.0)


@pytest.mark.parametrize("eta", [0.05, 1.0, 100.0])
def test_stability_bound_holds(mnist, eta):
    """||f_bar(D) - f_bar(D')||_m <= rho = 1/sqrt(2 eta) per class for add/remove neighbours: real
    records removed, adversarial records added (opposite labels, public-like and extreme points),
    and the one-record dataset where the bound is nearly attained at small eta."""
    rho = pdl.stability_radius(eta)
    pool = pdl.public_pool(mnist, 300)
    phi = pdl.FeatureMap.from_public(pool.x, 10)
    pz = phi(pool.x)
    px, y = phi(mnist.train_x[:200]), np.asarray(mnist.train_y[:200])
    w = _f_bar(px, y, pz, eta)
    worst = 0.0
    for i in range(0, 200, 25):
        keep = np.arange(200) != i
        w2 = _f_bar(px[keep], y[keep], pz, eta)
        worst = max(worst, np.sqrt(np.mean((pz @ (w - w2)) ** 2, axis=0)).max())
    for j in range(5):  # add adversarial records
        xa = pz[j : j + 1] / np.linalg.norm(pz[j])
        w2 = _f_bar(np.concatenate([px, xa]), np.concatenate([y, [(j + 3) % 10]]), pz, eta)
        worst = max(worst, np.sqrt(np.mean((pz @ (w - w2)) ** 2, axis=0)).max())
    assert worst <= rho
    # One record vs none, public points all equal to it: f_bar(x) = y / (1 + 4 eta) exactly.
    x1 = np.zeros((1, 10))
    x1[0, 0] = 1.0
    w1 = _f_bar(x1, np.array([0]), np.repeat(x1, 7, axis=0), eta)
    assert np.allclose(x1 @ w1, [[1 / (1 + 4 * eta)] + [-1 / (1 + 4 * eta)] * 9])
    assert 1 / (1 + 4 * eta) <= rho


def test_perturb_without_noise_returns_f_bar_on_public_points(mnist):
    """Algorithm 1 with zero noise projects f_bar onto F in ||.||_m: f_bar is in F, so it comes
    back (on the public points) -- the oracle solves the projection exactly."""

    class ZeroRng:
        def standard_normal(self, shape):
            return np.zeros(shape)

    hp = pdl.PublicDataHyperparams(eta=10.0, pca_dim=12)
    pool = pdl.public_pool(mnist, 400)
    model = pdl.fit_private_public(mnist.train_x[:500], mnist.train_y[:500], 10, pool.x, hp,
                                   ZeroRng())  # fmt: skip
    pz = model["phi"](pool.x)
    w_bar = _f_bar(model["phi"](mnist.train_x[:500]), np.asarray(mnist.train_y[:500]), pz, 10.0)
    assert np.allclose(pz @ model["w"], pz @ w_bar, atol=1e-8)


def test_dptune_tunes_the_public_data_family(mnist):
    tr = pdl.PublicDataTrainer(mnist, num_public=1000)
    sp = {"eta": space.choice(300.0, 3000.0), "pca_dim": space.choice(15, 30),
          "noise_multiplier": "auto"}  # fmt: skip
    rel = dptune.tune(tr, sp, RandomStopping.logarithmic(mean=2), (4.0, 1e-5), seed=1,
                      progress=False)  # fmt: skip
    assert 3.9 < rel.privacy["total_epsilon"] <= 4.0 + 1e-9
    if rel.released:
        assert rel.test_accuracy > 0.2  # well above chance (0.1) at eps = 4
    with pytest.raises(TuningConfigError):
        dptune.plan_privacy(tr, sp, RandomStopping.logarithmic(mean=2), (4.0, 1e-5),
                            adjacency="replace_one")  # fmt: skip


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_empty_private_split_trains_like_any_other(split):
    """No private record in a split is a dataset like any other: Perturb's output is noise, the
    score is noise, nothing fails (it used to fail, one record flipping the release)."""
    from tests.dptune.learners.test_fisher import tiny_dataset

    d = tiny_dataset()
    d = dataclasses.replace(
        d,
        **{f"{split}_x": getattr(d, f"{split}_x")[:0], f"{split}_y": getattr(d, f"{split}_y")[:0]},
    )
    score, model = pdl.PublicDataTrainer(d, num_public=20)(
        {"pca_dim": 3, "noise_multiplier": 1.0}, np.random.default_rng(0)
    )
    assert math.isfinite(score) and model["w"].shape == (3, 3)


@pytest.mark.parametrize(
    ("num_public", "named"),
    [(40, "num_public=40 .* < 40"), (10.5, "num_public=10.5 must be an integer"), ("10", "'10'")],
)
def test_a_wrong_pool_size_is_one_refusal_naming_num_public(num_public, named):
    from tests.dptune.learners.test_fisher import tiny_dataset

    with pytest.raises(TuningConfigError, match=named):
        pdl.PublicDataTrainer(tiny_dataset(), num_public=num_public)
