"""``dptune.tune``: from a total privacy budget to one released candidate, crash-safe and budgeted.

The order of operations is the privacy argument, so it is fixed here and nowhere else:

1. Check every input (budget, space, selection, trainer) and refuse bad ones with a clear message.
2. Account: the worst case over everything the space can draw (``Space.privacy_grid``) gives the
   candidates the selection theorem is applied to; with ``noise_multiplier="auto"`` the noise is
   calibrated so that the *total* (tuning included) meets the budget. A budget that cannot be met is
   refused. Nothing private has run yet.
3. Journal (``DIR/private/journal.sqlite``): bind the config (a different config is refused), then
   record the run id, the root entropy, the selection's plan and every candidate's seed and
   hyperparameters, each exactly once: a resume reads them back and never draws them again.
4. Ledger: charge the run's (epsilon, delta) to the dataset's budget (once per run id; refused if
   it would exceed the budget).
5. Train candidates in index order (sequentially, or in groups through the trainer's vectorised
   ``train_many``), each recorded as done with its score before the next decision; finished ones
   are never retrained on resume.
6. Select, and release only the selected candidate (``DIR/release/``).

Trainers. Anything with ``privacy(hparams)`` (the candidate's privacy, a
``dptune.accounting`` candidate or a ``dp_accounting`` ``DpEvent``) and ``__call__(hparams, rng)
-> (score, payload)`` is a trainer; :class:`FunctionTrainer` wraps a plain user function and
:class:`DpSgdTrainer` wraps this project's DP-SGD (``trainers.train``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from dptune.journal import JOURNAL_FILE, Journal
from dptune.ledger import Ledger
from dptune.release import Release, read_release, write_release
from dptune.space import Space

log = logging.getLogger("dptune")

#: Value of the ``noise_multiplier`` field meaning "calibrate it from the total budget".
AUTO = "auto"

#: Largest number of candidates a plan may ask for (thresholding's cap, a random-stopping K).
MAX_PLANNED_TRIALS = 100_000


class TuningConfigError(ValueError):
    """An input to the tuner is invalid; nothing private has run."""


class ImpossibleBudgetError(TuningConfigError):
    """The total budget cannot be met by any candidate the space can draw; nothing private ran."""


# --------------------------------------------------------------------------------------------------
# trainers


@runtime_checkable
class Trainer(Protocol):
    """A private candidate generator: its privacy is declared before it runs.

    ``privacy(hparams)`` returns the candidate's privacy for those hyperparameters (only the
    privacy-relevant fields may matter): a ``dptune.accounting`` candidate (``DpSgdCandidate``,
    ``EventCandidate``) or a ``dp_accounting`` ``DpEvent``. ``__call__(hparams, rng)`` trains one
    candidate with the randomness of ``rng`` (a numpy Generator seeded from the candidate's seed)
    and returns ``(score, payload)``: higher scores are better, NaN means failure.
    """

    def privacy(self, hparams: Mapping[str, Any]) -> Any: ...

    def __call__(
        self, hparams: Mapping[str, Any], rng: np.random.Generator
    ) -> tuple[float, Any]: ...


@dataclass
class FunctionTrainer:
    """Wraps a user's training function as a trainer.

    Args:
      fn: ``fn(hparams: dict, rng: numpy.random.Generator) -> (score, payload)``; it may return
        ``(score, payload, event)`` too, and the event must then equal the declared one (the
        accountant charged the declared event before training).
      privacy: the candidate's privacy: a ``DpEvent`` / accounting candidate, or a function of the
        hyperparameters returning one (e.g. building a DP-SGD event from ``noise_multiplier``).
      num_examples: size of the private dataset (checks delta < 1/n), if known.
      fingerprint: an id of the private dataset for the budget ledger, if one is used.
    """

    fn: Callable[..., tuple]
    privacy_fn: Any
    num_examples: int | None = None
    fingerprint: str | None = None
    name: str = "user function"

    def privacy(self, hparams: Mapping[str, Any]) -> Any:
        return self.privacy_fn(hparams) if callable(self.privacy_fn) else self.privacy_fn

    def __call__(self, hparams: Mapping[str, Any], rng: np.random.Generator) -> tuple[float, Any]:
        out = self.fn(dict(hparams), rng)
        if not isinstance(out, tuple) or len(out) not in (2, 3):
            raise TypeError(
                f"{self.name} must return (score, payload) or (score, payload, event), got "
                f"{out!r:.80}"
            )
        if len(out) == 3:
            declared = _as_candidate(self.privacy(hparams))
            if _as_candidate(out[2]) != declared:
                raise RuntimeError(
                    f"{self.name} returned the DpEvent {out[2]!r} but declared {declared!r} for "
                    f"hparams {dict(hparams)}: the accountant charged the declared one"
                )
        return float(out[0]), out[1]

    def describe(self) -> dict[str, Any]:
        return {"kind": "function", "name": self.name, "num_examples": self.num_examples}


def trainer(
    privacy: Any, *, num_examples: int | None = None, fingerprint: str | None = None
) -> Callable[[Callable], FunctionTrainer]:
    """Decorator form of :class:`FunctionTrainer`::

    @dptune.trainer(privacy=lambda hp: make_event(hp["noise_multiplier"]), num_examples=n)
    def train(hparams, rng):
        ...
        return accuracy, params
    """

    def wrap(fn: Callable) -> FunctionTrainer:
        return FunctionTrainer(
            fn, privacy, num_examples, fingerprint, getattr(fn, "__name__", "user function")
        )

    return wrap


def _test_row(curve: Mapping[int, float], epoch: Any) -> dict[str, float]:
    """``{"test_accuracy": ...}`` for ``epoch`` if it was evaluated (public test split)."""
    return {"test_accuracy": curve[epoch]} if epoch in curve else {}


class DpSgdTrainer:
    """This project's DP-SGD trainer (``trainers.train``) on an in-memory dataset.

    Args:
      data: a ``trainers.data.Dataset``.
      base: default hyperparameters (``trainers.train.Hyperparams`` fields) that the space's values
        override.
      epoch_progress: whether to show a per-epoch tqdm bar (the curator's console only).
      test_curve: evaluate every candidate on the public test split after each epoch, so that the
        released candidate's training curve shows its test accuracy (costs one test-set pass per
        epoch).
    """

    def __init__(
        self,
        data: Any,
        base: Mapping[str, Any] | None = None,
        epoch_progress: bool = True,
        test_curve: bool = True,
    ) -> None:
        self.data = data
        self.test_curve = test_curve
        self.base = dict(base or {})
        # The PUBLIC nominal training size (declared or published), never len() of private arrays.
        self.num_examples = int(data.public_num_train)
        self.epoch_progress = epoch_progress
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self.data.fingerprint()
        return self._fingerprint

    def hyperparams(self, hparams: Mapping[str, Any]) -> Any:
        from trainers.train import Hyperparams

        merged = {**self.base, **dict(hparams)}
        try:
            return Hyperparams(**merged)
        except (TypeError, ValueError) as e:
            raise TuningConfigError(f"invalid DP-SGD hyperparameters {merged}: {e}") from None

    def privacy(self, hparams: Mapping[str, Any]) -> Any:
        from trainers.train import dpsgd_privacy

        hp = self.hyperparams(hparams)
        if hp.score_noise_std is None and not getattr(self.data, "validation_public", False):
            raise TuningConfigError(
                "score_noise_std=None (an exact validation score) needs a validation set declared "
                "public and separate from the private data, but this dataset's validation split "
                "is private: set score_noise_std > 0 (config.train.score_noise_std), or load a "
                "separate public validation set (config.data.validation_dir with "
                "config.data.validation_public=True)"
            )
        try:
            privacy = dpsgd_privacy(hp, self.num_examples)
        except ValueError as e:
            raise TuningConfigError(f"invalid DP-SGD setting: {e}") from None
        return _dpsgd_candidate(privacy, getattr(hp, "score_noise_std", None))

    @contextlib.contextmanager
    def _progress(self, total_epochs: int) -> Iterator[Callable[[dict], None] | None]:
        """A per-epoch tqdm bar fed by the trainer's progress dicts (public counts only)."""
        if not self.epoch_progress:
            yield None
            return
        from tqdm.auto import tqdm

        # disable=None: only on an interactive terminal, never into a redirected log; leave=False:
        # erased when the candidate ends, so the screen does not accumulate one bar per candidate.
        bar = tqdm(
            total=total_epochs,
            desc="training",
            unit="epoch",
            leave=False,
            file=sys.stderr,
            disable=None,
        )

        def update(event: dict) -> None:
            if event.get("event") == "epoch":
                bar.update(1)

        try:
            yield update
        finally:
            bar.close()

    def __call__(self, hparams: Mapping[str, Any], rng: np.random.Generator) -> tuple[float, Any]:
        return self.train_many([hparams], [rng])[0]

    def train_many(
        self, hparams: Sequence[Mapping[str, Any]], rngs: Sequence[np.random.Generator]
    ) -> list[tuple[float, Any]]:
        """Trains len(hparams) candidates at once (``trainers.train.train_candidates``)."""
        import jax

        from trainers.train import evaluate, train_candidate, train_candidates

        hps = [self.hyperparams(h) for h in hparams]
        # The full 64 bits of a threefry key, drawn from the candidate's (OS-entropy) generator:
        # the DP noise must not be guessable from a small seed space.
        keys = [r.integers(0, 2**32, size=2, dtype=np.uint32) for r in rngs]
        # Per-epoch accuracy on the public test split: part of the released candidate's training
        # curve (``public_curve``); the other candidates' curves stay in private/ like the rest.
        test_curve: dict[int, dict[int, float]] = {}

        def on_epoch(i: int, epoch: int, params: Any) -> None:
            if self.test_curve and len(self.data.test_y):
                test_curve.setdefault(i, {})[epoch] = float(
                    evaluate(params, hps[i].model, self.data.test_x, self.data.test_y)
                )

        with self._progress(sum(hp.epochs for hp in hps)) as progress:
            if len(hps) == 1:
                results = [
                    train_candidate(
                        hps[0], self.data, keys[0], progress=progress, on_epoch=on_epoch
                    )
                ]
            else:
                results = train_candidates(
                    hps, self.data, keys, progress=progress, on_epoch=on_epoch
                )
        out = []
        for i, r in enumerate(results):
            if r.failed:
                # The curator's console: which error, not which score (a failure is data-dependent).
                log.warning("a candidate failed: %s", (r.error or "non-finite parameters")[:200])
            payload = {
                "params": jax.tree_util.tree_map(np.asarray, r.params),
                "history": [
                    {**h, **_test_row(test_curve.get(i, {}), h.get("epoch"))} for h in r.history
                ],
                "failed": bool(r.failed),
            }
            score = float("nan") if r.failed else float(r.validation_score)
            out.append((score, payload))
        return out

    def public_curve(
        self, hparams: Mapping[str, Any], payload: Any, delta: float
    ) -> list[dict[str, Any]]:
        """Per-epoch rows that may be released with the selected candidate.

        ``epsilon_one_run``: the epsilon (at ``delta``, tightest route of ``dptune.accounting``) of
        this candidate's training up to that epoch, without tuning (public: a function of its
        hyperparameters; the last epoch matches the statement's ``single_run_epsilon``). History
        entries whose name starts with ``test_`` or ``noisy_`` (public split or privatised) are
        copied too. The exact training loss is NOT: it is a non-private function of the data.
        """
        from dptune.accounting import total_privacy
        from trainers.train import dpsgd_privacy, steps_per_epoch

        hp = self.hyperparams(hparams)
        full = dpsgd_privacy(hp, self.num_examples)
        per_epoch = steps_per_epoch(hp.batch_size, self.num_examples)
        history = payload.get("history", []) if isinstance(payload, Mapping) else []
        rows = []
        for e in range(1, hp.epochs + 1):
            cand = _dpsgd_candidate(
                type(full)(full.sampling_rate, e * per_epoch, full.noise_multiplier),
                hp.score_noise_std,
                getattr(self, "_adjacency", "add_remove"),
            )
            eps = total_privacy(cand, None, delta, "auto").total_epsilon
            row: dict[str, Any] = {"epoch": e, "epsilon_one_run": float(eps)}
            for h in history:
                if h.get("epoch") == e:
                    row.update({k: v for k, v in h.items() if k.startswith(("test_", "noisy_"))})
            rows.append(row)
        return rows

    def test_accuracy(self, hparams: Mapping[str, Any], payload: Any) -> float | None:
        from trainers.train import evaluate

        if not isinstance(payload, Mapping) or payload.get("params") is None:
            return None
        hp = self.hyperparams(hparams)
        return float(evaluate(payload["params"], hp.model, self.data.test_x, self.data.test_y))

    def privacy_notes(self) -> list[str]:
        """Sentences for the privacy statement: how the validation split was formed, and which
        public size the sampling rate comes from."""
        notes = []
        if hasattr(self.data, "describe_split"):
            notes.append(self.data.describe_split() + ".")
        notes.append(
            f"Sampling rates and step counts use the public nominal training size "
            f"{self.num_examples}, not the private data's length."
        )
        return notes

    def check_adjacency(self, adjacency: str) -> None:
        """Replace-one needs a fixed, public dataset size: the loaded file must hold exactly the
        declared number of records."""
        self._adjacency = adjacency
        if adjacency != "replace_one":
            return
        declared = getattr(self.data, "split", {}).get("num_examples")
        actual = len(self.data.train_y) + len(self.data.val_y)
        if declared is None or declared != actual:
            raise TuningConfigError(
                "adjacency='replace_one' assumes a dataset of fixed, public size, but the loaded "
                f"training file holds {actual} records and {declared} were declared "
                "(config.data.num_examples); declare the exact size or use 'add_remove'"
            )

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "dpsgd",
            "dataset": getattr(self.data, "name", "?"),
            "num_examples": self.num_examples,
            "base": self.base,
        }


# --------------------------------------------------------------------------------------------------
# budget


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


def as_budget(budget: Any) -> Budget:
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, (tuple, list)) and len(budget) == 2:
        return Budget(*budget)
    if hasattr(budget, "epsilon") and hasattr(budget, "delta"):
        return Budget(budget.epsilon, budget.delta)
    raise TuningConfigError(f"budget={budget!r} must be (epsilon, delta) or a Budget")


# --------------------------------------------------------------------------------------------------
# accounting glue: every number comes from dptune.accounting (which applies selection.privacy)


def _as_candidate(x: Any) -> Any:
    """A trainer's declared privacy as a ``dptune.accounting`` candidate."""
    from dptune.accounting.events import as_candidates

    try:
        cands = as_candidates(x)
    except ValueError as e:
        raise TuningConfigError(f"the trainer's privacy declaration is invalid: {e}") from None
    if len(cands) != 1:
        raise TuningConfigError(f"privacy(hparams) must describe one candidate, got {x!r}")
    return cands[0]


def _dpsgd_candidate(
    privacy: Any, score_noise_std: float | None, adjacency: str = "add_remove"
) -> Any:
    from dptune.accounting.events import DpSgdCandidate

    try:
        return DpSgdCandidate.from_dpsgd_privacy(
            privacy, score_noise_std=score_noise_std, adjacency=adjacency
        )
    except ValueError as e:
        raise TuningConfigError(str(e)) from None


def _statement(
    cands: Sequence[Any], transform: Any, delta: float, accountant: str, seeded: bool, debug: bool
) -> Any:
    """The total privacy statement (``dptune.accounting.totals.total_privacy``)."""
    import dataclasses

    from dptune.accounting.totals import total_privacy

    try:
        st = total_privacy(cands, transform, delta, accountant, seeded=seeded)
    except ValueError as e:
        raise TuningConfigError(f"cannot account this run: {e}") from None
    if debug:
        st = dataclasses.replace(st, private=False)
    return st


def _calibrate(
    candidates: Callable[[float], list[Any]], transform: Any, budget: Budget, accountant: str
) -> float | None:
    """The smallest noise multiplier (rounded up, within 0.1%) whose total epsilon meets the
    budget (``dptune.accounting.calibrate``), or None when no sigma in its range does."""
    from dptune.accounting import calibrate

    try:
        cal = calibrate(
            candidates, transform, budget.epsilon, budget.delta, accountant, compare=False
        )
    except ValueError as e:
        log.info("calibration failed: %s", e)
        return None
    return float(cal.noise_multiplier)


# --------------------------------------------------------------------------------------------------
# the tuner


@dataclass
class _Private:
    """The curator's view of a run (K, every score): never printed by default, never released."""

    num_trials: int
    scores: list[float] = field(default_factory=list)
    run_id: str = ""

    def __repr__(self) -> str:  # keep K and scores out of accidental prints
        return "<private: see DIR/private/>"


@dataclass(frozen=True)
class PrivacyPlan:
    """What the accountant promised, computed once before anything private runs.

    Attributes:
      space: the search space, ``noise_multiplier`` filled in when it was "auto".
      statement: the total privacy statement of the run.
      candidates: every candidate privacy the statement holds for (the worst case was taken over
        them); a drawn candidate must be one of them or dominated by them (``check_candidate``).
      privacy_fields: the space's fields the accounting enumerated (declared privacy fields plus
        those the trainer's declared privacy was found to depend on).
      adjacency: "add_remove" or "replace_one".
    """

    space: Space
    statement: Any
    candidates: tuple
    privacy_fields: tuple[str, ...]
    adjacency: str
    transform: Any
    delta: float
    accountant: str


def plan_privacy(
    trainer: Any,
    space: Space,
    selection: Any,
    budget: Budget,
    *,
    accountant: str = "auto",
    seeded: bool = False,
    debug_nonprivate: bool = False,
    adjacency: str = "add_remove",
) -> tuple[Space, Any]:
    """Steps 1-2: validates, calibrates the noise if asked, and returns (space, statement).

    The returned space has ``noise_multiplier`` fixed to the calibrated value when it was "auto".
    Raises TuningConfigError / ImpossibleBudgetError before anything private runs.
    """
    plan = make_privacy_plan(
        trainer,
        space,
        selection,
        budget,
        accountant=accountant,
        seeded=seeded,
        debug_nonprivate=debug_nonprivate,
        adjacency=adjacency,
    )
    return plan.space, plan.statement


#: Points tried along a continuous field when probing whether a trainer's privacy depends on it.
_PROBES = 7


def _probe_values(dist: Any) -> list[Any]:
    """Values of a searched field at which the trainer's declared privacy is probed: the whole
    support of a finite distribution (up to 64 values), else both ends and interior points."""
    from dptune import space as space_mod

    if isinstance(dist, (space_mod.Choice, space_mod.Integer)):
        support = dist.support()
        if len(support) <= 64:
            return list(support)
        idx = np.unique(np.linspace(0, len(support) - 1, 64).round().astype(int))
        return [support[i] for i in idx]
    lo, hi = float(dist.low), float(dist.high)
    if isinstance(dist, space_mod.LogUniform):
        return [float(v) for v in np.geomspace(lo, hi, _PROBES)]
    return [float(v) for v in np.linspace(lo, hi, _PROBES)]


def _privacy_dependent_fields(
    trainer: Any, space: Space, candidate_of: Callable[[dict], Any]
) -> list[str]:
    """Searched fields (not already privacy-relevant) that change the trainer's declared privacy.

    A trainer declares ``privacy(hparams)``; the accountant must take the worst case over every
    field that declaration depends on, not only over the fields it was told about. Each searched
    field is varied alone from ``space.example()``: a field that changes the declared candidate is
    privacy-relevant. (Interactions that this one-at-a-time probe misses are still caught: every
    drawn candidate is checked against the accounted set before it trains.)
    """
    base_hp = space.example()
    base = candidate_of(base_hp)
    found = []
    relevant = set(space.privacy_relevant)
    for name in space.searched:
        if name in relevant:
            continue
        for v in _probe_values(space.fields[name]):
            if candidate_of({**base_hp, name: v}) != base:
                found.append(name)
                break
    return found


def make_privacy_plan(
    trainer: Any,
    space: Space | Mapping[str, Any],
    selection: Any,
    budget: Budget,
    *,
    accountant: str = "auto",
    seeded: bool = False,
    debug_nonprivate: bool = False,
    adjacency: str = "add_remove",
) -> PrivacyPlan:
    """Validates the inputs, calibrates the noise if asked, and accounts the whole run.

    Nothing private runs here. Raises TuningConfigError / ImpossibleBudgetError.
    """
    from dptune.accounting.events import ADJACENCIES, with_adjacency

    if not isinstance(space, Space):
        try:
            space = Space.from_config(space)
        except ValueError as e:
            raise TuningConfigError(str(e)) from None
    if adjacency not in ADJACENCIES:
        raise TuningConfigError(f"adjacency={adjacency!r} must be one of {ADJACENCIES}")
    if len(space) == 0 or not space.searched:
        raise TuningConfigError(
            "the search space is empty (no field is drawn at random): there is nothing to tune; "
            "declare at least one distribution, e.g. learning_rate=space.log_uniform(0.01, 1.0)"
        )
    for attr in ("plan", "select", "done", "privacy"):
        if not hasattr(selection, attr):
            raise TuningConfigError(
                f"selection={selection!r} has no {attr!r}: pass a selection method such as "
                "selection.RandomStopping(...)"
            )
    n = getattr(trainer, "num_examples", None)
    if n is not None and budget.delta >= 1.0 / n:
        raise TuningConfigError(
            f"delta={budget.delta:g} must be below 1/n = {1.0 / n:.3g} for n={n} training examples "
            "(a larger delta allows releasing an example outright)"
        )
    if hasattr(trainer, "check_adjacency"):
        trainer.check_adjacency(adjacency)
    transform = selection.privacy
    if not transform.is_private and not debug_nonprivate:
        raise TuningConfigError(
            f"selection {transform.name} is not private; use it only with debug_nonprivate=True"
        )
    auto = space.fields.get("noise_multiplier") == AUTO

    def candidate_of(hp: Mapping[str, Any], sigma: float | None = None) -> Any:
        hp = dict(hp)
        if sigma is not None or auto:
            hp["noise_multiplier"] = 1.0 if sigma is None else sigma
        try:
            return with_adjacency(_as_candidate(trainer.privacy(hp)), adjacency)
        except ValueError as e:
            if isinstance(e, TuningConfigError):
                raise
            raise TuningConfigError(f"cannot account this trainer: {e}") from None

    dependent = _privacy_dependent_fields(trainer, space, candidate_of)
    if dependent:
        log.info(
            "the trainer's declared privacy depends on %s: accounted over every value", dependent
        )
        try:
            space = Space(
                space.to_dict(), privacy_fields=set(space.privacy_fields) | set(dependent)
            )
        except ValueError as e:
            raise TuningConfigError(
                f"the trainer's declared privacy depends on {dependent}: {e}"
            ) from None
    grid = space.privacy_grid()

    def candidates(sigma: float | None) -> list[Any]:
        return [candidate_of({**space.example(), **combo}, sigma) for combo in grid]

    if auto:
        candidates(1.0)  # invalid settings raise their own message here, not "no sigma found"
        sigma = _calibrate(candidates, transform, budget, accountant)
        if sigma is None:
            raise ImpossibleBudgetError(
                f"no noise multiplier meets the total budget (epsilon={budget.epsilon:g}, "
                f"delta={budget.delta:g}) with {transform.name}: raise the budget, lower the "
                "mean number of trials, or train for fewer steps / a smaller sampling rate"
            )
        fields = dict(space.to_dict())
        fields["noise_multiplier"] = float(sigma)
        space = Space(fields, privacy_fields=space.privacy_fields)
        cands = candidates(float(sigma))
    else:
        cands = candidates(None)
    statement = _statement(cands, transform, budget.delta, accountant, seeded, debug_nonprivate)
    if hasattr(trainer, "privacy_notes"):
        import dataclasses

        statement = dataclasses.replace(
            statement, notes=tuple(statement.notes) + tuple(trainer.privacy_notes())
        )
    if not debug_nonprivate and statement.total_epsilon > budget.epsilon * (1 + 1e-9):
        raise ImpossibleBudgetError(
            f"the run would cost epsilon={statement.total_epsilon:.4g} > budget "
            f"{budget.epsilon:g} at delta={budget.delta:g} ({transform.name}; one candidate "
            f"costs {statement.single_run_epsilon:.4g}). Use noise_multiplier='auto', more noise, "
            "fewer steps or fewer trials"
        )
    return PrivacyPlan(
        space=space,
        statement=statement,
        candidates=tuple(dict.fromkeys(cands)),
        privacy_fields=tuple(space.privacy_relevant),
        adjacency=adjacency,
        transform=transform,
        delta=budget.delta,
        accountant=accountant,
    )


def check_candidates(trainer: Any, plan: PrivacyPlan, hparams_list: Sequence[Mapping]) -> None:
    """Every drawn candidate's declared privacy must be covered by what the statement accounted.

    Covered: equal to an accounted candidate, or adding it to the accounted set leaves the total
    epsilon (same theorem, route and delta) no larger than stated -- then the theorem applied to
    the enlarged worst case proves the stated bound for it too. Otherwise TuningConfigError, naming
    the fields that make the difference, before any candidate touches data.
    """
    from dptune.accounting.events import with_adjacency

    accounted = set(plan.candidates)
    checked: dict[Any, bool] = {}
    for hp in hparams_list:
        cand = with_adjacency(_as_candidate(trainer.privacy(dict(hp))), plan.adjacency)
        if cand in accounted:
            continue
        if cand not in checked:
            st = _statement(
                [*plan.candidates, cand],
                plan.transform,
                plan.delta,
                plan.accountant,
                plan.statement.seeded,
                not plan.statement.private,
            )
            checked[cand] = st.total_epsilon <= plan.statement.total_epsilon * (1 + 1e-9)
        if not checked[cand]:
            example = plan.space.example()
            culprits = [
                name
                for name in plan.space.searched
                if name not in plan.privacy_fields
                and with_adjacency(
                    _as_candidate(trainer.privacy({**hp, name: example[name]})), plan.adjacency
                )
                != cand
            ]
            raise TuningConfigError(
                "a drawn candidate's declared privacy is not covered by the accounted statement "
                f"(fields {culprits or sorted(hp)} change it beyond what was accounted): declare "
                "them privacy-relevant (space.choice(..., privacy=True)) so the accountant takes "
                "their worst case. Nothing was trained"
            )


def tune(
    trainer: Any,
    space: Space | Mapping[str, Any],
    selection: Any,
    budget: Budget | tuple[float, float],
    *,
    workdir: str | os.PathLike | None = None,
    seed: int | None = None,
    group_size: int = 1,
    accountant: str = "auto",
    ledger: Ledger | str | os.PathLike | None = None,
    dataset_budget: Budget | tuple[float, float] | None = None,
    fingerprint: str | None = None,
    config: Mapping[str, Any] | None = None,
    progress: bool = True,
    debug_nonprivate: bool = False,
    adjacency: str = "add_remove",
) -> Release:
    """Tunes privately and releases the selected candidate (or nothing).

    Args:
      trainer: a :class:`Trainer` (e.g. :class:`DpSgdTrainer`, :class:`FunctionTrainer`).
      space: the search space; ``noise_multiplier="auto"`` calibrates the noise to the budget.
      selection: a ``selection`` method (``RandomStopping``, ``Thresholding``, ...).
      budget: total (epsilon, delta) for everything released, tuning included.
      workdir: folder for ``private/`` (journal, candidates) and ``release/``; with it a killed run
        resumes when called again with the same arguments. None: everything stays in memory.
      seed: a fixed seed for every random choice (debugging, tests); default: OS entropy. The
        statement then says it holds only while the seed is secret.
      group_size: candidates trained at once through ``trainer.train_many`` (vectorised). Random
        stopping trains its K candidates in such groups; thresholding evaluates groups
        speculatively and consumes the scores in order.
      accountant: "auto" (the tightest valid route), "rdp" or "pld" (``dptune.accounting``).
      ledger: a :class:`~dptune.ledger.Ledger` or its path: charge the run to the dataset's budget.
      dataset_budget: the dataset's total budget in the ledger (default: ``budget``).
      fingerprint: the dataset id in the ledger (default: ``trainer.fingerprint``).
      config: what the journal binds the workdir to (default: a description of the arguments).
      progress: show a tqdm display (curator's console; it shows neither K nor scores).
      debug_nonprivate: print every candidate's score at the end; marks the statement NOT private.
      adjacency: "add_remove" (default: neighbours differ by one added or removed example) or
        "replace_one" (one example replaced; for datasets of fixed, public size).
    Returns:
      The :class:`~dptune.release.Release` (also written to ``workdir/release/`` if given).
    """
    budget = as_budget(budget)
    if not isinstance(group_size, int) or group_size < 1:
        raise TuningConfigError(f"group_size={group_size!r} must be an integer >= 1")
    if accountant not in ("auto", "rdp", "pld"):
        raise TuningConfigError(f"accountant={accountant!r} must be 'auto', 'rdp' or 'pld'")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise TuningConfigError(f"seed={seed!r} must be a non-negative integer or None")
    if debug_nonprivate and ledger is not None:
        raise TuningConfigError(
            "debug_nonprivate prints every score and K, which voids the guarantee: no finite spend "
            "can be charged to the dataset's ledger. Disable the ledger "
            "(config.ledger.enabled=False) for debug runs on data that has no budget to protect"
        )
    if not isinstance(space, Space):
        try:
            space = Space.from_config(space)
        except ValueError as e:
            raise TuningConfigError(str(e)) from None
    if config is None:
        config = {
            "space": space.to_dict(),
            "selection": selection.privacy.describe() if hasattr(selection, "privacy") else None,
            "budget": [budget.epsilon, budget.delta],
            "trainer": getattr(trainer, "describe", lambda: {"kind": type(trainer).__name__})(),
            "seed": seed,
            "accountant": accountant,
            "debug_nonprivate": debug_nonprivate,
            "adjacency": adjacency,
        }
    journal: Any = None
    if workdir is not None and (Path(workdir) / "private" / JOURNAL_FILE).exists():
        # An existing run: a changed config is refused before any (slow) accounting.
        journal = Journal(Path(workdir) / "private")
        try:
            journal.bind_config(dict(config))
        except BaseException:
            journal.close()
            raise
    try:
        log.info("accounting: checking the total budget (calibrating the noise if 'auto')")
        pplan = make_privacy_plan(
            trainer,
            space,
            selection,
            budget,
            accountant=accountant,
            seeded=seed is not None,
            debug_nonprivate=debug_nonprivate,
            adjacency=adjacency,
        )
        space, statement = pplan.space, pplan.statement
    except BaseException:
        if journal is not None:
            journal.close()
        raise
    privacy = statement.to_dict()
    privacy["budget_epsilon"] = budget.epsilon
    privacy["budget_delta"] = budget.delta
    privacy_text = statement.to_text()

    if journal is None:
        journal = _MemoryJournal() if workdir is None else Journal(Path(workdir) / "private")
    try:
        journal.bind_config(dict(config))
        release_dir = None if workdir is None else Path(workdir) / "release"
        if release_dir is not None and journal.get("released_at") and release_dir.exists():
            log.info("this run already finished; its release is in %s", release_dir)
            return read_release(release_dir)
        run_id = journal.set_once("run_id", uuid.uuid4().hex)
        journal.set_once("privacy", privacy)

        entropy = journal.set_once(
            "entropy", int(seed) if seed is not None else int(np.random.SeedSequence().entropy)
        )
        plan_dict = journal.get("plan")
        if plan_dict is None:
            plan = selection.plan(
                np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(0,)))
            )
            if plan.num_trials > MAX_PLANNED_TRIALS:
                raise TuningConfigError(
                    f"the plan asks for up to {plan.num_trials} candidates (> "
                    f"{MAX_PLANNED_TRIALS}); lower max_trials"
                )
            rows = []
            for i in range(plan.num_trials):
                ss = np.random.SeedSequence(entropy, spawn_key=(1, i))
                hp_rng = np.random.default_rng(ss.spawn(1)[0])
                # 128 bits: the candidate's noise must not be guessable from a small seed space.
                words = ss.generate_state(4, dtype=np.uint32)
                seed_i = sum(int(w) << (32 * j) for j, w in enumerate(words))
                rows.append((i, seed_i, space.sample(hp_rng)))
            journal.add_candidates(rows)
            plan_dict = journal.set_once("plan", plan.to_dict())
        plan = _plan_from_dict(selection, plan_dict)
        # Every drawn candidate's declared privacy must be what the statement accounted, before
        # the ledger is charged and before any candidate touches data.
        check_candidates(trainer, pplan, [r.hparams for r in journal.candidates()])

        # Ledger before anything private runs: a refused run trains nothing.
        if ledger is not None:
            led = ledger if isinstance(ledger, Ledger) else Ledger(ledger)
            fp = fingerprint or getattr(trainer, "fingerprint", None)
            if not fp:
                raise TuningConfigError(
                    "a ledger needs the dataset's fingerprint: pass fingerprint= or a trainer "
                    "with a .fingerprint"
                )
            dsb = as_budget(dataset_budget) if dataset_budget is not None else budget
            spend = led.charge(
                fp,
                run_id,
                float(statement.total_epsilon),
                float(statement.delta),
                budget_epsilon=dsb.epsilon,
                budget_delta=dsb.delta,
                name=str(getattr(getattr(trainer, "data", None), "name", "")),
                workdir=str(workdir or ""),
            )
            log.info(
                "ledger %s: this run costs epsilon=%.4g; dataset %s has spent %.4g of %.4g",
                led.path,
                statement.total_epsilon,
                fp[:12],
                spend.spent_epsilon,
                spend.budget_epsilon,
            )

        journal.set_once("started_at", time.time())
        private = _Private(num_trials=plan.num_trials, run_id=run_id)
        records = {r.index: r for r in journal.candidates()}
        payloads: dict[int, Any] = {}

        scores = _run_candidates(
            trainer, selection, plan, records, journal, payloads, group_size, progress
        )
        private.scores = list(scores)
        index = selection.select(plan, scores)
        if index is None:
            release = Release(False, None, None, None, privacy, privacy_text, private=private)
        else:
            rec = records[index]
            payload = payloads[index] if index in payloads else journal.read_payload(index)
            test_acc = None
            if hasattr(trainer, "test_accuracy"):
                test_acc = trainer.test_accuracy(rec.hparams, payload)
            curve = None
            if hasattr(trainer, "public_curve"):
                curve = trainer.public_curve(rec.hparams, payload, budget.delta)
            if isinstance(trainer, DpSgdTrainer) and isinstance(payload, dict):
                # The exact per-epoch history (training loss) is not private: it stays in
                # DIR/private/ with the candidate; the release gets the model only.
                payload = {k: v for k, v in payload.items() if k not in ("history", "failed")}
            release = Release(
                True,
                rec.hparams,
                float(scores[index]),
                test_acc,
                privacy,
                privacy_text,
                payload=payload,
                curve=curve,
                private=private,
            )
        if debug_nonprivate:
            # The curator asked for a non-private view: this print is why the statement says so.
            print(f"[debug_nonprivate] K={plan.num_trials}; scores in order: {scores}", flush=True)
        if release_dir is not None:
            write_release(release, release_dir)
            journal.set("released_at", time.time())
        return release
    finally:
        journal.close()


def _run_candidates(
    trainer: Any,
    selection: Any,
    plan: Any,
    records: dict[int, Any],
    journal: Any,
    payloads: dict[int, Any],
    group_size: int,
    progress: bool,
) -> list[float]:
    """Trains candidates in index order until the selection is done; returns the scores prefix."""

    def prefix() -> list[float]:
        out = []
        for i in range(plan.num_trials):
            r = records[i]
            if r.status != "done":
                break
            out.append(float("nan") if r.failed else float(r.score))
        return out

    scores = prefix()
    with _progress_bar(progress) as bar:
        while len(scores) < plan.num_trials and not selection.done(plan, scores):
            start = len(scores)
            group = [
                i
                for i in range(start, min(start + group_size, plan.num_trials))
                if records[i].status != "done"
            ]
            for i in group:
                journal.mark_running(i)
            t0 = time.time()
            results = _train(trainer, [records[i] for i in group])
            seconds = (time.time() - t0) / max(len(group), 1)
            for i, (score, payload) in zip(group, results, strict=True):
                failed = not math.isfinite(score)
                journal.write_payload(i, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
                journal.mark_done(i, score if not failed else float("nan"), failed, seconds)
                payloads[i] = payload
                records[i] = _done(records[i], score, failed)
                bar.update()
            scores = prefix()
    return scores


def _train(trainer: Any, recs: Sequence[Any]) -> list[tuple[float, Any]]:
    rngs = [np.random.default_rng(r.seed) for r in recs]
    hps = [r.hparams for r in recs]
    if len(recs) > 1 and hasattr(trainer, "train_many"):
        return list(trainer.train_many(hps, rngs))
    out = []
    for hp, rng in zip(hps, rngs, strict=True):
        try:
            score, payload = trainer(hp, rng)
        except Exception as e:  # noqa: BLE001 - failure depends on the data; it must not abort
            # A failing candidate gets the failure score (NaN ranks last) instead of aborting,
            # because whether it fails depends on the private data (DESIGN.md).
            log.warning("a candidate failed (%s); it counts as a failure", type(e).__name__)
            score, payload = float("nan"), None
        out.append((float(score), payload))
    return out


def _done(rec: Any, score: float, failed: bool) -> Any:
    from dataclasses import replace

    return replace(rec, status="done", score=None if failed else float(score), failed=failed)


def _plan_from_dict(selection: Any, d: Mapping[str, Any]) -> Any:
    plan_cls = getattr(selection, "plan_class", None)
    if plan_cls is None:
        from selection import Plan as plan_cls  # noqa: N813
    return plan_cls.from_dict(dict(d))


@contextlib.contextmanager
def _progress_bar(enabled: bool) -> Iterator[Any]:
    """Elapsed time only (a count of candidates would put K on screen), on an interactive
    terminal only (never into a redirected log), erased at the end (see docs/tuning.md)."""
    if not enabled:
        yield _NullBar()
        return
    from tqdm.auto import tqdm

    bar = tqdm(
        desc="tuning", bar_format="{desc}: {elapsed}", file=sys.stderr, leave=False, disable=None
    )
    try:
        yield bar
    finally:
        bar.close()


class _NullBar:
    def update(self, n: int = 1) -> None:
        pass


class _MemoryJournal:
    """The journal's interface kept in memory (``workdir=None``): no resume, nothing on disk."""

    def __init__(self) -> None:
        self._meta: dict[str, Any] = {}
        self._rows: dict[int, Any] = {}
        self._payloads: dict[int, bytes] = {}

    def bind_config(self, config: dict[str, Any]) -> bool:
        self._meta["config"] = config
        return False

    def get(self, key: str, default: Any = None) -> Any:
        return self._meta.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self._meta[key] = value

    def set_once(self, key: str, value: Any) -> Any:
        return self._meta.setdefault(key, value)

    def add_candidates(self, rows: Any) -> None:
        from dptune.journal import CandidateRecord

        for i, seed, hp in rows:
            self._rows.setdefault(i, CandidateRecord(i, seed, hp, "planned", None, False, 0))

    def candidates(self) -> list[Any]:
        return [self._rows[i] for i in sorted(self._rows)]

    def mark_running(self, index: int) -> None:
        pass

    def mark_done(
        self, index: int, score: float, failed: bool, seconds: float | None = None
    ) -> None:
        pass

    def write_payload(self, index: int, data: bytes) -> None:
        pass  # payloads stay in the tuner's memory

    def read_payload(self, index: int) -> Any:
        raise KeyError(index)

    def close(self) -> None:
        pass
