"""dp_accounting's own repeat-and-select route, kept as the reference that ``accountant="rdp"``
must reproduce (and that tests and benchmarks compare against).

dp_accounting 0.6.0 implements Papernot & Steinke 2022 (Thm 2 for truncated negative binomial
counts with shape eta >= 0, Thm 6 for Poisson) as ``dp_event.RepeatAndSelectDpEvent`` in its RDP
accountant only; it does not re-export the class at the package top level.
"""

from __future__ import annotations

from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant

from dptune.accounting.epsilon import DEFAULT_ORDERS, _rdp_of, check_delta
from dptune.accounting.events import as_candidates


def repeat_and_select_epsilon(candidate, mean: float, shape: float, delta: float) -> float:
    """epsilon at ``delta`` of dp_accounting's RDP repeat-and-select route (default orders) over one
    candidate without a private score (dp_accounting's event takes one event: no parallel
    composition). ``mean``: E[K] >= 1; ``shape``: 0 logarithmic, 1 geometric, (0, inf) truncated
    negative binomial, ``math.inf`` Poisson (dp_accounting rejects shape < 0)."""
    delta = check_delta(delta)
    cands = as_candidates(candidate)
    if len(cands) != 1 or len(cands[0].branches()) != 1:
        raise ValueError(
            "dp_accounting's RepeatAndSelectDpEvent takes one event: give one candidate without a "
            "private score."
        )
    event = dp_event.RepeatAndSelectDpEvent(cands[0].branches()[0], float(mean), float(shape))
    rdp = _rdp_of(event, DEFAULT_ORDERS)  # what RdpAccountant.get_epsilon reads
    return float(rdp_privacy_accountant.compute_epsilon(DEFAULT_ORDERS, rdp, delta)[0])
