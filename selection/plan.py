"""The random plan of a selection, its result, and the total order on candidates.

Everything in a `Plan` and in `Selection.private` is PRIVATE: the number of candidates that were
tried (K for random stopping, the coin-flip stopping time for thresholding), their scores and the
position of the released candidate in the sequence (index i reveals K >= i + 1). The selection
theorems cover only the released candidate, so none of these may be printed or published; their
``repr`` hides them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Plan", "Selection", "SelectionPrivate", "best_index", "rank_key"]


def rank_key(index: int, score: float) -> tuple[int, float, int]:
    """Sort key of the documented total order: larger is better.

    Higher score first; a NaN score (a failed candidate) ranks below every real score (-inf
    included); ties go to the lower index.
    """
    score = float(score)
    if math.isnan(score):
        return (0, 0.0, -index)
    return (1, score, -index)


def best_index(scores: Sequence[float]) -> int:
    """Index of the best score under the total order of `rank_key` (needs >= 1 score)."""
    if len(scores) == 0:
        raise ValueError("best_index needs at least one score")
    return max(range(len(scores)), key=lambda i: rank_key(i, scores[i]))


@dataclass(frozen=True)
class Plan:
    """The random plan, drawn before any private computation. PRIVATE (see module docstring).

    Attributes:
      num_trials: random stopping: K (0 allowed for Poisson); thresholding: the most candidates
        that will be tried, i.e. the coin flips' geometric stopping time capped at ``max_trials``;
        baselines: their fixed k.
      method: name of the method that drew it (checked by ``select``/``done``).
    """

    num_trials: int = field(repr=False)
    method: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.num_trials, bool) or int(self.num_trials) != self.num_trials:
            raise ValueError(f"num_trials must be an integer, got {self.num_trials!r}")
        if self.num_trials < 0:
            raise ValueError(f"num_trials must be >= 0, got {self.num_trials}")
        object.__setattr__(self, "num_trials", int(self.num_trials))

    def __repr__(self) -> str:
        return f"Plan(method={self.method!r}, num_trials=<private>)"

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form, for the run's private journal only."""
        return {"num_trials": self.num_trials, "method": self.method}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        if "num_trials" not in d:
            raise ValueError(f"a plan dict needs 'num_trials', got keys {sorted(d)}")
        unknown = set(d) - {"num_trials", "method"}
        if unknown:
            raise ValueError(f"unknown plan keys {sorted(unknown)}")
        return cls(num_trials=d["num_trials"], method=str(d.get("method", "")))


@dataclass
class SelectionPrivate:
    """What happened during a selection. PRIVATE: never print or publish (``repr`` hides it).

    Attributes:
      num_trials: the plan's number of trials (K, or thresholding's stopping time).
      num_evaluated: candidates actually evaluated (>= the consumed prefix with speculative
        batches).
      scores: scores of all evaluated candidates, in index order.
      index: position of the released candidate (None if nothing was released).
    """

    num_trials: int
    num_evaluated: int
    scores: list[float]
    index: int | None

    def __repr__(self) -> str:
        return "SelectionPrivate(<private: number of trials, scores, index>)"

    __str__ = __repr__


@dataclass(frozen=True)
class Selection:
    """The release of a selection: whether a candidate is released, its score and payload.

    ``score`` is None unless the method's theorem covers it (``SelectionMethod.publishes``: not
    for sparse vector, Accuracy First and stability-based validation, whose scores are exact
    private statistics; the curator finds it in ``private.scores``). ``index`` (the released
    candidate's position, which reveals that at least ``index + 1`` candidates were tried) and
    ``private`` are kept for the curator and hidden from ``repr``.
    """

    released: bool
    score: float | None
    payload: Any
    index: int | None = field(default=None, repr=False)
    private: SelectionPrivate | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class NoisyThresholdPlan(Plan):
    """A plan plus the noise of a noisy-threshold test (PRIVATE, like every plan: hidden from
    ``repr``): one threshold noise and one query noise per trial, drawn up front so that a resumed
    run replays the same test. Subclasses say which distributions they hold.

    Attributes:
      threshold_noise: added to the threshold (or target).
      query_noise: one per trial, added to that trial's query.
    """

    threshold_noise: float = field(default=0.0, repr=False)
    query_noise: tuple[float, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "query_noise", tuple(float(v) for v in self.query_noise))
        if len(self.query_noise) != self.num_trials:
            raise ValueError(f"a {type(self).__name__} needs one query noise per trial")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(method={self.method!r}, <private noise>)"

    @classmethod
    def draw_laplace(
        cls,
        gen: np.random.Generator,
        num_trials: int,
        method: str,
        threshold_scale: float,
        query_scale: float,
    ) -> NoisyThresholdPlan:
        """Threshold noise Lap(``threshold_scale``), then ``num_trials`` query noises
        Lap(``query_scale``), drawn from ``gen`` in that order."""
        threshold_noise = float(gen.laplace(0.0, threshold_scale))
        query_noise = gen.laplace(0.0, query_scale, size=num_trials)
        return cls(
            num_trials=num_trials,
            method=method,
            threshold_noise=threshold_noise,
            query_noise=tuple(query_noise),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "threshold_noise": self.threshold_noise,
            "query_noise": list(self.query_noise),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> NoisyThresholdPlan:
        return cls(
            num_trials=d["num_trials"],
            method=str(d.get("method", "")),
            threshold_noise=float(d["threshold_noise"]),
            query_noise=tuple(d["query_noise"]),
        )
