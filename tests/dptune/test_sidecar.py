"""The dptune command's sidecar (dptune/sidecar.py): the step PLD it builds ahead is exactly the
one the run would build, is used only for an equal request, and nothing but requests is read from
disk; the plots it draws are byte for byte the in-process ones; and whatever goes wrong with it
(dead, garbage, slow, a forked child, warm starts off) the command does the work itself."""

import json
import os

import numpy as np
import pytest

from dptune import plots, sidecar
from dptune.accounting import epsilon
from dptune.accounting.epsilon import PLD_DISCRETIZATION, build_step_pld

pytestmark = pytest.mark.skipif(
    os.name != "posix" or sidecar._usable_cores() < 2, reason="the sidecar needs POSIX, 2 cores"
)

ARGV = ["--config=smoke", "--workdir=/tmp/a", "--seed=1"]
SIGMA, Q = 0.8159669115532471, 0.036571428571428574


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A fresh dptune cache folder, warm starts on, and no sidecar left behind."""
    monkeypatch.setenv("DPTUNE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("DPTUNE_COMPILATION_CACHE", raising=False)
    sidecar.stop()
    yield
    sidecar.stop()
    epsilon.clear_caches()


def _pmfs(pld):
    out = []
    for pmf in (pld._pmf_remove, pld._pmf_add):
        out.append((pmf._lower_loss, pmf._discretization, pmf._infinity_mass, list(pmf._probs)))
    return out


def _second_run(tmp_path):
    """Run 1 of the command line notes its PLD; run 2's sidecar builds it ahead."""
    sidecar.start(ARGV, cwd=tmp_path)
    sidecar.note(SIGMA, Q, PLD_DISCRETIZATION)
    sidecar.stop()
    assert sidecar.start(["--workdir=/tmp/b", *ARGV[:1], *ARGV[2:]], cwd=tmp_path)


def test_requests_are_keyed_by_the_command_line_without_its_workdir(tmp_path):
    path = sidecar.request_path(ARGV, tmp_path)
    assert path.parent == tmp_path / "cache" / "sidecar"
    assert sidecar.request_path(["--config=smoke", "--workdir", "/x", "--seed=1"], tmp_path) == path
    assert sidecar.request_path(["--config=smoke", "--seed=2"], tmp_path) != path
    assert sidecar.request_path(ARGV, tmp_path / "elsewhere") != path


def test_a_second_run_takes_exactly_the_pld_it_would_have_built(tmp_path):
    _second_run(tmp_path)
    saved = json.loads(sidecar.request_path(ARGV, tmp_path).read_text())
    assert saved == [[SIGMA, Q, PLD_DISCRETIZATION, None]]  # requests only: public numbers
    # The accountant's cached step PLD is the sidecar's, and equals the one built here exactly.
    got = epsilon._step_pld(SIGMA, Q, PLD_DISCRETIZATION)
    assert got is sidecar.take(SIGMA, Q, PLD_DISCRETIZATION) is not None
    assert _pmfs(got) == _pmfs(build_step_pld(SIGMA, Q, PLD_DISCRETIZATION))
    # Anything else is the run's to build: another sigma, rate, discretisation or relation.
    assert sidecar.take(SIGMA * 1.001, Q, PLD_DISCRETIZATION) is None
    assert sidecar.take(SIGMA, Q, 1e-3) is None
    from dp_accounting import privacy_accountant

    replace_one = privacy_accountant.NeighboringRelation.REPLACE_ONE
    assert sidecar.take(SIGMA, Q, PLD_DISCRETIZATION, replace_one) is None


def test_warm_starts_off_read_and_write_no_requests(tmp_path, monkeypatch):
    _second_run(tmp_path)
    sidecar.stop()
    for argv in (["--compilation_cache=off", *ARGV], ["--compilation_cache", "no", *ARGV]):
        sidecar.start(argv, cwd=tmp_path)
        assert sidecar._state["path"] is None and not sidecar._state["promised"]
        sidecar.note(2.0, Q, PLD_DISCRETIZATION)
        sidecar.stop()
    monkeypatch.setenv("DPTUNE_COMPILATION_CACHE", "off")
    sidecar.start(ARGV, cwd=tmp_path)
    assert sidecar.take(SIGMA, Q, PLD_DISCRETIZATION) is None
    assert [p.name for p in (tmp_path / "cache" / "sidecar").iterdir()] == [
        sidecar.request_path(ARGV, tmp_path).name
    ]


def test_a_damaged_requests_file_is_ignored(tmp_path):
    path = sidecar.request_path(ARGV, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text('[[1.0, 0.5], "x", [-1.0, 0.1, 0.0001, null], [1.0, 2.0, 0.0001, null]')
    assert sidecar.start(ARGV, cwd=tmp_path)
    assert not sidecar._state["promised"]
    # Only well-formed requests are kept (positive finite numbers, a rate <= 1).
    text = "[[1.0, 0.5, 0.0001, null], [-1.0, 0.1, 0.0001, null], [1.0, 2.0, 0.0001, null], "
    text += "[1, 0.5, 0.0001, null], [NaN, 0.5, 0.0001, null], [1.0, 0.5, 0.0001, 3]]"
    assert sidecar._parse_requests(text) == [(1.0, 0.5, 0.0001, None)]


def test_the_sidecars_plots_are_byte_for_byte_the_ones_drawn_here(tmp_path):
    privacy = {"total_epsilon": 1.0, "single_run_epsilon": 0.6, "budget_epsilon": 1.0,
               "delta": 1e-5, "method": "truncated negative binomial"}  # fmt: skip
    curve = [{"epoch": e, "epsilon_one_run": 0.2 * e, "test_accuracy": 0.5 + 0.1 * e}
             for e in (1, 2, 3)]  # fmt: skip
    assert sidecar.start(ARGV, cwd=tmp_path)
    sidecar.draw("epsilon_breakdown", privacy, str(tmp_path / "e.png"))
    sidecar.draw("training_curve", curve, str(tmp_path / "c.png"), 1.0)
    assert [job[0] for job in sidecar._drawing] == ["epsilon_breakdown", "training_curve"]
    sidecar.finish_drawing()
    assert sidecar.running()  # it drew both: it was never replaced by in-process drawing
    plots.epsilon_breakdown(privacy, tmp_path / "e_here.png")
    plots.training_curve(curve, tmp_path / "c_here.png", 1.0)
    assert (tmp_path / "e.png").read_bytes() == (tmp_path / "e_here.png").read_bytes()
    assert (tmp_path / "c.png").read_bytes() == (tmp_path / "c_here.png").read_bytes()


def test_a_dead_sidecar_leaves_the_work_to_the_command(tmp_path):
    _second_run(tmp_path)
    sidecar._state["proc"].kill()
    sidecar._state["proc"].wait()
    assert sidecar.take(SIGMA, Q, PLD_DISCRETIZATION) is None
    sidecar.draw(
        "epsilon_breakdown", {"total_epsilon": 1.0, "delta": 1e-5}, str(tmp_path / "e.png")
    )
    assert (tmp_path / "e.png").exists()  # drawn here, at once
    sidecar.finish_drawing()


def test_a_figure_the_sidecar_could_not_draw_is_drawn_here(tmp_path):
    assert sidecar.start(ARGV, cwd=tmp_path)
    good = {"total_epsilon": 1.0, "delta": 1e-5}
    sidecar.draw("epsilon_breakdown", good, str(tmp_path / "a.png"))
    sidecar.finish_drawing()
    assert sidecar.running() and (tmp_path / "a.png").exists()
    # Its error comes back; drawn here, the figure fails as it would without a sidecar.
    sidecar.draw("epsilon_breakdown", {"delta": 1e-5}, str(tmp_path / "b.png"))
    with pytest.raises(KeyError, match="total_epsilon"):
        sidecar.finish_drawing()
    assert not sidecar.running()
    # A sidecar killed after a job was sent: the command draws it.
    assert sidecar.start(ARGV, cwd=tmp_path)
    sidecar.draw("epsilon_breakdown", good, str(tmp_path / "c.png"))
    sidecar._state["proc"].kill()
    sidecar.finish_drawing()
    assert (tmp_path / "c.png").read_bytes() == (tmp_path / "a.png").read_bytes()


def test_a_sidecar_that_answers_garbage_or_nothing_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setattr(sidecar, "WAIT_S", 0.5)
    garbage = "import sys, time; sys.stdout.write('x' * 63); sys.stdout.flush(); time.sleep(30)"
    for program in (garbage, "import time; time.sleep(30)"):
        monkeypatch.setattr(sidecar, "_SERVE", program + "  # {root}")
        _second_run(tmp_path)
        assert sidecar.take(SIGMA, Q, PLD_DISCRETIZATION) is None
        assert not sidecar.running()  # killed, not waited for again
        sidecar.stop()


def test_a_forked_child_never_touches_its_parents_sidecar(tmp_path):
    _second_run(tmp_path)
    pid = os.fork()
    if pid == 0:  # the child: no PLD, nothing noted, and its exit leaves the sidecar alone
        ok = sidecar.take(SIGMA, Q, PLD_DISCRETIZATION) is None and not sidecar.running()
        sidecar.note(3.0, Q, PLD_DISCRETIZATION)
        sidecar.stop()
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sidecar.running()
    assert sidecar.take(SIGMA, Q, PLD_DISCRETIZATION) is not None
    assert "3.0" not in sidecar.request_path(ARGV, tmp_path).read_text()


def test_the_library_never_starts_a_sidecar(tmp_path):
    assert not sidecar.running() and sidecar._state["path"] is None
    assert epsilon._step_pld(2.0, Q, PLD_DISCRETIZATION) is not None
    assert not (tmp_path / "cache" / "sidecar").exists()  # nothing noted: no command line
    sidecar.draw(
        "epsilon_breakdown", {"total_epsilon": 1.0, "delta": 1e-5}, str(tmp_path / "e.png")
    )
    assert (tmp_path / "e.png").exists()


def test_pmf_comparison_sees_a_difference():
    a = build_step_pld(SIGMA, Q, 1e-3)
    b = build_step_pld(SIGMA * 1.001, Q, 1e-3)
    assert _pmfs(a) != _pmfs(b)
    assert not np.isnan(a.get_epsilon_for_delta(1e-5))


def test_the_tuning_command_starts_the_sidecar_before_its_imports(monkeypatch):
    import importlib
    import sys

    from dptune import cli

    calls = []
    monkeypatch.setattr(sidecar, "start", lambda argv: calls.append(("start", list(argv))))

    class _Command:
        @staticmethod
        def run():
            calls.append(("run", None))

    monkeypatch.setattr(importlib, "import_module", lambda name: calls.append(name) or _Command)
    monkeypatch.setattr(sys, "argv", ["dptune", "--config=smoke", "--workdir=/tmp/x"])
    cli.run()
    assert calls == [("start", ["--config=smoke", "--workdir=/tmp/x"]), "dptune.cli.main",
                     ("run", None)]  # fmt: skip
    calls.clear()
    monkeypatch.setattr(sys, "argv", ["dptune", "ledger"])
    cli.run()
    assert calls == ["dptune.cli.ledger", ("run", None)]  # a subcommand: no sidecar


@pytest.mark.slow  # two tiny CLI runs (~20 s)
def test_a_second_run_of_the_command_uses_its_sidecar_and_releases_the_same(tmp_path):
    import subprocess
    import sys

    from tests.dptune.cli.test_main import SMOKE, TINY
    from tests.paths import REPO

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "DPTUNE_CACHE": str(tmp_path / "cache")}
    env.pop("DPTUNE_COMPILATION_CACHE", None)
    env["DPTUNE_LEDGER"] = str(tmp_path / "ledger.sqlite")
    releases = []
    for name in ("first", "second"):
        cmd = [sys.executable, "-m", "dptune", f"--config={SMOKE}", f"--workdir={tmp_path / name}",
               *TINY, "--verbosity=1"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        releases.append((tmp_path / name / "release", proc.stderr))
    (first, err1), (second, err2) = releases
    assert "is the sidecar's" not in err1 and "is the sidecar's" in err2
    assert json.loads((first / "privacy.json").read_text()) == json.loads(
        (second / "privacy.json").read_text()
    )
    for png in ("epsilon.png", "training_curve.png"):
        assert (second / png).read_bytes() == (first / png).read_bytes()


def test_a_release_that_fails_leaves_no_figure_for_the_next(tmp_path, monkeypatch):
    assert sidecar.start(ARGV, cwd=tmp_path)
    sidecar.draw("epsilon_breakdown", {"total_epsilon": 1.0}, str(tmp_path / "a.png"))
    sidecar.abandon_drawing()
    assert not sidecar.running() and sidecar._drawing == []
    sidecar.draw("epsilon_breakdown", {"total_epsilon": 2.0}, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").exists()  # drawn here: no answer of the first is read for it


def test_a_killed_command_leaves_no_sidecar_behind(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    # A command that started its sidecar (busy building a PLD) and is then killed with SIGKILL:
    # the sidecar, in its own session, ends on its own (broken pipe or end of input).
    sidecar.start(ARGV, cwd=tmp_path)
    sidecar.note(SIGMA, Q, PLD_DISCRETIZATION)
    sidecar.stop()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from dptune import sidecar; "
         f"sidecar.start({ARGV!r}, cwd={str(tmp_path)!r}); "
         "print(sidecar._state['proc'].pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, env=os.environ,
    )  # fmt: skip
    pid = int(child.stdout.readline())
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the sidecar outlived its killed command by 30 s")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (an ended process nobody has reaped yet, a zombie, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): the signal test
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
