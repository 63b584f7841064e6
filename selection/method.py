"""The loop shared by every selection method: plan first, evaluate candidates, release one.

A candidate is any callable ``candidate(index, rng) -> (score, payload)`` (see
``docs/architecture.md``); it must be differentially private with respect to the data, and it
should turn its own failures into a NaN score rather than raise (whether a run fails can depend on
the data, so failures must not abort the selection).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from selection.plan import Plan, Selection, SelectionPrivate, best_index
from selection.privacy import PrivacyTransform

__all__ = ["Candidate", "FirstPassing", "SelectionMethod", "make_rng"]

Candidate = Callable[[int, np.random.Generator], tuple[float, Any]]


def make_rng(rng: np.random.Generator | int | np.random.SeedSequence | None) -> np.random.Generator:
    """A Generator from ``rng``: OS entropy when None (the private default), else the given seed.

    A fixed seed is for tests and debugging only: the privacy guarantee then holds only while the
    seed stays secret.
    """
    if rng is None:
        return np.random.default_rng()  # fresh OS entropy
    if isinstance(rng, np.random.Generator):
        return rng
    if isinstance(rng, (int, np.integer, np.random.SeedSequence)) and not isinstance(rng, bool):
        return np.random.default_rng(rng)
    raise TypeError(f"rng must be None, an int seed, a SeedSequence or a Generator, got {rng!r}")


class _CallCandidate:
    """Picklable adapter so that ``map_fn`` can be a process pool's ``map`` (one iterable)."""

    def __init__(self, candidate: Candidate) -> None:
        self.candidate = candidate

    def __call__(self, args: tuple[int, np.random.Generator]) -> tuple[float, Any]:
        index, rng = args
        result = self.candidate(index, rng)
        try:
            score, payload = result
        except (TypeError, ValueError):
            # No index in the message: index i reveals that K >= i + 1 candidates ran.
            raise TypeError(
                f"candidate(index, rng) must return (score, payload), got {type(result).__name__}"
            ) from None
        return float(score), payload


class SelectionMethod:
    """Base class: subclasses implement `plan`, `select`, `done`, `privacy` and `_batch_limit`.

    Each method declares (the vocabularies are ``selection.registry.SCORE_KINDS`` and
    ``selection.registry.PUBLISHABLE``):

    * ``takes``: the kinds of candidate score its theorem is proved for; a trainer whose declared
      ``score_kind`` is not among them is refused before anything trains.
    * ``publishes``: what of the selected candidate its theorem covers, hence what a release (and
      `Selection`) may hold: ``"payload"``, ``"score"``, ``"index"``.

    The defaults are the safe ones for a method that declares nothing: scores covered by the
    candidates' privacy, and only the payload released.
    """

    #: Method name stored in plans and checked by select/done.
    method_name: str = ""
    plan_class = Plan
    #: score kinds the theorem takes (``selection.registry.SCORE_KINDS``)
    takes: tuple[str, ...] = ("covered",)
    #: what of the selected candidate the theorem covers (``selection.registry.PUBLISHABLE``)
    publishes: tuple[str, ...] = ("payload",)
    #: the public settings ``repr`` shows, as ``name=value`` (never anything from a plan)
    repr_fields: tuple[str, ...] = ()

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.repr_fields)
        return f"{type(self).__name__}({shown})"

    def plan(self, rng: np.random.Generator | int | None = None) -> Plan:
        raise NotImplementedError

    def select(self, plan: Plan, scores: Sequence[float]) -> int | None:
        raise NotImplementedError

    def done(self, plan: Plan, scores: Sequence[float]) -> bool:
        raise NotImplementedError

    @property
    def privacy(self) -> PrivacyTransform:
        raise NotImplementedError

    def _check_plan(self, plan: Plan) -> Plan:
        """``plan``, if this method drew it: a ``plan_class`` with this ``method_name``."""
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a selection.Plan, got {type(plan).__name__}")
        if plan.method and plan.method != self.method_name:
            raise ValueError(
                f"this plan was drawn by {plan.method!r}, not by {self.method_name!r}; "
                "a plan must be used with the method that drew it"
            )
        if not isinstance(plan, self.plan_class):
            raise TypeError(
                f"{self.method_name} needs the {self.plan_class.__name__} drawn by its own plan()"
            )
        return plan

    def run(
        self,
        candidate: Candidate,
        rng: np.random.Generator | int | None = None,
        *,
        batch_size: int = 1,
        map_fn: Callable[[Callable[[Any], Any], Iterable[Any]], Iterable[Any]] = map,
    ) -> Selection:
        """Draw the plan, evaluate candidates in index order (``batch_size`` at a time through
        ``map_fn``, e.g. ``ThreadPoolExecutor(n).map``), and release the selected one.

        Candidate ``i`` gets its own Generator, spawned from ``rng`` in index order, so the result
        does not depend on ``batch_size`` or ``map_fn``. Scores of candidates evaluated
        speculatively beyond the stopping point (thresholding) are never used.
        """
        if isinstance(batch_size, bool) or int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        gen = make_rng(rng)
        plan = self.plan(gen)  # before any private computation
        call = _CallCandidate(candidate)
        scores: list[float] = []
        payloads: list[Any] = []
        while not self.done(plan, scores):
            n = min(int(batch_size), plan.num_trials - len(scores))
            start = len(scores)
            args = list(zip(range(start, start + n), gen.spawn(n), strict=True))
            results = list(map_fn(call, args))
            if len(results) != n:
                # No counts in the message: n = min(batch_size, K - evaluated) reveals K.
                raise RuntimeError(
                    "map_fn returned a different number of results than candidates it was given"
                )
            for score, payload in results:
                scores.append(score)
                payloads.append(payload)
        index = self.select(plan, scores)
        private = SelectionPrivate(plan.num_trials, len(scores), list(scores), index)
        if index is None or math.isnan(scores[index]):
            # a NaN selected: every candidate failed (NaN ranks below every score), a function
            # of the selected output; a failure is never released as a success
            return Selection(False, None, None, None, private)
        # Only what the theorem covers is public: the score of an index-only method (an exact
        # private statistic) stays in ``private``.
        score = scores[index] if "score" in self.publishes else None
        return Selection(True, score, payloads[index], index, private)


class BestOfPlanned(SelectionMethod):
    """Methods that train exactly the plan's ``num_trials`` candidates and release the best
    (random stopping with K drawn up front, best-of-k with K fixed): their ``done`` and
    ``select``. Their theorems cover the selected candidate's whole output, score included."""

    publishes = ("payload", "score")

    def done(self, plan: Plan, scores: Sequence[float]) -> bool:
        self._check_plan(plan)
        return len(scores) >= plan.num_trials

    def select(self, plan: Plan, scores: Sequence[float]) -> int | None:
        """Best of the first K scores (scores beyond K are ignored); None when K = 0."""
        self._check_plan(plan)
        if len(scores) < plan.num_trials:
            raise ValueError(
                f"{self.method_name} needs all planned scores before selecting: got "
                f"{len(scores)} scores, fewer than the plan's number of trials"
            )
        if plan.num_trials == 0:
            return None
        return best_index(scores[: plan.num_trials])


class FirstPassing(SelectionMethod):
    """Methods that release the first candidate, among the plan's ``num_trials``, whose score
    passes a test (thresholding, sparse vector, Accuracy First): their ``done`` and ``select``.

    Subclasses implement `_first_pass`. Scores after the first pass (evaluated speculatively in a
    batch) and beyond ``num_trials`` are ignored.
    """

    @property
    def expected_trials(self) -> float:
        """Upper bound on the number of candidates evaluated: T, the subclass's ``max_trials``."""
        return float(self.max_trials)

    def _first_pass(self, plan: Plan, scores: Sequence[float]) -> int | None:
        """Index of the first of ``scores[:plan.num_trials]`` that passes; None if none did."""
        raise NotImplementedError

    def done(self, plan: Plan, scores: Sequence[float]) -> bool:
        plan = self._check_plan(plan)
        return len(scores) >= plan.num_trials or self._first_pass(plan, scores) is not None

    def select(self, plan: Plan, scores: Sequence[float]) -> int | None:
        """The first index < num_trials that passes the test; None if every planned one failed."""
        plan = self._check_plan(plan)
        if not self.done(plan, scores):
            raise ValueError(
                f"{self.method_name} is not done: no candidate passed yet and the plan's trials "
                "are not all evaluated; evaluate more candidates first"
            )
        return self._first_pass(plan, scores)
