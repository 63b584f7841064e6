"""Reproduction of Ligett et al. 2017 (Accuracy First), Fig. 1c: ex-post privacy loss of
covariance perturbation with noise reduction (CovNR, their Alg. 3) against the doubling method
(Alg. 4), across accuracy targets alpha, for ridge regression.

Data: Fashion-MNIST training file (the project's per-record training split), binary label "top"
(T-shirt, pullover, coat, shirt: +1) vs the rest (-1); features: 4x4 average-pooled pixels (49),
each row scaled to l1 norm <= 1 (a per-record map; the paper divides by the data's max norm, which
is not private). Loss, constants and parameters as in their §3.1 and App. B.1: L(theta) =
||y - X theta||^2 / (2n) + lambda ||theta||^2 / 2 over ||theta|| <= sqrt(1/lambda), lambda = 0.005,
gamma = 0.1, query sensitivity Delta = (sqrt(1/lambda) + 1)^2 / n (Claim A.5), IAT epsilon
eps_0 = 16 Delta log(2T/gamma) / alpha, T = 1000 noise-reduction levels from 1/n to 4E
(E: the epsilon at which their Thm 3.1 promises expected excess risk alpha), doubling from 1/n
until 4E. n is the PUBLIC nominal training size. The statistics (X^T X, X^T y) get l1 sensitivity
4 (their Lemma A.6: 2 + 2).

Run (declared in docs/reproductions/accuracy_first.md before running):
  nice -n 10 python scripts/repro_accuracy_first.py --trials 20 \
      --out results/reproductions/accuracy_first
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import _plots
import numpy as np
from scipy import optimize

from selection.accuracy_first import accuracy_first, doubling_method

REPO = Path(__file__).resolve().parents[1]


def load(data_dir: str) -> tuple[np.ndarray, np.ndarray, int]:
    from trainers.data import load_dataset

    d = load_dataset("fashion_mnist", data_dir, validation_size=5000, source="idx")
    x = d.train_x.reshape(-1, 7, 4, 7, 4).mean(axis=(2, 4)).reshape(-1, 49).astype(np.float64)
    x = x / np.maximum(np.abs(x).sum(axis=1), 1e-12)[:, None]
    y = np.where(np.isin(d.train_y, [0, 2, 4, 6]), 1.0, -1.0)
    return x, y, int(d.public_num_train)


def constrained_quadratic(a: np.ndarray, b: np.ndarray, radius: float) -> np.ndarray:
    """argmin 0.5 t^T a t - b^T t over ||t|| <= radius (trust-region subproblem, solved exactly
    by the eigendecomposition of the symmetric part of a; the 'hard case' has probability 0)."""
    mu, q = np.linalg.eigh(0.5 * (a + a.T))
    c = q.T @ b
    if mu[0] > 0 and np.linalg.norm(c / mu) <= radius:
        return q @ (c / mu)

    def norm_gap(nu):
        return np.linalg.norm(c / (mu + nu)) - radius

    lo = max(0.0, -mu[0]) + 1e-12
    hi = lo + np.linalg.norm(c) / radius + 1.0
    nu = optimize.brentq(norm_gap, lo, hi, xtol=1e-14)
    return q @ (c / (mu + nu))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "fashion-mnist"))
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--alphas", default="0.01,0.02,0.05,0.1,0.15,0.2")
    ap.add_argument("--levels", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "results" / "reproductions" / "accuracy_first"))
    args = ap.parse_args()
    t0 = time.time()
    x, y, n = load(args.data)
    p, lam, gamma, T = x.shape[1], 0.005, 0.1, args.levels
    radius = math.sqrt(1.0 / lam)
    xtx, xty, yty = x.T @ x, x.T @ y, float(y @ y)

    def loss(theta):
        r = yty - 2 * theta @ xty + theta @ xtx @ theta
        return r / (2 * n) + lam * theta @ theta / 2

    def hypothesis(v):
        z, zy = v[: p * p].reshape(p, p), v[p * p :]
        return constrained_quadratic(z / n + lam * np.eye(p), zy / n, radius)

    theta_star = hypothesis(np.concatenate([xtx.ravel(), xty]))
    l_star = loss(theta_star)
    delta_q = (radius + 1) ** 2 / n
    v = np.concatenate([xtx.ravel(), xty])
    rng = np.random.default_rng(args.seed)
    rows = []
    for alpha in [float(a) for a in args.alphas.split(",")]:
        big_e = 4 * math.sqrt(2) * (2 * math.sqrt(p / lam) + p / lam) / (n * alpha)
        eps = np.geomspace(1.0 / n, 4 * big_e, T)
        eps0 = 16 * delta_q * math.log(2 * T / gamma) / alpha
        t_double = math.ceil(math.log2(4 * big_e * n))
        nr, dbl = [], []
        for _ in range(args.trials):
            r = accuracy_first(
                v,
                4.0,
                eps,
                hypothesis,
                lambda th: l_star - loss(th),
                -alpha / 2,
                delta_q,
                eps0,
                rng,
            )
            excess = loss(r.hypothesis) - l_star if r.released else math.nan
            nr.append((r.released, r.ex_post_epsilon, r.worst_case_epsilon, excess))

            def train(e, g):
                return hypothesis(v + g.laplace(0.0, 4.0 / e, size=v.shape))

            d = doubling_method(
                1.0 / n,
                t_double,
                train,
                lambda th: l_star - loss(th),
                alpha,
                gamma,
                delta_q,
                rng,
            )
            excess = loss(d.hypothesis) - l_star if d.released else math.nan
            dbl.append((d.released, d.ex_post_epsilon, d.worst_case_epsilon, excess))
        for name, res in (("noise_reduction", nr), ("doubling", dbl)):
            a = np.array(res, dtype=float)
            rows.append(
                {
                    "method": name,
                    "alpha": alpha,
                    "released_fraction": float(a[:, 0].mean()),
                    "mean_ex_post_epsilon": float(a[:, 1].mean()),
                    "median_ex_post_epsilon": float(np.median(a[:, 1])),
                    "worst_case_epsilon": float(a[0, 2]),
                    "mean_excess_risk_released": float(np.nanmean(a[:, 3]))
                    if a[:, 0].any()
                    else None,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    out = {
        "rows": rows,
        "n_public": n,
        "n_actual": int(len(y)),
        "dim": p,
        "lambda": lam,
        "gamma": gamma,
        "levels": T,
        "trials": args.trials,
        "seed": args.seed,
        "loss_star": l_star,
        "wall_s": time.time() - t0,
    }
    Path(args.out + ".json").write_text(json.dumps(out, indent=1))
    fig, ax = _plots.figure()
    for name, style in (("noise_reduction", "o-"), ("doubling", "s--")):
        rs = [r for r in rows if r["method"] == name]
        ax.plot(
            [r["alpha"] for r in rs], [r["mean_ex_post_epsilon"] for r in rs], style, label=name
        )
    _plots.save(
        fig, ax, args.out + ".png", yscale="log", ylabel="mean ex-post epsilon",
        xlabel="accuracy target alpha (excess empirical risk)",
        title="Ridge, Fashion-MNIST tops vs rest",
    )  # fmt: skip
    print(f"wall {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
