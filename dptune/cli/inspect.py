"""``dptune inspect WORKDIR``: the curator's view of a run, from its private journal.

    dptune inspect runs/fmnist                  # every candidate: status, score, failure, time
    dptune inspect runs/fmnist --candidate=3    # candidate 3's failure with its traceback
    dptune inspect runs/fmnist --json           # the same as one JSON object

It prints what ``DIR/private/`` holds (the number of candidates, every score, every failure's
reason), headed by a warning: this view is PRIVATE, for the data curator only, and must never be
published (the selection theorems cover the released candidate alone). It reads the journal
without writing, so it is safe while the run is going on.
"""

from __future__ import annotations

import json
import math
import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from absl import flags

from dptune._state.journal import JOURNAL_FILE, Journal
from dptune.cli import common
from dptune.errors import Refused, StateError
from dptune.report import num

#: This command's own flags (kept apart from the other commands' in one process).
FLAGS = flags.FlagValues()
_CANDIDATE = flags.DEFINE_integer("candidate", None, "Its failure, traceback.", flag_values=FLAGS)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object.", flag_values=FLAGS)

WARNING = (
    "PRIVATE -- the curator's view of {dir}: it shows the number of candidates and every score. "
    "Never publish it or paste it where others read (the release is {dir}/release/)."
)


def read_run(workdir: str | Path) -> dict[str, Any]:
    """The run in ``workdir`` as the curator sees it (the keys below); a candidate's
    ``dropped_nonfinite`` counts its sampled examples whose gradient norm was not finite, left out
    of its clipped sums (None: its payload holds no count). StateError: no intact journal."""
    workdir = Path(workdir)
    private = workdir / "private"
    if not (private / JOURNAL_FILE).exists():
        raise StateError(
            f"{workdir} holds no run: there is no journal {private / JOURNAL_FILE} (give the "
            "--workdir of a run)"
        )
    with Journal(private, readonly=True) as journal:
        meta, failures = journal.meta(), journal.failures()
        calibrated = meta.get("calibrated") or {}
        cands = [
            dict(
                index=r.index, status=r.status,
                score=None if r.score is None or math.isnan(r.score) else r.score,
                failed=r.failed, seconds=r.seconds, attempts=r.attempts,
                hparams={**r.hparams, **calibrated},
                failure=None if (f := failures.get(r.index)) is None else
                {"type": f.type, "message": f.message, "traceback": f.traceback},
                dropped_nonfinite=_dropped(journal, r.index) if r.status == "done" else None,
            )
            for r in journal.candidates()
        ]  # fmt: skip
    privacy = meta.get("privacy") or {}
    return {
        "workdir": str(workdir), "run_id": meta.get("run_id"),
        "started_at": meta.get("started_at"), "released_at": meta.get("released_at"),
        "curator_view": meta.get("curator_view") or {}, "clipping": meta.get("clipping"),
        "calibrated": calibrated, "total_epsilon": privacy.get("total_epsilon"),
        "delta": privacy.get("delta"), "candidates": cands,
    }  # fmt: skip


def render(run: dict[str, Any], candidate: int | None = None) -> str:
    """The view as text (headed by the warning)."""
    lines = [WARNING.format(dir=run["workdir"]), ""]
    if candidate is not None:
        match = [c for c in run["candidates"] if c["index"] == candidate]
        if not match:
            raise StateError(
                f"the run in {run['workdir']} has no candidate {candidate} (its candidates are "
                f"0..{len(run['candidates']) - 1})"
            )
        c = match[0]
        lines.append(f"candidate {c['index']}: {c['status']}; hyperparameters {c['hparams']}")
        lines += _dropped_lines([c])
        if (f := c["failure"]) is not None:
            tb = f["traceback"] or "(no traceback)"
            lines += [f"failed: {f['type']}: {f['message']}", "", tb]
        else:
            lines.append("failed; no reason recorded" if c["failed"] else "it did not fail")
        return "\n".join(lines)
    released = run["released_at"]
    state = f"finished {_when(released)}" if released else "not finished (rerun to resume it)"
    lines.append(
        f"run {run['run_id'] or '(not planned yet)'}: started {_when(run['started_at'])}, {state}"
    )
    if run["total_epsilon"] is not None:
        lines.append(
            f"privacy: total epsilon {run['total_epsilon']:.4g} at delta {run['delta']:g}; "
            f"calibrated {run['calibrated'] or 'nothing'}"
        )
    if run.get("clipping"):
        lines.append(f"per-example clipping: {run['clipping']['path']} ({run['clipping']['why']})")
    for key, value in sorted(run["curator_view"].items()):
        lines.append(f"loader: {key}: {value}")
    lines += [
        "",
        f"{'idx':>4}  {'status':<8} {'score':>9} {'seconds':>8}  {'reason':<40}  hyperparameters",
    ]
    for c in run["candidates"]:
        score = "failed" if c["failed"] else ("" if c["score"] is None else f"{c['score']:.4f}")
        secs = "" if c["seconds"] is None else f"{c['seconds']:.1f}"
        f = c["failure"]
        reason = "" if f is None else f"{f['type']}: {(f['message'].splitlines() or [''])[0]}"
        reason = reason if len(reason) <= 40 else reason[:37] + "..."
        hp = ", ".join(f"{k}={num(v)}" for k, v in sorted(c["hparams"].items()))
        lines.append(f"{c['index']:>4}  {c['status']:<8} {score:>9} {secs:>8}  {reason:<40}  {hp}")
    if dropped := _dropped_lines(run["candidates"]):
        lines += ["", *dropped]
    if failed := [c["index"] for c in run["candidates"] if c["failed"]]:
        lines += ["", f"{len(failed)} failed; `dptune inspect {run['workdir']} "
                  f"--candidate={failed[0]}` prints a failure's traceback."]  # fmt: skip
    return "\n".join(lines)


def cli(argv: Sequence[str]) -> int:
    """``dptune inspect`` in this process; returns the exit code."""
    try:
        rest = common.parse_subcommand(FLAGS, argv, __doc__)
        if rest is None:
            return common.OK
        if len(rest) != 1:
            return common.refuse(
                f"dptune inspect takes one WORKDIR (got {rest or 'none'}): dptune inspect DIR "
                "[--candidate=N] [--json]"
            )
        run = read_run(rest[0])
        print(
            json.dumps(run, indent=2, default=str) if _JSON.value else render(run, _CANDIDATE.value)
        )
        return common.OK
    except Refused as e:
        return common.refuse(e)
    finally:
        FLAGS.unparse_flags()


def _dropped(journal: Journal, index: int) -> int | None:
    """The ``dropped_nonfinite`` count in candidate ``index``'s payload, or None (a learner that
    records none, or a payload that cannot be read now)."""
    try:
        payload = journal.read_payload(index)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        return None
    count = payload.get("dropped_nonfinite") if isinstance(payload, dict) else None
    return int(count) if count is not None else None


def _dropped_lines(candidates: list[dict[str, Any]]) -> list[str]:
    """One line per candidate that left records with a non-finite gradient out of its clipped
    sums (none when no candidate did)."""
    return [
        f"candidate {c['index']}: records with a non-finite gradient dropped: "
        f"{c['dropped_nonfinite']} (sampled examples left out of the clipped sums)"
        for c in candidates
        if c.get("dropped_nonfinite")
    ]


def _when(t: Any) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(t)))


if __name__ == "__main__":
    common.entry(cli)
