"""The release whitelist, written out here on purpose: a key
added to a release file must be added here too, by someone who checked that the selection theorem
covers it. ``dptune/release.py`` holds the same sets and its writer enforces them; any test that
writes a release can call :func:`check_release_whitelist` on the folder."""

from __future__ import annotations

import json
from pathlib import Path

from dptune import release as release_mod

#: Files (and the ``checkpoint/`` folder) of a release folder.
FILES = {
    "result.json", "privacy.json", "privacy.txt", "report.md", "epsilon.png",
    "training_curve.json", "training_curve.png", "payload.pkl", "checkpoint",
}  # fmt: skip
# "reason" (with released: false): "none_selected" or "no_candidate_succeeded", a function of the
# selected output alone (the selections rank a failure below every score)
# "test_metric": a model scored by its own declared metric
# reports that metric of the released model on the public test split, in place of arg-max
# accuracy; like test_accuracy, post-processing of the released model on public data.
RESULT_KEYS = {"released", "hparams", "validation_score", "test_accuracy", "test_metric", "reason"}
PRIVACY_KEYS = {
    "total_epsilon", "delta", "single_run_epsilon", "single_run_delta", "overhead", "method",
    "theorem", "accountant", "route", "rdp_order", "seeded", "private", "adjacency", "notes",
    "selection", "candidates", "budget_epsilon", "budget_delta", "ex_post_epsilon",
    "assumptions", "checked", "trainer_word", "published",
}  # fmt: skip
CURVE_KEYS = {"epoch", "epsilon_one_run"}  # and test_* / noisy_* metrics


def check_release_whitelist(folder: Path) -> dict:
    """Asserts every file and key of a release folder is on the whitelist; returns result.json."""
    assert release_mod.RELEASE_FILES == FILES
    assert release_mod.RESULT_KEYS == RESULT_KEYS and release_mod.PRIVACY_KEYS == PRIVACY_KEYS
    assert {p.name for p in folder.iterdir()} <= FILES
    result = json.loads((folder / "result.json").read_text())
    assert set(result) <= RESULT_KEYS
    assert set(json.loads((folder / "privacy.json").read_text())) <= PRIVACY_KEYS
    if (folder / "training_curve.json").exists():
        for row in json.loads((folder / "training_curve.json").read_text()):
            assert all(k in CURVE_KEYS or k.startswith(("test_", "noisy_")) for k in row), row
    return result
