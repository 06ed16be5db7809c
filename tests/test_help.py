"""Every command's --help prints and exits 0 (argparse formats each help string with %, so a bare
'95%' in one of them crashes --help while every other use of the parser works)."""
import re
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.parametrize("script", ["simulator.py", "rollout.py", "ppo.py", "grpo.py", "evaluate.py",
                                    "bench.py"])
def test_help_prints(script):
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")


ONE_NAME = ("--clip-low", "--clip-high", "--update-epochs", "--kl-loss-coef", "--lr", "--user-reply-tokens",
            "--loss-agg", "--ent-coef", "--max-turns")


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py"])
def test_the_trainers_share_one_name_per_idea(script):
    # the same idea has the same flag in both trainers; the old names say what they became
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    flags = set(re.findall(r"--[a-z0-9-]+", done.stdout))
    assert set(ONE_NAME) <= flags, set(ONE_NAME) - flags
    old = ("--actor-lr", "--clip-range", "--ppo-epochs", "--num-iterations", "--beta", "--sim-reply-tokens")
    assert not flags & set(old)
    stop = subprocess.run([sys.executable, script, "--ppo-epochs", "2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert stop.returncode == 2 and stop.stderr.strip() == \
        "error: unknown flag --ppo-epochs (renamed); did you mean --update-epochs?"
