"""``dptune account``: JSON output, calibration, and refusal of invalid input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dptune import accounting
from selection import privacy as sp

BASE = ["--sampling_rate=0.004266666666666667", "--steps=7032", "--delta=1e-5", "--mean_trials=10"]


def cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "dptune.cli.account", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=300)
    return p.returncode, out, err


def test_json_rdp_reproduces_dp_accounting_and_default_is_tighter():
    # started together: the two processes overlap on the 2 cores
    rdp = cli(*BASE, "--noise_multiplier=1.1", "--selection=poisson", "--accountant=rdp", "--json")
    auto = cli(*BASE, "--noise_multiplier=1.1", "--selection=poisson", "--json")
    rc, out, err = finish(rdp)
    assert rc == 0, err
    d = json.loads(out)
    ref = accounting.repeat_and_select_epsilon(
        accounting.DpSgdCandidate(256 / 60000, 7032, 1.1), 10.0, float("inf"), 1e-5
    )
    assert d["total_epsilon"] == pytest.approx(ref, rel=1e-9)
    assert d["single_run_epsilon"] == pytest.approx(1.7935, rel=1e-3)
    assert d["delta"] == 1e-5 and d["selection"] == "poisson" and d["accountant"] == "rdp"
    assert "Thm 6" in d["theorem"]
    rc, out, err = finish(auto)
    assert rc == 0, err
    d2 = json.loads(out)
    assert d2["accountant"] == "pld"
    assert d2["total_epsilon"] == pytest.approx(3.245, rel=1e-3)
    assert d2["total_epsilon"] < d["total_epsilon"]


def test_target_epsilon_prints_noise_multiplier_and_text_mode():
    cal = cli(
        "--sampling_rate=0.01",
        "--steps=500",
        "--selection=tnb",
        "--mean_trials=10",
        "--shape=0.5",
        "--target_epsilon=2",
        "--accountant=rdp",
        "--json",
    )
    text = cli(
        "--sampling_rate=0.01", "--steps=500", "--noise_multiplier=1.0", "--selection=best_of_k",
        "--k=10",
    )  # fmt: skip
    rc, out, err = finish(cal)
    assert rc == 0, err
    d = json.loads(out)
    assert d["total_epsilon"] <= 2.0
    sigma = d["noise_multiplier"]
    tnb = sp.RandomStoppingPrivacy.from_mean(10.0, 0.5)
    st = accounting.total_privacy(accounting.DpSgdCandidate(0.01, 500, sigma), tnb, 1e-5, "rdp")
    assert st.total_epsilon == pytest.approx(d["total_epsilon"], rel=1e-12)
    assert d["untuned_noise_multiplier"] < sigma < d["naive_noise_multiplier"]
    rc, out, err = finish(text)
    assert rc == 0, err
    assert "best_of_k" in out and "satisfies (" in out


INVALID = [
    (["--sampling_rate=0", "--steps=10", "--noise_multiplier=1"], "--sampling_rate=0"),
    (["--sampling_rate=1.5", "--steps=10", "--noise_multiplier=1"], "--sampling_rate=1.5"),
    (["--sampling_rate=0.1", "--steps=10", "--noise_multiplier=0"], "--noise_multiplier=0"),
    (["--sampling_rate=0.1", "--steps=10", "--noise_multiplier=-2"], "--noise_multiplier=-2"),
    (["--sampling_rate=0.1", "--steps=10", "--noise_multiplier=1", "--delta=0"], "--delta=0"),
    (["--sampling_rate=0.1", "--steps=10", "--noise_multiplier=1", "--delta=1"], "--delta=1"),
    (
        [
            "--sampling_rate=0.1",
            "--steps=10",
            "--noise_multiplier=1",
            "--selection=geometric",
            "--mean_trials=0.5",
        ],
        "--mean_trials=0.5",
    ),
    (
        [
            "--sampling_rate=0.1",
            "--steps=10",
            "--noise_multiplier=1",
            "--selection=tnb",
            "--mean_trials=10",
            "--shape=-1",
        ],
        "--shape=-1",
    ),
    (
        [
            "--sampling_rate=0.1",
            "--steps=10",
            "--noise_multiplier=1",
            "--selection=tnb",
            "--mean_trials=10",
            "--shape=-3",
        ],
        "--shape=-3",
    ),
    (["--sampling_rate=0.1", "--steps=10"], "--noise_multiplier"),
    (["--sampling_rate=0.1", "--steps=10", "--noise_multiplier=1", "--selection=best"], "best"),
    (
        ["--sampling_rate=0.1", "--steps=10", "--noise_multiplier=1", "--selection=poisson"],
        "needs ['--mean_trials']",
    ),
    (
        [
            "--sampling_rate=0.1",
            "--steps=10",
            "--noise_multiplier=1",
            "--selection=poisson",
            "--mean_trials=3",
            "--k=2",
        ],
        "do not apply",
    ),  # fmt: skip
    # a delta so large that one candidate is (0, delta)-DP (the overhead was "xinfinite")
    (["--sampling_rate=0.1", "--steps=10", "--noise_multiplier=1", "--delta=0.5"], "--delta=0.5:"),
    (["--laplace_epsilon=1", "--delta=0.5"], "--delta=0.5: one candidate alone is (0, 0.5)-DP"),
]


# Runs every case through the real flag parser and main() in ONE interpreter (importing
# dp_accounting per case would cost ~2 s each); the subprocess cases below check the entry point.
DRIVER = """
import contextlib, io, json, sys
from absl import flags
from dptune.cli import account
results = []
for argv in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    err, out = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            flags.FLAGS(["dptune.cli.account", *argv])
            code = account.main(["dptune.cli.account"])
        except SystemExit as e:
            code, msg = 1, str(e.code)
            print(msg, file=sys.stderr)
        except flags.Error as e:
            code = 2
            print(e, file=sys.stderr)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def test_invalid_input_is_refused_with_the_value():
    argvs = [argv for argv, _ in INVALID]
    p = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    results = json.loads(p.stdout)
    assert len(results) == len(INVALID)
    for (argv, match), (code, out, err) in zip(INVALID, results, strict=True):
        assert code != 0, (argv, out)
        assert match in err, (argv, err)
        assert out == ""


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--sampling_rate=1.5", "--steps=10", "--noise_multiplier=1"], "--sampling_rate=1.5"),
        (["--sampling_rate=0.1", "--steps=10", "--selection=best"], "--selection=best"),
    ],
    ids=["library-check", "absl-enum"],
)
def test_entry_point_exits_nonzero_without_traceback(argv, match):
    rc, out, err = finish(cli(*argv))
    assert rc != 0
    assert match in err and "Traceback" not in err
    assert out == ""


def test_laplace_candidates_are_described_in_words_not_as_json():
    """``--laplace_epsilon`` listed its candidate as dp_accounting's named-tuple JSON."""
    rc, out, err = finish(cli("--laplace_epsilon=0.5", "--selection=poisson", "--mean_trials=3"))
    assert rc == 0, err
    assert "  Laplace mechanism: LaplaceDpEvent(noise_multiplier=2)." in out.splitlines(), out
    assert "{" not in out and "NamedTuple" not in out, out
