"""Hyperparameter search spaces: distributions declared in config files and a random sampler.

A :class:`Space` maps each hyperparameter name to either a constant or a distribution
(:class:`Choice`, :class:`Uniform`, :class:`LogUniform`, :class:`Integer`). Random search draws
every candidate's hyperparameters independently from it, which is the hypothesis of the random-
stopping theorems (Papernot & Steinke 2022, §3.3: each run draws its hyperparameters independently,
with one uniform privacy bound over all of them).

Privacy-relevant fields (those the trainer names, those marked ``privacy=True``, and those the
trainer's declared privacy is found to depend on, ``dptune.plan``) change each candidate's privacy
loss. The accountant takes the worst case over everything the sampler can draw, so such fields may
only be constants, :class:`Choice` or :class:`Integer` (finite supports that
:meth:`Space.privacy_grid` enumerates exactly); a continuous one is refused, not approximated.

A config file declares ``config.space = dict(learning_rate=space.log_uniform(0.05, 5.0),
batch_size=256)`` (a constant); the command line overrides ``--config.space.learning_rate.high=2``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dptune.errors import Refused

#: Largest number of privacy-relevant combinations the accountant will enumerate.
MAX_PRIVACY_GRID = 4096


class SpaceError(Refused):
    """A search space or one of its distributions is malformed."""


def _field_error(name: str, why: str) -> SpaceError:
    """``why`` the space's field ``name`` is refused, named as the command's ``config.space``."""
    return SpaceError(f"space field {name!r}: {why}", command=f"--config.space.{name}: {why}")


@dataclass(frozen=True)
class Choice:
    """Uniform choice among a finite, non-empty tuple of values."""

    values: tuple
    privacy: bool = False
    kind: ClassVar[str] = "choice"

    def __post_init__(self) -> None:
        if len(self.values) == 0:
            raise SpaceError("choice() needs at least one value")

    def sample(self, rng: np.random.Generator) -> Any:
        return _plain(self.values[int(rng.integers(len(self.values)))])

    def support(self) -> tuple:
        return tuple(_plain(v) for v in self.values)

    def to_dict(self) -> dict:
        return {"distribution": "choice", "values": [_plain(v) for v in self.values]}


@dataclass(frozen=True)
class _Interval:
    """A distribution on [low, high] (finite numbers, low <= high)."""

    low: float
    high: float
    privacy: bool = False
    kind: ClassVar[str]

    def __post_init__(self) -> None:
        for label, x in (("low", self.low), ("high", self.high)):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                raise SpaceError(f"{self.kind} needs finite numeric bounds, got {label}={x!r}")
        if self.low > self.high:
            raise SpaceError(f"{self.kind} needs low <= high, got low={self.low}, high={self.high}")

    def to_dict(self) -> dict:
        return {"distribution": self.kind, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class Uniform(_Interval):
    """Uniform on the real interval [low, high]."""

    kind: ClassVar[str] = "uniform"

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.low, self.high))


@dataclass(frozen=True)
class LogUniform(Uniform):
    """Log-uniform on [low, high], 0 < low <= high: log(x) is uniform on [log low, log high]."""

    kind: ClassVar[str] = "log_uniform"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.low <= 0:
            raise SpaceError(f"log_uniform needs low > 0, got low={self.low}")

    def sample(self, rng: np.random.Generator) -> float:
        return float(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))


@dataclass(frozen=True)
class Integer(_Interval):
    """Uniform on the integers low, low+1, ..., high (both ends included)."""

    kind: ClassVar[str] = "integer"

    def __post_init__(self) -> None:
        if int(self.low) != self.low or int(self.high) != self.high:
            raise SpaceError(
                f"integer() needs integer bounds, got low={self.low}, high={self.high}"
            )
        super().__post_init__()

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(int(self.low), int(self.high) + 1))

    def support(self) -> tuple:
        return tuple(range(int(self.low), int(self.high) + 1))

    def to_dict(self) -> dict:
        return {"distribution": "integer", "low": int(self.low), "high": int(self.high)}


Distribution = Choice | Uniform | LogUniform | Integer
_DISTRIBUTIONS = (Choice, _Interval)
_BY_KIND = {c.kind: c for c in (Choice, Uniform, LogUniform, Integer)}


# --- helpers for config files: they return plain dicts so ml_collections can override their fields


def choice(*values: Any, privacy: bool = False) -> dict:
    """Config entry for a uniform choice among ``values``."""
    return {"distribution": "choice", "values": tuple(values), "privacy": privacy}


def uniform(low: float, high: float, privacy: bool = False) -> dict:
    """Config entry for Uniform[low, high]."""
    return {"distribution": "uniform", "low": low, "high": high, "privacy": privacy}


def log_uniform(low: float, high: float, privacy: bool = False) -> dict:
    """Config entry for a log-uniform distribution on [low, high], low > 0."""
    return {"distribution": "log_uniform", "low": low, "high": high, "privacy": privacy}


def integer(low: int, high: int, privacy: bool = False) -> dict:
    """Config entry for a uniform integer in {low, ..., high}."""
    return {"distribution": "integer", "low": low, "high": high, "privacy": privacy}


def distribution_from_dict(name: str, spec: Mapping[str, Any]) -> Distribution:
    """Builds a distribution from a config entry made by :func:`choice`, :func:`uniform`, ... ."""
    spec = dict(spec)
    kind = spec.pop("distribution", None)
    privacy = bool(spec.pop("privacy", False))
    cls = _BY_KIND.get(kind)
    if cls is None:
        raise _field_error(
            name, f"unknown distribution {kind!r} (expected 'choice', 'uniform', 'log_uniform' or "
            "'integer')",
        )  # fmt: skip
    try:
        if cls is Choice:
            values = spec.pop("values", None)
            if values is None or isinstance(values, (str, bytes)):
                raise SpaceError(f"choice needs a list of values, got {values!r}")
            dist: Distribution = Choice(tuple(values), privacy)
        else:
            if "low" not in spec or "high" not in spec:
                raise SpaceError(f"{kind} needs 'low' and 'high'")
            dist = cls(spec.pop("low"), spec.pop("high"), privacy)
    except SpaceError as e:
        raise _field_error(name, str(e)) from None
    if spec:
        raise _field_error(name, f"unknown keys {sorted(spec)} for {kind}")
    return dist


class Space:
    """A random-search space: hyperparameter name -> constant or distribution.

    Args:
      fields: name -> constant (int, float, str, bool) or a distribution (or its config dict);
        or give them as keywords: ``Space(learning_rate=space.log_uniform(0.1, 1.0), epochs=5)``.
      privacy_fields: names that are privacy-relevant besides those marked ``privacy=True``.
    """

    def __init__(
        self, fields: Mapping[str, Any] | None = None,
        privacy_fields: frozenset[str] | set[str] = frozenset(), **kwargs: Any,
    ) -> None:  # fmt: skip
        if fields is None:
            fields = kwargs
        elif kwargs:
            raise SpaceError("give the fields as one mapping or as keywords, not both")
        if not isinstance(fields, Mapping):
            raise SpaceError(
                f"a search space must be a mapping name -> distribution, got {type(fields)}"
            )
        parsed: dict[str, Any] = {}
        for name in sorted(fields):
            value = fields[name]
            if not isinstance(name, str) or not name.isidentifier():
                raise SpaceError(f"space field name {name!r} is not a valid identifier")
            if hasattr(value, "to_dict") and not isinstance(value, _DISTRIBUTIONS):
                value = value.to_dict()  # ml_collections.ConfigDict
            if isinstance(value, Mapping):
                value = distribution_from_dict(name, value)
            elif isinstance(value, (list, tuple)):
                raise _field_error(
                    name, f"a bare list {value!r} is ambiguous; use space.choice(...) for a "
                    "choice or a scalar for a constant",
                )  # fmt: skip
            elif not isinstance(value, (*_DISTRIBUTIONS, int, float, str, bool, type(None))):
                raise _field_error(name, f"unsupported value {value!r}")
            parsed[name] = value
        self.fields: dict[str, Any] = parsed
        self.privacy_fields = frozenset(privacy_fields)
        for name in self.privacy_relevant:
            if isinstance(value := parsed[name], Uniform):
                raise _field_error(
                    name, "it changes each candidate's privacy loss, so the accountant needs its "
                    "worst case exactly: use a constant, space.choice(...) or space.integer(...), "
                    f"not {type(value).__name__}",
                )  # fmt: skip

    @classmethod
    def from_config(cls, config: Any) -> Space:
        """Builds a space from a config's ``space`` entry (a ConfigDict or a mapping)."""
        return cls(config.to_dict() if hasattr(config, "to_dict") else config)

    @property
    def searched(self) -> tuple[str, ...]:
        """Names of the fields that are drawn at random (not constants)."""
        return tuple(n for n, v in self.fields.items() if isinstance(v, _DISTRIBUTIONS))

    @property
    def privacy_relevant(self) -> tuple[str, ...]:
        """Names of the fields that change a candidate's privacy loss."""
        marked = {n for n, v in self.fields.items() if isinstance(v, _DISTRIBUTIONS) and v.privacy}
        return tuple(n for n in self.fields if n in self.privacy_fields or n in marked)

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        """Draws one candidate's hyperparameters (fields in sorted name order, so draws are
        reproducible)."""
        return {
            n: (v.sample(rng) if isinstance(v, _DISTRIBUTIONS) else v)
            for n, v in self.fields.items()
        }

    def example(self) -> dict[str, Any]:
        """One fixed point of the space (constants, first choice, lower bounds), no randomness:
        for questions whose answer must not depend on non-privacy fields (the accountant's)."""
        return {
            n: _plain(v.values[0]) if isinstance(v, Choice) else getattr(v, "low", v)
            for n, v in self.fields.items()
        }

    def privacy_grid(self) -> list[dict[str, Any]]:
        """Every combination of values the privacy-relevant fields can take (for the worst case):
        dicts over :attr:`privacy_relevant` (one empty dict if there are none)."""
        names = self.privacy_relevant
        fields = [self.fields[n] for n in names]
        supports = [v.support() if isinstance(v, _DISTRIBUTIONS) else (v,) for v in fields]
        if (size := math.prod(len(s) for s in supports)) > MAX_PRIVACY_GRID:
            raise SpaceError(
                f"the privacy-relevant fields {list(names)} take {size} combinations; at most "
                f"{MAX_PRIVACY_GRID} are enumerated for the worst case. Narrow their ranges."
            )
        return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*supports)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe description (for the journal and the release's hyperparameter file)."""
        out = dict(self.fields)
        for n, v in out.items():
            if isinstance(v, _DISTRIBUTIONS):
                out[n] = {**v.to_dict(), "privacy": True} if v.privacy else v.to_dict()
        return out

    def __repr__(self) -> str:
        return f"Space({self.to_dict()!r})"


def _plain(v: Any) -> Any:
    """numpy scalars -> Python scalars (JSON-safe)."""
    return v.item() if isinstance(v, np.generic) else v
