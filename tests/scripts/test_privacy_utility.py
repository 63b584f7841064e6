"""scripts/privacy_utility.py, small version: one total epsilon, one repetition, one epoch on the
shipped MNIST-10k (the shipped config smoke). Checks the four budget-spending methods run,
stay within the budget, and that the table and plot are written."""

import importlib.util
import math

import pytest

from tests.paths import REPO

ROOT = REPO


def _script():
    spec = importlib.util.spec_from_file_location(
        "privacy_utility", ROOT / "scripts" / "privacy_utility.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_centre_of_the_space():
    pu = _script()
    assert pu.centre({"distribution": "log_uniform", "low": 1.0, "high": 4.0}) == 2.0
    assert pu.centre({"distribution": "choice", "values": ["a", "b"]}) == "a"
    assert pu.centre({"distribution": "integer", "low": 1, "high": 4}) == 2
    assert pu.centre("auto") == "auto"
    cfg = pu.load_config("smoke")
    c = pu.method_config(cfg, "best_of_k", 2.0)
    assert c["selection"] == {"method": "best_of_k", "k": 2} and c["privacy"]["epsilon"] == 2.0
    assert c["ledger"] == {"enabled": False}
    c = pu.method_config(cfg, "subsampled", 2.0, 0.25, 0.2)
    assert c["strategy"] == {"name": "subsampled", "fraction": 0.25, "tuning_epsilon": 0.4}
    assert c["selection"] == cfg["selection"]  # the config's tuning, run on the subset


@pytest.mark.slow  # a whole (small) study (~35 s)
def test_small_privacy_utility_run_on_mnist_10k(tmp_path):
    pu = _script()
    out = pu.main([
        "--config", "smoke", "--eps", "4", "--reps", "1",
        "--set", "train.epochs=1", "--out", str(tmp_path),
    ])  # fmt: skip
    rows = out["rows"]
    assert sorted(r["method"] for r in rows) == ["best_of_k", "dptune", "subsampled", "untuned"]
    for r in rows:
        assert r["total_epsilon"] <= 4.0 + 1e-9
        if r["released"]:
            assert 0.0 <= r["test_accuracy"] <= 1.0
    untuned = next(r for r in rows if r["method"] == "untuned")
    assert untuned["released"] and untuned["test_accuracy"] > 0.3  # one epoch, chance is 0.1
    assert untuned["hparams"]["learning_rate"] == pytest.approx(2.0)  # sqrt(1 * 4)
    assert untuned["hparams"]["clip_norm"] == pytest.approx(1.0)  # sqrt(0.5 * 2)
    assert math.isnan(out["summary"][("untuned", 4.0)]["sd"])  # one repetition
    assert (tmp_path / "privacy_utility.png").stat().st_size > 1000
    table = (tmp_path / "privacy_utility.md").read_text()
    assert table.count("\n") == 3 and "| 4 |" in table
    sub = next(r for r in rows if r["method"] == "subsampled")
    assert sub["released"] and sub["total_epsilon"] > 3.9  # the composition uses the budget


def test_merge_combines_parallel_repetitions_and_refuses_overlaps(tmp_path):
    """--only_rep R runs in separate folders are combined by --merge (nothing trained); a
    folder repeating a (method, epsilon, repetition) already merged is refused."""
    import json

    pu = _script()
    meta = {"config": "smoke", "overrides": [], "epsilons": [4.0], "reps": 3, "delta": 1e-5}

    def folder(name, rep, acc):
        d = tmp_path / name
        d.mkdir()
        run = dict(method="dptune", epsilon=4.0, rep=rep, released=True, test_accuracy=acc,
                   hparams={}, total_epsilon=4.0, seconds=1.0)  # fmt: skip
        (d / "privacy_utility.json").write_text(json.dumps({"meta": meta, "runs": [run]}))
        return str(d)

    a, b = folder("r0", 0, 0.80), folder("r1", 1, 0.90)
    out = tmp_path / "all"
    args = ["--config", "smoke", "--eps", "4", "--methods", "dptune", "--out", str(out)]
    res = pu.main([*args, "--merge", a, b])
    assert sorted(r["rep"] for r in res["rows"]) == [0, 1]
    s = res["summary"][("dptune", 4.0)]
    assert s["n"] == 2 and s["mean"] == pytest.approx(0.85)
    assert len(json.loads((out / "privacy_utility.json").read_text())["runs"]) == 2
    with pytest.raises(SystemExit, match="repeats"):
        pu.main([*args[:-1], str(tmp_path / "again"), "--merge", a, a])
