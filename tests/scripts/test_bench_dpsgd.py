"""``scripts/bench_dpsgd.py --suite=accelerator`` runs on CPU with tiny sizes (so the one command
for a GPU table cannot rot): every row times, reports its compiled memory, jax_privacy's clipped
sum agrees with dptune's, and the K-candidate rows are there."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.paths import REPO

# jax_privacy is in the `bench` extra; without it the suite runs without its rows.
HAVE_JAX_PRIVACY = importlib.util.find_spec("jax_privacy") is not None


def _suite(*extra):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "scripts/bench_dpsgd.py", "--suite=accelerator", "--tiny", "--json",
         *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, json.loads(out.stdout.strip().splitlines()[-1])


def _check(table, models, ks):
    rows = {r["name"]: r for r in table["rows"]}
    for m in models:
        expected = {"nonprivate", "dp", "naive"} | ({"jax_privacy"} if HAVE_JAX_PRIVACY else set())
        expected |= {f"k{k}_{how}" for k in ks for how in ("vmap", "seq")}
        assert {n.split("/", 1)[1] for n in rows if n.startswith(f"{m}/")} == expected
        if HAVE_JAX_PRIVACY:
            # the same clipping: jax_privacy's clipped sum is dptune's (float32 rounding). WRN-16-4
            # on the ghost path: its output gradients come from one batched backward pass, and XLA
            # CPU's batched backward through WRN-16-4's convolutions at 5 or more examples is
            # 1e-2 (relative) off a float64 reference, the plain non-private gradient alike, where
            # vmap(grad)'s per-example backward is not (docs/performance.md); so this bounds gross
            # errors only, and exact agreement is tested on small WideResNets
            # (tests/trainers/test_ghost.py).
            tol = 5e-2 if m == "wrn16_4" else 1e-5
            assert table["clipped_sum_agreement"][m] < tol
            assert f"{m}: dp / jax_privacy" in table["ratios"]
    assert all(r["examples_per_s"] > 0 for r in rows.values())
    assert all(r["peak_mib"] > 0 for r in rows.values())  # XLA's buffer assignment, per row


def test_accelerator_suite_tiny_on_cpu():
    text, table = _suite("--models=cnn26k", "--ks=2")
    assert table["device"].startswith("cpu") and table["batch"] == 8
    _check(table, ["cnn26k"], [2])
    assert "cnn26k: k2 vmapped / sequential" in text


@pytest.mark.slow  # compiles WRN-16-4 and the CIFAR CNN (vmapped too): minutes on 2 cores
def test_accelerator_suite_every_model():
    _, table = _suite("--ks=2,4")
    _check(table, ["cnn26k", "cifar_cnn", "wrn16_4", "user_cnn"], [2, 4])
