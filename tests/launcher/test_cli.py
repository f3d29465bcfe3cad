"""`python -m ds_longstraw.tools.cli` exits with the subcommand's status, as the `longstraw` console script does.

A failing `plan` (an unknown model) returns 2 from main(); run as a module, that status must reach the shell, or a
script that checks it (bin/main's `set -e`, a CI step) carries on after a failure.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "ds_longstraw.tools.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_a_failing_subcommand_exits_nonzero():
    result = _cli("plan", "--model", "no-such-model", "--context", "1M", "--gpu-memory", "80GB", "--host-memory",
                  "512GB")
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "longstraw plan: model 'no-such-model' is neither a built-in shape" in result.stderr


def test_a_bad_option_exits_nonzero():
    result = _cli("plan", "--model", "qwen3.6-27b", "--context", "lots")
    assert result.returncode == 2 and "argument --context: 'lots' is not a token count" in result.stderr
