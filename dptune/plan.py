"""The privacy plan of a tuning run: from the total budget to the noise in every candidate, once.

:func:`make_privacy_plan` accounts the whole run before anything private runs and returns a frozen
:class:`PrivacyPlan` that the tuner, the journal and the release all read: nothing is accounted
twice. Every number comes from ``dptune.accounting`` (which applies ``selection.privacy``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from dp_accounting import dp_event

from dptune import space as space_mod
from dptune.accounting import calibrate, total_privacy
from dptune.accounting.calibration import SIGMA_MAX, default_memo
from dptune.accounting.events import ADJACENCIES, with_adjacency
from dptune.accounting.quiet import quiet_accounting
from dptune.errors import ImpossibleBudgetError, TuningConfigError
from dptune.space import Space, SpaceError
from dptune.trainer_protocol import as_candidate, check_trainer
from selection.registry import SCORE_KINDS

log = logging.getLogger("dptune")

#: Value of a field meaning "calibrate it from the total budget" (``trainer.calibrated_field``).
AUTO = "auto"

#: Points tried along a continuous field when probing whether a trainer's privacy depends on it.
_PROBES = 7

#: Largest number of candidates a drawn plan may ask for (thresholding's cap, a random-stopping K).
MAX_PLANNED_TRIALS = 100_000

#: Largest expected number of candidates a selection may plan (``selection.expected_trials``),
#: checked before anything is drawn, so ``--dry_run`` and the real run refuse the same settings.
MAX_EXPECTED_TRIALS = 10_000


@dataclass(frozen=True)
class Budget:
    """A total privacy budget: everything released (tuning included) is (epsilon, delta)-DP."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        e, d = self.epsilon, self.delta
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not math.isfinite(e) or e <= 0:
            raise TuningConfigError(f"budget epsilon={e!r} must be a finite number > 0")
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < 1:
            raise TuningConfigError(
                f"budget delta={d!r} must be in (0, 1), and below 1/(number of training examples)"
            )


def as_budget(budget: Any, name: str = "budget") -> Budget:
    """``(epsilon, delta)`` or a Budget -> Budget; a refusal names the keyword ``name``."""
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, (tuple, list)) and len(budget) == 2:
        try:
            return Budget(*budget)
        except TuningConfigError as e:
            raise (e if name == "budget" else TuningConfigError(f"{name}: {e}")) from None
    raise TuningConfigError(f"{name}={budget!r} must be (epsilon, delta) or a Budget")


@dataclass(frozen=True)
class PrivacyPlan:
    """What the accountant promised, computed once before anything private runs.

    Attributes:
      space: the search space (a calibrated field still reads ``"auto"``), with every field the
        accounting enumerated marked privacy-relevant (``space.privacy_relevant``).
      calibrated: the values that replace ``"auto"`` (e.g. ``{"noise_multiplier": 1.23}``); every
        candidate trains with ``{**drawn, **calibrated}`` (:meth:`hparams`).
      statement: the total privacy statement of the run (``dptune.accounting.PrivacyStatement``).
      candidates: every candidate privacy the statement holds for (the worst case was taken over
        them); a drawn candidate must be one of them or be covered (``check_candidates``).
      adjacency, transform, delta, accountant: what the statement was computed with.
    """

    space: Space
    calibrated: Mapping[str, Any]
    statement: Any
    candidates: tuple
    adjacency: str
    transform: Any
    delta: float
    accountant: str

    def hparams(self, drawn: Mapping[str, Any]) -> dict[str, Any]:
        """A candidate's hyperparameters: the drawn ones with the calibrated values filled in."""
        return {**dict(drawn), **dict(self.calibrated)}

    def single_run_epsilon(self, candidate: Any) -> float:
        """epsilon at the plan's delta and adjacency of one run of ``candidate`` (no tuning;
        tightest route): e.g. the released curve's epsilon so far (public hyperparameters only)."""
        cand = with_adjacency(as_candidate(candidate), self.adjacency)
        return float(total_privacy(cand, None, self.delta, "auto").total_epsilon)


def _check_score_kind(trainer: Any, selection: Any, debug_nonprivate: bool) -> None:
    """The trainer's score must be a kind the method's theorem takes; a trainer that declares
    nothing returns an exact score (a wrong "exact" only refuses, a wrong "covered" would make
    the statement false)."""
    kind = getattr(trainer, "score_kind", "exact")
    if kind not in SCORE_KINDS:
        raise TuningConfigError(
            f"the trainer's score_kind={kind!r} must be one of {', '.join(SCORE_KINDS)}"
        )
    takes = tuple(getattr(selection, "takes", ("covered",)))
    if kind in takes or debug_nonprivate:
        return
    name = getattr(selection.privacy, "name", type(selection).__name__)
    hint = f"use a trainer whose score is {' or '.join(takes)}" if "covered" not in takes else (
        "if the score is a noisy statistic whose noise the trainer's privacy declares, or is "
        "computed on public data, declare score_kind='covered' (FunctionTrainer(..., "
        "score_kind='covered') or @dptune.trainer(..., score_kind='covered'))"
    )  # fmt: skip
    raise TuningConfigError(
        f"selection {name} is proved for {' or '.join(takes)} scores ("
        + "; ".join(SCORE_KINDS[k] for k in takes)
        + f"), but the trainer declares score_kind={kind!r} ({SCORE_KINDS[kind]}): {hint}, or "
        "choose a method that takes this kind (docs/privacy-model.md). Nothing was trained"
    )


def _accounted(candidate: Any, adjacency: str) -> Any:
    """A declared candidate under the run's adjacency; a candidate that has no form under it (a
    user event with no known replace-one sensitivity) is one TuningConfigError line."""
    try:
        return with_adjacency(candidate, adjacency)
    except ValueError as e:
        raise TuningConfigError(f"the trainer's privacy under {adjacency}: {e}") from None


def accounted_candidate(trainer: Any, hparams: Mapping[str, Any], adjacency: str) -> Any:
    """The trainer's declared privacy at ``hparams`` as a candidate under ``adjacency``."""
    return _accounted(as_candidate(trainer.privacy(dict(hparams))), adjacency)


def grid_candidates(
    trainer: Any, space: Space, grid: Sequence[Mapping[str, Any]], adjacency: str,
    fill: Mapping[str, Any],
) -> list[Any]:  # fmt: skip
    """:func:`accounted_candidate` at every point of the privacy ``grid`` (other fields at
    ``space.example()``; ``fill`` over both)."""
    base = space.example()
    return [accounted_candidate(trainer, {**base, **combo, **fill}, adjacency) for combo in grid]


def probe_points(space: Space) -> list[tuple[str | None, dict[str, Any]]]:
    """``(field, point)`` for checks that read only public settings (a trainer's
    ``check_inputs``): ``(None, space.example())``, then each searched field varied alone."""
    ex, fields = space.example(), _one_field_variations(space, space.searched)
    return [(None, ex), *((n, p) for n, p in fields if p != ex)]


def _one_field_variations(space: Space, names: Sequence[str]):
    """``(name, space.example() with name set to each of its probe values)`` for ``names``: the
    whole support of a finite distribution (up to 64 values, evenly spread), else ``_PROBES``
    points."""
    base = space.example()
    for name in names:
        dist = space.fields[name]
        if isinstance(dist, (space_mod.Choice, space_mod.Integer)):
            support = dist.support()
            idx = np.unique(np.linspace(0, len(support) - 1, 64).round().astype(int))
            values = [support[i] for i in idx]
        else:
            spaced = np.geomspace if isinstance(dist, space_mod.LogUniform) else np.linspace
            values = [float(v) for v in spaced(float(dist.low), float(dist.high), _PROBES)]
        for value in values:
            yield name, {**base, name: value}


def _check_whole_support(
    space: Space, grid: Sequence[Mapping[str, Any]], candidate_of: Callable[[dict], Any]
) -> bool:
    """Every candidate a finite space can draw declares what its accounted twin (same
    privacy-relevant values, other fields at ``space.example()``) declares: the selection
    theorems hold for "draw from the space, then train", whose privacy is the worst case over the
    whole support (docs/privacy-model.md). Checked when every searched field is finite and the
    product is at most ``MAX_PRIVACY_GRID``; returns whether it was."""
    others = [n for n in space.searched if n not in space.privacy_relevant]
    dists = [space.fields[n] for n in others]
    if not others:
        return True  # the accounted grid is the whole space
    if not all(isinstance(d, (space_mod.Choice, space_mod.Integer)) for d in dists):
        return False
    supports = [d.support() for d in dists]
    if math.prod(len(s) for s in supports) * len(grid) > space_mod.MAX_PRIVACY_GRID:
        return False
    base = space.example()
    for combo in grid:
        twin = candidate_of({**base, **combo})
        for values in itertools.product(*supports):
            point = dict(zip(others, values, strict=True))
            if candidate_of({**base, **combo, **point}) != twin:
                changed = sorted(n for n in others if point[n] != base[n])
                raise TuningConfigError(
                    "a candidate this space can draw is not covered by the accounted candidates: "
                    f"the trainer's declared privacy changes with {changed + sorted(combo)} "
                    "jointly, which a one-field-at-a-time probe cannot see; declare them "
                    "privacy-relevant (space.choice(..., privacy=True)) so the accountant takes "
                    "their worst case. Nothing was trained"
                )
    return True


def _basis(
    trainer: Any, selection: Any, space: Space, cands: Sequence[Any], adjacency: str,
    whole_space: bool,
) -> dict[str, tuple[str, ...]]:  # fmt: skip
    """What the statement rests on: the assumptions that apply to this run
    (``dptune.assumptions``), what dptune checked (with the trainer's ``privacy_checks``), what it
    takes on the trainer's word (``taken_on_word``), and what the release holds."""
    kind = getattr(trainer, "score_kind", "exact")
    takes = tuple(getattr(selection, "takes", ("covered",)))
    published = tuple(getattr(selection, "publishes", ("payload",)))
    name = getattr(selection.privacy, "name", type(selection).__name__)
    how = "the whole (finite) space was checked point by point" if whole_space else (
        "the other fields were probed one at a time"
    )  # fmt: skip
    checked = [
        f"every candidate the space can draw is covered: the {len(set(cands))} accounted "
        f"setting(s) enumerate the privacy-relevant fields {list(space.privacy_relevant)}; {how}"
        "; each drawn candidate must declare its accounted setting, again just before it trains",
        f"the score kind {kind!r} is one {name} is proved for; the release holds "
        f"{' + '.join(published)} only",
    ]
    checked += list(getattr(trainer, "privacy_checks", lambda: [])())
    if hasattr(trainer, "taken_on_word"):
        word = list(trainer.taken_on_word())
    elif hasattr(trainer, "privacy_checks"):
        word = []
    else:  # a trainer that says nothing about itself (e.g. a FunctionTrainer: a user's function)
        word = [
            f"{getattr(trainer, 'name', None) or type(trainer).__name__}: its training does what "
            "privacy(hparams) declares for each candidate -- its clipping, noise and sampling, "
            "and a split into the declared parallel parts that puts each record in one part by "
            "that record alone",
            f"its score is score_kind={kind!r}: {SCORE_KINDS.get(kind, '?')}",
            "it fails (raises, scores NaN) only as a function of its private output",
        ]
        if (n := getattr(trainer, "num_examples", None)) is not None:
            word.append(f"num_examples={n} is the public size of its private data")
    assumptions = ["neighbours"]
    data = getattr(trainer, "data", None)
    if data is not None or getattr(trainer, "num_examples", None) is not None:
        assumptions.append("public-sizes")
    if any(len(c.branches()) > 1 for c in cands) or adjacency == "replace_one":
        assumptions.append("per-record-split")
    assumptions += ["pure-declaration", "declaration-matches-code", "score-kind"]
    if set(takes) - {"covered"} and selection.privacy.is_private:
        assumptions.append("method-constants")
    assumptions += ["public-inputs", "hidden-private-folder", "secret-randomness", "failures"]
    if hasattr(trainer, "release_view"):
        assumptions.append("public-test-split")
    if data is not None and getattr(data, "validation_public", False):
        assumptions.append("public-validation")
    if getattr(trainer, "init_fingerprint", None):
        assumptions.append("public-init")
    return {"assumptions": tuple(assumptions), "checked": tuple(checked),
            "trainer_word": tuple(word), "published": published}  # fmt: skip


@quiet_accounting
def make_privacy_plan(
    trainer: Any, space: Space | Mapping[str, Any], selection: Any,
    budget: Budget | tuple[float, float], *, accountant: str = "auto", seeded: bool = False,
    debug_nonprivate: bool = False, adjacency: str = "add_remove",
) -> PrivacyPlan:  # fmt: skip
    """Validates the inputs, calibrates ``"auto"``, and accounts the whole run; nothing private
    runs. The worst case is taken over every value of the privacy-relevant fields (the trainer's
    ``privacy_fields``, fields marked ``privacy=True``, and any searched field whose value changes
    ``trainer.privacy``); the ``"auto"`` field is calibrated so the selection theorem's total
    meets the budget. Raises TuningConfigError / ImpossibleBudgetError."""
    budget, space = as_budget(budget), as_space(space)
    field, auto = _check_inputs(trainer, space, selection, budget, adjacency, debug_nonprivate)
    transform = selection.privacy

    def fill(value: float | None) -> dict[str, Any]:
        return {field: 1.0 if value is None else value} if auto else {}

    def candidate_of(hp: Mapping[str, Any], value: float | None = None) -> Any:
        return accounted_candidate(trainer, {**hp, **fill(value)}, adjacency)

    known = set(getattr(trainer, "privacy_fields", ())) - ({field} if auto else set())
    space, grid = _privacy_space(space, known, candidate_of)

    def candidates(value: float | None) -> list[Any]:
        return grid_candidates(trainer, space, grid, adjacency, fill(value))

    score = getattr(trainer, "score_noise_field", None)  # its score's noise, named by a refusal
    calibrated, statement = _worst_case(candidates, transform, budget, accountant, seeded, field,
                                        auto, score)  # fmt: skip
    cands = candidates(calibrated.get(field))
    whole = _check_whole_support(space, grid, lambda hp: candidate_of(hp, calibrated.get(field)))
    statement = dataclasses.replace(
        statement, notes=(*statement.notes, *getattr(trainer, "privacy_notes", tuple)()),
        private=not debug_nonprivate, **_basis(trainer, selection, space, cands, adjacency, whole),
    )  # fmt: skip
    if not debug_nonprivate:
        check_total(statement, budget, transform.name, field)
    return PrivacyPlan(
        space, calibrated, statement, tuple(dict.fromkeys(cands)),
        adjacency, transform, budget.delta, accountant,
    )  # fmt: skip


def as_space(space: Space | Mapping[str, Any]) -> Space:
    """``space`` as a :class:`Space` (a mapping is read as a config); TuningConfigError if not."""
    if isinstance(space, Space):
        return space
    try:
        return Space.from_config(space)
    except ValueError as e:
        raise TuningConfigError(str(e)) from None


def _check_inputs(trainer, space, selection, budget, adjacency, debug_nonprivate):
    """``make_privacy_plan``'s checks of its inputs. Returns ``(calibrated field, whether it is
    "auto")``."""
    check_trainer(trainer)
    if not space.searched:
        raise TuningConfigError(
            "the search space is empty (no field is drawn at random): there is nothing to tune; "
            "declare at least one distribution, e.g. learning_rate=space.log_uniform(0.01, 1.0)"
        )
    if adjacency not in ADJACENCIES:
        raise TuningConfigError(f"adjacency={adjacency!r} must be one of {ADJACENCIES}")
    for attr in ("plan", "select", "done", "privacy"):
        if not hasattr(selection, attr):
            raise TuningConfigError(f"selection={selection!r} has no {attr!r}: pass a selection "
                                    "method such as selection.RandomStopping(...)")  # fmt: skip
    expected = getattr(selection, "expected_trials", None)  # public: a property of its settings
    if expected is not None and not float(expected) <= MAX_EXPECTED_TRIALS:  # NaN refused too
        raise TuningConfigError(
            f"the selection expects to train {float(expected):.4g} candidates on average, more "
            f"than the {MAX_EXPECTED_TRIALS} dptune plans at most: lower mean_trials "
            "(config.selection.mean_trials), or raise stop_probability / lower max_trials"
        )
    _check_score_kind(trainer, selection, debug_nonprivate)
    n = getattr(trainer, "num_examples", None)
    if n is not None and budget.delta >= 1.0 / n:
        why = (f"must be below 1/n = {1.0 / n:.3g} for n={n} training examples (a larger delta "
               "allows releasing an example outright)")  # fmt: skip
        command = f"--config.privacy.delta={budget.delta:g} {why}"
        raise TuningConfigError(f"delta={budget.delta:g} {why}", command=command)
    if hasattr(trainer, "check_adjacency"):
        trainer.check_adjacency(adjacency)
    if not selection.privacy.is_private and not debug_nonprivate:
        raise TuningConfigError(
            f"selection {selection.privacy.name} is not private; use it only with "
            "debug_nonprivate=True"
        )
    field = getattr(trainer, "calibrated_field", None)
    value = space.fields.get(field)
    if isinstance(value, str) and value != AUTO:  # a misspelt "auto" would reach the accountant
        raise TuningConfigError(f"{field}={value!r}: write 'auto' (calibrated) or a number")
    autos = [name for name, v in space.fields.items() if v == AUTO]
    if any(name != field for name in autos):
        raise TuningConfigError(
            f"{autos} is 'auto', but this trainer calibrates only {field!r}; give a value"
        )
    return field, bool(autos)


def _privacy_space(space: Space, known: set[str], candidate_of: Callable) -> tuple[Space, list]:
    """``space`` with every field the declared privacy depends on marked privacy-relevant (the
    ``known`` ones, and any searched field whose value, varied alone from ``space.example()``,
    changes ``candidate_of``; joint effects are caught by ``_check_whole_support`` and
    ``check_candidates``), and its privacy grid: the accountant takes the worst case over it."""
    try:
        space = Space(space.to_dict(), privacy_fields=set(space.privacy_fields) | known)
        base = candidate_of(space.example())
        if candidate_of(space.example()) != base:  # else blamed on the first field probed
            raise TuningConfigError(
                "the trainer's privacy(hparams) declared two different things for the same "
                "hparams: it is not a pure function of them (no state, counter, clock or "
                "randomness); dptune asks it again before each candidate trains"
            )
        others = [n for n in space.searched if n not in space.privacy_relevant]
        dependent: list[str] = []
        for name, point in _one_field_variations(space, others):
            if name not in dependent and candidate_of(point) != base:
                dependent.append(name)
        if dependent:
            log.info("the trainer's privacy depends on %s: accounted over every value", dependent)
            space = Space(space.to_dict(), privacy_fields=space.privacy_fields | set(dependent))
        return space, space.privacy_grid()
    except SpaceError as e:
        raise TuningConfigError(str(e), command=e.command) from None


def check_total(statement: Any, budget: Budget, method: str, field: str | None) -> None:
    """ImpossibleBudgetError unless the statement's total fits the budget."""
    if statement.total_epsilon > budget.epsilon * (1 + 1e-9):
        raise ImpossibleBudgetError(
            f"the run would cost epsilon={statement.total_epsilon:.4g} > budget "
            f"{budget.epsilon:g} at delta={budget.delta:g} ({method}; one candidate "
            f"costs {statement.single_run_epsilon:.4g}). Use {field or 'the noise'}='auto', more "
            "noise, fewer steps or fewer trials"
        )


def _events(events: Any) -> Any:
    """Every event of ``events``, nested ones too (depth first)."""
    for e in events:
        yield e
        yield from _events([*getattr(e, "events", ()), *filter(None, [getattr(e, "event", None)])])


def _worst_case(candidates, transform, budget, accountant, seeded, field, auto, score):
    """The worst case over the grid: ``(calibrated values, statement)``; with an ``"auto"``
    field, its smallest value whose total meets the budget (ImpossibleBudgetError if none does)."""

    def unaccountable(why: object, cands: list) -> TuningConfigError:
        """dp_accounting's refusal (``why``) names no field: a declared event without noise is
        named instead (its RDP of LaplaceDpEvent(0) divides by 0)."""
        noisy = (dp_event.LaplaceDpEvent, dp_event.GaussianDpEvent)
        bad = next((e for e in _events(b for c in cands for b in c.branches())
                    if isinstance(e, noisy) and not e.noise_multiplier > 0), None)  # fmt: skip
        if bad is not None:
            why = (f"the trainer declared {bad!r}: its noise multiplier (the noise's scale in "
                   f"units of the sensitivity) must be > 0; give {field or 'noise_multiplier'} a "
                   "value > 0 or 'auto'")  # fmt: skip
        return TuningConfigError(f"cannot account this run: {why}")

    if not auto:
        cands = candidates(None)
        try:
            return {}, total_privacy(cands, transform, budget.delta, accountant, seeded=seeded)
        except (ValueError, ZeroDivisionError) as e:
            raise unaccountable(e, cands) from None
    # invalid settings raise their own message here, not "no sigma found"
    if candidates(1.0) == candidates(2.0):  # else "auto" would hand the trainer a floor value
        raise TuningConfigError(
            f"{field}='auto', but the trainer's privacy(hparams) does not change with it: the "
            f"declaration must read hp[{field!r}] (the value the trainer trains with), or give "
            f"{field} a value"
        )
    try:
        # the memo: a second run of the same plan skips the search
        cal = calibrate(
            candidates, transform, budget.epsilon, budget.delta, accountant, seeded=seeded,
            compare=False, memo=default_memo(),
        )  # fmt: skip
    except ValueError as e:
        log.debug("calibration failed: %s", e)  # the refusal below says it, in the user's words
        try:  # no route even at the most noise: say why, since no budget or noise would help
            total_privacy(cands := candidates(SIGMA_MAX), transform, budget.delta, accountant)
        except (ValueError, ZeroDivisionError) as why:
            raise unaccountable(why, cands) from None
        what = f"no {field.replace('_', ' ')} meets the total budget"
        noise = (f"{score} (the" if score else "the declared candidates' score_noise_std (their"
                 ) + " validation score's noise, a cost no noise multiplier lowers)"  # fmt: skip
        raise ImpossibleBudgetError(
            f"{what} (epsilon={budget.epsilon:g}, delta={budget.delta:g}) with {transform.name}: "
            "raise the budget, lower the mean number of trials, train for fewer steps / a smaller "
            f"sampling rate, or raise {noise}",
            command=f"{what} (--config.privacy.epsilon={budget.epsilon:g}, --config.privacy.delta="
            f"{budget.delta:g}) with {transform.name}: raise --config.privacy.epsilon, lower "
            "--config.selection.mean_trials, train for fewer steps or a smaller sampling rate "
            "(--config.train.epochs, --config.train.batch_size), or raise "
            f"{'--config.train.' if score else ''}{noise}",
        ) from None
    return {field: float(cal.noise_multiplier)}, cal.statement


def plan_privacy(trainer: Any, space: Any, selection: Any, budget: Any, **kwargs: Any):
    """``(space with the calibrated values filled in, statement)`` of :func:`make_privacy_plan`
    (what ``dptune --dry_run`` prints)."""
    plan = make_privacy_plan(trainer, space, selection, budget, **kwargs)
    return Space({**plan.space.to_dict(), **plan.calibrated}), plan.statement


def declared_candidate(trainer: Any, plan: PrivacyPlan, drawn: Mapping[str, Any]) -> Any:
    """The trainer's declared privacy of ``drawn`` (calibrated values filled in), as an accounting
    candidate, before the run's adjacency is applied."""
    return as_candidate(trainer.privacy(plan.hparams(drawn)))


def check_candidates(
    trainer: Any, plan: PrivacyPlan, drawn: Sequence[Mapping[str, Any]]
) -> list[Any]:
    """Every drawn candidate must declare exactly what its accounted twin (same privacy-relevant
    values, other fields at ``space.example()``) declares. Anything else -- even a less lossy
    candidate -- shows that the declaration depends on fields the accountant did not enumerate:
    TuningConfigError naming them, before any candidate touches data. Returns each drawn
    candidate's declaration, in order: what it must still declare when it trains."""

    def candidate(hp: Mapping[str, Any]) -> Any:
        return accounted_candidate(trainer, plan.hparams(hp), plan.adjacency)

    accounted, example = set(plan.candidates), plan.space.example()
    fields = plan.space.privacy_relevant
    twins: dict[tuple, Any] = {}
    declared = [declared_candidate(trainer, plan, hp) for hp in drawn]
    for hp, raw in zip(drawn, declared, strict=True):
        cand = _accounted(raw, plan.adjacency)
        key = tuple(repr(hp.get(n)) for n in fields)
        if key not in twins:
            twins[key] = candidate({**example, **{n: hp[n] for n in fields if n in hp}})
        if cand != twins[key] or cand not in accounted:
            others = [n for n in plan.space.searched if n not in fields]
            culprits = [n for n in others if candidate({**hp, n: example[n]}) != cand]
            raise TuningConfigError(
                "a drawn candidate's declared privacy is not covered by the accounted statement "
                f"(fields {culprits or sorted(hp)} change it beyond what was accounted): declare "
                "them privacy-relevant (space.choice(..., privacy=True)) so the accountant takes "
                "their worst case. Nothing was trained"
            )
    return declared


def check_unchanged(
    trainer: Any, plan: PrivacyPlan, drawn: Mapping[str, Any], checked: Any
) -> None:
    """Before a candidate trains: its declaration now must be the one ``check_candidates``
    accounted (a declaration that reads a counter, the clock or any state could otherwise train a
    candidate the statement does not cover). TuningConfigError otherwise: it does not train."""
    if (now := declared_candidate(trainer, plan, drawn)) != checked:
        raise TuningConfigError(
            f"the trainer's declared privacy for hyperparameters {dict(drawn)} changed after "
            f"accounting ({checked!r} was accounted, {now!r} is declared now): privacy(hparams) "
            "must be a pure function of the hyperparameters (no state, counter or clock). The "
            "candidate was not trained; fix the trainer and start a new workdir"
        )
