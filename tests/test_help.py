"""Every command's --help prints and exits 0 (argparse formats each help string with %, so a bare
'95%' in one of them crashes --help while every other use of the parser works)."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "evaluate.py", "tools/bench.py",
                                    "tools/capability.py"])
def test_help_prints(script):
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:")
    # each flag's default (the script's own: evaluate.py's SAGE sizes), and what each preset changes
    text = " ".join(done.stdout.split())
    shown = {"ppo.py": "(RLVER: 5%% of 1,000) (default: 50)", "grpo.py": "(Dr. GRPO) (default: mean-std)",
             "evaluate.py": "tokens per agent turn (default: 128)", "tools/bench.py": "subcommand",
             "tools/capability.py": "(offline), or any of lm-eval's"}[script]
    assert shown.replace("%%", "%") in text
    if script in ("ppo.py", "grpo.py"):
        trainer = __import__(script[:-3])
        for name, preset in trainer.PRESETS.items():
            changes = " ".join(f"--{k.replace('_', '-')} {str(v).lower() if isinstance(v, bool) else v}"
                               for k, v in preset.items())
            assert f"{name}: {changes or 'the defaults'}" in text, name


ONE_NAME = ("--clip-low", "--clip-high", "--update-epochs", "--kl-loss-coef", "--lr", "--user-reply-tokens",
            "--loss-agg", "--ent-coef", "--max-turns")


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py"])
def test_the_trainers_share_one_name_per_idea_method_first_operational_last(script):
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    flags = re.findall(r"^  (--[a-z0-9-]+)", done.stdout, re.M)
    assert set(ONE_NAME) <= set(flags), set(ONE_NAME) - set(flags)
    # the method's own flags open the list, the rarely changed operational ones close it
    assert flags[0] == ("--dialogues-per-iteration" if script == "ppo.py" else "--personas-per-iteration")
    groups = re.findall(r"^(\S.*):$", done.stdout, re.M)
    assert groups[1] in ("PPO", "GRPO") and groups[-1] == "operational (rarely changed)", groups
    last = done.stdout.split("operational (rarely changed):")[1]
    assert "--micro-batch-size" in last and "--api-timeout" in last and "--lr " not in last
    stop = subprocess.run([sys.executable, script, "--ppo-epochs", "2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert stop.returncode == 2 and stop.stderr.strip() == (
        "error: unrecognized arguments: --ppo-epochs 2; --ppo-epochs: did you mean --update-epochs?")


def test_a_first_run_prints_only_the_projects_own_lines(tmp_path):
    """`python ppo.py --preset cpu` from an empty model cache, as a newcomer's first run: stdout and
    stderr hold the project's own lines (its line an iteration among them), no library's warning,
    advice or bar (bitsandbytes' kernel-hub advice, transformers' deprecation and its GGUF and
    loading bars)."""
    env = {**os.environ, "RLVER_CACHE": str(tmp_path / "cache")}
    env.pop("OMP_NUM_THREADS", None)  # a newcomer's shell: the script picks its threads
    done = subprocess.run([sys.executable, "ppo.py", "--preset", "cpu", "--iterations", "1",
                           "--dialogues-per-iteration", "2", "--minibatch-size", "2", "--max-turns", "1",
                           "--max-new-tokens", "8", "--out", str(tmp_path / "run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    frames = [line for line in re.split(r"[\r\n]", done.stdout + done.stderr) if line.strip()]
    ours = re.compile(r"(policy smollm2 on cpu|converting .*\.gguf to |run /|done: |ppo 1/1 \| reward_mean )")
    assert frames and all(ours.match(line) for line in frames), [f for f in frames if not ours.match(f)]
    assert "converting" in done.stderr  # it was a first run: the model was converted
    # its start-up line says the threads it took: half the usable cores (cli.use_cpu_threads)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert f"policy smollm2 on cpu (CPU threads: {threads}) x 1 process(es)" in done.stdout
