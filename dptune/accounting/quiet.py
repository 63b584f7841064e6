"""dp_accounting's expected warnings, summarised in one line instead of dumped.

At high sampling rates dp_accounting's RDP accountant cannot evaluate the series of some Rényi
orders and logs, for each one, ``_compute_log_a_frac failed to converge ... Excluding this order
from the epsilon computation`` (``dp_accounting/rdp/rdp_privacy_accountant.py``). That is not an
accounting failure: the order is left out and the minimum over the remaining orders is still a
valid (if possibly looser) bound. A calibration asks for many orders, so a newcomer would see
dozens of such lines; inside :func:`summarised_accounting_warnings` they are counted and reported
once, at INFO level, by the ``dptune`` logger.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("dptune")

#: The start of dp_accounting's per-order warning.
_EXCLUDED_ORDER = "_compute_log_a_frac failed to converge"

_state = {"depth": 0, "count": 0}


class _ExcludedOrders(logging.Filter):
    """Drops (and counts) dp_accounting's excluded-order warnings."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(_EXCLUDED_ORDER):
            _state["count"] += 1
            return False
        return True


_FILTER = _ExcludedOrders()


@contextlib.contextmanager
def summarised_accounting_warnings() -> Iterator[None]:
    """Within the block, dp_accounting's excluded-order warnings are counted, not printed; the
    outermost block then logs one line if there were any. Re-entrant."""
    absl_logger = logging.getLogger("absl")
    if _state["depth"] == 0:
        _state["count"] = 0
        absl_logger.addFilter(_FILTER)
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        if _state["depth"] == 0:
            absl_logger.removeFilter(_FILTER)
            if _state["count"]:
                log.info(
                    "dp_accounting left out %d Renyi order evaluation(s) whose series did not "
                    "converge (expected at high sampling rates); the bound uses the other "
                    "orders and stays valid",
                    _state["count"],
                )


def quiet_accounting(fn: F) -> F:
    """Decorator: ``fn`` runs inside :func:`summarised_accounting_warnings`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with summarised_accounting_warnings():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
