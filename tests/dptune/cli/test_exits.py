"""``exits.leave``: a finished command's process ends with its exit status, after what a normal
exit does that can matter (other threads, exit handlers, buffered output), without the
interpreter's teardown."""

import subprocess
import sys

from tests.paths import REPO

SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from dptune.cli import exits
out = Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.3)
    (out / "thread").write_text("done")
threading.Thread(target=late).start()
sys.stdout.write("buffered, no newline")
exits.leave(3)
"""


def test_leave_waits_for_threads_runs_exit_handlers_and_flushes(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 3, out.stderr
    assert out.stdout == "buffered, no newline"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "done"
