"""Records whose gradient is not finite are dropped from the clipped sums and COUNTED ONLY IN THE
CURATOR'S VIEW: the count is in each candidate's journaled payload and in ``dptune inspect``,
never on the run's console, never in the release folder."""

from __future__ import annotations

import json
import logging
import re

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import dptune
from dptune import space
from dptune._state.journal import Journal
from dptune.cli import inspect as inspect_cmd
from selection import BestOfK
from tests.release_whitelist import check_release_whitelist

VOCAB = 5


class _Tokens(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Embed(VOCAB, 4)(x)  # a token id equal to VOCAB gives NaN
        return nn.Dense(3)(jnp.tanh(nn.Dense(4)(h)).mean(axis=1))


def test_the_count_is_journaled_shown_by_inspect_and_never_released(
    tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.setenv("DPTUNE_COMPILATION_CACHE", "off")
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (150, 3)).astype(np.int32)
    y = rng.integers(0, 3, 150).astype(np.int32)
    x[[3, 20, 40, 58, 77, 101], 1] = VOCAB  # six records with a NaN gradient
    data = dptune.Dataset.from_arrays(
        x[:120], y[:120], num_examples=120, num_classes=3, x_test=x[120:] % VOCAB, y_test=y[120:]
    )
    tr = dptune.DpSgdTrainer(data, model=_Tokens(), base=dict(batch_size=20, epochs=2),
                             epoch_progress=False)  # fmt: skip
    caplog.set_level(logging.DEBUG)
    rel = dptune.tune(
        tr, dict(learning_rate=space.choice(0.3, 1.0), noise_multiplier=1.0), BestOfK(2),
        (50.0, 1e-5), seed=3, workdir=tmp_path, progress=False,
    )  # fmt: skip
    assert rel.released
    console = capsys.readouterr()
    logged = console.out + console.err + caplog.text
    assert "non-finite gradient" not in logged and "dropped" not in logged
    with Journal(tmp_path / "private", readonly=True) as j:
        counts = [j.read_payload(r.index)["dropped_nonfinite"] for r in j.candidates()]
    assert len(counts) == 2 and all(c > 0 for c in counts)
    # the release: whitelisted files and keys only; nothing holds the count
    check_release_whitelist(tmp_path / "release")
    shown = " ".join(
        p.read_text() for p in (tmp_path / "release").rglob("*.*")
        if p.suffix in (".json", ".txt", ".md")
    )  # fmt: skip
    assert "dropped" not in shown and "non-finite" not in shown
    loaded = dptune.load_release(tmp_path)
    assert "dropped" not in json.dumps(loaded.hparams, default=str)
    # the curator's view
    assert inspect_cmd.cli(["dptune", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PRIVATE")
    got = [int(n) for n in re.findall(r"records with a non-finite gradient dropped: (\d+)", out)]
    assert got == counts
    assert inspect_cmd.cli(["dptune", str(tmp_path), "--candidate=1"]) == 0
    assert f"records with a non-finite gradient dropped: {counts[1]}" in capsys.readouterr().out
    assert inspect_cmd.cli(["dptune", str(tmp_path), "--json"]) == 0
    run = json.loads(capsys.readouterr().out)
    assert [c["dropped_nonfinite"] for c in run["candidates"]] == counts
