"""A run folder nothing can clobber, and every bad input a line (issue 26). Each test holds one of
the issue's cases, named by its number in the docstring, as decided case by case for issue 26;
grouped as the issue groups them. Everything goes through the command line and the files a run
writes, never through the functions behind it.

How a command runs. Where the process is part of the case (a run under test, an injected fault,
the process that owns a run folder, a signal, bench.py's exit status), as a real subprocess (shell()).
A command that should end with one line runs, as tests/test_bad_input.py runs its settings cases,
through the script's main(argv) in this process (command()): the code `python SCRIPT ARGV` runs,
without the 3 s each new Python spends importing torch and transformers (about 30 such commands
would add minutes). RLVER_TEST_SUBPROCESS=1 runs every command as a subprocess instead.

Two tools make the cases cheap and exact:
- `unloadable`: a --model folder whose config and tokenizer load but whose weights do not. A check
  that must come before the weights ends the command with its own line; a command that reaches the
  weights ends in the loader's traceback instead. So a test that gets its one line with it has also
  shown that the check ran before any model loaded (and today's failures take seconds, not minutes).
- tests/faults.py: runs a script with a read-only folder, a full disk or NaN weights injected (the
  tests run as root, whom chmod does not stop; its docstring says how, and the last test here holds
  its faults against real tmpfs mounts where mounting is allowed).
"""
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback

import pytest
import torch

import cli
from conftest import NOT_A_WEIGHTS_FILE, ROOT, read_metrics
from test_bad_input import ENV, assert_one_line, shell, tiny

TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


# ----------------------------------------------------------------------------------------------
# Helpers and shared runs
# ----------------------------------------------------------------------------------------------
def faulty(*argv):
    """shell() through tests/faults.py: faulty(FAULT FLAGS..., "--", SCRIPT, ARGS...)."""
    return shell(os.path.join("tests", "faults.py"), *argv)


SUBPROCESS = os.environ.get("RLVER_TEST_SUBPROCESS") == "1"


def command(capsys, script, *argv, cwd=None):
    """`python SCRIPT ARGV` (in the folder cwd) through the script's main(argv) in this process, or as
    a subprocess with RLVER_TEST_SUBPROCESS=1; returns what shell() does. An exception that would reach
    the interpreter comes back as it would print it: exit code 1 and a traceback on stderr."""
    if SUBPROCESS:
        return shell(os.path.join(ROOT, script), *argv, cwd=cwd or ROOT)
    main = cli.command(importlib.import_module(os.path.basename(script)[:-len(".py")]).main)
    here, threads = os.getcwd(), torch.get_num_threads()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    capsys.readouterr()
    t0 = time.time()
    try:
        os.chdir(cwd or here)
        main(list(argv))
        code = 0
    except SystemExit as e:  # sys.exit("text"): the interpreter prints the text and exits 1
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    except Exception:
        traceback.print_exc()
        code = 1
    finally:  # what the command may have changed in this process
        os.chdir(here)
        torch.set_num_threads(threads)
        for s, handler in handlers.items():
            signal.signal(s, handler)
    out, err = capsys.readouterr()
    return code, out, err, time.time() - t0


def produce(script, *argv):
    """A run that tests then work on (not itself a case): in this process unless RLVER_TEST_SUBPROCESS=1."""
    if SUBPROCESS:
        run_ok(script, *argv)
    else:
        importlib.import_module(os.path.basename(script)[:-len(".py")]).main(list(argv))


def snapshot(folder):
    """Every entry under folder, links not followed: relative path -> content digest, link target or
    'dir'. The lock file is left out: a lock is not part of a run's record."""
    seen = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if name == ".lock":
                continue
            if os.path.islink(path):
                seen[rel] = "-> " + os.readlink(path)
            elif os.path.isdir(path):
                seen[rel] = "dir"
            else:
                with open(path, "rb") as f:
                    seen[rel] = hashlib.sha256(f.read()).hexdigest()
    return seen


def copy_run(run, tmp_path, name="run"):
    shutil.copytree(run, tmp_path / name, symlinks=True)
    return tmp_path / name


def complete_checkpoints(run):
    folder = os.path.join(run, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return sorted(d for d in names if re.fullmatch(r"iter_\d{6}", d))


def newest_checkpoint(run):
    """The iteration of a run's newest complete checkpoint (0: none)."""
    done = complete_checkpoints(run)
    return int(done[-1][len("iter_"):]) if done else 0


def scalars(run, tag):
    """(step, value) of a TensorBoard scalar in a run's rlver/ folder, every event file read."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "rlver"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def background(argv, log):
    """A script started as a user would, its stderr to the file `log` (a pipe could fill and stall it)."""
    with open(log, "w") as err:
        return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL,
                                stderr=err)


def wait_for(condition, proc, log, timeout=240):
    t0 = time.time()
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} first: {log.read_text()[-2000:]}"
        assert time.time() - t0 < timeout, f"waited {timeout} s: {log.read_text()[-2000:]}"
        time.sleep(0.05)


def stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(60)


@contextlib.contextmanager
def weights_unloadable(model_dir):
    """For the time of a with-block, model_dir's weights (a link to the tiny model's) do not load."""
    path = os.path.join(model_dir, "model.safetensors")
    target = os.readlink(path)
    os.remove(path)
    with open(path, "wb") as f:
        f.write(NOT_A_WEIGHTS_FILE)
    try:
        yield
    finally:
        os.remove(path)
        os.symlink(target, path)


def run_ok(*argv):
    code, _, err, _ = shell(*argv)
    assert code == 0, err[-3000:]


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    """The tiny random Llama as a folder of links to tiny_model_dir's files: the module's runs are
    made with it, and case 14 makes its weights unloadable for a moment (weights_unloadable)."""
    folder = tmp_path_factory.mktemp("model")
    for name in os.listdir(tiny_model_dir):
        os.symlink(os.path.join(tiny_model_dir, name), folder / name)
    return str(folder)


@pytest.fixture(scope="module")
def ppo_run(model, personas_file, tmp_path_factory):
    """A finished PPO run of 2 iterations, a checkpoint after each, TensorBoard events when the
    package is there. Tests copy it (copy_run) before they change anything."""
    out = tmp_path_factory.mktemp("ppo") / "run"
    produce("ppo.py", *tiny(model, personas_file, out, "--iterations", "2", "--save-every", "1",
                            *(["--report-to", "tensorboard"] if TENSORBOARD else [])))
    return out


@pytest.fixture(scope="module")
def grpo_run(model, personas_file, tmp_path_factory):
    """A finished GRPO run of 1 iteration, with its checkpoint."""
    out = tmp_path_factory.mktemp("grpo") / "run"
    produce("grpo.py", *tiny(model, personas_file, out, "--iterations", "1", "--save-every", "1",
                             script="grpo"))
    return out


@pytest.fixture(scope="module")
def resumed(ppo_run, tmp_path_factory):
    """The PPO run, copied, resumed as a user types it: `ppo.py --resume RUN --iterations 3`, without
    --preset cpu (case 31). Cases 6 and 31 read what it did: (run, exit code, stderr)."""
    run = copy_run(ppo_run, tmp_path_factory.mktemp("resumed"))
    code, _, err, _ = shell("ppo.py", "--resume", str(run), "--iterations", "3")
    return run, code, err


# ----------------------------------------------------------------------------------------------
# Data loss (cases 1-5)
# ----------------------------------------------------------------------------------------------
# ----------------------------------------------------------------------------------------------
# Silent wrong results (cases 6-11)
# ----------------------------------------------------------------------------------------------
def test_resume_keeps_logging_to_tensorboard(resumed):
    """Case 6: a run made with --report-to tensorboard, resumed without the flag, logs its new
    iteration to TensorBoard (the run's settings hold it), once, with metrics.jsonl's value."""
    if not TENSORBOARD:
        pytest.skip("tensorboard is not installed")
    run, code, err = resumed
    rewards = [(m["iteration"], pytest.approx(m["reward_mean"], rel=1e-6)) for m in read_metrics(run)]
    assert scalars(run, "reward_mean") == rewards and len(rewards) == 3, err[-2000:]


def test_bench_rollout_refuses_zero_turns(unloadable, capsys):
    """Case 10: bench.py rollout --max-turns 0: one line, exit 2, before any model loads."""
    code, _, err, _ = command(capsys, "tools/bench.py", "rollout", "--max-turns", "0", "--model", unloadable)
    assert_one_line(code, err, "--max-turns", "0")


# ----------------------------------------------------------------------------------------------
# Tracebacks instead of one line (cases 12-24)
# ----------------------------------------------------------------------------------------------
def test_ppo_with_a_read_only_out(unloadable, personas_file, tmp_path):
    """Case 12: ppo.py --out on a read-only folder: one line before any model loads."""
    out = tmp_path / "run"
    out.mkdir()
    code, _, err, _ = faulty("--read-only", str(out), "--", "ppo.py",
                             *tiny(unloadable, personas_file, out, "--iterations", "1"))
    assert_one_line(code, err, str(out), "Read-only file system")


def test_grpo_with_an_out_in_a_read_only_folder(unloadable, personas_file, tmp_path):
    """Case 13: grpo.py --out in a read-only folder (the run folder cannot be made): one line before
    any model loads."""
    parent = tmp_path / "read_only"
    parent.mkdir()
    out = parent / "run"
    code, _, err, _ = faulty("--read-only", str(parent), "--", "grpo.py",
                             *tiny(unloadable, personas_file, out, "--iterations", "1", script="grpo"))
    assert_one_line(code, err, str(out), "Read-only file system")
    assert not out.exists()


def test_resuming_a_read_only_run(ppo_run, model, tmp_path):
    """Case 14: --resume of a run on a read-only file system: one line before any model loads (the
    run's model, which resume takes from its settings, has unloadable weights meanwhile)."""
    run = copy_run(ppo_run, tmp_path)
    with weights_unloadable(model):
        code, _, err, _ = faulty("--read-only", str(run), "--", "ppo.py", "--resume", str(run),
                                 "--preset", "cpu", "--iterations", "3")
    assert_one_line(code, err, str(run), "Read-only file system")


def test_out_is_a_file(unloadable, personas_file, tmp_path, capsys):
    """Case 15: --out names a regular file: one line before any model loads, the file unchanged."""
    out = tmp_path / "run.txt"
    out.write_text("not a folder")
    code, _, err, _ = command(capsys, "ppo.py", *tiny(unloadable, personas_file, out, "--iterations", "1"))
    assert_one_line(code, err, str(out))
    assert out.read_text() == "not a folder"


def test_a_run_resumed_by_the_other_trainer(ppo_run, grpo_run, tmp_path, capsys):
    """Cases 19 and 28: grpo.py --resume of a PPO run, and ppo.py --resume of a GRPO run: one line
    saying which script made the run (not a ValueError, not "critic/... is missing")."""
    code, _, err, _ = command(capsys, "grpo.py", "--resume", str(copy_run(ppo_run, tmp_path, "ppo")),
                              "--preset", "cpu")
    assert_one_line(code, err, "ppo.py")
    code, _, err, _ = command(capsys, "ppo.py", "--resume", str(copy_run(grpo_run, tmp_path, "grpo")),
                              "--preset", "cpu")
    assert_one_line(code, err, "grpo.py")
    assert "missing" not in err


@pytest.mark.parametrize("flag, value", [("--lr", "inf"), ("--lr", "nan"), ("--critic-lr", "inf")])
def test_learning_rates_must_be_finite(flag, value, unloadable, personas_file, tmp_path, capsys):
    """Case 21: --lr inf (accepted today: it saved a checkpoint of non-finite weights), --lr nan,
    --critic-lr inf: one line saying the rate must be finite, before any model loads."""
    argv = tiny(unloadable, personas_file, tmp_path / "run", flag, value)
    code, _, err, _ = command(capsys, "ppo.py", *argv)
    assert_one_line(code, err, flag, value, "finite")


@pytest.mark.parametrize("case", ["22 rollout --dialogues 0", "23 rollout --threads -1",
                                  "24 learning --seeds a,b"])
def test_bench_flags_are_checked_like_the_trainers(case, unloadable, tmp_path, capsys):
    """Cases 22-24: bench.py rollout --dialogues 0, rollout --threads -1, learning --seeds a,b: one
    line naming the flag and the value, exit 2, before any model loads (or any run starts)."""
    _, sub, flag, value = case.split()
    where = ["--model", unloadable] if sub == "rollout" else ["--out", str(tmp_path / "bench")]
    code, _, err, _ = command(capsys, "tools/bench.py", sub, flag, value, *where)
    assert_one_line(code, err, flag, value)
    assert not (tmp_path / "bench").exists()


# ----------------------------------------------------------------------------------------------
# Unclear messages (cases 26-32; case 25, a key typed as its variable: tests/test_simulator.py)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", ["ppo", "grpo"])
def test_the_batch_shape_error_names_both_values(script, unloadable, personas_file, tmp_path, capsys):
    """Case 27: "must be a multiple of --minibatch-size" names both values (GRPO: the batch of
    --personas-per-iteration x --group-size, and --minibatch-size). GRPO's already did."""
    if script == "ppo":
        flags, words = ["--dialogues-per-iteration", "3", "--minibatch-size", "4"], \
            ["--dialogues-per-iteration 3", "--minibatch-size 4"]
    else:
        flags, words = ["--personas-per-iteration", "3", "--group-size", "2", "--minibatch-size", "4"], \
            ["--minibatch-size 4", "6"]
    argv = tiny(unloadable, personas_file, tmp_path / "run", *flags, script=script)
    code, _, err, _ = command(capsys, f"{script}.py", *argv)
    assert_one_line(code, err, *words)


def test_resume_takes_the_runs_preset_from_its_settings(resumed):
    """Case 31: `ppo.py --resume RUN` without --preset cpu, on a machine without CUDA, resumes a run
    made with --preset cpu (its saved settings say which model and where), no "needs CUDA"."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    run, code, err = resumed
    assert code == 0 and "CUDA" not in err, err[-2000:]
    assert [m["iteration"] for m in read_metrics(run)] == [1, 2, 3]


def test_grpo_resume_with_another_out_is_refused(grpo_run, tmp_path, capsys):
    """Case 32: grpo.py --resume A --out B: one line (a resume continues in A; drop --out); nothing
    written in A or B."""
    run = copy_run(grpo_run, tmp_path)
    before = snapshot(run)
    other = tmp_path / "other"
    code, _, err, _ = command(capsys, "grpo.py", "--resume", str(run), "--out", str(other), "--preset", "cpu")
    assert_one_line(code, err, "--out", "--resume")
    assert not other.exists() and snapshot(run) == before


# ----------------------------------------------------------------------------------------------
# Also: bench.py's exit codes
# ----------------------------------------------------------------------------------------------
def test_bench_own_checks_exit_2_with_one_line(tmp_path):
    """Also: bench.py's own checks (here --jobs, and `bench.py gpu` on a machine without CUDA) end
    with one error line and exit code 2, as every other command's."""
    code, _, err, _ = shell("tools/bench.py", "learning", "--jobs", "99", "--out", str(tmp_path / "bench"))
    assert_one_line(code, err, "--jobs", "99")
    if not torch.cuda.is_available():
        code, _, err, _ = shell("tools/bench.py", "gpu")
        assert_one_line(code, err, "CUDA")


# ----------------------------------------------------------------------------------------------
# The fault launcher against the real thing
# ----------------------------------------------------------------------------------------------
PROBE = """
import json, os, shutil, sys
import torch
from safetensors.torch import save_file


def outcome(f):
    try:
        f()
        return "ok"
    except Exception as e:
        return f"{type(e).__name__} {getattr(e, 'errno', None) or ''}".strip()


def probe(d):
    t = {"w": torch.zeros(50_000)}  # 200 KB: more than the full disk's free space
    seen = {"open": outcome(lambda: open(f"{d}/a.txt", "w").write("x" * 300_000)),
            "makedirs": outcome(lambda: os.makedirs(f"{d}/sub/deeper")),
            "makedirs existing": outcome(lambda: os.makedirs(d, exist_ok=True)),
            "safetensors": outcome(lambda: save_file(t, f"{d}/w.safetensors")),
            "torch.save": outcome(lambda: torch.save(t, f"{d}/s.pt")),
            "replace": outcome(lambda: os.replace(f"{d}/old", f"{d}/new")),
            "remove": outcome(lambda: os.remove(f"{d}/old")),
            "rmtree": outcome(lambda: shutil.rmtree(f"{d}/tree")),
            "writable": os.access(d, os.W_OK),
            "read-only flag": bool(os.statvfs(d).f_flag & os.ST_RDONLY),
            "under 100 KB free": os.statvfs(d).f_bavail * os.statvfs(d).f_frsize < 100_000}
    seen["left"] = sorted(os.listdir(d))
    return seen


print(json.dumps({d: probe(d) for d in sys.argv[1:]}))
"""


def test_the_fault_launcher_fails_as_a_real_mount_does(tmp_path):
    """tests/faults.py against a real read-only tmpfs and a full 64 KB one: the same outcome (error
    type and errno, or success; files left; os.access, statvfs) for each way the project writes.
    Needs mount privileges (root with CAP_SYS_ADMIN); skipped where mounting is not allowed."""
    real_ro, real_full, fake_ro, fake_full = (tmp_path / n for n in ("real_ro", "real_full", "ro", "full"))
    mounted = []
    try:
        for folder, limit in ((real_ro, "1m"), (real_full, "64k")):
            folder.mkdir()
            mount = ["mount", "-t", "tmpfs", "-o", f"size={limit}", "tmpfs", str(folder)]
            if not shutil.which("mount") or subprocess.run(mount, capture_output=True).returncode:
                pytest.skip("mounting a tmpfs is not allowed here")
            mounted.append(folder)
        for folder in (real_ro, real_full, fake_ro, fake_full):
            (folder / "tree" / "x").mkdir(parents=True)
            (folder / "old").touch()
        subprocess.run(["mount", "-o", "remount,ro", str(real_ro)], check=True)
        (tmp_path / "probe.py").write_text(PROBE)
        folders = [str(f) for f in (real_ro, fake_ro, real_full, fake_full)]
        code, out, err, _ = faulty("--read-only", str(fake_ro), "--disk-full", str(fake_full), "--free",
                                   "65536", "--", str(tmp_path / "probe.py"), *folders)
        assert code == 0, err[-2000:]
        seen = json.loads(out)
        assert seen[str(fake_ro)] == seen[str(real_ro)]
        assert seen[str(fake_full)] == seen[str(real_full)]
    finally:
        for folder in reversed(mounted):
            subprocess.run(["umount", str(folder)], capture_output=True)
