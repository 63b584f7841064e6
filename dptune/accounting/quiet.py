"""dp_accounting's expected warnings, summarised in one line instead of dumped.

At high sampling rates dp_accounting's RDP accountant cannot evaluate the series of some Rényi
orders and logs, for each one, ``_compute_log_a_frac failed to converge ... Excluding this order
from the epsilon computation``. The order is left out and the minimum over the others is still a
valid (if looser) bound, so inside :func:`summarised_accounting_warnings` such lines are counted
and reported once, at INFO level, by the ``dptune`` logger.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

log = logging.getLogger("dptune")

_state = {"depth": 0, "count": 0}


def _drop_excluded_order(record: logging.LogRecord) -> bool:
    """A logging filter: drops (and counts) dp_accounting's excluded-order warnings."""
    if str(record.msg).startswith("_compute_log_a_frac failed to converge"):
        _state["count"] += 1
        return False
    return True


@contextlib.contextmanager
def summarised_accounting_warnings() -> Iterator[None]:
    """Within the block, dp_accounting's excluded-order warnings are counted, not printed; the
    outermost block then logs one line if there were any. Re-entrant."""
    absl_logger = logging.getLogger("absl")
    if _state["depth"] == 0:
        _state["count"] = 0
        absl_logger.addFilter(_drop_excluded_order)
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            absl_logger.removeFilter(_drop_excluded_order)
            if _state["count"]:
                log.info(
                    "dp_accounting left out %d Renyi order evaluation(s) whose series did not "
                    "converge (expected at high sampling rates); the bound uses the other "
                    "orders and stays valid",
                    _state["count"],
                )


#: Decorator: each call of the function runs inside :func:`summarised_accounting_warnings` (a
#: generator context manager re-creates itself per call, so one serves every function).
quiet_accounting = summarised_accounting_warnings()
