"""Input checks shared by the theorem classes (``selection.privacy``) and the privacy-profile bounds
(``selection.profiles``): each raises ValueError naming the value."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def set_frozen(obj: object, **values: object) -> None:
    """Store validated values on a frozen dataclass (from its ``__post_init__``)."""
    for name, value in values.items():
        object.__setattr__(obj, name, value)


def check_positive(value: float, name: str) -> float:
    """``value`` as a float, if it is a finite number > 0."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = math.nan  # a string or None: refused below, naming the field
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return v


def check_poisson_mean(mean: float) -> float:
    """The mean of a Poisson count: a finite number > 0."""
    m = float(mean)
    if not (math.isfinite(m) and m > 0.0):
        raise ValueError(f"Poisson mean must be a finite number > 0, got {mean}")
    return m


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    epsilon = float(epsilon)
    if not (epsilon >= 0.0) or math.isnan(epsilon):
        raise ValueError(f"{name} must be >= 0 (a candidate's DP epsilon), got {epsilon}")
    return epsilon


def check_count(value: int, name: str) -> int:
    """``value`` as an int, if it is an integer >= 1 (a number of candidates or levels)."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value}")
    return int(value)


def check_cap(gamma: float, max_trials: int) -> tuple[float, int]:
    """(gamma, T) of a capped geometric count: gamma in (0, 1], T an integer >= 1."""
    g = float(gamma)
    if not (0.0 < g <= 1.0):
        raise ValueError(f"gamma (stop probability) must be in (0, 1], got {gamma}")
    return g, check_count(max_trials, "max_trials")


def check_delta(delta: float, name: str = "delta") -> float:
    delta = float(delta)
    if not (0.0 <= delta <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {delta}")
    return delta


def check_curve(orders: Sequence[float], rdp: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Validate an RDP curve: orders >= 1 (1 = KL), rdp >= 0 (inf allowed), same length, 1-D."""
    o = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if o.ndim != 1 or r.ndim != 1:
        raise ValueError(f"orders and rdp must be 1-D, got shapes {o.shape} and {r.shape}")
    if o.shape != r.shape:
        raise ValueError(f"orders and rdp must have the same length, got {o.size} and {r.size}")
    if o.size == 0:
        raise ValueError("orders must not be empty")
    if not np.all(np.isfinite(o) & (o >= 1.0)):
        # The theorems hold for finite orders; an infinite one also makes Cor. 16's (a-2)/(a-1)
        # NaN, which dp_accounting's compute_epsilon would report as epsilon 0.
        bad = o[~(np.isfinite(o) & (o >= 1.0))][0]
        raise ValueError(f"every Renyi order must be a finite number >= 1, got {bad!r}")
    if np.any(np.isnan(r)) or np.any(r < 0.0):
        raise ValueError("every RDP value must be >= 0 (inf allowed), got a negative or NaN value")
    return o, r


def monotone_envelope(orders: np.ndarray, values: np.ndarray) -> np.ndarray:
    """out[i] = min over orders[j] >= orders[i] of values[j].

    Valid because the Rényi divergence is non-decreasing in the order [vEH14, Thm 3], so a bound at
    a higher order bounds every lower order. The same envelope as dp_accounting 0.6.0 (a minimum
    involves no rounding, so results agree bit for bit), computed as a suffix minimum over sorted
    orders; ties in the order see each other through ``searchsorted(side="left")``.
    """
    order_idx = np.argsort(orders, kind="stable")
    sorted_orders = orders[order_idx]
    suffix_min = np.minimum.accumulate(values[order_idx][::-1])[::-1]
    return suffix_min[np.searchsorted(sorted_orders, orders, side="left")]
