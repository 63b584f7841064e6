"""Classical candidates (`dptune.learners.classical`): each declared privacy against an independent
computation, and each trainer through `dptune.tune`.

* Ridge / Laplace: on neighbouring datasets (one record added, the worst record x = e_1, y = 1),
  the log-ratio of the released statistics' densities (scipy's Laplace logpdf), maximised over
  outputs, equals the declared event's epsilon (1/noise_multiplier); random records never exceed
  the l1 sensitivity 2.
* Ridge / Gaussian: the declared event's epsilon (dptune.accounting, PLD) equals the analytic
  Gaussian mechanism's (Balle & Wang 2018, Thm 8) at the l2 sensitivity sqrt(2), which the worst
  record attains.
* Logistic output perturbation: the exact minimiser moves by <= 2/(n lambda) in l2 when a record
  is added (checked by optimisation over random records), and the Laplace scale is
  noise_multiplier x sqrt(d) x 2/(n lambda).
* Histogram: neighbouring counts differ in one bin by 1; the log-ratio of the noisy counts'
  densities equals 1/noise_multiplier.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from dp_accounting import dp_event
from scipy import optimize, stats

import dptune
from dptune import accounting, space
from dptune.accounting.events import pure_epsilon
from dptune.learners import classical
from selection import RandomStopping


def _data(n, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = np.where(x[:, 0] + 0.3 * rng.normal(size=n) > 0, 1.0, -1.0)
    return x, y


def _max_log_ratio(s, s2, scale):
    """sup over outputs o of |log Lap(o; s, scale) - log Lap(o; s2, scale)| (product over coords):
    attained at any o beyond both means coordinatewise, e.g. o = s + 100 sign(s - s2) scale."""
    o = s + 100.0 * scale * np.sign(s - s2)
    lr = stats.laplace.logpdf(o, s, scale).sum() - stats.laplace.logpdf(o, s2, scale).sum()
    return abs(lr)


def test_ridge_laplace_privacy_equals_declared_epsilon():
    x, y = _data(50, 4, 0)
    xc = classical.clip_rows(x, "l1")
    s = classical.ridge_statistics(xc, y)
    worst = np.eye(4)[:1]
    s2 = classical.ridge_statistics(np.vstack([xc, worst]), np.append(y, 1.0))
    nm = 0.7
    tr = classical.ridge_trainer((x, y), (x, y), 50, 50, 1.0, "laplace")
    declared = pure_epsilon(tr.privacy({"noise_multiplier": nm, "regularization": 0.1}).event)
    got = _max_log_ratio(s, s2, nm * classical.RIDGE_L1_SENSITIVITY)
    assert got == pytest.approx(declared, rel=1e-9) and declared == pytest.approx(1 / nm)
    rng = np.random.default_rng(1)
    for _ in range(200):  # any clipped record moves the statistics by <= 2 in l1
        r = classical.clip_rows(rng.normal(size=(1, 4)) * rng.exponential(3), "l1")
        lab = rng.uniform(-1, 1)
        diff = classical.ridge_statistics(r, np.array([lab]))
        assert np.abs(diff).sum() <= classical.RIDGE_L1_SENSITIVITY + 1e-12


def _analytic_gaussian_epsilon(sigma: float, delta: float) -> float:
    """Balle & Wang 2018, Thm 8, for noise multiplier sigma (std / l2 sensitivity)."""

    def gap(eps):
        a = 1 / (2 * sigma)
        return (
            stats.norm.cdf(a - eps * sigma)
            - math.exp(eps) * stats.norm.cdf(-a - eps * sigma)
            - delta
        )

    return optimize.brentq(gap, 0.0, 50.0, xtol=1e-12)


def test_ridge_gaussian_privacy_equals_analytic_gaussian():
    e1 = np.eye(4)[:1]
    diff = classical.ridge_statistics(classical.clip_rows(e1, "l2"), np.array([1.0]))
    assert np.linalg.norm(diff) == pytest.approx(classical.RIDGE_L2_SENSITIVITY)  # attained
    tr = classical.ridge_trainer(_data(20, 4, 0), _data(20, 4, 1), 20, 20, 1e9, "gaussian")
    cand = tr.privacy({"noise_multiplier": 1.3, "regularization": 0.1})
    assert isinstance(cand.event, dp_event.GaussianDpEvent)
    got = accounting.pld_epsilon([accounting.EventCandidate(cand.event)], 1e-5)
    assert got == pytest.approx(_analytic_gaussian_epsilon(1.3, 1e-5), rel=2e-3)


def test_logistic_sensitivity_bound_holds():
    n, d, lam = 60, 3, 0.05
    x, y = _data(n, d, 2)
    xc = classical.clip_rows(x, "l2")
    w = classical._logistic_minimiser(xc, y, lam, n)
    rng = np.random.default_rng(3)
    worst = 0.0
    for _ in range(12):
        r = rng.normal(size=(1, d))
        r /= np.linalg.norm(r)  # on the unit sphere: the largest records
        w2 = classical._logistic_minimiser(
            np.vstack([xc, r]), np.append(y, rng.choice([-1, 1])), lam, n
        )
        worst = max(worst, float(np.linalg.norm(w2 - w)))
    assert 0.2 / (n * lam) < worst <= 2 / (n * lam)  # nontrivial, and within CMS's bound
    assert classical.logistic_sensitivity(lam, n, d) == pytest.approx(math.sqrt(d) * 2 / (n * lam))
    # the released noise has the declared scale: (w_released - w*) / scale ~ Laplace(1)
    scale = 0.5 * classical.logistic_sensitivity(lam, n, d)
    draws = np.array(
        [
            classical.logistic_output_perturbation(x, y, 0.5, lam, n, np.random.default_rng(s)) - w
            for s in range(80)
        ]
    ).ravel()
    assert stats.kstest(draws / scale, stats.laplace.cdf).pvalue > 1e-3


def test_histogram_privacy_equals_declared_epsilon():
    z = np.random.default_rng(4).beta(2, 5, size=100)
    bins, nm = 16, 0.4
    c = np.bincount((z * bins).astype(int), minlength=bins).astype(float)
    c2 = np.bincount((np.append(z, 0.99) * bins).astype(int), minlength=bins).astype(float)
    assert np.abs(c - c2).sum() == 1.0
    tr = classical.histogram_trainer(z, z, 100, 100, 1.0)
    declared = pure_epsilon(tr.privacy({"noise_multiplier": nm, "bins": bins}).event)
    assert _max_log_ratio(c, c2, nm) == pytest.approx(declared, rel=1e-9)
    f = classical.histogram_density(z, bins, nm, np.random.default_rng(0))
    assert f.sum() / bins == pytest.approx(1.0)


@pytest.mark.parametrize("kind", ["ridge", "logistic", "histogram"])
def test_trainers_tune_end_to_end(kind):
    if kind == "histogram":
        z = np.random.default_rng(5).beta(2, 5, size=600)
        tr = classical.histogram_trainer(z[:400], z[400:], 400, 200, 1.0)
        sp = {"bins": space.choice(4, 8, 16, 32), "noise_multiplier": "auto"}
    else:
        (x, y), (xv, yv) = _data(400, 5, 6), _data(200, 5, 7)
        make = classical.ridge_trainer if kind == "ridge" else classical.logistic_trainer
        tr = make((x, y), (xv, yv), 400, 200, 1.0)
        sp = {"regularization": space.log_uniform(1e-3, 1.0), "noise_multiplier": "auto"}
    rel = dptune.tune(tr, sp, RandomStopping.logarithmic(4), (3.0, 1e-5), seed=1, progress=False)
    assert rel.released and rel.privacy["total_epsilon"] <= 3.0
    assert math.isfinite(rel.validation_score) and rel.hparams["noise_multiplier"] > 0
    with pytest.raises(dptune.TuningConfigError, match="add/remove"):
        tr.check_adjacency("replace_one")


def test_command_line_tunes_on_shipped_mnist(capsys):
    """``python -m dptune.learners.classical`` (called in-process): one private tuning run on
    MNIST-10k whose statement meets the budget, printing only the release and its statement."""
    out = classical.main(["--learner=logistic", "--epsilon=2", "--seed=0"])
    assert out["released"] and 0.0 <= out["validation_score"] <= 1.05
    assert out["total_epsilon"] <= 2.0 * (1 + 1e-6) and "eta=0" in out["theorem"]
    printed = capsys.readouterr().out
    assert set(json.loads(printed)) == set(out)


# ------------------------------------------------------------------------------------------------
# A user's own arrays and mistakes


@pytest.mark.parametrize(
    ("call", "named"),
    [
        (
            lambda x, y: classical.logistic_trainer(
                (x, np.where(y > 0, "a", "b")), (x, y), 40, 40, 1.0
            ),
            "train",
        ),
        (lambda x, y: classical.logistic_trainer((x, y[:-1]), (x, y), 40, 40, 1.0), "train="),
        (lambda x, y: classical.ridge_trainer((x[:, 0], y), (x, y), 40, 40, 1.0), "train="),
        (lambda x, y: classical.ridge_trainer((x, y), (x[:, :2], y), 40, 40, 1.0), "val="),
        (lambda x, y: classical.ridge_trainer((x, y), (x, y), 40, 40, 1.0, "gauss"), "mechanism="),
        (lambda x, y: classical.logistic_trainer((x, y), (x, y), 40, 40, 0.0), "score_noise_mul"),
        (lambda x, y: classical.logistic_trainer((x, y), (x, y), 40, 0, 1.0), "m_public="),
        (lambda x, y: classical.histogram_trainer(x[:, :1], x[:, 0], 40, 40, 1.0), "train="),
    ],
)
def test_malformed_inputs_are_refused_when_the_trainer_is_built(call, named):
    """A mistake in the arrays or the factory's arguments is one TuningConfigError naming the
    keyword, raised before anything is trained (it used to surface as every candidate failing
    inside a charged run, or as a ZeroDivisionError)."""
    x, y = _data(40, 3, 0)
    with pytest.raises(dptune.TuningConfigError, match=named) as e:
        call(x, y)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("kind", "sp", "named"),
    [
        ("logistic", {"regularization": space.choice(-1.0, 0.1)}, "regularization=-1.0"),
        ("ridge", {"regularisation": space.choice(1.0, 0.1)}, "regularisation"),
        ("histogram", {"bins": space.choice(2.5, 8)}, "bins=2.5"),
        ("histogram", {"bins": space.choice(0, 8)}, "bins=0"),
        ("logistic", {"regularization": space.choice(1.0, 0.1), "noise_multiplier": 0.0},
         "noise_multiplier=0.0"),
    ],
)  # fmt: skip
def test_space_mistakes_are_refused_before_anything_trains(kind, sp, named):
    """A search-space value the learner cannot train (or would train as another value: bins=2.5
    ran with 2 bins and released 2.5) is refused by ``dptune.tune`` before any candidate runs."""
    ran = []
    if kind == "histogram":
        z = np.random.default_rng(0).uniform(size=60)
        tr = classical.histogram_trainer(z[:40], z[40:], 40, 20, 1.0)
    else:
        make = classical.ridge_trainer if kind == "ridge" else classical.logistic_trainer
        tr = make(_data(40, 3, 0), _data(20, 3, 1), 40, 20, 1.0)
    fn = tr.fn
    tr.fn = lambda hp, rng: ran.append(hp) or fn(hp, rng)
    with pytest.raises(dptune.TuningConfigError, match=named):
        dptune.tune(tr, {"noise_multiplier": "auto", **sp}, RandomStopping.logarithmic(2),
                    (2.0, 1e-3), seed=0, progress=False, ledger=None)  # fmt: skip
    assert ran == []


@pytest.mark.parametrize("kind", ["ridge", "gaussian", "logistic", "histogram"])
def test_a_non_finite_record_is_left_out_on_its_own(kind):
    """Adding one record with a NaN or infinite feature or label changes nothing: the candidate's
    score and model equal those without it (it used to turn every candidate into a failure, or
    a garbage model: one record flipping the release)."""
    hp = {"noise_multiplier": 0.5, "regularization": 0.1, "bins": 8}
    if kind == "histogram":
        z = np.random.default_rng(1).uniform(size=60)
        a = classical.histogram_trainer(z[:40], z[40:], 40, 20, 1.0)
        b = classical.histogram_trainer(np.append(z[:40], np.nan), z[40:], 40, 20, 1.0)
        key = "density"
    else:
        (x, y), val = _data(40, 3, 2), _data(20, 3, 3)
        make = {
            "ridge": classical.ridge_trainer,
            "logistic": classical.logistic_trainer,
            "gaussian": lambda *a: classical.ridge_trainer(*a, mechanism="gaussian"),
        }[kind]
        a = make((x, y), val, 40, 20, 1.0)
        for bad_x, bad_y in (([np.nan, 0.0, 1.0], 1.0), ([np.inf, 0.0, 1.0], -1.0),
                             ([0.1, 0.2, 0.3], np.nan)):  # fmt: skip
            b = make((np.vstack([x, bad_x]), np.append(y, bad_y)), val, 40, 20, 1.0)
            sa, pa = a.fn(hp, np.random.default_rng(7))
            sb, pb = b.fn(hp, np.random.default_rng(7))
            assert sa == sb and np.array_equal(pa["w"], pb["w"])
        assert b.curator_view() == {"non_finite_train_records": 1}
        return
    sa, pa = a.fn(hp, np.random.default_rng(7))
    sb, pb = b.fn(hp, np.random.default_rng(7))
    assert math.isfinite(sa) and sa == sb and np.array_equal(pa[key], pb[key])


def test_labels_in_any_binary_encoding_train_the_same_model():
    """{-1, +1}, {0, 1} integers and booleans are read the same way (y > 0 is +1), for ridge too
    (which used to regress on {0, 1} targets while scoring against the signs), and lists work."""
    (x, y), (xv, yv) = _data(40, 3, 4), _data(20, 3, 5)
    hp = {"noise_multiplier": 0.5, "regularization": 0.1}
    for make in (classical.ridge_trainer, classical.logistic_trainer):
        outs = [
            make((xx, yy), (xv, yv), 40, 20, 1.0).fn(hp, np.random.default_rng(3))
            for xx, yy in ((x, y), (x, (y > 0).astype(int)), (x, y > 0), (x.tolist(), list(y)))
        ]
        for score, payload in outs[1:]:
            assert score == outs[0][0] and np.array_equal(payload["w"], outs[0][1]["w"])


def test_ledger_fingerprint_is_the_multiset_of_records():
    """The ledger charges the same budget however the records are ordered or split (a shuffle
    used to open a fresh budget); another record is another dataset."""
    x, y = _data(30, 3, 6)
    fp = classical.logistic_trainer((x[:20], y[:20]), (x[20:], y[20:]), 20, 10, 1.0).fingerprint
    p = np.random.default_rng(0).permutation(30)
    xs, ys = x[p], y[p]
    moved = classical.logistic_trainer((xs[:25], ys[:25]), (xs[25:], ys[25:]), 25, 5, 1.0)
    assert moved.fingerprint == fp
    other = classical.logistic_trainer((x[:20], -y[:20]), (x[20:], y[20:]), 20, 10, 1.0)
    assert other.fingerprint != fp


@pytest.mark.parametrize("argv", [["--epsilon=-1"], ["--epsilon=nan"], ["--learner=foo"]])
def test_command_line_mistakes_are_one_refusal_line(argv, capsys):
    """A wrong flag is one ``dptune: refused:`` line and exit code 2 (a negative epsilon used to
    end in a TuningConfigError traceback), before the data is loaded."""
    with pytest.raises(SystemExit) as e:
        classical.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("dptune: refused: ") and err.count("\n") == 1


def test_the_console_says_records_were_left_out_not_how_many(caplog):
    """How many private records have a NaN is a statistic of the data: the curator's view holds
    it, the console only says that some were left out."""
    x, y = _data(40, 3, 2)
    x[:3, 0] = np.nan
    with caplog.at_level("WARNING", logger="dptune"):
        tr = classical.ridge_trainer((x, y), _data(20, 3, 3), 40, 20, 1.0)
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert said and not any(c.isdigit() for m in said for c in m), said
    assert tr.curator_view() == {"non_finite_train_records": 3}
