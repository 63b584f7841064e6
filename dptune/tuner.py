"""``dptune.tune``: from a total privacy budget to one released candidate, crash-safe and budgeted.

The order of operations is the privacy argument, so it is fixed here and nowhere else; ``tune`` is
the sequence of these named steps:

1. ``make_privacy_plan`` (``dptune.plan``): check every input; account the worst case over
   everything the space can draw, calibrating ``"auto"`` so the *total* (tuning included) meets the
   budget. Nothing private has run yet.
2. ``_open_journal``: ``DIR/private/journal.sqlite`` binds the config (a different one is
   refused); a finished run returns its release.
3. ``_draw_plan``: the run id, the root entropy, the selection's plan and every candidate's seed and
   hyperparameters, each drawn once: a resume reads them back and never draws them again.
4. ``check_candidates`` (``dptune.plan``): every drawn candidate's declared privacy is what the
   statement accounted.
5. ``_charge_ledger``: the run's (epsilon, delta) is charged to the dataset's budget (once per run
   id; refused if it would exceed the budget).
6. ``_run_candidates``: candidates train in index order, one at a time or in groups (vectorised
   ``train_many``), each journaled as it finishes behind one failure guard; finished ones are never
   retrained on resume.
7. ``_release``: select, and release only the selected candidate (``DIR/release/``).

Trainers: ``dptune.trainer_protocol`` (the protocol, ``FunctionTrainer``) and
``dptune.learners`` (``DpSgdTrainer`` and the other candidate families).
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from dptune.accounting import ACCOUNTANTS
from dptune.errors import ImpossibleBudgetError, TuningConfigError
from dptune.executors import Job, make_executor
from dptune.journal import JOURNAL_FILE, Journal, MemoryJournal
from dptune.ledger import Ledger
from dptune.plan import (
    AUTO,
    Budget,
    PrivacyPlan,
    as_budget,
    check_candidates,
    check_unchanged,
    make_privacy_plan,
    plan_privacy,
)
from dptune.progress import tuning_bar
from dptune.release import Release, public_curve, read_release, write_release
from dptune.space import Space
from dptune.trainer_protocol import FunctionTrainer, Trainer, release_view, trainer
from dptune.workdir_lock import holds_workdir_lock

__all__ = [
    "AUTO",
    "Budget",
    "FunctionTrainer",
    "ImpossibleBudgetError",
    "PrivacyPlan",
    "Trainer",
    "TuningConfigError",
    "make_privacy_plan",
    "plan_privacy",
    "trainer",
    "tune",
]

log = logging.getLogger("dptune")

#: Largest number of candidates a plan may ask for (thresholding's cap, a random-stopping K).
MAX_PLANNED_TRIALS = 100_000


@dataclass
class _Private:
    """The curator's view of a run (K, every score): never printed by default, never released."""

    num_trials: int
    scores: list[float] = field(default_factory=list)
    run_id: str = ""

    def __repr__(self) -> str:  # keep K and scores out of accidental prints
        return "<private: see DIR/private/>"


@holds_workdir_lock  # one run per workdir, for the whole run (dptune/workdir_lock.py)
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
    executor: Any = None,
) -> Release:
    """Tunes privately and releases the selected candidate (or nothing).

    Args:
      trainer: a trainer (``dptune.trainer_protocol``): e.g. ``dptune.DpSgdTrainer``, a
        ``FunctionTrainer``.
      space: the search space; ``noise_multiplier="auto"`` calibrates the noise to the budget.
      selection: a ``selection`` method (``RandomStopping``, ``Thresholding``, ...).
      budget: total (epsilon, delta) for everything released, tuning included.
      workdir: folder for ``private/`` (journal, candidates) and ``release/``; with it a killed run
        resumes when called again with the same arguments. None: everything stays in memory.
      seed: a fixed seed for every random choice (debugging, tests); default: OS entropy. The
        statement then says it holds only while the seed is secret.
      group_size: candidates trained at once through ``trainer.train_many`` (vectorised); a
        shortcut for ``executor=dptune.executors.VectorizedExecutor(group_size)``.
      accountant: "auto" (the tightest valid route), "rdp" or "pld" (``dptune.accounting``).
      ledger: a :class:`~dptune.ledger.Ledger` or its path: charge the run to the dataset's budget.
      dataset_budget: the dataset's total budget in the ledger (default: ``budget``).
      fingerprint: the dataset id in the ledger (default: ``trainer.fingerprint``).
      config: what the journal binds the workdir to (default: a description of the arguments).
      progress: show a tqdm display (curator's console; it shows neither K nor scores).
      debug_nonprivate: print every candidate's score at the end; marks the statement NOT private.
      adjacency: "add_remove" (default: neighbours differ by one added or removed example) or
        "replace_one" (one example replaced; for datasets of fixed, public size).
      executor: how candidates are trained (``dptune.executors``; default sequential). Random
        stopping hands it all K candidates as it can take them; thresholding evaluates extra
        candidates speculatively and consumes their scores in order.
    Returns:
      The :class:`~dptune.release.Release` (also written to ``workdir/release/`` if given).
    """
    budget = as_budget(budget)
    _check_arguments(group_size, accountant, seed, debug_nonprivate, ledger)
    if executor is None:
        executor = make_executor("sequential", group_size=group_size)
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
    private_dir = None if workdir is None else Path(workdir) / "private"
    # An existing run: a changed config is refused before any (slow) accounting.
    journal = _open_journal(private_dir, config, existing_only=True)
    try:
        log.info("accounting: checking the total budget (calibrating the noise if 'auto')")
        plan = make_privacy_plan(
            trainer, space, selection, budget, accountant=accountant, seeded=seed is not None,
            debug_nonprivate=debug_nonprivate, adjacency=adjacency,
        )  # fmt: skip
        journal = journal or _open_journal(private_dir, config)
        release_dir = None if workdir is None else Path(workdir) / "release"
        if release_dir is not None and journal.get("released_at") and release_dir.exists():
            log.info("this run already finished; its release is in %s", release_dir)
            return read_release(release_dir)
        run_id, sel_plan = _draw_plan(journal, plan, selection, seed)
        drawn = journal.candidates()
        checked = dict(
            zip(
                (r.index for r in drawn),
                check_candidates(trainer, plan, [r.hparams for r in drawn]),
                strict=True,
            )
        )
        if hasattr(trainer, "bind_accounted"):
            # the event a trainer reports is compared with what was accounted, not a fresh call
            trainer.bind_accounted([(plan.hparams(r.hparams), checked[r.index]) for r in drawn])
        if ledger is not None:
            _charge_ledger(
                ledger, trainer, plan, run_id, budget, dataset_budget, fingerprint, workdir
            )
        journal.set_once("started_at", time.time())
        records = {r.index: r for r in journal.candidates()}
        payloads: dict[int, Any] = {}
        scores = _run_candidates(
            trainer, selection, sel_plan, plan, records, journal, payloads, executor, progress,
            checked,
        )  # fmt: skip
        private = _Private(num_trials=sel_plan.num_trials, scores=list(scores), run_id=run_id)
        release = _release(trainer, selection, sel_plan, plan, budget, records, payloads, journal)
        release.private = private
        if debug_nonprivate:
            # The curator asked for a non-private view: this print is why the statement says so.
            print(f"[debug_nonprivate] K={sel_plan.num_trials}; scores in order: {scores}")
        if release_dir is not None:
            write_release(release, release_dir)
            journal.set("released_at", time.time())
        return release
    finally:
        if journal is not None:
            journal.close()


def _check_arguments(group_size, accountant, seed, debug_nonprivate, ledger) -> None:
    if not isinstance(group_size, int) or group_size < 1:
        raise TuningConfigError(f"group_size={group_size!r} must be an integer >= 1")
    if accountant not in ACCOUNTANTS:
        raise TuningConfigError(
            f"accountant={accountant!r} is unknown; choose one of {', '.join(ACCOUNTANTS)}"
        )
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise TuningConfigError(f"seed={seed!r} must be a non-negative integer or None")
    if debug_nonprivate and ledger is not None:
        raise TuningConfigError(
            "debug_nonprivate prints every score and K, which voids the guarantee: no finite spend "
            "can be charged to the dataset's ledger. Disable the ledger "
            "(config.ledger.enabled=False) for debug runs on data that has no budget to protect"
        )


def _open_journal(
    private_dir: Path | None, config: Mapping[str, Any], existing_only: bool = False
) -> Any:
    """The run's journal bound to ``config`` (in memory without a workdir); with
    ``existing_only``, None unless a journal is already there."""
    if private_dir is None:
        if existing_only:
            return None
        journal: Any = MemoryJournal()
    elif existing_only and not (private_dir / JOURNAL_FILE).exists():
        return None
    else:
        journal = Journal(private_dir)
    try:
        journal.bind_config(dict(config))
    except BaseException:
        journal.close()
        raise
    return journal


def _draw_plan(journal: Any, plan: PrivacyPlan, selection: Any, seed: int | None):
    """Draws (once) the run id, the entropy, the selection's plan and every candidate's seed and
    hyperparameters; a resume reads them back. Returns ``(run_id, selection plan)``."""
    run_id = journal.set_once("run_id", uuid.uuid4().hex)
    privacy = plan.statement.to_dict()
    privacy.update(calibrated=dict(plan.calibrated))
    journal.set_once("privacy", privacy)
    if journal.get("calibrated", dict(plan.calibrated)) != dict(plan.calibrated):
        raise TuningConfigError(
            f"this run was planned with {journal.get('calibrated')} but the accountant now gives "
            f"{dict(plan.calibrated)} (a different dptune version?): finish it with the version "
            "that started it, or start a new workdir"
        )
    journal.set_once("calibrated", dict(plan.calibrated))
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
    return run_id, _plan_from_dict(selection, plan_dict)


def _charge_ledger(ledger, trainer, plan, run_id, budget, dataset_budget, fingerprint, workdir):
    """Charges the run to the dataset's budget before anything private runs (refused: nothing
    trains)."""
    led = ledger if isinstance(ledger, Ledger) else Ledger(ledger)
    fp = fingerprint or getattr(trainer, "fingerprint", None)
    if not fp:
        raise TuningConfigError(
            "a ledger needs the dataset's fingerprint: pass fingerprint= or a trainer with a "
            ".fingerprint"
        )
    dsb = as_budget(dataset_budget) if dataset_budget is not None else budget
    st = plan.statement
    spend = led.charge(
        fp,
        run_id,
        float(st.total_epsilon),
        float(st.delta),
        budget_epsilon=dsb.epsilon,
        budget_delta=dsb.delta,
        name=str(getattr(getattr(trainer, "data", None), "name", "")),
        workdir=str(workdir or ""),
    )
    log.info(
        "ledger %s: this run costs epsilon=%.4g; dataset %s has spent %.4g of %.4g",
        led.path,
        st.total_epsilon,
        fp[:12],
        spend.spent_epsilon,
        spend.budget_epsilon,
    )


def _run_candidates(
    trainer: Any,
    selection: Any,
    sel_plan: Any,
    plan: PrivacyPlan,
    records: dict[int, Any],
    journal: Any,
    payloads: dict[int, Any],
    executor: Any,
    progress: bool,
    checked: Mapping[int, Any],
) -> list[float]:
    """Trains candidates until the selection is done; returns the scores prefix (index order).

    The executor gets the next ``executor.parallelism`` unfinished candidates, each first checked
    to declare what was accounted for it (``checked``: ``check_unchanged``); each result is
    journaled as it comes back (score NaN = failure), so a kill loses at most the candidates in
    flight, which a rerun trains again with the same seeds."""

    def prefix() -> list[float]:
        out = []
        for i in range(sel_plan.num_trials):
            r = records[i]
            if r.status != "done":
                break
            out.append(float("nan") if r.failed else float(r.score))
        return out

    scores = prefix()
    with tuning_bar(progress) as bar:
        while len(scores) < sel_plan.num_trials and not selection.done(sel_plan, scores):
            todo = [
                i for i in range(len(scores), sel_plan.num_trials) if records[i].status != "done"
            ][: max(1, int(executor.parallelism))]
            for i in todo:
                check_unchanged(trainer, plan, records[i].hparams, checked[i])
            for i in todo:
                journal.mark_running(i)
            jobs = [Job(i, records[i].seed, plan.hparams(records[i].hparams)) for i in todo]
            t0 = time.time()
            for i, score, payload in executor.run(trainer, jobs):
                failed = not math.isfinite(score)
                journal.write_payload(i, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
                journal.mark_done(i, float("nan") if failed else score, failed, time.time() - t0)
                payloads[i] = payload
                records[i] = replace(
                    records[i], status="done", score=None if failed else float(score), failed=failed
                )
                bar.update()
            scores = prefix()
    return scores


def _release(trainer, selection, sel_plan, plan, budget, records, payloads, journal) -> Release:
    """The selected candidate's release (or nothing): its hyperparameters, what its trainer says
    may be released of it, its score, and the statement; the curve's epsilon is the privacy its
    training produced per epoch, at the plan's delta and adjacency."""
    scores = [
        float("nan") if records[i].failed else float(records[i].score)
        for i in range(sel_plan.num_trials)
        if records[i].status == "done"
    ]
    index = selection.select(sel_plan, scores)
    # What the selection's theorem covers (issue 25): the score only where it is covered.
    published = tuple(getattr(selection, "publishes", ("payload",)))
    privacy = plan.statement.to_dict()
    privacy.update(budget_epsilon=budget.epsilon, budget_delta=budget.delta)
    text = plan.statement.to_text()
    ex_post = getattr(selection, "ex_post_epsilon", None)
    if ex_post is not None and plan.statement.accountant == "pure" and "index" in published:
        # Ex-post privacy (Ligett et al. 2017, Lemma 2.8; pure-DP candidates only, their Remark
        # 2.9): reported next to the worst case above, which is what the budget and ledger hold.
        privacy["ex_post_epsilon"] = float(ex_post(plan.statement.single_run_epsilon, index))
        text += (
            f"\nRealised ex-post privacy loss of this outcome: {privacy['ex_post_epsilon']:.4g} "
            "(Ligett et al. 2017, Lemma 2.8); charged: the worst case above."
        )
    if index is None:
        return Release(False, None, None, None, privacy, text, published=published)
    hp = plan.hparams(records[index].hparams)
    payload = payloads[index] if index in payloads else journal.read_payload(index)
    view = release_view(trainer, hp, payload)
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
    score = float(scores[index]) if "score" in published else None
    return Release(
        True, hp, score, view.test_accuracy, privacy, text, payload=view.payload,
        curve=public_curve(curve), published=published,
    )  # fmt: skip


def _plan_from_dict(selection: Any, d: Mapping[str, Any]) -> Any:
    plan_cls = getattr(selection, "plan_class", None)
    if plan_cls is None:
        from selection import Plan as plan_cls  # noqa: N813
    return plan_cls.from_dict(dict(d))
