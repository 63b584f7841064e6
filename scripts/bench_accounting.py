"""Times dptune.accounting calls (cold caches) and prints a table.

    python scripts/bench_accounting.py [--repeats=3]

The reference case: q = 256/60000, sigma = 1.1, 7032 steps, delta = 1e-5, E[K] = 10.
Targets: one RDP total < 0.1 s, one PLD total < 1 s, a calibration < 3 s (RDP) and < 15 s (PLD).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

from dptune import accounting
from dptune.accounting.epsilon import clear_caches
from selection import privacy as sp

Q, SIGMA, STEPS, DELTA = 256 / 60000, 1.1, 7032, 1e-5
CAND = accounting.DpSgdCandidate(Q, STEPS, SIGMA)


def cases():
    poisson = sp.PoissonStoppingPrivacy(10.0)
    log = sp.RandomStoppingPrivacy.from_mean(10.0, 0.0)
    tnb = sp.RandomStoppingPrivacy.from_mean(10.0, 0.5)
    geo = sp.RandomStoppingPrivacy.from_mean(10.0, 1.0)
    naive = sp.BestOfKPrivacy(10)
    thr = sp.ThresholdingPrivacy(0.1)

    def total(tr, acc):
        return lambda: accounting.total_privacy(CAND, tr, DELTA, acc).total_epsilon

    def cal(tr, acc):
        return lambda: (
            accounting.calibrate_noise(
                Q, STEPS, tr, 3.0, DELTA, acc, compare=False
            ).noise_multiplier
        )

    return [
        ("total", "single run", "rdp", 0.1, total(None, "rdp")),
        ("total", "single run", "pld", 1.0, total(None, "pld")),
        ("total", "poisson (PS Thm 6)", "rdp", 0.1, total(poisson, "rdp")),
        ("total", "poisson (PS Thm 6)", "pld", 1.0, total(poisson, "pld")),
        ("total", "poisson (PS Thm 6)", "auto", 1.0, total(poisson, "auto")),
        ("total", "logarithmic (PS Thm 2)", "rdp", 0.1, total(log, "rdp")),
        ("total", "tnb eta=0.5 (PS Thm 2)", "rdp", 0.1, total(tnb, "rdp")),
        ("total", "geometric (LT Thm 3.2)", "rdp", 0.1, total(geo, "rdp")),
        ("total", "threshold (PS Cor. 16)", "rdp", 0.1, total(thr, "rdp")),
        ("total", "naive best-of-10", "rdp", 0.1, total(naive, "rdp")),
        ("total", "naive best-of-10", "pld", 1.0, total(naive, "pld")),
        ("calibrate eps=3", "single run", "rdp", 3.0, cal(None, "rdp")),
        ("calibrate eps=3", "single run", "pld", 15.0, cal(None, "pld")),
        ("calibrate eps=3", "logarithmic", "rdp", 3.0, cal(log, "rdp")),
        ("calibrate eps=3", "poisson", "rdp", 3.0, cal(poisson, "rdp")),
        ("calibrate eps=3", "poisson", "pld", 15.0, cal(poisson, "pld")),
        ("calibrate eps=3", "naive best-of-10", "pld", 15.0, cal(naive, "pld")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(load average {os.getloadavg()[0]:.1f}), python {platform.python_version()}"
    )
    print(f"case: q={Q:.6g}, sigma={SIGMA}, steps={STEPS}, delta={DELTA:g}, E[K]=10; cold caches")
    print()
    header = f"| {'call':<16}| {'selection':<24}| {'acct':<5}| {'result':>8} | "
    header += f"{'median s':>8} | {'max s':>6} | {'target s':>8} |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for call, sel, acc, target, fn in cases():
        times = []
        for _ in range(args.repeats):
            clear_caches()
            t0 = time.perf_counter()
            value = fn()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        flag = "" if med < target else "  (over target)"
        print(
            f"| {call:<16}| {sel:<24}| {acc:<5}| {value:8.4f} | {med:8.3f} | "
            f"{max(times):6.3f} | {target:8.1f} |{flag}"
        )


if __name__ == "__main__":
    main()
