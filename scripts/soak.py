"""Soak test of crash safety: SIGKILL at random moments, resume, compare with an uninterrupted run.

    nice -n 10 python scripts/soak.py --runs=20 --races=50 --json=soak.json

For each of ``--runs`` seeds it runs the smoke config (``configs/smoke.py``, through the real
``dptune`` command in a subprocess) once uninterrupted, then again in a fresh workdir killed with
SIGKILL at 1 to ``--max_kills`` uniformly random moments (each kill lands on a fresh start of the
same command, i.e. on a resume), then lets the last resume finish; the two releases must be
identical: ``result.json``, ``privacy.json`` and every array of the released checkpoint, and the
ledger must hold one charge for the run however often it was started.

Then three targeted checks:

* two processes on one workdir: the second is refused (exit code 2, one ``dptune: refused:`` line)
  while the first runs on and releases the reference release;
* a kill during release writing (the checkpoint write is slowed down by a wrapper so that the kill
  lands inside it): no ``release/`` afterwards (complete or absent), and a rerun completes it;
* ``--races`` cross-process ledger races: two processes charge the last remaining budget of one
  dataset at the same moment (a ``multiprocessing`` barrier); exactly one may succeed.

Prints a markdown table (pasted into ``docs/reliability.md``) and writes every measurement to
``--json``. CPU heavy (each run trains the smoke config); run it in the background with nice.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.py"


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def command(workdir: Path, ledger: Path, seed: int, *extra: str) -> list[str]:
    """The smoke run through the real command line."""
    return [
        sys.executable, "-m", "dptune.cli.main", f"--config={SMOKE}", f"--workdir={workdir}",
        f"--seed={seed}", "--noprogress", f"--config.ledger.path={ledger}", *extra,
    ]  # fmt: skip


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run(cmd: list[str], timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def phase(workdir: Path) -> str:
    """Where a killed run stood: what is on disk after the kill."""
    if (workdir / "release").exists():
        return "after release"
    if (workdir / "release.tmp").exists():
        return "writing release"
    journal = workdir / "private" / "journal.sqlite"
    if not journal.exists():
        return "before journal"
    try:
        with sqlite3.connect(journal, timeout=5) as db:
            rows = db.execute("SELECT status FROM candidates").fetchall()
    except sqlite3.Error:
        return "journal opening"
    done = sum(r[0] == "done" for r in rows)
    return f"training ({done} done)" if rows else "planning"


def release_digest(folder: Path) -> dict[str, Any]:
    """What must be identical between two releases: the JSON files and the checkpoint arrays."""
    import numpy as np

    from dptune.release import load_params

    out: dict[str, Any] = {
        "result": json.loads((folder / "result.json").read_text()),
        "privacy": json.loads((folder / "privacy.json").read_text()),
    }
    if (folder / "checkpoint").exists():
        import jax

        leaves = jax.tree_util.tree_leaves_with_path(load_params(folder))
        out["arrays"] = {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}
    return out


def same_release(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import numpy as np

    if a["result"] != b["result"] or a["privacy"] != b["privacy"]:
        return False
    if a.get("arrays") is None or b.get("arrays") is None:
        return a.get("arrays") is None and b.get("arrays") is None
    return a["arrays"].keys() == b["arrays"].keys() and all(
        np.array_equal(a["arrays"][k], b["arrays"][k]) for k in a["arrays"]
    )


def charges(ledger: Path, workdir: Path) -> int:
    with sqlite3.connect(ledger, timeout=30) as db:
        return db.execute(
            "SELECT COUNT(*) FROM charges WHERE workdir = ?", (str(workdir),)
        ).fetchone()[0]


def soak_one(root: Path, seed: int, max_kills: int, rng: random.Random) -> dict[str, Any]:
    ledger = root / "ledger.sqlite"
    ref_dir, dir_ = root / f"ref-{seed}", root / f"killed-{seed}"
    t0 = time.time()
    ref = run(command(ref_dir, ledger, seed))
    ref_seconds = time.time() - t0
    if ref.returncode != 0:
        return {"seed": seed, "error": "reference failed: " + ref.stderr[-500:]}
    target = rng.randint(1, max_kills)
    kills: list[dict[str, Any]] = []
    attempts = 0
    while len(kills) < target and attempts < target + 5:
        attempts += 1
        at = rng.uniform(0.3, ref_seconds)
        proc = start(command(dir_, ledger, seed))
        try:
            proc.wait(timeout=at)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            kills.append({"after_s": round(at, 2), "phase": phase(dir_)})
            continue
        proc.communicate()
        if proc.returncode != 0:
            return {"seed": seed, "error": f"an interrupted attempt exited {proc.returncode}"}
        break  # it finished before the kill: the release is there
    t1 = time.time()
    final = run(command(dir_, ledger, seed))
    resume_seconds = time.time() - t1
    ok = final.returncode == 0 and same_release(
        release_digest(ref_dir / "release"), release_digest(dir_ / "release")
    )
    return {
        "seed": seed,
        "reference_s": round(ref_seconds, 1),
        "final_resume_s": round(resume_seconds, 1),
        "kills": kills,
        "released": json.loads((dir_ / "release" / "result.json").read_text())["released"]
        if (dir_ / "release").exists()
        else None,
        "identical": bool(ok),
        "charges": charges(ledger, dir_),
        "leftovers": sorted(p.name for p in dir_.iterdir() if p.name.startswith("release.")),
    }


def two_processes(root: Path, seed: int, reference: Path) -> dict[str, Any]:
    """A second run on a live run's workdir is refused; the first one runs on unharmed."""
    ledger = root / "ledger.sqlite"
    workdir = root / f"two-{seed}"
    first = start(command(workdir, ledger, seed))
    lock = workdir / ".dptune.lock"
    deadline = time.time() + 300
    while time.time() < deadline and not (lock.exists() and lock.stat().st_size > 0):
        time.sleep(0.1)
    time.sleep(1.0)  # well inside the run (accounting / training)
    t0 = time.time()
    second = run(command(workdir, ledger, seed), timeout=300)
    refused_s = time.time() - t0
    out, err = first.communicate()
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("dptune: refused:")]
    return {
        "second_exit_code": second.returncode,
        "second_refusal": lines[0] if lines else second.stderr[-300:],
        "second_seconds": round(refused_s, 1),
        "first_exit_code": first.returncode,
        "first_identical_to_reference": first.returncode == 0
        and same_release(release_digest(reference), release_digest(workdir / "release")),
    }


_SLOW_RELEASE = """
import sys, time
from pathlib import Path
import dptune.release as r
flag = Path(sys.argv.pop(1))
def slow_save(params, path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "partial").write_text("half a checkpoint")
    flag.write_text("writing")
    time.sleep(600)
r._save_orbax = slow_save
from dptune.cli.main import run
sys.argv[0] = "dptune"
run()
"""


def kill_during_release(root: Path, seed: int, reference: Path) -> dict[str, Any]:
    """SIGKILL while the release's checkpoint is being written, then rerun."""
    ledger = root / "ledger.sqlite"
    workdir = root / f"release-kill-{seed}"
    flag = root / f"writing-{seed}.flag"
    cmd = command(workdir, ledger, seed)
    proc = start([sys.executable, "-c", _SLOW_RELEASE, str(flag), *cmd[3:]])
    deadline = time.time() + 900
    while time.time() < deadline and not flag.exists() and proc.poll() is None:
        time.sleep(0.1)
    if not flag.exists():
        return {"error": "the run never reached release writing: " + proc.stderr.read()[-500:]}
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    after_kill = {
        "release_exists": (workdir / "release").exists(),
        "release_tmp_exists": (workdir / "release.tmp").exists(),
    }
    rerun = run(cmd)
    return {
        **after_kill,
        "rerun_exit_code": rerun.returncode,
        "rerun_identical_to_reference": rerun.returncode == 0
        and same_release(release_digest(reference), release_digest(workdir / "release")),
        "leftovers": sorted(p.name for p in workdir.iterdir() if p.name.startswith("release.")),
    }


# --- cross-process ledger races ------------------------------------------------------------------

_BUDGET, _FIRST, _EACH = 1.0, 0.5, 0.5  # after the first charge, exactly one more fits


def _racer(name: str, paths: list[str], barrier: Any, results: Any) -> None:
    from dptune._state.ledger import BudgetExceededError, Ledger

    for i, path in enumerate(paths):
        with Ledger(path) as led:
            barrier.wait()  # both processes charge at the same moment
            try:
                led.charge(
                    "race", f"{name}-{i}", _EACH, 1e-6, budget_epsilon=_BUDGET, budget_delta=1e-3
                )
                results.put((i, name, "charged"))
            except BudgetExceededError:
                results.put((i, name, "refused"))
            except Exception as e:  # noqa: BLE001 - reported, counted as an error
                results.put((i, name, f"error: {type(e).__name__}: {e}"))


def ledger_races(n: int, folder: Path) -> dict[str, Any]:
    """``n`` races of two processes for the last budget of a dataset; counts overspends."""
    from dptune._state.ledger import Ledger

    paths = []
    for i in range(n):
        path = folder / f"race-{i}.sqlite"
        with Ledger(path) as led:
            led.charge("race", "first", _FIRST, 1e-6, budget_epsilon=_BUDGET, budget_delta=1e-3)
        paths.append(str(path))
    ctx = mp.get_context("spawn")  # fresh interpreters: a real second process, no shared state
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(nm, paths, barrier, results)) for nm in "AB"]
    for p in procs:
        p.start()
    outcomes: dict[int, list[str]] = {}
    for _ in range(2 * n):
        i, _name, what = results.get(timeout=600)
        outcomes.setdefault(i, []).append(what)
    for p in procs:
        p.join()
    overspent, one_winner, errors = 0, 0, []
    for i, path in enumerate(paths):
        with Ledger(path) as led:
            spend = led.spend("race")
        overspent += spend.spent_epsilon > _BUDGET * (1 + 1e-9)
        one_winner += sorted(outcomes[i]) == ["charged", "refused"]
        errors += [w for w in outcomes[i] if w.startswith("error")]
    return {"races": n, "overspends": overspent, "exactly_one_winner": one_winner, "errors": errors}


# --- report --------------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| seed | reference (s) | kills: after (s), phase on disk | final resume (s) | released "
        "| identical release | ledger charges |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['seed']} | ERROR: {r['error'][:120]} | | | | | |")
            continue
        kills = "; ".join(f"{k['after_s']:.1f}: {k['phase']}" for k in r["kills"]) or "none"
        out.append(
            f"| {r['seed']} | {r['reference_s']} | {kills} | {r['final_resume_s']} | "
            f"{r['released']} | {'yes' if r['identical'] else '**NO**'} | {r['charges']} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--max_kills", type=int, default=3)
    ap.add_argument("--races", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="first smoke seed; also seeds the kills")
    ap.add_argument("--json", type=Path, default=None, help="write all measurements here")
    ap.add_argument("--root", type=Path, default=None, help="work folder (default: a temp dir)")
    args = ap.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="dptune-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    report: dict[str, Any] = {"root": str(root), "started": time.ctime(), "runs": []}
    t0 = time.time()

    def save() -> None:
        report["wall_s"] = round(time.time() - t0, 1)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")

    report["ledger_races"] = ledger_races(args.races, root)
    print("ledger races:", report["ledger_races"], flush=True)
    save()
    for i in range(args.runs):
        row = soak_one(root, args.seed + i, args.max_kills, rng)
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
        save()
        if i == 0:  # the targeted checks compare with the first seed's reference release
            ref = root / f"ref-{args.seed}" / "release"
            report["two_processes"] = two_processes(root, args.seed, ref)
            print("two processes:", report["two_processes"], flush=True)
            save()
            report["kill_during_release"] = kill_during_release(root, args.seed, ref)
            print("kill during release:", report["kill_during_release"], flush=True)
            save()
    print()
    print(table(report["runs"]))
    n_ok = sum(bool(r.get("identical")) for r in report["runs"])
    n_kills = sum(len(r.get("kills", [])) for r in report["runs"])
    print(f"\n{n_ok}/{len(report['runs'])} identical releases after {n_kills} kills; "
          f"wall {report['wall_s']} s")  # fmt: skip


if __name__ == "__main__":
    main()
