"""Total epsilon of random stopping at the README setting: auto without and with the profile route.

The profile route is ``selection.profiles.ProfileSelectionBound`` fed with the candidate's PLD.

    python scripts/profile_accounting.py            # q = 256/60000, sigma = 1.1, 7032 steps, 1e-5
    python scripts/profile_accounting.py --mean 100

Prints one markdown table: for each count with E[K] = mean, the minimum over every route except the
profile route (what ``auto`` gave before it existed), the profile route alone, the new ``auto``
(minimum over all routes) and the relative change.
"""

from __future__ import annotations

import argparse
import time

from dptune import accounting
from selection import privacy as sp


def rows(q: float, sigma: float, steps: int, delta: float, mean: float):
    cand = accounting.DpSgdCandidate(q, steps, sigma)
    transforms = [
        ("logarithmic (eta = 0)", sp.RandomStoppingPrivacy.from_mean(mean, 0.0)),
        ("TNB eta = -0.5", sp.RandomStoppingPrivacy.from_mean(mean, -0.5)),
        ("TNB eta = 0.5", sp.RandomStoppingPrivacy.from_mean(mean, 0.5)),
        ("geometric (eta = 1)", sp.RandomStoppingPrivacy.from_mean(mean, 1.0)),
        ("Poisson", sp.PoissonStoppingPrivacy(mean)),
    ]
    for label, tr in transforms:
        t0 = time.perf_counter()
        found = accounting.routes(cand, tr, delta, "auto")
        seconds = time.perf_counter() - t0
        before = min(r.epsilon for r in found if r.theorem is None)
        profile = min(r.epsilon for r in found if r.theorem is not None)
        after = min(r.epsilon for r in found)
        yield label, before, profile, after, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sampling_rate", type=float, default=256 / 60000)
    parser.add_argument("--noise_multiplier", type=float, default=1.1)
    parser.add_argument("--steps", type=int, default=7032)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--mean", type=float, default=10.0)
    a = parser.parse_args()
    print(
        f"q = {a.sampling_rate:.6g}, sigma = {a.noise_multiplier:g}, {a.steps} steps, "
        f"delta = {a.delta:g}, E[K] = {a.mean:g}\n"
    )
    print("| count | auto before (no profile route) | profile route | auto now | change | s |")
    print("|---|---|---|---|---|---|")
    for label, before, profile, after, s in rows(
        a.sampling_rate, a.noise_multiplier, a.steps, a.delta, a.mean
    ):
        print(
            f"| {label} | {before:.3f} | {profile:.3f} | {after:.3f} | "
            f"{100 * (after / before - 1):+.1f}% | {s:.1f} |"
        )


if __name__ == "__main__":
    main()
