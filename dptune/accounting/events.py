"""Candidates as dp_accounting ``DpEvent``s: what one training run (plus its private score) costs.

A *candidate* is one run that the selection layer may release: a DP-SGD training run and, when the
validation split is private, a noisy validation score.  Its privacy is described by one or more
*branches*, each a ``dp_accounting.DpEvent``, that act on **disjoint** parts of the data (the
training split and the validation split). A neighbouring dataset differs in one example, which lies
in exactly one part, so the candidate's privacy loss is that of one branch, never of their sum:
parallel composition (McSherry 2009, "Privacy Integrated Queries", Thm 4). Hence the candidate's
guarantee is the worse of its branches: the pointwise maximum of their RDP curves, and the maximum
of their ``delta(epsilon)`` curves (hockey-stick divergences) for PLD.

Adjacency: add/remove one example (default), or ``adjacency="replace_one"`` (a fixed, public
dataset size); the branches are then wrapped in :class:`ReplaceOneDpEvent`, accounted under
dp_accounting's ``REPLACE_ONE``, and training and score compose (:meth:`DpSgdCandidate.branches`).
The replace-one rule (docs/privacy-model.md), on every route: events describe their mechanism
under add/remove, and a replacement moves the query by up to twice that sensitivity, as
dp_accounting's PLD accountant reads ``REPLACE_ONE`` (:func:`doubled_sensitivity`; the RDP forms
are in ``epsilon._replace_one_rdp``). Events with no known replace-one sensitivity are refused.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import attr
from dp_accounting import dp_event

#: Neighbouring relations: add/remove one example (default) or replace one example.
ADJACENCIES = ("add_remove", "replace_one")


def doubled_sensitivity(event: dp_event.DpEvent) -> dp_event.DpEvent:
    """``event``'s replace-one form under the module's rule: every Gaussian's and Laplace's noise
    multiplier halved (also inside sampling without replacement); a Poisson-subsampled Gaussian is
    kept (accounted by its ``REPLACE_ONE`` PLD, or Mironov 2017, Prop. 11). ValueError for any
    other event."""
    if isinstance(event, (dp_event.GaussianDpEvent, dp_event.LaplaceDpEvent)):
        return type(event)(event.noise_multiplier / 2.0)
    if isinstance(event, dp_event.ComposedDpEvent):
        return dp_event.ComposedDpEvent(tuple(doubled_sensitivity(e) for e in event.events))
    if isinstance(event, dp_event.SelfComposedDpEvent):
        return dp_event.SelfComposedDpEvent(doubled_sensitivity(event.event), event.count)
    sampled = (dp_event.PoissonSampledDpEvent, dp_event.SampledWithoutReplacementDpEvent)
    if isinstance(event, sampled) and not isinstance(event.event, dp_event.GaussianDpEvent):
        raise ValueError(
            f"replace-one adjacency: a sampled {type(event.event).__name__} has no replace-one "
            "form in dptune (only sampled Gaussians); describe the candidate under add_remove"
        )
    if isinstance(event, dp_event.SampledWithoutReplacementDpEvent):
        return dp_event.SampledWithoutReplacementDpEvent(
            event.source_dataset_size, event.sample_size, doubled_sensitivity(event.event)
        )
    if isinstance(event, (dp_event.PoissonSampledDpEvent, dp_event.NoOpDpEvent)):
        return event
    raise ValueError(
        f"replace-one adjacency: {type(event).__name__} has no known replace-one sensitivity "
        "(dptune doubles the add/remove sensitivity of Gaussian and Laplace events; see "
        "dptune.accounting.events): describe the candidate with those events, or use "
        "adjacency='add_remove'"
    )


def check_adjacency(adjacency: str) -> None:
    if adjacency not in ADJACENCIES:
        raise ValueError(f"adjacency={adjacency!r} must be one of {ADJACENCIES}")


@attr.s(frozen=True)
class ReplaceOneDpEvent(dp_event.DpEvent):
    """``event`` accounted under replace-one adjacency (dp_accounting's ``REPLACE_ONE``): a marker,
    since dp_accounting's accountants take the relation per accountant, not per event."""

    event = attr.ib()


@runtime_checkable
class Candidate(Protocol):
    """What the accountant needs of a candidate: its parallel branches and JSON-safe inputs."""

    def branches(self) -> tuple[dp_event.DpEvent, ...]: ...

    def params(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class DpSgdCandidate:
    """One DP-SGD training run, optionally with a privately scored validation split.

    Attributes:
      sampling_rate: Poisson sampling probability q of each training example per step, in (0, 1]
        (expected batch size / number of training examples).
      steps: number of noisy gradient steps (>= 1).
      noise_multiplier: sigma, the Gaussian noise std divided by the clipping norm (> 0).
      score_noise_std: std, in counts, of the Gaussian noise added to the number of correct
        predictions on the validation split (whose sensitivity is 1 example); ``None`` when the
        validation split is public and the score costs nothing.
      adjacency: "add_remove" (default) or "replace_one".
    """

    sampling_rate: float
    steps: int
    noise_multiplier: float
    score_noise_std: float | None = None
    adjacency: str = "add_remove"

    def __post_init__(self) -> None:
        q = self.sampling_rate
        if isinstance(q, bool) or not isinstance(q, numbers.Real) or not (0 < q <= 1):
            raise ValueError(
                f"sampling_rate={q!r} must be in (0, 1]: it is the probability that a training "
                "example is in a step's Poisson-sampled batch (expected batch size / training "
                "set size)."
            )
        s = self.steps
        if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1:
            raise ValueError(
                f"steps={s!r} must be an integer >= 1 (the number of noisy gradient steps)."
            )
        for name in ("noise_multiplier", "score_noise_std"):
            v = getattr(self, name)
            if v is None and name == "score_noise_std":
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 < v < math.inf:
                raise ValueError(
                    f"{name}={v!r} must be a finite number > 0 (with no noise nothing is private)."
                )
            object.__setattr__(self, name, float(v))
        check_adjacency(self.adjacency)
        object.__setattr__(self, "sampling_rate", float(q))
        object.__setattr__(self, "steps", int(s))

    @classmethod
    def from_dpsgd_privacy(
        cls, privacy: Any, score_noise_std: float | None = None, adjacency: str = "add_remove"
    ) -> DpSgdCandidate:
        """From anything with ``sampling_rate``, ``steps``, ``noise_multiplier``
        (``trainers.spec.dpsgd_privacy``)."""
        p = privacy
        return cls(p.sampling_rate, p.steps, p.noise_multiplier, score_noise_std, adjacency)

    def training_event(self) -> dp_event.DpEvent:
        """``steps`` compositions of the Poisson-subsampled Gaussian (Abadi et al. 2016, Alg. 1)."""
        noise = dp_event.GaussianDpEvent(self.noise_multiplier)
        step = dp_event.PoissonSampledDpEvent(self.sampling_rate, noise)
        return dp_event.SelfComposedDpEvent(step, self.steps)

    def branches(self) -> tuple[dp_event.DpEvent, ...]:
        """Add/remove: training and score act on disjoint splits (parallel composition): the
        worse of ``(training, score)``.

        Replace-one: the replaced and the new example each lie in one split (a per-record split).
        Both in training: training under replace-one; both in validation: the score's Gaussian
        (sensitivity 1 under either relation); one in each: training loses (or gains) one example
        and the score gains (or loses) one, i.e. training and score composed under add/remove (the
        Gaussian's add and remove privacy losses are the same, so dp_accounting's same-direction
        composition covers the mixed one). The score-only branch is dominated by the composed one.
        """
        train, std = self.training_event(), self.score_noise_std
        # the noisy validation count: Gaussian mechanism, sensitivity 1, noise multiplier = std
        score = None if std is None else dp_event.GaussianDpEvent(std)
        if self.adjacency == "replace_one":
            out: tuple[dp_event.DpEvent, ...] = (ReplaceOneDpEvent(train),)
            if score is not None:
                out += (dp_event.ComposedDpEvent((train, score)),)  # a tuple: hashable
            return out
        return (train,) if score is None else (train, score)

    def params(self) -> dict[str, Any]:
        names = ("sampling_rate", "steps", "noise_multiplier", "score_noise_std")
        return _with_adjacency({"kind": "dpsgd", **{n: getattr(self, n) for n in names}}, self)


@dataclass(frozen=True)
class EventCandidate:
    """A candidate described by any user ``DpEvent`` (a Laplace mechanism, a DP k-means run).

    ``parallel`` lists further events on disjoint data (e.g. a private score on a separate split).
    """

    event: dp_event.DpEvent
    parallel: tuple[dp_event.DpEvent, ...] = ()
    label: str = "user DpEvent"
    adjacency: str = "add_remove"

    def __post_init__(self) -> None:
        for e in (self.event, *self.parallel):
            if not isinstance(e, dp_event.DpEvent):
                raise ValueError(f"event={e!r} must be a dp_accounting DpEvent.")
        object.__setattr__(self, "parallel", tuple(self.parallel))
        check_adjacency(self.adjacency)
        if self.adjacency == "replace_one" and self.parallel:
            # One replacement can touch two parts (one example leaves one, another joins the
            # other), in opposite directions, which dp_accounting's compositions do not cover for
            # a general DpEvent.
            raise ValueError(
                "replace-one adjacency with parallel branches is not supported for user "
                "DpEvents: describe the candidate as one event"
            )
        if self.adjacency == "replace_one":
            doubled_sensitivity(self.event)  # refuses an event with no replace-one form

    def branches(self) -> tuple[dp_event.DpEvent, ...]:
        if self.adjacency == "replace_one":
            return (ReplaceOneDpEvent(self.event),)
        return (self.event, *self.parallel)

    def params(self) -> dict[str, Any]:
        out = {"kind": "event", "label": self.label, "event": _event_to_json(self.event)}
        out["parallel"] = [_event_to_json(e) for e in self.parallel]
        return _with_adjacency(out, self)


def _with_adjacency(params: dict[str, Any], candidate: Any) -> dict[str, Any]:
    """``params`` naming the adjacency when it is not the default (older params stay equal)."""
    if candidate.adjacency != "add_remove":
        params["adjacency"] = candidate.adjacency
    return params


def _event_to_json(event: dp_event.DpEvent) -> Any:
    """A JSON-safe nested description of a DpEvent (dp_accounting's named-tuple form)."""

    def convert(x: Any) -> Any:
        if hasattr(x, "_asdict"):
            return {"type": type(x).__name__, **{k: convert(v) for k, v in x._asdict().items()}}
        if isinstance(x, (list, tuple)):
            return [convert(v) for v in x]
        return str(x) if isinstance(x, float) and not math.isfinite(x) else x

    return convert(event.to_named_tuple())


def with_adjacency(candidate: Candidate, adjacency: str) -> Candidate:
    """``candidate`` accounted under ``adjacency`` (a copy; DP-SGD and event candidates)."""
    check_adjacency(adjacency)
    if isinstance(candidate, (DpSgdCandidate, EventCandidate)):
        return dataclasses.replace(candidate, adjacency=adjacency)
    if adjacency != "add_remove":
        raise ValueError(f"candidate {candidate!r} cannot be accounted under {adjacency!r}")
    return candidate


def adjacency_of(candidates: Sequence[Candidate]) -> str:
    """The one adjacency of a set of candidates (ValueError when they mix relations)."""
    found = {getattr(c, "adjacency", "add_remove") for c in candidates}
    if len(found) > 1:
        raise ValueError(f"candidates mix adjacencies {sorted(found)}: account them separately")
    return found.pop() if found else "add_remove"


def _as_candidate(x: Any) -> Candidate:
    if isinstance(x, (DpSgdCandidate, EventCandidate)):
        return x
    if isinstance(x, dp_event.DpEvent):
        return EventCandidate(x)
    if all(hasattr(x, a) for a in ("sampling_rate", "steps", "noise_multiplier")):
        return DpSgdCandidate.from_dpsgd_privacy(x, getattr(x, "score_noise_std", None))
    if isinstance(x, Candidate):
        return x
    raise ValueError(
        f"candidate={x!r} is not a DpSgdCandidate, EventCandidate, DpEvent, or an object with "
        "sampling_rate, steps and noise_multiplier."
    )


def as_candidates(candidates: Any) -> tuple[Candidate, ...]:
    """One candidate (a ``Candidate``, a ``DpEvent``, or an object with ``sampling_rate``,
    ``steps``, ``noise_multiplier``) or a collection of them (*every candidate the sampler can
    draw*: the accountant holds uniformly over all of them) as a non-empty, de-duplicated tuple."""
    if isinstance(candidates, (str, bytes)):
        raise ValueError(f"candidates={candidates!r} is not a candidate description.")
    one = not isinstance(candidates, Iterable) or isinstance(candidates, dp_event.DpEvent)
    items = [candidates] if one else list(candidates)
    if not items:
        raise ValueError("candidates=[] is empty: give at least one candidate.")
    out: dict[Any, None] = {}
    unhashable: list[Candidate] = []
    for x in items:
        c = _as_candidate(x)
        try:
            out.setdefault(c, None)  # de-duplicates a privacy grid of thousands in O(n)
        except TypeError:  # a user Candidate that cannot be hashed
            if c not in unhashable:
                unhashable.append(c)
    return tuple(out) + tuple(unhashable)


def pareto_candidates(candidates: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """Drops DP-SGD candidates that another DP-SGD candidate dominates (its curves lie above
    theirs, ``dominating_dpsgd_candidate``): the worst case over a search space is then taken over
    few candidates instead of the whole privacy grid."""

    def lossiness(c: DpSgdCandidate) -> tuple[float, float, float, float]:
        std = math.inf if c.score_noise_std is None else c.score_noise_std
        return (-c.sampling_rate, -c.steps, c.noise_multiplier, std)

    # A dominating run sorts before the runs it dominates, and dominance is transitive, so comparing
    # each run with the runs kept so far suffices (O(n * front) instead of O(n^2) over a privacy
    # grid of thousands).
    dpsgd = sorted((c for c in candidates if isinstance(c, DpSgdCandidate)), key=lossiness)
    front: list[DpSgdCandidate] = []
    for c in dpsgd:
        if not any(dominating_dpsgd_candidate((k, c)) == k for k in front):
            front.append(c)
    return tuple(front) + tuple(c for c in candidates if not isinstance(c, DpSgdCandidate))


def dominating_dpsgd_candidate(candidates: Sequence[Candidate]) -> DpSgdCandidate | None:
    """A DP-SGD run dominating every candidate (max q, steps; min sigma, score std), or None when
    a candidate is not a ``DpSgdCandidate`` (or several are, under replace-one).

    The Poisson-subsampled Gaussian's hockey-stick divergences (and RDP) grow with q (its
    dominating pair (N(0,s^2), (1-q)N(0,s^2) + qN(1,s^2)) is a mixture whose divergence is convex
    in q and 0 at q = 0; shown for add/remove only), with the number of steps (composition), and
    as sigma falls (adding noise is post-processing). So any sequence of runs drawn from
    ``candidates`` is dominated by as many copies of it, as composition by PLD needs.
    """
    if not all(isinstance(c, DpSgdCandidate) for c in candidates):
        return None
    if len(candidates) > 1 and any(c.adjacency != "add_remove" for c in candidates):
        return None
    stds = [c.score_noise_std for c in candidates if c.score_noise_std is not None]
    return DpSgdCandidate(
        sampling_rate=max(c.sampling_rate for c in candidates),
        steps=max(c.steps for c in candidates),
        noise_multiplier=min(c.noise_multiplier for c in candidates),
        score_noise_std=min(stds) if stds else None,
    )


def dominating_candidate(candidates: Any) -> Candidate | None:
    """The one candidate left by ``pareto_candidates``, else ``dominating_dpsgd_candidate``."""
    cands = pareto_candidates(as_candidates(candidates))
    return cands[0] if len(cands) == 1 else dominating_dpsgd_candidate(cands)


def pure_epsilon(event: dp_event.DpEvent) -> float | None:
    """The pure epsilon-DP of ``event`` if it is built from Laplace mechanisms only, else None.

    Laplace mechanism with scale b on a sensitivity-1 query is (1/b)-DP (Dwork, McSherry, Nissim &
    Smith 2006, Prop. 1; dp_accounting's ``LaplaceDpEvent.noise_multiplier`` is b); pure-DP epsilons
    add up under composition (Dwork & Roth 2014, Thm 3.14).
    """
    if isinstance(event, dp_event.NoOpDpEvent):
        return 0.0
    if isinstance(event, ReplaceOneDpEvent):
        # the replace-one rule (module docstring): Laplace(b) -> Laplace(b / 2)
        return pure_epsilon(doubled_sensitivity(event.event))
    if isinstance(event, dp_event.LaplaceDpEvent):
        return math.inf if event.noise_multiplier == 0 else 1.0 / event.noise_multiplier
    if isinstance(event, dp_event.SelfComposedDpEvent):
        inner = pure_epsilon(event.event)
        return None if inner is None else event.count * inner
    if isinstance(event, dp_event.ComposedDpEvent):
        parts = [pure_epsilon(e) for e in event.events]
        return None if any(p is None for p in parts) else math.fsum(parts)
    return None
