"""One vocabulary of tuning strategies: how the candidates use the private data. The configs
(``config.strategy.name``), the ``dptune`` command, ``--dry_run`` and the docs read the names and
options from here: ``full`` (``dptune.tune``: every candidate on all the data) and ``subsampled``
(``dptune.tune_subsampled``: candidates on a Poisson subset, the selection retrained once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dptune.errors import Refused

__all__ = ["STRATEGIES", "check", "describe", "names"]

#: ``config.strategy.name`` -> (one line: what it does and what accounts it, {option: one line:
#: meaning and valid range}); every option is a required number.
STRATEGIES: dict[str, tuple[str, dict[str, str]]] = {
    "full": (
        "every candidate trains on all the private data; the selection theorem prices the run",
        {},
    ),
    "subsampled": (
        "candidates train on a per-record Poisson subset, the selected hyperparameters once more "
        "on all the data (Koskela & Kulkarni 2023); accounted as one composition",
        {
            "fraction": "Poisson subsampling rate of the tuning subset, in (0, 1)",
            "tuning_epsilon": "epsilon of the tuning phase on the FULL data (amplification "
            "included), > 0 and below the total epsilon (the final run needs the rest)",
        },
    ),
}


class StrategyConfigError(Refused):
    """A strategy name or option is invalid; the message names the field."""


def names() -> tuple[str, ...]:
    """The strategy names, in the order the docs list them."""
    return tuple(STRATEGIES)


def check(name: Any, options: Mapping[str, Any], total_epsilon: float) -> dict[str, float]:
    """The options ``name`` takes, checked (None values are unset); StrategyConfigError naming
    the field and its fix otherwise."""
    if name not in STRATEGIES:
        raise StrategyConfigError(
            f"config.strategy.name={name!r} is unknown; choose one of {', '.join(names())}"
        )
    takes = STRATEGIES[name][1]
    out: dict[str, float] = {}
    for opt, meaning in takes.items():
        value = options.get(opt)
        if value is None:
            raise StrategyConfigError(
                f"config.strategy.{opt} is required by strategy {name!r}: {meaning}"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StrategyConfigError(f"config.strategy.{opt}={value!r} must be a number")
        out[opt] = float(value)
    # each is a number in (0, upper): a rate below 1, an epsilon below the total
    for opt, upper in (("fraction", 1.0), ("tuning_epsilon", total_epsilon)):
        if opt in out and not 0 < out[opt] < upper:
            raise StrategyConfigError(
                f"config.strategy.{opt}={out[opt]!r} must be in (0, {upper:g}): {takes[opt]}"
            )
    if unused := sorted(k for k, v in options.items() if v is not None and k not in takes):
        raise StrategyConfigError(
            f"config.strategy: {unused} are not options of strategy {name!r}; unset them"
        )
    return out


def describe() -> str:
    """The strategies and their options, for ``dptune --help`` and the docs."""
    lines = ["Tuning strategies (config.strategy.name):"]
    for name, (summary, takes) in STRATEGIES.items():
        lines.append(f"  {name}: {summary}")
        lines += [f"    strategy.{opt}: {meaning}" for opt, meaning in takes.items()]
    return "\n".join(lines)
