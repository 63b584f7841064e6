"""The privacy statement released with a tuned model: one (epsilon, delta) for the whole run."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

SEEDED_NOTE = (
    "This run used a fixed seed instead of the operating system's entropy: the guarantee holds "
    "only while the seed stays secret."
)
NOT_PRIVATE_NOTE = (
    "NOT PRIVATE: this is a debug run whose selection reveals more than the selected candidate "
    "(e.g. every score or the number of trials); no differential privacy guarantee holds."
)


#: Candidates listed by ``to_text()``; a search space's whole privacy grid is in ``to_dict()``.
_MAX_LISTED = 8


def _json_safe(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # "inf", "-inf" or "nan"
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return _json_safe(x.item())
    return x


_WORD = ("Taken on the trainer's word (dptune cannot see inside it; check it empirically "
         "with `dptune audit`):")  # fmt: skip
_PUBLISHED_WORDS = {
    "payload": "its hyperparameters and model (and what they give on public data)",
    "score": "its score",
    "index": "its position in the run",
}


def _fmt(x: float) -> str:
    return "infinite" if not math.isfinite(x) else f"{x:.4g}"


@dataclass(frozen=True)
class PrivacyStatement:
    """What a tuning run guarantees for everything it releases (only the selected candidate).

    Attributes:
      total_epsilon: epsilon of the whole procedure (all candidates trained, the selection, the
        release), at ``delta``; ``inf`` for a non-private run.
      delta: the total delta (0 for a pure-DP statement).
      single_run_epsilon, single_run_delta: one untuned run's (epsilon, delta) (the tightest route
        of the requested accountant), for comparison.
      method, theorem: the selection transform's ``name`` (``"single_run"`` for one run), and the
        paper and theorem behind ``total_epsilon``.
      accountant, route, rdp_order: the route that gave ``total_epsilon`` (``"pld"``, ``"rdp"``
        or ``"pure"``), one line saying how, and the optimal Renyi order where it went by RDP.
      candidates, selection: every candidate's inputs (all the sampler can draw; the bound is
        uniform) and the selection transform's ``params()``.
      seeded, private: a fixed seed (``SEEDED_NOTE``); False for a non-private debug selection
        (``NOT_PRIVATE_NOTE``).
      notes: further caveats, one sentence each.
      adjacency: the neighbouring relation the guarantee is stated for: "add_remove" (one example
        added or removed) or "replace_one" (one example replaced; the dataset size is public).
      assumptions: names of the assumptions the statement rests on (``dptune.assumptions``).
      checked, trainer_word: what dptune checked or guarantees by its own code, and what the
        statement takes on the trainer's word (empty for dptune's own trainers); a sentence each.
      published: what of the selected candidate the release holds (``selection.registry.
        PUBLISHABLE``): only what the selection's theorem covers.
    """

    total_epsilon: float
    delta: float
    single_run_epsilon: float
    single_run_delta: float
    method: str
    theorem: str
    accountant: str
    route: str
    candidates: tuple[dict[str, Any], ...] = ()
    selection: dict[str, Any] = field(default_factory=dict)
    rdp_order: float | None = None
    seeded: bool = False
    private: bool = True
    notes: tuple[str, ...] = ()
    adjacency: str = "add_remove"
    assumptions: tuple[str, ...] = ()
    checked: tuple[str, ...] = ()
    trainer_word: tuple[str, ...] = ()
    published: tuple[str, ...] = ()

    @property
    def overhead(self) -> float | None:
        """total / one run's epsilon, the price of tuning; None where one run's epsilon is 0."""
        one = self.single_run_epsilon
        return self.total_epsilon / one if one > 0 else None

    def all_notes(self) -> tuple[str, ...]:
        flags = [] if self.private else [NOT_PRIVATE_NOTE]
        if self.seeded:
            flags.append(SEEDED_NOTE)
        return (*flags, *self.notes)

    def to_dict(self) -> dict[str, Any]:
        """Every field plus ``overhead`` and the rendered notes; JSON-safe (inf becomes "inf")."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(overhead=self.overhead, notes=self.all_notes())
        return _json_safe(d)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def to_text(self) -> str:
        """A human-readable statement (in the spirit of TF Privacy's
        ``compute_dp_sgd_privacy_statement``)."""
        lines = [] if self.private else [NOT_PRIVATE_NOTE, ""]
        lines.append("Candidates (the guarantee holds for every one the search can draw):")
        lines += [f"  {_candidate_text(c)}" for c in self.candidates[:_MAX_LISTED]]
        if (more := len(self.candidates) - _MAX_LISTED) > 0:
            lines.append(f"  ... and {more} more settings (all in to_dict()).")
        # the text rounds floats to 6 digits (mean=3, not 3.0000000000000004); to_dict() keeps them
        sel = ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in self.selection.items())  # fmt: skip
        order = f" (optimal Renyi order {self.rdp_order:g})" if self.rdp_order else ""
        neighbours = {"replace_one": "replacing one example (fixed, public size)"}.get(
            self.adjacency, "adding or removing one example")  # fmt: skip
        lines += [
            "",
            f"Selection: {self.method}" + (f" ({sel})" if sel else "") + ".",
            "Only the selected candidate (or 'none') is released: not the other candidates, "
            "their scores, nor the number of candidates trained.",
            "",
            f"One untuned run satisfies ({_fmt(self.single_run_epsilon)}, "
            f"{self.single_run_delta:g})-DP.",
            f"The whole tuning run satisfies ({_fmt(self.total_epsilon)}, {self.delta:g})-DP"
            + ("." if self.overhead is None else f" (overhead x{_fmt(self.overhead)})."),
            f"  Theorem: {self.theorem}.",
            f"  Accountant: {self.accountant}; {self.route}{order}.",
            f"  Neighbouring datasets differ by {neighbours}.",
        ]
        notes = [f"Note: {n}" for n in self.all_notes() if n != NOT_PRIVATE_NOTE]  # top: stated
        if notes:
            lines += ["", *notes]
        for head, items in (("Checked by dptune:", self.checked), (_WORD, self.trainer_word)):
            if items:
                lines += ["", head, *(f"  - {x}" for x in items)]
        if self.published:
            words = [_PUBLISHED_WORDS.get(w, w) for w in self.published]
            if "score" not in self.published:
                words.append("not its score (the theorem does not cover it)")
            lines += ["", f"Released of the selected candidate: {'; '.join(words)}."]
        if self.assumptions:
            names = ", ".join(f"`{a}`" for a in self.assumptions)
            lines += ["", f"Assumptions (docs/privacy-model.md): {names}."]
        return "\n".join(lines)


def _candidate_text(c: dict[str, Any]) -> str:
    """One line describing a candidate from its ``params()``."""
    if c.get("kind") != "dpsgd":
        parallel = "".join(f"; in parallel {_event_text(e)}" for e in c.get("parallel", ()))
        return f"{c.get('label', 'event')}: {_event_text(c['event'])}{parallel}."
    score = "exact score (public validation split)"
    if c.get("score_noise_std") is not None:
        how = ("composed with training: a replacement can touch both splits"
               if c.get("adjacency") == "replace_one"
               else "parallel composition with training: needs a per-record split")  # fmt: skip
        score = f"validation count + Gaussian noise of std {c['score_noise_std']:g} ({how})"
    return (f"DP-SGD: {c['steps']} steps, Poisson sampling rate {c['sampling_rate']:.6g}, "
            f"noise multiplier {c['noise_multiplier']:.6g}; {score}.")  # fmt: skip


def _event_text(x: Any) -> str:
    """An event's JSON form (``params()["event"]``) as ``LaplaceDpEvent(noise_multiplier=1)``."""
    if isinstance(x, dict):
        skip = ("type", "module_name", "class_name")
        args = ", ".join(f"{k}={_event_text(v)}" for k, v in x.items() if k not in skip)
        return f"{x.get('class_name', 'DpEvent')}({args})"
    if isinstance(x, list):
        return "(" + ", ".join(map(_event_text, x)) + ")"
    return f"{x:.6g}" if isinstance(x, float) else str(x)
