"""The run folder by construction (issue 31) and the stop lines that must tell the truth (issue 30).

A new run creates its folder (an existing non-empty --out is refused); --resume DIR is the one way back
in, and it keeps the run's settings; a folder being written holds an flock; pruning deletes only the
checkpoints the run wrote. A full disk, non-finite weights, Ctrl-C and SIGTERM end with one line that
names what holds and a command that works, and each command is run here."""
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import ppo
import cli
from conftest import ROOT, read_metrics

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def tiny(model_dir, personas, out, *extra):
    return ["--preset", "cpu", "--model", model_dir, "--simulator", "rules", "--personas", personas,
            "--split", "test", "--dialogues-per-iteration", "2", "--minibatch-size", "2",
            "--micro-batch-size", "1", "--max-turns", "2", "--max-new-tokens", "6", "--max-context", "512",
            "--lora-r", "4", "--lora-alpha", "8", "--out", str(out), *extra]


def one_line(err):
    """The one error line a refused command printed (and that there is exactly one, with no traceback)."""
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def refused(capsys, *argv):
    with pytest.raises(SystemExit) as stop:
        cli.command(ppo.main)(list(argv))
    assert stop.value.code == 2
    return one_line(capsys.readouterr().err)


def shell(*argv, timeout=600):
    """python ARGV in the project's root: (exit code, stderr)."""
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=ENV,
                          timeout=timeout)
    return proc.returncode, proc.stderr


def snapshot(folder):
    """Every file under folder with a digest of its bytes."""
    seen = {}
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                seen[os.path.relpath(os.path.join(root, name), folder)] = hashlib.sha256(f.read()).hexdigest()
    return seen


def test_a_run_creates_its_folder_and_refuses_one_that_holds_anything(tiny_model_dir, personas_file, tmp_path,
                                                                     capsys):
    out = tmp_path / "deep" / "run"
    ppo.main(tiny(tiny_model_dir, personas_file, out, "--iterations", "1"))
    assert json.load(open(out / "config.json"))["script"] == "ppo.py"  # the run's mark
    before = snapshot(out)
    line = refused(capsys, *tiny(tiny_model_dir, personas_file, out, "--iterations", "1"))
    assert f"--out {out} exists" in line and "--resume" in line
    assert snapshot(out) == before  # nothing of the run was touched
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    line = refused(capsys, *tiny(tiny_model_dir, personas_file, foreign))
    assert "exists and is not an empty folder" in line
    assert snapshot(foreign) == {"keep.txt": hashlib.sha256(b"mine").hexdigest()}
    (tmp_path / "a_file").write_text("x")
    line = refused(capsys, *tiny(tiny_model_dir, personas_file, tmp_path / "a_file"))
    assert "is not an empty folder" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    ppo.main(tiny(tiny_model_dir, personas_file, empty, "--iterations", "1"))  # an empty folder is taken
    assert [m["iteration"] for m in read_metrics(empty)] == [1]


def test_an_out_inside_a_run_folder_is_refused(tiny_model_dir, personas_file, tmp_path, capsys):
    # issue 30 item 11: a run made in R/checkpoints/iter_000009 took the name of R's next checkpoint
    outer = tmp_path / "outer"
    ppo.main(tiny(tiny_model_dir, personas_file, outer, "--iterations", "1"))
    inner = outer / "checkpoints" / "iter_000009"
    line = refused(capsys, *tiny(tiny_model_dir, personas_file, inner))
    assert "inside the run folder" in line and str(outer) in line
    assert not inner.exists()


def test_pruning_deletes_only_the_checkpoints_this_run_wrote(tiny_model_dir, personas_file, tmp_path):
    out = tmp_path / "run"
    ppo.main(tiny(tiny_model_dir, personas_file, out, "--iterations", "1", "--save-every", "1"))
    foreign = out / "checkpoints" / "iter_000000"  # named like a checkpoint, older than every one of the run
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not the run's")
    ppo.main(tiny(tiny_model_dir, personas_file, out, "--iterations", "4", "--save-every", "1",
                  "--keep-checkpoints", "2", "--resume", str(out)))
    assert sorted(os.listdir(out / "checkpoints")) == ["iter_000000", "iter_000003", "iter_000004"]
    assert (foreign / "notes.txt").read_text() == "not the run's"


def test_a_second_writer_stops_with_one_line(tiny_model_dir, personas_file, tmp_path, capsys):
    out = tmp_path / "run"
    ppo.main(tiny(tiny_model_dir, personas_file, out, "--iterations", "1"))
    holder = os.open(out, os.O_RDONLY)  # what a running resume of the folder holds
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        argv = tiny(tiny_model_dir, personas_file, out, "--iterations", "2", "--resume", str(out))
        line = refused(capsys, *argv)
    finally:
        os.close(holder)
    assert "being written by another process" in line
    assert [m["iteration"] for m in read_metrics(out)] == [1]


def test_resume_keeps_the_runs_settings_and_lets_only_some_change(tiny_model_dir, personas_file, tmp_path,
                                                                  capsys):
    out = tmp_path / "run"
    ppo.main(tiny(tiny_model_dir, personas_file, out, "--iterations", "1", "--lr", "3e-4"))
    line = refused(capsys, "--resume", str(out), "--lr", "1e-3")
    assert "--lr 0.001" in line and "keeps it" in line and "iterations" in line
    line = refused(capsys, "--resume", str(out), "--out", str(tmp_path / "elsewhere"))
    assert line.startswith(f"error: --out {tmp_path / 'elsewhere'} with --resume") and "own folder" in line
    assert "not a run folder" in refused(capsys, "--resume", str(tmp_path))
    ppo.main(["--resume", str(out), "--iterations", "2"])  # every other setting is the run's own
    config = json.load(open(out / "config.json"))
    assert (config["lr"], config["iterations"], config["model"]) == (3e-4, 2, tiny_model_dir)
    assert [m["iteration"] for m in read_metrics(out)] == [1, 2]


def test_a_full_disk_at_the_first_checkpoint_says_to_start_again_and_that_works(tiny_model_dir, personas_file,
                                                                                tmp_path):
    # issue 30 item 13: before any checkpoint the line must not point at a checkpoint that is not there
    out = tmp_path / "run"
    out.mkdir()
    argv = tiny(tiny_model_dir, personas_file, out, "--iterations", "2", "--save-every", "2")
    code, err = shell(os.path.join("tests", "faults.py"), "--disk-full", str(out), "--free", "60000", "--",
                    "ppo.py", *argv)
    line = one_line(err)
    assert code == 1 and "the disk is full" in line and "no checkpoint yet" in line, err[-2000:]
    command = line.split("`")[1]
    assert command == f"python ppo.py --resume {out}"
    assert not (out / "checkpoints" / "iter_000002.tmp").exists()
    code, err = shell(*command.split()[1:])
    assert code == 0, err[-2000:]
    assert [m["iteration"] for m in read_metrics(out)] == [1, 2]


def test_sigterm_while_a_checkpoint_is_written_names_it_and_the_resume_works(tiny_model_dir, personas_file,
                                                                            tmp_path):
    # issue 30 item 13: a SIGTERM during the last checkpoint of a 2-iteration run said "in iteration 3"
    out = tmp_path / "run"
    launcher = ("import os, runpy, signal, sys, torch\n"
                "def killed(*a, **k):\n"
                "    os.kill(os.getpid(), signal.SIGTERM)\n"
                "torch.save = killed\n"
                "sys.argv = ['ppo.py', *sys.argv[1:]]\n"
                "runpy.run_path('ppo.py', run_name='__main__')\n")
    code, err = shell("-c", launcher, *tiny(tiny_model_dir, personas_file, out, "--iterations", "2",
                                          "--save-every", "2"))
    assert code == 143, err[-2000:]
    line = next(line for line in err.splitlines() if line.startswith("stopped by SIGTERM"))
    assert "while the checkpoint of iteration 2 was written" in line and "no checkpoint yet" in line
    code, err = shell(*line.split("`")[1].split()[1:])
    assert code == 0, err[-2000:]
    assert os.listdir(out / "checkpoints") == ["iter_000002"]
    assert [m["iteration"] for m in read_metrics(out)] == [1, 2]


def test_ctrl_c_in_an_iteration_names_it_and_the_resume_goes_on(tiny_model_dir, personas_file, tmp_path):
    out = tmp_path / "run"
    argv = tiny(tiny_model_dir, personas_file, out, "--iterations", "20", "--save-every", "1")
    proc = subprocess.Popen([sys.executable, "ppo.py", *argv],
                            cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while not (out / "checkpoints" / "iter_000001").exists() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130, err[-2000:]
    line = next(line for line in err.splitlines() if line.startswith("stopped by SIGINT"))
    # the signal lands in an iteration, or (as it may on a fast machine) in a checkpoint's save
    assert re.search(r"(in iteration \d+|while the checkpoint of iteration \d+ was written) of",
                     line), line
    assert "the newest complete checkpoint is" in line
    assert err.endswith(line + "\n")  # the last line: no progress bar drawn again under it
    # the run folder keeps it (summary.txt: a line each time the run's process ended, with its time)
    kept = (out / "summary.txt").read_text().splitlines()
    assert kept[-1].split(" ", 2)[2] == "stopped by Ctrl-C or SIGTERM" + line[len("stopped by SIGINT"):]
    code, err = shell(*line.split("`")[1].split()[1:])
    assert code == 0, err[-2000:]
    assert [m["iteration"] for m in read_metrics(out)] == list(range(1, 21))
    kept = (out / "summary.txt").read_text().splitlines()
    assert len(kept) == 2 and kept[1].split(" ", 2)[2].startswith(f"done: {out}: 20 iterations in ")


@pytest.mark.parametrize("omp", [False, True])
def test_a_command_takes_half_the_usable_cores_unless_omp_num_threads_says(omp):
    """cli.use_cpu_threads (each script's command line): half the cores this process may use, at
    least one; OMP_NUM_THREADS wins."""
    half = str(max(1, len(os.sched_getaffinity(0)) // 2))
    env = {k: v for k, v in ENV.items() if k != "OMP_NUM_THREADS"}
    if omp:  # a count other than half (torch takes at most the cores there are)
        env["OMP_NUM_THREADS"] = "2" if half == "1" else "1"
    code = "import torch, cli; cli.use_cpu_threads(); print(torch.get_num_threads())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.stdout.split() == [env.get("OMP_NUM_THREADS", half)], done.stderr[-2000:]


def test_non_finite_weights_are_never_a_checkpoint(tiny_model_dir, personas_file, tmp_path):
    out = tmp_path / "run"
    first = out / "checkpoints" / "iter_000001"
    code, err = shell(os.path.join("tests", "faults.py"), "--nan-after", str(first), "--", "ppo.py",
                    *tiny(tiny_model_dir, personas_file, out, "--iterations", "2", "--save-every", "1"))
    line = one_line(err)
    assert code == 1 and "NaN or infinity" in line, err[-2000:]
    assert f"newest complete checkpoint is {first}" in line, err[-2000:]
    assert os.listdir(out / "checkpoints") == ["iter_000001"]
    assert (out / "summary.txt").read_text().splitlines()[-1].split(" ", 2)[2] == line


def test_a_stop_line_is_the_last_thing_drawn_below_an_open_bar(capsys):
    """A command that stops while its progress bar is open prints the stop line last: the bar is
    closed first (its last state stays above the line) and nothing redraws it under the line, not
    even the bar's own clean-up when the stopped main() lets go of it."""
    from tqdm import tqdm

    def main(argv):
        bar = tqdm(total=10, desc="rollout", file=sys.stderr)
        bar.update(3)
        cli.fail("--lr 5: must be at most 1")

    with pytest.raises(SystemExit) as stopped:
        cli.command(main)([])
    err = capsys.readouterr().err
    assert stopped.value.code == 2
    assert "rollout" in err and "3/10" in err  # the bar was drawn, above the line
    assert err.endswith("error: --lr 5: must be at most 1\n"), repr(err[-200:])
