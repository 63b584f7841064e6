"""scripts/scatter_cache.py fills the per-record feature cache and reports what it did: a second
call finds every record on disk."""

import importlib.util
from pathlib import Path

import pytest

from tests.paths import REPO

pytest.importorskip("kymatio")

ROOT = REPO


def test_scatter_cache_script_fills_then_hits(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "scatter_cache", ROOT / "scripts" / "scatter_cache.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setenv("DPTUNE_CACHE", str(tmp_path))
    argv = ["--name", "mnist", "--data_dir", "<shipped:mnist-10k>", "--limit", "50"]
    first = mod.main(argv)
    assert first["records"] == first["computed"] == 50
    assert first["backend"] == "jax" and Path(first["cache_folder"]).is_relative_to(tmp_path)
    assert mod.main(argv)["computed"] == 0  # all on disk
