"""``dptune.tune``: from a total privacy budget to one released candidate, crash-safe and budgeted.

The order of operations is the privacy argument, so it is fixed here and nowhere else: ``tune``
runs ``preflight`` (every check, nothing written: ``--dry_run`` stops there), ``run_in_workdir``
(the journal binds config and code), ``draw_plan`` (everything random, drawn once and journaled),
``check_candidates``, ``charge_ledger`` (once per run id), ``run_candidates`` (journaled as each
finishes) and ``release_selected`` (the selected candidate, or nothing); ``dptune.subsampled``
runs the first, second and fifth around its own plan.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

import dptune
from dptune._state.journal import JOURNAL_FILE, Journal
from dptune._state.ledger import Ledger, default_ledger_path
from dptune._state.workdir_lock import workdir_lock
from dptune.accounting import ACCOUNTANTS
from dptune.accounting.events import ADJACENCIES
from dptune.accounting.quiet import quiet_accounting
from dptune.errors import CandidateFailure, StateError, TuningConfigError
from dptune.errors import ImpossibleBudgetError as ImpossibleBudgetError  # re-exported
from dptune.execution import Job, VectorizedExecutor
from dptune.plan import (
    MAX_PLANNED_TRIALS,
    Budget,
    PrivacyPlan,
    as_budget,
    as_space,
    check_candidates,
    check_unchanged,
    make_privacy_plan,
    probe_points,
)
from dptune.progress import tuning_bar
from dptune.release import (
    NO_CANDIDATE_SUCCEEDED,
    NONE_SELECTED,
    Release,
    read_release,
    write_release,
)
from dptune.space import Space
from dptune.trainer_protocol import (
    FUNCTION_TRAINER,
    FunctionTrainer,
    ReleaseView,
    check_trainer,
    checked_result,
    code_digest,
)
from selection import Plan

log = logging.getLogger("dptune")


class _DefaultLedger:
    def __repr__(self) -> str:
        return "DEFAULT_LEDGER"


#: The default of ``tune(ledger=...)`` and of ``config.ledger``: the curator's ledger,
#: ``$DPTUNE_LEDGER`` or ``~/.dptune/ledger.sqlite`` (``_state.ledger.default_ledger_path``).
DEFAULT_LEDGER: Any = _DefaultLedger()


@dataclass
class _Private:
    """The curator's view of a run (K, every score): never printed by default, never released."""

    num_trials: int
    scores: list[float] = field(default_factory=list)

    def __repr__(self) -> str:  # keep K and scores out of accidental prints
        return "<private: see DIR/private/>"


@dataclass(frozen=True)
class TuneOptions:
    """How a run goes, apart from what it tunes: every keyword argument of :func:`tune`, as one
    frozen value (the same for the run and ``--dry_run``).

    Attributes:
      workdir: folder for ``private/`` (journal, candidates) and ``release/``; with it a killed run
        resumes when called again with the same arguments. None: everything stays in memory.
      seed: a fixed seed for every random choice (debugging, tests; the statement then holds only
        while it is secret); default: OS entropy.
      group_size: candidates trained at once through ``trainer.train_many`` (vectorised).
      accountant: "auto" (the tightest valid route), "rdp" or "pld" (``dptune.accounting``).
      ledger: where the run is charged to the dataset's budget: a
        :class:`~dptune._state.ledger.Ledger` or its path (default ``DEFAULT_LEDGER``); None: none.
      dataset_budget: the dataset's lifetime budget as this run states it (default: the one the
        ledger holds; for a new dataset 10 times this run's ``budget``, with a warning).
      fingerprint, config: the dataset id in the ledger (default: ``trainer.fingerprint``); what
        the journal binds the workdir to (default: a description of the arguments).
      progress: show a tqdm display (curator's console; it shows neither K nor scores).
      debug_nonprivate: print every candidate's score at the end; marks the statement NOT private.
      adjacency: "add_remove" (default: neighbours differ by one added or removed example) or
        "replace_one" (one example replaced; for datasets of fixed, public size).
      executor: how candidates are trained (``dptune.executors``; default: ``group_size`` groups).
    """

    workdir: str | os.PathLike | None = None
    seed: int | None = None
    group_size: int = 1
    accountant: str = "auto"
    ledger: Ledger | str | os.PathLike | None = DEFAULT_LEDGER
    dataset_budget: Budget | tuple[float, float] | None = None
    fingerprint: str | None = None
    config: Mapping[str, Any] | None = None
    progress: bool = True
    debug_nonprivate: bool = False
    adjacency: str = "add_remove"
    executor: Any = None

    def check(self) -> None:
        """The checks that need no data and read nothing (the command's too, in the same words):
        TuningConfigError / StateError naming the field."""
        g, seed = self.group_size, self.seed
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise TuningConfigError(f"group_size={g!r} must be an integer >= 1")
        for name, value, known in (("accountant", self.accountant, ACCOUNTANTS),
                                   ("adjacency", self.adjacency, ADJACENCIES)):  # fmt: skip
            if value not in known:
                raise TuningConfigError(
                    f"{name}={value!r} is unknown; choose one of {', '.join(known)}"
                )
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise TuningConfigError(
                f"seed={seed!r} must be a non-negative integer (--seed=N), or None for the "
                "operating system's entropy"
            )
        if self.debug_nonprivate and self.ledger is not None:
            raise TuningConfigError(
                "debug_nonprivate prints every score and K, which voids the guarantee: no finite "
                "spend can be charged to the dataset's ledger. Disable the ledger "
                "(config.ledger.enabled=False; ledger=None in Python) for debug runs on data that "
                "has no budget to protect"
            )
        if self.workdir is None:
            return
        # The workdir must be a folder this process can write (or create), before anything is
        # read, locked or written.
        path = Path(self.workdir)
        fix = "choose another --workdir (workdir= in Python)"
        existing = path  # the workdir, or the nearest folder above it that exists
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        for p in (existing, path / "private", path / "release"):
            if p.exists() and not p.is_dir():
                raise StateError(
                    f"the workdir {path} cannot be used: {p} is a file, not a folder: {fix}"
                )
        for p in (existing, path / "private"):
            if p.is_dir() and not os.access(p, os.W_OK | os.X_OK):
                raise StateError(
                    f"the workdir {path} is not writable ({p} is read-only for this user): {fix}, "
                    "or make it writable"
                )

    @classmethod
    def build(cls, options: TuneOptions | None, kwargs: Mapping[str, Any]) -> TuneOptions:
        """``options`` (default: all defaults) with ``kwargs`` replacing its fields; a keyword
        that is not a field is refused with the fields' names."""
        if unknown := sorted(set(kwargs) - set(cls.__dataclass_fields__)):
            raise TuningConfigError(
                f"unknown keyword argument(s) {unknown}; tune() takes "
                f"{', '.join(cls.__dataclass_fields__)}"
            )
        return replace(options or cls(), **kwargs)


@quiet_accounting
def tune(
    trainer: Any, space: Space | Mapping[str, Any], selection: Any,
    budget: Budget | tuple[float, float], options: TuneOptions | None = None, **kwargs: Any,
) -> Release:  # fmt: skip
    """Tunes privately and releases the selected candidate (or nothing).

    Args:
      trainer: a trainer (``dptune.trainer_protocol``), e.g. ``dptune.DpSgdTrainer``.
      space: the search space; ``noise_multiplier="auto"`` calibrates the noise to the budget.
      selection: a ``selection`` method (``RandomStopping``, ``Thresholding``, ...).
      budget: total (epsilon, delta) for everything released, tuning included.
      options, **kwargs: how the run goes (:class:`TuneOptions`; keywords replace its fields,
        e.g. ``workdir=``, ``seed=``, ``ledger=None``).
    Returns:
      The :class:`~dptune.release.Release` (also written to ``workdir/release/`` if given); its
      ``outcome`` says whether a candidate was released, none was selected, or every one failed.
    Raises:
      TuningConfigError (and its StateError), BudgetExceededError, LedgerBudgetMismatchError,
      ConfigChangedError, WorkdirLockedError: refused before any private computation, nothing
      charged.
    """
    opts = TuneOptions.build(options, kwargs)
    # The cheap checks first, so that a refused call creates nothing (not even the workdir).
    opts.check()
    budget = as_budget(budget)
    return run_in_workdir(
        opts.workdir, lambda: preflight(trainer, space, selection, budget, opts),
        lambda pre, j: _tune_steps(pre, trainer, selection, opts, j),
    )  # fmt: skip


@dataclass(frozen=True)
class Preflight:
    """What :func:`preflight` checked, for the run that follows: the plan (a :class:`PrivacyPlan`
    or a strategy's, with a ``statement``), what the journal binds (``config``, ``code``), the
    ledger's path (None: none), the dataset's ``spend`` after this run as the ledger would record
    it, and whether the workdir holds this run's journal already (``resuming``)."""

    plan: Any
    budget: Budget
    config: Mapping[str, Any]
    code: Mapping[str, Any]
    workdir: Path | None
    ledger: Path | None
    fingerprint: str | None
    dataset_budget: Budget | None
    dataset_name: str
    spend: Any = None
    resuming: bool = False


@quiet_accounting
def preflight(
    trainer: Any, space: Space | Mapping[str, Any], selection: Any, budget: Budget,
    opts: TuneOptions,
) -> Preflight:  # fmt: skip
    """Every check of :func:`tune` after ``opts.check()`` that needs no private computation,
    writing nothing: the one validation shared by the run and ``dptune --dry_run`` (raises what
    ``tune`` raises): the privacy plan, the data's schema at every probe point of the space, then
    :func:`check_run` (the workdir's journal and the dataset's ledger)."""
    check_trainer(trainer)
    if isinstance(selection, type):
        raise TuningConfigError(
            f"selection={selection.__name__} is a class: pass a selection method, e.g. "
            "RandomStopping.logarithmic(mean=3)"
        )
    space = as_space(space)
    config = describe_run(trainer, space, selection, budget, opts)

    def plan() -> PrivacyPlan:
        p = make_privacy_plan(
            trainer, space, selection, budget, accountant=opts.accountant,
            seeded=opts.seed is not None, debug_nonprivate=opts.debug_nonprivate,
            adjacency=opts.adjacency,
        )  # fmt: skip
        if hasattr(trainer, "check_inputs"):  # the data's schema against a candidate's settings
            _check_inputs(trainer, p)
        return p

    return check_run(trainer, budget, config, opts, plan)


def check_run(
    trainer: Any, budget: Budget, config: Mapping[str, Any], opts: TuneOptions,
    make_plan: Callable[[], Any],
) -> Preflight:  # fmt: skip
    """The checks of :func:`preflight` around ``make_plan()`` (a strategy passes its own),
    read-only: the dataset's fingerprint, the workdir's journal (``config``, this code), and the
    run within the dataset's budget (a finished run, which returns its release, is not charged)."""
    ledger = opts.ledger
    if ledger is DEFAULT_LEDGER:
        ledger = default_ledger_path()
    elif ledger is not None:
        ledger = ledger.path if isinstance(ledger, Ledger) else Path(ledger)
    fp = None if ledger is None else opts.fingerprint or getattr(trainer, "fingerprint", None)
    if ledger is not None and not fp:
        raise TuningConfigError(
            f"the budget ledger ({ledger}) charges every run to its dataset, but this "
            "trainer names no dataset: pass fingerprint='<an id of your dataset>' (to tune(), "
            "or to dptune.trainer / FunctionTrainer), or ledger=None to run without a ledger"
        )
    code = {"dptune": dptune.__version__, "trainer": code_digest(trainer)}
    workdir = None if opts.workdir is None else Path(opts.workdir)
    run_id, resuming, finished = None, False, False
    private_dir = None if workdir is None else workdir / "private"
    if private_dir is not None and (private_dir / JOURNAL_FILE).exists():
        with open_journal(private_dir, config, code, readonly=True) as journal:
            run_id, resuming = journal.get("run_id"), journal.get("config") is not None
            finished = bool(journal.get("released_at")) and (workdir / "release").exists()
    elif private_dir is not None:  # a release or candidates without their journal: refused
        dirs = (workdir / "release", private_dir / "candidates")
        if orphans := [p for p in dirs if p.is_dir() and any(p.iterdir())]:
            raise StateError(
                f"{orphans[0]} exists but its journal {private_dir / JOURNAL_FILE} does not: the "
                "run that wrote it can be neither resumed nor checked (was the journal deleted, "
                "or the workdir copied without it?). Restore the journal from a backup, or use a "
                "new --workdir"
            )
    log.info("accounting: checking the total budget (calibrating the noise if 'auto')")
    plan = make_plan()
    dsb = None if opts.dataset_budget is None else as_budget(opts.dataset_budget, "dataset_budget")
    name = str(getattr(getattr(trainer, "data", None), "name", "") or "")
    pre = Preflight(plan, budget, config, code, workdir, ledger, fp, dsb, name, None, resuming)
    if ledger is None or finished:
        return pre
    parent = next((p for p in ledger.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise StateError(
            f"the ledger {ledger} cannot be created: {parent} is a file; point config.ledger.path "
            "(ledger= in Python) elsewhere"
        )
    return replace(pre, spend=_on_ledger(pre, run_id, charge=False))


def describe_run(
    trainer: Any, space: Space, selection: Any, budget: Budget, opts: TuneOptions, **extra: Any
) -> Mapping[str, Any]:
    """What the journal binds a workdir to: ``opts.config``, else what changes the run (and
    ``extra``)."""
    if opts.config is not None:
        return opts.config
    return {
        **extra,
        "space": space.to_dict(),
        "selection": selection.privacy.describe() if hasattr(selection, "privacy") else None,
        "budget": [budget.epsilon, budget.delta],
        "trainer": getattr(trainer, "describe", lambda: {"kind": type(trainer).__name__})(),
        "seed": opts.seed, "accountant": opts.accountant,
        "debug_nonprivate": opts.debug_nonprivate, "adjacency": opts.adjacency,
    }  # fmt: skip


def _check_inputs(trainer: Any, plan: Any) -> None:
    """``trainer.check_inputs`` at every probe point of the space (``dptune.plan.probe_points``):
    a setting the search can draw and the data cannot take (say ``augmult > 0`` on tabular rows)
    is refused, naming the field and value, before anything is charged."""
    for name, point in probe_points(plan.space):
        try:
            trainer.check_inputs(plan.hparams(point))
        except TuningConfigError as e:
            if name is None:
                raise
            raise TuningConfigError(
                f"{e} (at {name}={point[name]!r}, a value the search space can draw: remove it "
                "from the space or fix the data)"
            ) from None


def run_in_workdir(
    workdir: Any, check: Callable[[], Preflight], steps: Callable[[Preflight, Any], Release]
) -> Release:
    """One run per workdir (``dptune/_state/workdir_lock.py``), locked for ``pre = check()`` (it
    reads the journal) and the run: opens the journal (bound to ``pre.config`` and ``pre.code``);
    a finished run returns its release, trains and charges nothing; otherwise ``steps(pre,
    journal)`` runs and its release is written to ``workdir/release/`` and marked in the journal."""
    with workdir_lock(workdir):
        pre = check()
        private_dir = None if pre.workdir is None else pre.workdir / "private"
        release_dir = None if pre.workdir is None else pre.workdir / "release"
        with open_journal(private_dir, pre.config, pre.code) as journal:
            if release_dir is not None and journal.get("released_at") and release_dir.exists():
                phase = pre.config.get("phase") if isinstance(pre.config, Mapping) else None
                if phase is None:
                    log.warning(
                        "this workdir's run finished already: its release is in %s (nothing was "
                        "trained or charged now; use a new --workdir for a new run)", release_dir,
                    )  # fmt: skip
                else:  # a finished phase of a resumed run (strategy 'subsampled'): reused
                    log.info("the %s phase finished already: its result is reused", phase)
                return read_release(release_dir)
            release = steps(pre, journal)
            if release_dir is not None:
                write_release(release, release_dir)
                journal.set("released_at", time.time())
            return release


def _tune_steps(
    pre: Preflight, trainer: Any, selection: Any, opts: TuneOptions, journal: Any
) -> Release:
    """``tune`` once ``preflight`` passed, in the run's open journal (holding the lock)."""
    plan = pre.plan
    # The curator's console: that the run resumes, and which kinds of malformed records the
    # loader dropped (no counts: the console's log may be shared; ``dptune inspect`` has them).
    if pre.resuming:
        t = journal.get("started_at")
        when = time.strftime("on %Y-%m-%d at %H:%M:%S", time.localtime(t)) if t else "earlier"
        log.info(
            "resuming the run started %s in %s: its plan and seeds are read back from the "
            "journal; finished candidates are kept, unfinished ones train again with their "
            "own seeds", when, pre.workdir,
        )  # fmt: skip
    if hasattr(trainer, "curator_view"):
        view = trainer.curator_view()
        journal.set("curator_view", view)
        if view:
            log.warning(
                "the loader dropped malformed private records (%s), each judged on its own "
                "(the guarantee is unchanged: docs/privacy-model.md); `dptune inspect %s` "
                "shows how many",
                ", ".join(sorted(view)).replace("_", " "), pre.workdir or "WORKDIR",
            )  # fmt: skip
    if hasattr(trainer, "clipping_path"):  # public: a function of the model and shapes
        clipping = trainer.clipping_path()
        journal.set("clipping", clipping)
        log.info("per-example clipping: %s (%s)", clipping["path"], clipping["why"])
    sel_plan = draw_plan(journal, plan, selection, opts.seed)
    drawn = journal.candidates()
    declared = check_candidates(trainer, plan, [r.hparams for r in drawn])
    checked = dict(zip((r.index for r in drawn), declared, strict=True))
    if hasattr(trainer, "bind_accounted"):
        # the event a trainer reports is compared with what was accounted, not a fresh call
        trainer.bind_accounted([(plan.hparams(r.hparams), checked[r.index]) for r in drawn])
    charge_ledger(pre, journal)
    records = {r.index: r for r in journal.candidates()}
    payloads: dict[int, Any] = {}
    executor = opts.executor or VectorizedExecutor(opts.group_size)  # 1: one at a time
    scores = run_candidates(
        trainer, selection, sel_plan, plan, records, journal, payloads, executor,
        opts.progress, checked,
    )  # fmt: skip
    release = release_selected(
        trainer, selection, sel_plan, plan, pre.budget, records, scores, payloads, journal
    )
    release.private = _Private(sel_plan.num_trials, list(scores))
    if opts.debug_nonprivate:
        # The curator asked for a non-private view: this print is why the statement says so.
        print(f"[debug_nonprivate] K={sel_plan.num_trials}; scores in order: {scores}")
    return release


def _on_ledger(pre: Preflight, run_id: str | None, charge: bool) -> Any:
    """``Ledger.charge`` (``charge``) or its read-only ``check`` of the run's (epsilon, delta) on
    the dataset's budget; a missing ledger is checked as the empty one a charge would create."""
    st, dsb = pre.plan.statement, pre.dataset_budget
    args = (pre.fingerprint, run_id, float(st.total_epsilon), float(st.delta))
    kw: dict[str, Any] = {"name": pre.dataset_name}
    if dsb is not None:
        kw.update(budget_epsilon=dsb.epsilon, budget_delta=dsb.delta)
    with Ledger(pre.ledger, readonly=not charge) as led:
        if not charge:
            return led.check(*args, **kw)
        return led.charge(*args, **kw, workdir=str(pre.workdir or ""))


@contextlib.contextmanager
def open_journal(
    private_dir: Path | None, config: Mapping[str, Any], code: Mapping[str, Any], readonly=False
) -> Iterator[Any]:
    """The run's journal bound to ``config`` and ``code`` (in memory without a workdir)."""
    with Journal(private_dir, readonly=readonly) as journal:
        journal.bind_config(dict(config))
        journal.bind_code(dict(code))
        journal.check_complete()
        yield journal


def bind_calibrated(journal: Any, statement: Any, calibrated: Mapping[str, Any]) -> str:
    """Journals, once, the run id (returned), the statement and the calibrated values; a resume
    whose accountant now calibrates otherwise is refused."""
    run_id = journal.set_once("run_id", uuid.uuid4().hex)
    journal.set_once("privacy", {**statement.to_dict(), "calibrated": dict(calibrated)})
    if (planned := journal.set_once("calibrated", calibrated)) != calibrated:
        raise TuningConfigError(
            f"this run was planned with {planned} but the accountant now gives {calibrated} (a "
            "different dptune version?): finish it with the version that started it, or start a "
            "new workdir"
        )
    return run_id


def draw_plan(journal: Any, plan: PrivacyPlan, selection: Any, seed: int | None):
    """Draws (once) the run id, the entropy, the selection's plan and every candidate's seed and
    hyperparameters; a resume reads them back. Returns the selection's plan."""
    bind_calibrated(journal, plan.statement, dict(plan.calibrated))
    entropy = journal.set_once(
        "entropy", int(seed) if seed is not None else int(np.random.SeedSequence().entropy)
    )
    plan_dict = journal.get("plan")
    if plan_dict is None:
        sel_plan = selection.plan(
            np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(0,)))
        )
        if sel_plan.num_trials > MAX_PLANNED_TRIALS:
            raise TuningConfigError(
                f"the plan asks for up to {sel_plan.num_trials} candidates (> "
                f"{MAX_PLANNED_TRIALS}); lower max_trials"
            )
        rows = []
        for i in range(sel_plan.num_trials):
            ss = np.random.SeedSequence(entropy, spawn_key=(1, i))
            hp_rng = np.random.default_rng(ss.spawn(1)[0])
            # 128 bits: the candidate's noise must not be guessable from a small seed space.
            words = ss.generate_state(4, dtype=np.uint32)
            seed_i = sum(int(w) << (32 * j) for j, w in enumerate(words))
            rows.append((i, seed_i, plan.space.sample(hp_rng)))
        journal.add_candidates(rows)
        plan_dict = journal.set_once("plan", sel_plan.to_dict())
    plan_cls = getattr(selection, "plan_class", None) or Plan
    return plan_cls.from_dict(dict(plan_dict))


def charge_ledger(pre: Preflight, journal: Any) -> None:
    """Charges the run's (epsilon, delta) to the dataset's budget in ``pre.ledger`` (if any) once
    per journaled run id, then marks the run started; BudgetExceededError if it does not fit."""
    if pre.ledger is not None:
        spend = _on_ledger(pre, journal.get("run_id"), charge=True)
        fp, explicit = pre.fingerprint or "", pre.dataset_budget is not None
        if spend.registered:
            # A budget the run states is explicit: INFO. One taken from the run itself: a
            # WARNING, since it fixes the dataset's lifetime budget.
            log.log(
                logging.INFO if explicit else logging.WARNING,
                "ledger %s: dataset %s (%s) had no lifetime budget; registered (epsilon=%g, "
                "delta=%g) %s. Every later run on it must fit in what is left; change it with "
                "`dptune ledger --dataset=%s --budget_epsilon=E --budget_delta=D`",
                pre.ledger, spend.name or "?", fp[:12], spend.budget_epsilon, spend.budget_delta,
                "as this run states it" if explicit else "(the default: 10 runs like this one)",
                fp[:12],
            )  # fmt: skip
        log.info(
            "ledger %s: this run costs epsilon=%.4g; dataset %s has spent %.4g of %.4g",
            pre.ledger, pre.plan.statement.total_epsilon, fp[:12], spend.spent_epsilon,
            spend.budget_epsilon,
        )  # fmt: skip
    journal.set_once("started_at", time.time())


def run_candidates(
    trainer: Any, selection: Any, sel_plan: Any, plan: PrivacyPlan, records: dict[int, Any],
    journal: Any, payloads: dict[int, Any], executor: Any, progress: bool,
    checked: Mapping[int, Any],
) -> list[float]:  # fmt: skip
    """Trains candidates until the selection is done; returns the scores prefix (index order).
    The executor gets the next ``executor.parallelism`` unfinished candidates, each first checked
    to declare what was accounted (``check_unchanged``); each result is journaled as it comes
    back (NaN: failure), so a kill loses at most the candidates in flight (rerun: same seeds)."""
    n = sel_plan.num_trials

    def prefix() -> list[float]:
        done = itertools.takewhile(lambda r: r.status == "done", (records[i] for i in range(n)))
        return [float("nan") if r.failed else float(r.score) for r in done]

    scores = prefix()
    with tuning_bar(progress) as bar:
        while len(scores) < n and not selection.done(sel_plan, scores):
            todo = [i for i in range(len(scores), n) if records[i].status != "done"]
            todo = todo[: max(1, int(executor.parallelism))]
            for i in todo:
                check_unchanged(trainer, plan, records[i].hparams, checked[i])
            for i in todo:
                journal.mark_running(i)
            jobs = [Job(i, records[i].seed, plan.hparams(records[i].hparams)) for i in todo]
            t0 = time.time()
            for i, raw_score, raw_payload in executor.run(trainer, jobs):
                score, payload = checked_result(raw_score, raw_payload)
                failed = isinstance(payload, CandidateFailure)
                if not failed:
                    journal.write_payload(i, pickle.dumps(payload, pickle.HIGHEST_PROTOCOL))
                journal.mark_done(i, score, failed, time.time() - t0, payload if failed else None)
                payloads[i] = None if failed else payload
                records[i] = replace(
                    records[i], status="done", score=None if failed else score, failed=failed
                )
                bar.update()
            scores = prefix()
    return scores


def release_selected(
    trainer, selection, sel_plan, plan, budget, records, scores, payloads, journal
) -> Release:
    """The selected candidate's release (or nothing) from ``scores`` (``run_candidates``'s): its
    hyperparameters, what its trainer says may be released of it, its score, and the statement;
    the curve's epsilon is the privacy its training produced per epoch, at the plan's delta."""
    index = selection.select(sel_plan, scores)
    # What the selection's theorem covers: the score only where it is covered.
    published = tuple(getattr(selection, "publishes", ("payload",)))
    st = plan.statement
    privacy = {**st.to_dict(), "budget_epsilon": budget.epsilon, "budget_delta": budget.delta}
    text = st.to_text()
    ex_post = getattr(selection, "ex_post_epsilon", None)
    if ex_post is not None and st.accountant == "pure" and "index" in published:
        # Ex-post privacy (Ligett et al. 2017, Lemma 2.8; pure-DP candidates only, their Remark
        # 2.9): reported next to the worst case above, which is what the budget and ledger hold.
        privacy["ex_post_epsilon"] = float(ex_post(st.single_run_epsilon, index))
        text += (
            f"\nRealised ex-post privacy loss of this outcome: {privacy['ex_post_epsilon']:.4g} "
            "(Ligett et al. 2017, Lemma 2.8); charged: the worst case above."
        )
    name = (f"{FUNCTION_TRAINER} {trainer.name!r}" if isinstance(trainer, FunctionTrainer)
            else getattr(trainer, "kind", "") or type(trainer).__name__)  # fmt: skip
    common = dict(published=published, trainer_name=str(name))
    if index is None or records[index].failed:
        # A failed selected candidate: the selections rank a failure below every score, so every
        # candidate failed (a function of the selected output: post-processing). No model.
        outcome = NONE_SELECTED if index is None else NO_CANDIDATE_SUCCEEDED
        return Release(False, None, None, None, privacy, text, outcome=outcome, **common)
    hp = plan.hparams(records[index].hparams)
    payload = payloads[index] if index in payloads else journal.read_payload(index)
    has_view = hasattr(trainer, "release_view")
    view = trainer.release_view(hp, payload) if has_view else ReleaseView(payload)
    # The curve's privacy travelled with the candidate's result (what its training spent up to
    # each epoch); only the conversion to epsilon at the plan's delta happens here.
    spent = list(view.privacy_by_epoch)
    rows = list(view.history) or [{"epoch": e} for e in range(1, len(spent) + 1)]
    curve = None
    if spent and len(spent) == len(rows):
        curve = [
            {"epoch": row.get("epoch", e), "epsilon_one_run": plan.single_run_epsilon(c), **row}
            for e, (row, c) in enumerate(zip(rows, spent, strict=True), start=1)
        ]
    elif spent:
        log.warning(
            "no training curve: the trainer gave %d per-epoch privacy values for %d rows",
            len(spent), len(rows),
        )  # fmt: skip
    return Release(
        True, hp, float(scores[index]) if "score" in published else None, view.test_accuracy,
        privacy, text, payload=view.payload, curve=curve, **common,
        test_metric=None if view.test_metric is None else dict(view.test_metric),
    )  # fmt: skip
