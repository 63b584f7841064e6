"""``dptune.audit``: an empirical privacy audit of a tuning run (or of one candidate's training),
next to the epsilon that run states (Steinke, Nasr & Jagielski 2023; docs/audit.md).

The order of the steps is part of the audit's validity: the canaries are designed and their coins
drawn (OS entropy; kept in ``DIR/private/audit_canaries.npz``, so a killed audit resumes with the
same coins) before ``dptune.tune`` runs, as a user would, on the audited trainer, charged to an
audit entry of the ledger. A bound above the stated epsilon says the implementation does not meet
its statement; a bound below it proves nothing."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dptune._state.journal import JOURNAL_FILE
from dptune._state.state_files import open_new, private_folder
from dptune.auditing.canaries import KINDS, Canaries, design_rng, draw_inclusion
from dptune.auditing.dpsgd import AuditDpSgdTrainer
from dptune.auditing.guesses import Outcome, evaluate
from dptune.errors import TuningConfigError
from dptune.learners.dpsgd import DpSgdTrainer
from dptune.plan import as_budget, make_privacy_plan
from dptune.release import load_release
from dptune.space import Space
from dptune.trainer_protocol import FunctionTrainer
from dptune.tuner import as_space, tune
from selection import BestOfK

__all__ = ["AUDIT_JSON", "AUDIT_MD", "BREAKS", "WHATS", "AuditResult", "audit"]

log = logging.getLogger("dptune")

#: Negative controls: deliberate breaks that must make the bound exceed the stated epsilon.
BREAKS = ("no_clipping", "noise_reused", "no_noise", "exact_score")
#: What is audited: the whole tuning run as released, or one candidate's training.
WHATS = ("tuning", "training")
#: Default number of canaries per kind (score canaries are decoded by subset sum: at most 24).
DEFAULT_CANARIES = {"gradient": 2000, "input": 1000, "score": 20}

AUDIT_JSON = "audit.json"
AUDIT_MD = "audit.md"
_CANARIES_FILE = "audit_canaries.npz"
#: ``no_clipping``: the clipping norm is multiplied and the noise multiplier divided by this, so
#: the noise keeps its std sigma * C while no per-example gradient is clipped.
UNCLIPPED = 1.0e6

#: The hyperparameter breaks: field -> its value in training (the declaration keeps the drawn one).
_REWRITES: dict[str, dict[str, Callable[[float], float]]] = {
    "no_noise": {"noise_multiplier": lambda v: 0.0},
    "no_clipping": {"clip_norm": lambda v: v * UNCLIPPED,
                    "noise_multiplier": lambda v: v / UNCLIPPED},
}  # fmt: skip

AUDIT_NOTE = (
    "AUDIT RUN (dptune audit): canaries were added to the private data; this is not a release of "
    "the dataset and must never be published as one."
)


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """An audit's outcome: ``stated_epsilon`` and ``delta``, what the audited run states (its
    total, tuning included, for ``what="tuning"``; the one candidate's for ``"training"``);
    ``epsilon_lower_bound`` at ``confidence`` (1 - beta over every guessing rule together);
    ``canaries`` (m) of ``kind``; ``break_``, the negative control (None: an ordinary audit); the
    best ``rule``'s ``guesses`` made and ``correct``; ``ceiling``, the largest bound these m
    canaries and ``rules`` (how many rules were tried) could show; ``released``, whether a
    candidate was released (nothing to score otherwise); ``included``, how many canaries were in
    (the coins themselves stay private)."""

    stated_epsilon: float
    delta: float
    epsilon_lower_bound: float
    confidence: float
    canaries: int
    kind: str
    what: str
    break_: str | None
    guesses: int
    correct: int
    rule: str
    ceiling: float
    rules: int
    released: bool
    included: int

    @property
    def exceeds(self) -> bool:
        """Whether the bound exceeds the stated epsilon: the run does not meet its statement."""
        return self.epsilon_lower_bound > self.stated_epsilon

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["break"] = d.pop("break_")
        d["exceeds_stated_epsilon"] = self.exceeds
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AuditResult:
        d = {k: v for k, v in d.items() if k not in ("exceeds_stated_epsilon", "status")}
        d["break_"] = d.pop("break", None)
        return cls(**d)

    def _rows(self) -> list[tuple[str, str]]:
        """The facts both renderings show, as (label, value)."""
        control = f"negative control --break={self.break_}" if self.break_ else "no break"
        return [
            ("stated epsilon (delta)", f"{self.stated_epsilon:.4g} ({self.delta:g})"),
            ("empirical lower bound on epsilon", f"{self.epsilon_lower_bound:.4g}"),
            ("confidence", f"{self.confidence:g} (over {self.rules} guessing rules)"),
            ("canaries (m), kind", f"{self.canaries}, {self.kind}"),
            ("guesses made / correct", f"{self.guesses} / {self.correct} ({self.rule})"),
            ("ceiling (every guess right)", f"{self.ceiling:.4g}"),
            ("audited", f"{self.what} ({control})"),
        ]

    def to_markdown(self) -> str:
        verdict = (
            "**exceeds the stated epsilon: the run does not meet its privacy statement.**"
            if self.exceeds
            else "is below the stated epsilon: this audit found no violation (which proves "
            "nothing: a lower bound is not a proof of privacy)."
        )
        if self.ceiling <= self.stated_epsilon:
            verdict += (
                f" The ceiling {self.ceiling:.4g} is not above the stated epsilon: with "
                f"{self.canaries} canaries this audit could not have shown a violation (use more)."
            )
        table = "\n".join(f"| {k} | {v} |" for k, v in self._rows())
        return (
            "# Privacy audit (dptune audit)\n\n"
            "Steinke, Nasr & Jagielski 2023, one training run (Cor. 5.4): a lower bound on the "
            "epsilon of the run as implemented, at the stated delta.\n\n"
            f"| | |\n|---|---|\n{table}\n\nThe lower bound {verdict}\n"
        )

    def __str__(self) -> str:
        exceeds = "  <-- EXCEEDS the stated epsilon" if self.exceeds else ""
        return "audit: " + "; ".join(f"{k}: {v}" for k, v in self._rows()) + exceeds


def audit(
    trainer: Any, space: Space | Mapping[str, Any], selection: Any, budget: Any, *,
    canaries: int | tuple[np.ndarray, np.ndarray] | None = None, kind: str | None = None,
    what: str = "tuning", break_: str | None = None,
    score: Callable[[Any, np.ndarray, np.ndarray], np.ndarray] | None = None,
    confidence: float = 0.95, workdir: str | os.PathLike | None = None, seed: int | None = None,
    ledger: Any = None, accountant: str = "auto", adjacency: str = "add_remove",
    progress: bool = True, config: Mapping[str, Any] | None = None,
) -> AuditResult:  # fmt: skip
    """Audits a tuning run (or one candidate) empirically: its epsilon lower bound next to the
    epsilon it states.

    Args:
      trainer, space, selection, budget: as for ``dptune.tune``.
      canaries: m, the number of canaries the trainer designs (``trainer.audit_canaries``; default
        ``DEFAULT_CANARIES[kind]``), or the canary records ``(x, y)`` themselves. A
        ``@dptune.trainer`` function is audited with records ``(x, y)`` and ``score``: its function
        must take a keyword argument ``canaries=(x, y)``, the records to add to its training data.
      kind: "gradient" (white-box: DP-SGD's step; the default for DP-SGD), "input" (black-box:
        out-of-distribution images scored by their loss) or "score" (validation canaries read from
        the released score; forced by ``break_="exact_score"``).
      what: "tuning" (the whole run as released) or "training" (one candidate at the tuning's
        noise, stated at one candidate's epsilon).
      break_: a negative control from ``BREAKS`` (the run is then NOT private): "no_noise",
        "no_clipping" (noise std unchanged, nothing clipped), "noise_reused" (the same noise every
        step), "exact_score" (the score released exactly).
      score: ``score(payload, x, y) -> (m,)`` membership scores (higher = included) of records on a
        released payload, for trainers that do not score canaries themselves.
      confidence: 1 - beta of the bound (default 0.95).
      workdir: the audit's own folder (``DIR/audit.json``, ``DIR/audit.md``, ``DIR/private/``,
        ``DIR/release/``); never a tuning run's folder.
      seed, ledger, accountant, adjacency, progress, config: as for ``dptune.tune`` (``seed``
        also fixes the canaries and their coins; the ledger charges an audit entry of its own).
    Returns:
      The :class:`AuditResult` (also written to ``DIR/audit.json`` and ``DIR/audit.md``).
    """
    budget, space = as_budget(budget), as_space(space)
    workdir = None if workdir is None else Path(workdir)
    hooks = _hooks(trainer)
    kind, m = _kind_and_size(hooks, canaries, kind, what, break_, score, confidence)
    done = _finished(workdir, dict(canaries=m, kind=kind, what=what, break_=break_))
    if done is not None:
        log.info("this audit already finished; its result is in %s", workdir / AUDIT_JSON)
        return done
    design, included, keep = _canaries(hooks[0], canaries, kind, m, seed, workdir)
    inner = _with_canaries(trainer, hooks[1], design, included, break_)
    audited = _AuditTrainer(inner, break_, space, design, what)
    # The run's own checks (the plan) before anything is written: a refused audit leaves its
    # folder as it was (else its stored canaries would refuse the corrected audit)
    plan = make_privacy_plan(audited, space, selection, budget, accountant=accountant,
                             seeded=seed is not None, adjacency=adjacency)  # fmt: skip
    if what == "training":  # the tuning's calibrated values, fixed, and one candidate
        fields = {k: plan.calibrated.get(k, v) for k, v in space.fields.items()}
        space, selection = Space(fields, privacy_fields=set(space.privacy_fields)), BestOfK(1)
    keep()
    if workdir is not None:
        _write_json(workdir / AUDIT_JSON, {"status": "running", **audited.audit_info})
    # The canaries make it another dataset: the ledger charges an audit entry of its own.
    digest = f"{getattr(trainer, 'fingerprint', None)}/{design.digest()}/{included.tobytes().hex()}"
    release = tune(
        audited, space, selection, budget, workdir=workdir, seed=seed, accountant=accountant,
        ledger=ledger, fingerprint="audit-" + hashlib.sha256(digest.encode()).hexdigest(),
        config=None if config is None else {**dict(config), "_audit": audited.audit_info},
        progress=progress, adjacency=adjacency,
    )  # fmt: skip
    result = _result(release, inner, design, included, score, confidence, what, break_)
    if workdir is not None:
        (workdir / AUDIT_MD).write_text(result.to_markdown())
        _write_json(workdir / AUDIT_JSON, {"status": "done", **result.to_dict()})
    return result


def _kind_and_size(hooks, canaries, kind, what, break_, score, confidence) -> tuple[str, int]:
    """The audit's arguments checked; the canaries' kind (``score`` for ``exact_score``) and
    number m, from the arguments and the trainer's defaults."""
    if not 0 < confidence < 1:
        raise TuningConfigError(f"confidence={confidence!r} must be in (0, 1)")
    named = (("what", what, WHATS), ("break", break_, BREAKS), ("kind", kind, KINDS))
    for name, value, known in named:  # None: the default (what has none)
        if value not in known and (value is not None or name == "what"):
            raise TuningConfigError(f"{name}={value!r} must be one of {known}")
    if break_ == "exact_score":
        if kind not in (None, "score"):
            raise TuningConfigError("break=exact_score is audited with score canaries: kind=score")
        kind = "score"
    design, with_canaries = hooks
    if isinstance(canaries, tuple):
        if len(canaries) != 2 or len(canaries[0]) != len(canaries[1]):
            raise TuningConfigError("canaries=(x, y): the canary records' inputs and labels")
        kind, m = kind or "input", len(canaries[1])
        if kind != "input" and with_canaries is None:
            raise TuningConfigError(f"kind={kind!r} needs a trainer that designs its canaries")
    else:
        if design is None:
            raise TuningConfigError(
                "this trainer does not design canaries: pass canaries=(x, y), records to add to "
                "its training data, and score=fn(payload, x, y) -> membership scores",
                command="config.trainer: this trainer designs no canaries, so `dptune audit` "
                "cannot audit it (config.trainer='dpsgd' can); audit it from Python with "
                "dptune.audit(..., canaries=(x, y), score=fn(payload, x, y))",
            )
        kind = kind or "gradient"
        m = DEFAULT_CANARIES[kind] if canaries is None else canaries
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise TuningConfigError(f"canaries={canaries!r} must be a positive integer")
    if score is None and with_canaries is None:
        raise TuningConfigError(
            "score=fn(payload, x, y) is needed: this trainer does not score canaries itself"
        )
    return kind, int(m)


def _result(release, inner, design, included, score, confidence, what, break_) -> AuditResult:
    """The released candidate's canaries scored, guessed and turned into the bound (nothing to
    score when nothing was released: a bound of 0)."""
    stated, delta = (float(release.privacy[k]) for k in ("total_epsilon", "delta"))
    if release.released:
        if release.payload is None and release.path is not None:
            # A resumed audit whose tuning had finished: the release folder holds the payload.
            release = dataclasses.replace(release, payload=load_release(release.path).payload)
        if score is None:  # per-canary statistics, higher = more likely included
            statistics = inner.canary_scores(release)
        else:
            values = np.asarray(score(release.payload, design.x, design.y), dtype=np.float64)
            statistics = {"score": values.reshape(len(design))}
        o = evaluate(statistics, included, delta, confidence)
    else:
        o = Outcome(0.0, "nothing released: no canary scored", 0, 0, 0.0, 0, 0.0)
    outcome = dataclasses.asdict(o)
    del outcome["significance"]  # the fields an AuditResult shares with the Outcome remain
    result = AuditResult(
        stated_epsilon=stated, delta=delta, confidence=confidence, canaries=len(design),
        kind=design.kind, what=what, break_=break_, released=bool(release.released),
        included=int(included.sum()), **outcome,
    )  # fmt: skip
    if result.released and result.ceiling <= stated:
        log.warning(
            "the audit's ceiling %.4g is not above the stated epsilon %.4g: with %d canaries it "
            "could not have shown a violation; use more canaries",
            result.ceiling, stated, len(design),
        )  # fmt: skip
    return result


def _finished(workdir: Path | None, asked: Mapping[str, Any]) -> AuditResult | None:
    """A finished audit's result (refused if it was asked with other settings); refuses a workdir
    that holds a tuning run (not an audit)."""
    if workdir is None:
        return None
    marker = workdir / AUDIT_JSON
    if not marker.exists():
        if (workdir / "private" / JOURNAL_FILE).exists():
            raise TuningConfigError(
                f"{workdir} holds a tuning run, not an audit: an audit needs a folder of its own "
                "(its canaries must never reach a real release)"
            )
        return None
    d = json.loads(marker.read_text())
    if d.get("status") != "done":
        return None
    result = AuditResult.from_dict(d)
    if any(getattr(result, k) != v for k, v in asked.items()):
        raise TuningConfigError(
            f"{workdir} holds a finished audit with other settings ({AUDIT_JSON}); use a new folder"
        )
    return result


def _canaries(design_hook, canaries, kind, m, seed, workdir) -> tuple[Canaries, np.ndarray, Any]:
    """The canaries, which are included, and ``keep()``: drawn once and kept (by ``keep``, once
    the run's checks pass) in ``DIR/private/`` (owner-only, like the journal: the coins are the
    curator's), read back on resume."""
    given = Canaries(kind, *map(np.asarray, canaries)) if isinstance(canaries, tuple) else None
    stored = None if workdir is None else workdir / "private" / _CANARIES_FILE
    if stored is not None and stored.exists():
        with np.load(stored) as f:
            design = Canaries(str(f["kind"]), f["x"], f["y"])
            included = np.asarray(f["included"], bool)
        other = given is not None and given.digest() != design.digest()
        if design.kind != kind or len(design) != m or other:
            raise TuningConfigError(f"{workdir} holds another audit's canaries; use a new folder")
        return design, included, lambda: None
    design = given
    if design is None:
        try:
            design = design_hook(kind, m, design_rng(seed))
        except ValueError as e:
            raise TuningConfigError(f"canaries: {e}") from None
    included = draw_inclusion(len(design), seed)

    def keep() -> None:
        if stored is None:
            return
        private_folder(stored.parent, "the audit's private folder")
        tmp = stored.with_name(stored.name + ".tmp.npz")
        with open_new(tmp) as f:
            np.savez(f, kind=design.kind, x=design.x, y=design.y, included=included)
        os.replace(tmp, stored)

    return design, included, keep


def _hooks(trainer: Any) -> tuple[Callable | None, Callable | None]:
    """``(audit_canaries(kind, m, rng), with_canaries(canaries, included, fault))``: DP-SGD's
    (``dptune.auditing.dpsgd``), else the trainer's own hooks of those names (None if absent)."""
    if isinstance(trainer, DpSgdTrainer):
        cls = AuditDpSgdTrainer
        return functools.partial(cls.design, trainer), functools.partial(cls, trainer)
    return getattr(trainer, "audit_canaries", None), getattr(trainer, "with_canaries", None)


def _with_canaries(trainer, with_canaries, design, included, break_) -> Any:
    """The trainer on its data plus the included canaries (and an engine fault if asked)."""
    fault = break_ if break_ in AuditDpSgdTrainer.FAULTS else None
    if with_canaries is not None:
        try:
            return with_canaries(design, included, fault)
        except ValueError as e:
            raise TuningConfigError(f"canaries: {e}") from None
    if fault is not None:
        raise TuningConfigError(f"break={break_!r} needs a trainer that can inject it (DP-SGD)")
    if not isinstance(trainer, FunctionTrainer):
        raise TuningConfigError(
            f"{type(trainer).__name__} cannot take canaries: give it with_canaries(...) or use a "
            "@dptune.trainer function that takes canaries=(x, y)"
        )
    if "canaries" not in inspect.signature(trainer.fn).parameters:
        raise TuningConfigError(
            f"{trainer.name} must take a keyword argument canaries=(x, y) (records to add to its "
            "training data) to be audited"
        )
    x, y = design.subset(included)
    return dataclasses.replace(trainer, fn=functools.partial(trainer.fn, canaries=(x, y)))


class _AuditTrainer:
    """The audited trainer: the canary-holding trainer with the unbroken privacy declaration,
    the hyperparameter breaks (``no_noise``, ``no_clipping``) applied at training time only, and
    the audit's note in the statement. Other hooks are the inner trainer's."""

    def __init__(self, inner: Any, break_: str | None, space: Space, design: Canaries, what: str):
        self.inner, self.break_ = inner, break_
        fixed = getattr(getattr(inner, "hyperparams_class", None), "__dataclass_fields__", {})
        for name in _REWRITES.get(break_ or "", {}):
            if name not in space.fields and name not in fixed:
                raise TuningConfigError(
                    f"break={break_!r} rewrites the hyperparameter {name!r}, which this trainer "
                    "does not have"
                )
        self.audit_info = {
            "canaries": len(design), "kind": design.kind, "what": what, "break": break_,
            "design": design.digest(),
        }  # fmt: skip
        if hasattr(inner, "train_many"):
            self.train_many = self._train_many

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __call__(self, hparams: Mapping[str, Any], rng: np.random.Generator) -> Any:
        return self._unaccounted(self.inner(self._broken(hparams), rng))

    def _train_many(self, hparams, rngs) -> Any:
        out = self.inner.train_many([self._broken(h) for h in hparams], rngs)
        return [self._unaccounted(r) for r in out]

    def _unaccounted(self, result: Any) -> Any:
        """A negative control trained with settings its statement does not cover: its per-epoch
        privacy (of the broken settings, e.g. a vanishing noise multiplier) is dropped, so the
        released curve states nothing for it."""
        if not self.break_ or not isinstance(result, tuple) or len(result) != 2:
            return result
        score, payload = result
        if isinstance(payload, Mapping) and "privacy_by_epoch" in payload:
            payload = {**payload, "privacy_by_epoch": []}
        return score, payload

    def privacy_notes(self) -> list[str]:
        notes = list(self.inner.privacy_notes()) if hasattr(self.inner, "privacy_notes") else []
        if self.break_:
            notes.append(
                f"NEGATIVE CONTROL --break={self.break_}: training deliberately does not match "
                "this statement."
            )
        return notes + [AUDIT_NOTE]

    def describe(self) -> dict[str, Any]:
        inner = getattr(self.inner, "describe", lambda: {"kind": type(self.inner).__name__})()
        return {**inner, "audit": self.audit_info}

    def _broken(self, hparams: Mapping[str, Any]) -> dict[str, Any]:
        hp = dict(hparams)
        for name, rewrite in _REWRITES.get(self.break_ or "", {}).items():
            # the value the field takes in training: drawn, or the trainer's fixed hyperparameter
            value = hp[name] if name in hp else getattr(self.inner.hyperparams(hp), name)
            hp[name] = rewrite(float(value))
        return hp


def _write_json(path: Path, obj: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=lambda x: x.item()) + "\n")
    os.replace(tmp, path)
