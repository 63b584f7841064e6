"""Privacy accounting for private hyperparameter tuning: one (epsilon, delta) for the whole run.

Candidates (DP-SGD runs, optionally with a private validation score, or any ``DpEvent``) are
accounted by dp_accounting (RDP and PLD); the selection theorems come from ``selection.privacy``;
this package combines them along every valid route and states the result::

    from dptune import accounting
    from selection.privacy import PoissonStoppingPrivacy

    cand = accounting.DpSgdCandidate(sampling_rate=256 / 60000, steps=7032, noise_multiplier=1.1)
    st = accounting.total_privacy(cand, PoissonStoppingPrivacy(mean=10), delta=1e-5)
    print(st.to_text())   # total epsilon 3.25 (PS Thm 6, delta-hat from PLD); one run 1.64
"""

from dptune.accounting.calibration import Calibration, calibrate, calibrate_noise, naive_trials
from dptune.accounting.epsilon import (
    DEFAULT_ORDERS,
    composed_pld_epsilon,
    pld_delta,
    pld_epsilon,
    rdp_curve,
    rdp_epsilon,
)
from dptune.accounting.events import (
    Candidate,
    DpSgdCandidate,
    EventCandidate,
    as_candidates,
    dominating_dpsgd_candidate,
    pareto_candidates,
    pure_epsilon,
)
from dptune.accounting.reference import repeat_and_select_epsilon
from dptune.accounting.statement import PrivacyStatement
from dptune.accounting.totals import ACCOUNTANTS, Route, routes, total_privacy

__all__ = ["ACCOUNTANTS", "Calibration", "Candidate", "calibrate", "DEFAULT_ORDERS",
    "DpSgdCandidate", "EventCandidate", "PrivacyStatement", "Route", "as_candidates",
    "calibrate_noise", "composed_pld_epsilon", "dominating_dpsgd_candidate", "naive_trials",
    "pareto_candidates", "pld_delta", "pld_epsilon", "pure_epsilon", "rdp_curve",
    "rdp_epsilon", "repeat_and_select_epsilon", "routes", "total_privacy"]  # fmt: skip
