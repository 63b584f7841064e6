"""Private selection of a DP histogram's bin count: the `selection` package without any neural net.

The task: publish a differentially private density estimate (a histogram) of values in [0, 1),
with the number of bins chosen on the same private data. Each *candidate*

1. draws a bin count b log-uniformly from [2, 128] (random search: the hyperparameter does not
   depend on the candidate's position, so releasing it reveals nothing about how many ran);
2. builds a histogram of the training half with Laplace(1/eps) noise on every count
   (adding or removing one record changes one count by 1: eps-DP);
3. scores it by the validation half's log-likelihood, each point's log-density clipped to
   [-L, L] and the sum noised with Laplace(L/eps) (adding or removing one validation record moves
   the sum by <= L: eps-DP), divided by the nominal (public) validation size.

A record is in either the training or the validation half, so by parallel composition each
candidate is eps-DP. `RandomStopping.logarithmic(mean)` then releases the best candidate at
2 eps in total (Papernot & Steinke 2022, Cor. 3 with eta = 0), whatever the mean number of
candidates; `BestOfK(k)` would cost k eps (composition). Only the released candidate is printed:
the number of candidates tried and their scores are private.

Run:  python examples/selection_laplace.py --epsilon 0.5 --mean 10
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from selection import BestOfK, RandomStopping

CLIP = 4.0  # L: per-point clip of the log-density to [-L, L] (nats): the score's sensitivity


def synthetic_data(n: int, rng: np.random.Generator) -> np.ndarray:
    """Public stand-in for private data: a two-component Beta mixture on [0, 1)."""
    first = rng.random(n) < 0.6
    values = np.where(first, rng.beta(2.0, 8.0, n), rng.beta(9.0, 3.0, n))
    return np.minimum(values, np.nextafter(1.0, 0.0))


def make_candidate(train: np.ndarray, valid: np.ndarray, epsilon: float, nominal_size: int):
    """A candidate(index, rng) -> (score, payload) that is epsilon-DP with respect to the data.

    ``nominal_size``: the public, planned size of the validation half (not the private count).
    """

    def candidate(index: int, rng: np.random.Generator) -> tuple[float, dict[str, Any]]:
        del index  # the hyperparameter is drawn independently of the position
        bins = int(round(math.exp(rng.uniform(math.log(2), math.log(128)))))
        counts = np.bincount((train * bins).astype(int), minlength=bins).astype(float)
        noisy = np.maximum(counts + rng.laplace(0.0, 1.0 / epsilon, bins), 0.0) + 0.5
        density = noisy / noisy.sum() * bins  # piecewise-constant density on [0, 1)
        log_density = np.clip(np.log(density[(valid * bins).astype(int)]), -CLIP, CLIP)
        noisy_sum = log_density.sum() + rng.laplace(0.0, CLIP / epsilon)
        return float(noisy_sum / nominal_size), {"bins": bins, "density": density}

    return candidate


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000, help="number of private records")
    parser.add_argument("--epsilon", type=float, default=0.5, help="each candidate's eps")
    parser.add_argument("--mean", type=float, default=10.0, help="expected number of candidates")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="fixed seed (debugging only: privacy then holds only while the seed is secret); "
        "default: OS entropy",
    )
    args = parser.parse_args(argv)

    data_rng = np.random.default_rng(0)  # the synthetic data itself is public and fixed
    data = synthetic_data(args.n, data_rng)
    train, valid = data[: args.n // 2], data[args.n // 2 :]

    method = RandomStopping.logarithmic(args.mean)
    result = method.run(
        make_candidate(train, valid, args.epsilon, args.n - args.n // 2), rng=args.seed
    )

    transform = method.privacy
    total = transform.pure_dp(args.epsilon)
    naive = BestOfK(max(1, round(args.mean))).privacy.pure_dp(args.epsilon)
    if result.released:
        print(f"released: {result.payload['bins']} bins, noisy validation score {result.score:.4f}")
    else:  # cannot happen for logarithmic counts (K >= 1), kept for other methods
        print("released: nothing")
    print(
        f"privacy: each candidate {args.epsilon:g}-DP; total {total:g}-DP by {transform.theorem} "
        f"(best of a fixed {max(1, round(args.mean))} would cost {naive:g})"
    )
    return {
        "released": result.released,
        "bins": result.payload["bins"] if result.released else None,
        "score": result.score,
        "total_epsilon": total,
        "theorem": transform.theorem,
        "selection": result,
    }


if __name__ == "__main__":
    main()
