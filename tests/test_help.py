"""Every command's --help prints and exits 0 (argparse formats each help string with %, so a bare
'95%' in one of them crashes --help while every other use of the parser works)."""
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.parametrize("script", ["simulator.py", "rollout.py", "ppo.py", "grpo.py", "evaluate.py", "bench.py"])
def test_help_prints(script):
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")
