"""The reproduction scripts of docs/reproductions/ import and draw their plots (no training)."""

from __future__ import annotations

import importlib.util
import json

from tests.paths import REPO

SCRIPTS = REPO / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_plots_from_rows(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as `python scripts/NAME.py`: finds _plots
    a = load("repro_fisher_vs_dpsgd")
    rows = [{"method": m, "epsilon_budget": e, "test_accuracy": 0.5 + 0.1 * e}
            for m in ("dp-fisher", "dp-sgd") for e in (1.0, 2.0)]  # fmt: skip
    a.plot(rows, tmp_path / "a.png")
    c = load("repro_public_data")
    c.plot([{"dataset": "x", "num_public": m, "test_accuracy": 0.3} for m in (50, 100)],
           tmp_path / "c.png")  # fmt: skip
    b = load("repro_cnn_width")
    lines = [{"model": m, "epsilon_budget": e, "test_accuracy": 0.9} for m in b.MODELS
             for e in b.EPSILONS]  # fmt: skip
    (tmp_path / "results.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    b.plot(tmp_path)
    assert all((tmp_path / f).stat().st_size > 0 for f in ("a.png", "c.png", "cnn_width.png"))
