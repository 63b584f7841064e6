"""Regenerates the "What tuning costs" table of README.md and docs/accounting.md.

    python scripts/accounting_table.py            # every column (nine calibrations: ~1 min)
    python scripts/accounting_table.py --no_sigma # the epsilon columns only (seconds)

The case: q = 256/60000, sigma = 1.1, 7032 steps, delta = 1e-5, ten candidates expected, exact
(public) validation score. "auto" is the tightest valid route (``dptune.accounting``), "RDP"
dp_accounting's RDP route; "x one run" divides the auto total by one untuned run's auto epsilon; the
last column calibrates the noise multiplier so that the whole run is (3, 1e-5)-DP.
``tests/dptune/accounting/test_published_numbers.py`` checks the table's epsilon columns against
:func:`rows`.
"""

from __future__ import annotations

import argparse
from typing import Any

from dptune import accounting
from selection import privacy as sp

Q, SIGMA, STEPS, DELTA, TARGET = 256 / 60000, 1.1, 7032, 1e-5, 3.0

#: (row label as printed, E[trainings] as printed, the selection's privacy transform or None)
METHODS: list[tuple[str, str, Any]] = [
    ("one run, no tuning", "1", None),
    ("naive best-of-10 (composition)", "10", sp.BestOfKPrivacy(10)),
    (
        "random stopping, geometric (LT Thm 3.2 = PS Thm 2, η=1)",
        "10",
        sp.RandomStoppingPrivacy.from_mean(10.0, 1.0),
    ),
    ("random stopping, TNB η=0.5 (PS Thm 2)", "10", sp.RandomStoppingPrivacy.from_mean(10.0, 0.5)),
    (
        "random stopping, logarithmic (PS Thm 2, η=0)",
        "10",
        sp.RandomStoppingPrivacy.from_mean(10.0, 0.0),
    ),
    (
        "random stopping, TNB η=−0.5 (PS Thm 2)",
        "10",
        sp.RandomStoppingPrivacy.from_mean(10.0, -0.5),
    ),
    ("random stopping, Poisson (PS Thm 6)", "10", sp.PoissonStoppingPrivacy(10.0)),
    ("thresholding, γ=0.1 (LT Alg. 1; PS App. C Cor. 16)", "≤ 10", sp.ThresholdingPrivacy(0.1)),
    (
        "capped random stopping, γ=0.1, T=300 (ours: profile of min(K, T); (ε₁, δ₁) bound for RDP)",
        "≤ 10",
        sp.HardCappedRandomStoppingPrivacy(0.1, 300),
    ),
]


def _route(route: str) -> str:
    return route if route == "profile" else route.upper()


def rows(sigma_column: bool = True) -> list[dict[str, Any]]:
    """One dict per method: label, trainings, auto, route (the auto route's accountant), rdp,
    times (auto / one run's auto) and, with ``sigma_column``, sigma for a total of (3, 1e-5)."""
    cand = accounting.DpSgdCandidate(Q, STEPS, SIGMA)
    out = []
    for label, trainings, transform in METHODS:
        auto = accounting.total_privacy(cand, transform, DELTA, "auto")
        rdp = accounting.total_privacy(cand, transform, DELTA, "rdp")
        row = {
            "label": label,
            "trainings": trainings,
            "auto": auto.total_epsilon,
            # The profile route (ProfileSelectionBound) reads the PLD too; name it.
            "route": "profile" if "profile" in auto.route else auto.accountant,
            "rdp": rdp.total_epsilon,
        }
        if sigma_column:
            row["sigma"] = accounting.calibrate_noise(
                Q, STEPS, transform, TARGET, DELTA, "auto", compare=False
            ).noise_multiplier
        out.append(row)
    for row in out:
        row["times"] = row["auto"] / out[0]["auto"]
    return out


def _eps(x: float) -> str:
    return f"{x:.4g}" if x >= 10 else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no_sigma", action="store_true", help="skip the calibration column")
    args = ap.parse_args()
    print(
        "| method | E[trainings] | total ε (auto) | route | total ε (RDP) | × one run "
        "| σ for total ε = 3 |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows(sigma_column=not args.no_sigma):
        sigma = f"{r['sigma']:.3f}" if "sigma" in r else "-"
        print(
            f"| {r['label']} | {r['trainings']} | {_eps(r['auto'])} | {_route(r['route'])} | "
            f"{_eps(r['rdp'])} | ×{r['times']:.2f} | {sigma} |"
        )


if __name__ == "__main__":
    main()
