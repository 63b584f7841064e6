"""Subsampled tuning (strategy ``subsampled``): tune on a per-record Poisson subset of the private
data with a budget of its own, then train the selected hyperparameters once on all the data
(Koskela & Kulkarni 2023, "Practical Differentially Private Hyperparameter Tuning with
Subsampling", arXiv:2301.11989). The two phases are accounted as one composition
(``dptune.accounting.subsampled``: the selection theorem on the subset, amplification by Poisson
subsampling, PLD composition with the final run) and charged to the ledger once; the subset's
secret key is drawn once and journaled, and a killed run resumes phase by phase
(``DIR/private/tuning``, ``DIR/private/final``). Phase 1's release stays private; if it releases
nothing, nothing is released.

The trainer must have the hook ``subset(fraction, key) -> trainer``: the same trainer on the
records whose keyed hash falls below ``fraction`` (``DpSgdTrainer.subset``). Scope: add/remove
adjacency (the amplification theorem's), the ``auto`` or ``pld`` accountant (the composition is by
PLD), a calibrated (``"auto"``) noise multiplier, and a score the trainer's privacy covers
(``score_kind="covered"``: the release holds the final run's model and its noisy score).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from dptune.accounting import subsampled as acc
from dptune.accounting.statement import PrivacyStatement
from dptune.errors import ImpossibleBudgetError, TuningConfigError
from dptune.plan import (
    AUTO,
    Budget,
    PrivacyPlan,
    _check_inputs,
    accounted_candidate,
    as_budget,
    as_space,
    check_total,
    grid_candidates,
    make_privacy_plan,
)
from dptune.release import Release
from dptune.space import Space
from dptune.tuner import (
    TuneOptions,
    bind_calibrated,
    charge_ledger,
    check_run,
    describe_run,
    run_in_workdir,
    tune,
)
from selection.baselines import BestOfK

__all__ = ["SubsampledPlan", "plan_subsampled", "tune_subsampled"]

#: What the release holds of the final run (``selection.registry.PUBLISHABLE`` words): its model
#: and its noisy validation score, both covered by the final run's accounted privacy.
FINAL_PUBLISHES = ("payload", "score")


@dataclass(frozen=True)
class SubsampledPlan:
    """What the accountant promised for a subsampled tuning run, before anything private runs:
    the tuning phase's budgets (``tuning``: on the subset, and amplified to the full data) and
    privacy plan over the subset's candidates (``tuning_plan``), the final run's ``calibrated``
    values and every privacy it may have (``final_candidates``, one per privacy-grid point), and
    the whole run's ``statement`` (``dptune.accounting.subsampled``)."""

    tuning: acc.SubsampledTuning
    tuning_plan: PrivacyPlan
    calibrated: Mapping[str, Any]
    final_candidates: tuple
    statement: PrivacyStatement


def _check(trainer: Any, space: Space, accountant: str, adjacency: str) -> str:
    if not hasattr(trainer, "subset"):
        raise TuningConfigError(
            f"strategy 'subsampled' needs a trainer with a subset(fraction, key) hook (the same "
            f"trainer on a per-record subset); {type(trainer).__name__} has none: use strategy "
            "'full'"
        )
    if adjacency != "add_remove":
        raise TuningConfigError(
            "strategy 'subsampled' is accounted under add/remove adjacency (amplification by "
            "Poisson subsampling): set adjacency='add_remove' or use strategy 'full'"
        )
    if accountant not in ("auto", "pld"):
        raise TuningConfigError(
            f"strategy 'subsampled' composes the two phases by PLD: accountant={accountant!r} "
            "has no route for it; use 'auto' or 'pld'"
        )
    kind = getattr(trainer, "score_kind", "exact")
    if kind != "covered":
        raise TuningConfigError(
            f"strategy 'subsampled' releases the final run's validation score, which needs a score "
            f"its declared privacy covers, but the trainer declares score_kind={kind!r}: use "
            "strategy 'full', or a trainer whose score is covered (score_kind='covered')"
        )
    field = getattr(trainer, "calibrated_field", "noise_multiplier")
    if space.fields.get(field) != AUTO:
        raise TuningConfigError(
            f"strategy 'subsampled' calibrates {field} separately for the tuning candidates and "
            f"the final run: set {field}='auto' in the space"
        )
    return field


def plan_subsampled(
    trainer: Any, space: Space | Mapping[str, Any], selection: Any,
    budget: Budget | tuple[float, float], *, fraction: float, tuning_epsilon: float,
    subset_trainer: Any = None, accountant: str = "auto", seeded: bool = False,
    adjacency: str = "add_remove",
) -> SubsampledPlan:  # fmt: skip
    """Checks the inputs and accounts a subsampled tuning run; nothing private runs.

    Args:
      trainer: the trainer on all the data (with a ``subset`` hook).
      space, selection: as ``dptune.tune``'s, run over the subset's candidates.
      budget: the TOTAL (epsilon, delta) of both phases.
      fraction: the subset's Poisson rate f in (0, 1).
      tuning_epsilon: the tuning phase's epsilon on the full data (amplification included), in
        (0, budget epsilon).
      subset_trainer: ``trainer.subset(fraction, key)`` if already built (its privacy depends only
        on public sizes); default: built with a throwaway key (nothing of it is trained).
      accountant, seeded, adjacency: as ``dptune.tune``.
    Raises:
      TuningConfigError, ImpossibleBudgetError (one line each, nothing charged).
    """
    budget, space = as_budget(budget), as_space(space)
    field = _check(trainer, space, accountant, adjacency)
    # The final run's checks on all the data (e.g. delta below 1/N), which its own tune() makes
    # again: here, before the tuning phase trains or the ledger is charged.
    _check_inputs(trainer, space, BestOfK(1), budget, adjacency, False)
    if not 0 < tuning_epsilon < budget.epsilon:
        raise TuningConfigError(
            f"tuning_epsilon={tuning_epsilon!r} must be > 0 and below the total epsilon "
            f"{budget.epsilon:g} (the final run needs the rest)"
        )
    try:
        tuning = acc.SubsampledTuning.from_budget(fraction, tuning_epsilon, budget.delta)
    except ValueError as e:
        raise TuningConfigError(str(e)) from None
    sub = subset_trainer if subset_trainer is not None else trainer.subset(fraction, os.urandom(32))
    try:
        tuning_plan = make_privacy_plan(
            sub, space, selection, Budget(tuning.subset_epsilon, tuning.subset_delta),
            accountant=accountant, seeded=seeded, adjacency=adjacency,
        )  # fmt: skip
    except ImpossibleBudgetError as e:
        raise ImpossibleBudgetError(
            f"the tuning phase's budget (tuning_epsilon={tuning_epsilon:g} on the full data, "
            f"{tuning.subset_epsilon:.4g} on the subset of rate {fraction:g}) is too small for "
            f"its candidates: raise strategy.tuning_epsilon or strategy.fraction ({e})"
        ) from None
    try:
        sigma, cands, statement = _final_run(
            trainer, sub, tuning_plan, field, fraction, budget, seeded, adjacency
        )
    except ValueError as e:
        raise ImpossibleBudgetError(
            f"no final {field.replace('_', ' ')} meets the total budget (epsilon="
            f"{budget.epsilon:g}, delta={budget.delta:g}) after a tuning phase of epsilon "
            f"{tuning_epsilon:g}: lower strategy.tuning_epsilon or raise the budget ({e})"
        ) from None
    check_total(statement, budget, "subsampled tuning", field)
    return SubsampledPlan(
        tuning, tuning_plan, {field: float(sigma)}, tuple(dict.fromkeys(cands)), statement
    )


def _final_run(trainer, sub, tuning_plan, field, fraction, budget, seeded, adjacency):
    """The final run's calibrated noise, its possible privacy settings (any point of the privacy
    grid the tuning plan enumerated) and the whole run's statement; ``sub`` is the subset's
    trainer the tuning plan was made for. ValueError if no noise meets the budget."""
    space, grid = tuning_plan.space, tuning_plan.space.privacy_grid()

    def final_candidates(sigma: float) -> list[Any]:
        return grid_candidates(trainer, space, grid, adjacency, {field: sigma})

    final_candidates(1.0)  # invalid settings raise their own message here
    eps_t, delta_t = acc.amplify(
        tuning_plan.statement.total_epsilon, tuning_plan.statement.delta, fraction
    )
    sigma = acc.calibrate_final(final_candidates, eps_t, delta_t, budget.epsilon, budget.delta)
    cands = final_candidates(sigma)
    notes = (
        *getattr(trainer, "privacy_notes", tuple)(),
        f"Tuning on a per-record Poisson subset of rate {fraction:g} (each record's membership "
        "a keyed hash of that record alone under a secret key), then one final run on all the "
        "data with the selected hyperparameters.",
    )
    statement = acc.subsampled_statement(
        cands, tuning_plan.statement, fraction, budget.delta, seeded=seeded, notes=notes
    )
    # What the statement rests on: the tuning phase's basis, plus this strategy's guarantees.
    basis = tuning_plan.statement
    # The trainer's own checks name its public sizes: the subset's (q = B f / (N f)) hold for the
    # tuning candidates, the full trainer's for the final run; the statement says both.
    sub_checks = tuple(getattr(sub, "privacy_checks", tuple)())
    full_checks = tuple(getattr(trainer, "privacy_checks", tuple)())
    # The tuning phase's selection output stays private: its score-kind line says what that
    # selection would release, so it is named as the tuning phase's.
    checked = (
        *(f"tuning phase: {c}" if c.startswith("the score kind") else c
          for c in basis.checked if c not in sub_checks),
        *(f"tuning candidates (on the subset of rate {fraction:g}): {c}" for c in sub_checks
          if c not in full_checks),
        *full_checks,
        "the tuning subset is drawn per record: a keyed hash of each record and its copy "
        "number under a secret 32-byte key (trainers.data.record_subset_mask), so adding or "
        "removing a record changes only its own membership (Poisson subsampling)",
        "the final run's setting is one the statement accounted, checked before it trains",
    )  # fmt: skip
    # A public start (fine-tuning) is assumed by both phases: the final run starts from it too.
    assumptions = tuple(basis.assumptions)
    if getattr(trainer, "init_fingerprint", None) and "public-init" not in assumptions:
        assumptions += ("public-init",)
    # Released: the final run's model and its noisy validation score (best of one, whose score
    # the final candidate's privacy covers), whatever the tuning phase's selection publishes.
    statement = dataclasses.replace(
        statement, assumptions=assumptions, checked=checked, trainer_word=basis.trainer_word,
        published=FINAL_PUBLISHES,
    )  # fmt: skip
    return sigma, cands, statement


def tune_subsampled(
    trainer: Any, space: Space | Mapping[str, Any], selection: Any,
    budget: Budget | tuple[float, float], *, fraction: float, tuning_epsilon: float,
    options: TuneOptions | None = None, **kwargs: Any,
) -> Release:  # fmt: skip
    """Tunes on a per-record Poisson subset, retrains the selection on all the data, and releases
    that final model under one statement for both phases (module docstring). Args are those of
    ``dptune.tune`` (the same default ledger, charged once for both phases; ``debug_nonprivate``
    is refused) and ``fraction``, ``tuning_epsilon`` as :func:`plan_subsampled`'s. Returns the
    final run's :class:`~dptune.release.Release` (also written to ``workdir/release/``)."""
    opts = TuneOptions.build(options or TuneOptions(), kwargs)
    opts.check()
    if opts.debug_nonprivate:
        raise TuningConfigError("strategy 'subsampled' has no debug_nonprivate: use 'full'")
    budget, space = as_budget(budget), as_space(space)
    _check(trainer, space, opts.accountant, opts.adjacency)  # before the lock makes the workdir
    strategy = {"name": "subsampled", "fraction": fraction, "tuning_epsilon": tuning_epsilon}
    config = describe_run(trainer, space, selection, budget, opts, strategy=strategy)

    def plan() -> SubsampledPlan:
        # The subset trainer's privacy depends on public sizes only, so the plan is the same for
        # every key: it is computed before anything is written (a refusal leaves no journal).
        return plan_subsampled(
            trainer, space, selection, budget, fraction=fraction, tuning_epsilon=tuning_epsilon,
            accountant=opts.accountant, seeded=opts.seed is not None, adjacency=opts.adjacency,
        )  # fmt: skip

    return run_in_workdir(
        opts.workdir, lambda: check_run(trainer, budget, config, opts, plan),
        lambda pre, j: _phases(trainer, selection, space, pre, j, opts),
    )  # fmt: skip


def _phases(trainer, selection, space, pre, journal, opts) -> Release:
    """Journals the run id and the calibrated values, charges the whole run to the ledger once,
    then phase 1 (``tune`` on the subset) and, if it released, phase 2 (the selected setting
    once on all the data at the final noise, best of 1); the release carries the whole run's
    statement. Both phases run with ``ledger=None``: the run was charged once, as a whole."""
    plan, budget = pre.plan, pre.budget
    calibrated = {"tuning": dict(plan.tuning_plan.calibrated), "final": dict(plan.calibrated)}
    run_id = bind_calibrated(journal, plan.statement, calibrated)
    charge_ledger(pre, journal)
    private_dir = None if pre.workdir is None else pre.workdir / "private"
    phase = replace(opts, ledger=None)
    outer = {"run_id": run_id, "outer": dict(pre.config)}
    # The subset's secret key, drawn once: OS entropy (from the seed for debugging).
    seeded = hashlib.blake2b(f"dptune/subset-key/{opts.seed}".encode(), digest_size=32).digest()
    fresh = os.urandom(32) if opts.seed is None else seeded
    key = bytes.fromhex(journal.set_once("subset_key", fresh.hex()))
    log = logging.getLogger("dptune")  # quiet: the plan's subset (same public sizes) warned
    quiet, log.disabled = log.disabled, True
    try:
        sub = trainer.subset(plan.tuning.fraction, key)
    finally:
        log.disabled = quiet
    tuned = tune(
        sub, space, selection, Budget(plan.tuning.subset_epsilon, plan.tuning.subset_delta),
        phase, workdir=None if private_dir is None else private_dir / "tuning",
        config={"phase": "tuning", **outer},
    )  # fmt: skip
    privacy = plan.statement.to_dict()
    privacy.update(budget_epsilon=budget.epsilon, budget_delta=budget.delta)
    release = Release(False, None, None, None, privacy, plan.statement.to_text())
    if tuned.released:
        hp = {**dict(tuned.hparams), **dict(plan.calibrated)}
        cand = accounted_candidate(trainer, hp, opts.adjacency)
        if cand not in plan.final_candidates and cand != acc.final_candidate(plan.final_candidates):
            # Never expected (the tuning phase drew from the same privacy grid); refuse rather
            # than train a run the statement may not cover.
            raise TuningConfigError(
                f"the selected setting's final run {cand} is not one the statement accounted"
            )
        # One-value choices: the space of one candidate (tune refuses a space with nothing drawn).
        one = Space({name: {"distribution": "choice", "values": [v]} for name, v in hp.items()})
        final = tune(
            trainer, one, BestOfK(1), budget, phase,
            workdir=None if private_dir is None else private_dir / "final",
            seed=None if phase.seed is None else phase.seed + 1,
            config={"phase": "final", "hparams": hp, **outer},
        )  # fmt: skip
        release = dataclasses.replace(
            final, privacy=privacy, privacy_text=release.privacy_text, published=FINAL_PUBLISHES
        )
    release.private = {"tuning": tuned.private}
    return release
