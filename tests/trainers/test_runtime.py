"""The glibc malloc setting the compiled step depends on is applied once and can be opted out of."""

import os
import platform
import subprocess
import sys

import pytest

CODE = "from trainers.runtime import tune_malloc; print(tune_malloc(), tune_malloc())"


def _run(opt_out: bool):
    env = {k: v for k, v in os.environ.items() if k != "DPTUNE_NO_MALLOC_TUNING"}
    if opt_out:
        env["DPTUNE_NO_MALLOC_TUNING"] = "1"
    out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_opt_out():
    assert _run(opt_out=True) == ["False", "False"]


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)
def test_applied_on_glibc():
    assert _run(opt_out=False) == ["True", "True"]
