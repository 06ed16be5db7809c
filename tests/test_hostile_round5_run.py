"""Hostile cases, round 5 (issue 44), the run's part: a resume never loses a log, everything read back
from a run is checked before it is used, evaluate.py checks an adapter before any model loads, every
line tells the truth, and bench.py reads its trainer flags. Each test holds one of the issue's cases
through the command line (the script's cli.command(main) in this process), as tests/test_hostile.py
and tests/test_hostile_round4.py do for the earlier rounds.

A run's checkpoints are the folders RUN/checkpoints/iter_NNNNNN: a save writes iter_NNNNNN.tmp and
renames it into place. The kill points are tested by building the states a kill leaves."""
import importlib.util
import json
import os
import shutil
import sys

import pytest
import torch

import bench
import evaluate
import run as run_module
from conftest import read_metrics
from test_bad_input import assert_one_line, error_lines, tiny
from test_hostile import command, copy_run, produce

CHECKPOINT = os.path.join("checkpoints", "iter_{:06d}")


@pytest.fixture(scope="module")
def two_checkpoints(tiny_model_dir, personas_file, tmp_path_factory):
    """A PPO run of 2 iterations with a checkpoint after each (not itself a case)."""
    out = tmp_path_factory.mktemp("r5") / "run"
    produce("ppo.py", *tiny(tiny_model_dir, personas_file, out, "--iterations", "2", "--save-every", "1"))
    return out


def resume(capsys, run, *extra):
    return command(capsys, "ppo.py", "--resume", str(run), "--iterations", "3", *extra)


def checkpoint(run, n):
    return run / CHECKPOINT.format(n)


def resumed_from(err, run, n):
    return f"resuming {run} from {checkpoint(run, n)}" in err


def lines(path):
    return path.read_bytes().splitlines(keepends=True)


# ----------------------------------------------------------------------------------------------
# 1. The checkpoints are the folders: no list beside them can disagree, no log is lost
# ----------------------------------------------------------------------------------------------
LISTS = {  # a checkpoints.txt an older save left beside the folders (the run reads none)
    "naming only the older": b"iter_000001\n",  # a kill between the rename and the list's append
    "empty": b"",
    "in another order": b"iter_000002\niter_000001\n",
    "not UTF-8": b"iter_000001\n\xff\xfe\n",
}


@pytest.mark.parametrize("kind", [*LISTS, "a folder"])
def test_the_newest_checkpoint_folder_is_resumed_whatever_a_list_beside_it_says(kind, two_checkpoints,
                                                                               tmp_path, capsys):
    run = copy_run(two_checkpoints, tmp_path)
    listed = run / "checkpoints.txt"
    shutil.rmtree(listed, ignore_errors=True)
    listed.unlink(missing_ok=True)
    if kind == "a folder":
        listed.mkdir()
    else:
        listed.write_bytes(LISTS[kind])
    rollouts = lines(run / "rollouts.jsonl")
    code, _, err, _ = resume(capsys, run)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    assert resumed_from(err, run, 2)
    assert [m["iteration"] for m in read_metrics(run)] == [1, 2, 3]
    assert lines(run / "rollouts.jsonl")[:len(rollouts)] == rollouts  # nothing of iterations 1-2 lost


@pytest.mark.parametrize("kind", ["not UTF-8", "naming only the older"])
def test_evaluate_takes_a_runs_newest_checkpoint_folder(kind, two_checkpoints, tmp_path):
    run = copy_run(two_checkpoints, tmp_path)
    (run / "checkpoints.txt").write_bytes(LISTS[kind])
    args = evaluate.parse_args(["--adapter", str(run)])
    assert args.adapter == [str(checkpoint(run, 2) / "default")]


def test_a_save_killed_while_writing_leaves_a_tmp_folder_the_next_save_replaces(two_checkpoints, tmp_path,
                                                                                 capsys):
    run = copy_run(two_checkpoints, tmp_path)
    killed = run / (CHECKPOINT.format(3) + ".tmp")  # what a kill in the save of iteration 3 left
    shutil.copytree(checkpoint(run, 2), killed)
    (killed / "state.pt").write_bytes(b"half")
    (killed / "from_the_killed_save").write_text("x")
    code, _, err, _ = resume(capsys, run)
    assert code == 0, err[-2000:]
    assert not killed.exists() and sorted(os.listdir(checkpoint(run, 3))) == sorted(
        os.listdir(checkpoint(run, 2)))  # a checkpoint holds what one save wrote, nothing else
    assert [m["iteration"] for m in read_metrics(run)] == [1, 2, 3]


def test_a_save_killed_after_the_rename_before_the_pruning(two_checkpoints, tmp_path, capsys):
    # iteration 2's checkpoint was renamed into place, iteration 1's not yet pruned (--keep-checkpoints
    # 1), and a list an older save kept names only iteration 1
    run = copy_run(two_checkpoints, tmp_path)
    (run / "checkpoints.txt").write_bytes(LISTS["naming only the older"])
    code, _, err, _ = resume(capsys, run, "--keep-checkpoints", "1")
    assert code == 0, err[-2000:]
    assert resumed_from(err, run, 2)
    assert os.listdir(run / "checkpoints") == ["iter_000003"]
    assert [m["iteration"] for m in read_metrics(run)] == [1, 2, 3]


def test_a_save_killed_while_pruning(two_checkpoints, tmp_path, capsys):
    # the pruning of iteration 1's checkpoint stopped half way: its state.pt and policy are gone
    run = copy_run(two_checkpoints, tmp_path)
    (run / "checkpoints.txt").write_bytes(LISTS["naming only the older"])
    for part in ("state.pt", "default"):
        shutil.rmtree(checkpoint(run, 1) / part, ignore_errors=True)
        (checkpoint(run, 1) / part).unlink(missing_ok=True)
    code, _, err, _ = resume(capsys, run, "--keep-checkpoints", "1")
    assert code == 0, err[-2000:]
    assert resumed_from(err, run, 2)
    # the remains hold no state.pt, so they are never taken for a checkpoint to delete
    assert sorted(os.listdir(run / "checkpoints")) == ["iter_000001", "iter_000003"]
    assert [m["iteration"] for m in read_metrics(run)] == [1, 2, 3]


def test_a_broken_checkpoint_that_cannot_be_moved_aside_is_one_line_and_nothing_is_cut(two_checkpoints,
                                                                                       tmp_path, capsys):
    run = copy_run(two_checkpoints, tmp_path)
    (checkpoint(run, 2) / "state.pt").write_bytes(b"broken")
    earlier = run / (CHECKPOINT.format(2) + ".broken")  # an earlier broken copy, kept
    (earlier / "notes").mkdir(parents=True)
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "rollouts.jsonl")}
    code, _, err, _ = resume(capsys, run)
    assert_one_line(code, err, str(checkpoint(run, 2)), "does not load", "cannot be moved", str(earlier),
                    f"python ppo.py --resume {run}")
    assert "warning:" not in err  # no line claims it was moved
    assert {name: (run / name).read_bytes() for name in before} == before
    assert (checkpoint(run, 2) / "state.pt").exists() and (earlier / "notes").is_dir()


# ----------------------------------------------------------------------------------------------
# 2. state.pt's layout is checked before anything of it is used
# ----------------------------------------------------------------------------------------------
def not_a_dict(state):
    return 5


def without_log_sizes(state):
    del state["log_sizes"]
    return state


def rng_of_strings(state):
    return {**state, "rng": ["x"]}


def a_log_size_as_text(state):
    return {**state, "log_sizes": {**state["log_sizes"], "metrics.jsonl": "12"}}


@pytest.mark.parametrize("damage, words", [(not_a_dict, "not a dict"), (without_log_sizes, "'log_sizes'"),
                                           (rng_of_strings, "'rng'"), (a_log_size_as_text, "'log_sizes'")])
def test_a_state_of_another_layout_is_a_broken_checkpoint(damage, words, two_checkpoints, tmp_path, capsys):
    run = copy_run(two_checkpoints, tmp_path)
    path = checkpoint(run, 2) / "state.pt"
    torch.save(damage(torch.load(path, weights_only=False)), path)
    code, _, err, _ = resume(capsys, run)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and str(path) in warnings[0] and words in warnings[0], warnings
    assert resumed_from(err, run, 1)
    assert [m["iteration"] for m in read_metrics(run)] == [1, 2, 3]


# ----------------------------------------------------------------------------------------------
# 5. evaluate.py checks the adapter folder before any model loads
# ----------------------------------------------------------------------------------------------
def no_model_loads(monkeypatch):
    def loaded(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(evaluate, "load_policy", loaded)


def config_text(text):
    return lambda adapter: (adapter / "adapter_config.json").write_text(text)


def config_edit(**fields):
    def edit(adapter):
        config = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return edit


def weights(data):
    def write(adapter):
        (adapter / "adapter_model.safetensors").unlink()
        if data is not None:
            (adapter / "adapter_model.safetensors").write_bytes(data)
    return write


@pytest.mark.parametrize("damage, file, words", [
    (config_text("{"), "adapter_config.json", "not valid JSON"),
    (config_text("[1]"), "adapter_config.json", "LoRA"),
    (config_edit(peft_type="IA3"), "adapter_config.json", "LoRA"),
    (config_edit(target_modules=["q_proj", "nope"]), "adapter_config.json", "'nope' is no layer"),
    (weights(None), "adapter_model.safetensors", "missing"),
    (weights(b"{"), "adapter_model.safetensors", "not a safetensors file"),
], ids=["broken JSON", "not an object", "not LoRA", "another model's layers", "no weights", "not weights"])
def test_a_bad_adapter_is_one_line_before_any_model_loads(damage, file, words, two_checkpoints, tmp_path,
                                                          capsys, monkeypatch, tiny_model_dir, personas_file):
    adapter = tmp_path / "adapter"
    shutil.copytree(checkpoint(two_checkpoints, 2) / "default", adapter)
    damage(adapter)
    no_model_loads(monkeypatch)
    code, _, err, _ = command(capsys, "evaluate.py", "--model", tiny_model_dir, "--adapter", str(adapter),
                              "--personas", personas_file, "--simulator", "rules",
                              "--out", str(tmp_path / "e"))
    assert_one_line(code, err, str(adapter / file), words)
    assert not (tmp_path / "e").exists()


def test_a_role_file_with_a_line_break_is_read_stripped(two_checkpoints, tmp_path, tiny_model_dir):
    adapter = tmp_path / "adapter"
    shutil.copytree(checkpoint(two_checkpoints, 2) / "default", adapter)
    (adapter / "role").write_text("default\n")
    args = evaluate.parse_args(["--model", tiny_model_dir, "--adapter", str(adapter)])
    assert args.adapter == [str(adapter)]


# ----------------------------------------------------------------------------------------------
# 6. Every line tells the truth
# ----------------------------------------------------------------------------------------------
def test_a_run_made_by_no_trainer_is_not_told_to_resume_with_it(two_checkpoints, tmp_path, capsys):
    run = copy_run(two_checkpoints, tmp_path)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "script": "evaluate.py"}))
    code, _, err, _ = resume(capsys, run)
    assert_one_line(code, err, "evaluate.py", "not a training run")
    assert "--resume" not in error_lines(err)[0].split("evaluate.py", 1)[1]


def test_after_the_run_folder_is_deleted_the_advice_is_a_new_run_and_that_works(tiny_model_dir,
                                                                                personas_file, tmp_path,
                                                                                monkeypatch, capsys):
    out, real = tmp_path / "run", run_module.Run.save_if_due

    def then_deleted(self):  # someone removes the folder after the first iteration
        real(self)
        shutil.rmtree(out)
    monkeypatch.setattr(run_module.Run, "save_if_due", then_deleted)
    argv = tiny(tiny_model_dir, personas_file, out, "--iterations", "2")
    code, _, err, _ = command(capsys, "ppo.py", *argv)
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 1 and len(line) == 1, err[-2000:]
    assert "--resume" not in line[0] and "start a new run" in line[0] and "`python ppo.py`" in line[0]
    monkeypatch.undo()
    code, _, err, _ = command(capsys, "ppo.py", *argv)  # the new run, with the flags it was started with
    assert code == 0, err[-2000:]
    assert [m["iteration"] for m in read_metrics(out)] == [1, 2]


def two_processes(monkeypatch):
    import accelerate

    monkeypatch.setattr(accelerate.Accelerator, "num_processes", property(lambda self: 2))


SAVED = [  # (config.json's edits, what else the case needs, the words of the line besides config.json)
    ({"max_context": 6}, None, ["'max_context'", "--max-context 6"]),                # DialogueSettings.check
    ({"dialogues_per_iteration": 3}, None, ["'dialogues_per_iteration'", "--minibatch-size 2"]),  # PPO's
    ({"personas": "/nonexistent/personas.json"}, None, ["'personas'", "/nonexistent/personas.json"]),
    ({"target_modules": "q_proj,nope"}, None, ["'target_modules'", "'nope' is no layer"]),  # check_model
    ({"dialogues_per_iteration": 3, "minibatch_size": 1}, two_processes,
     ["'dialogues_per_iteration'", "divide by the 2 processes"]),                             # Run's
    ({"report_to": "wandb"}, None, ["'report_to'", "pip install wandb"]),                     # Run's tracker
]


@pytest.mark.parametrize("edits, setup, words", SAVED, ids=["joint check", "trainer's check", "path",
                                                          "model check", "processes", "tracker"])
def test_a_bad_value_from_config_json_names_the_file_and_field(edits, setup, words, two_checkpoints, tmp_path,
                                                               capsys, monkeypatch):
    if "report_to" in edits and importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    run = copy_run(two_checkpoints, tmp_path)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, **edits}))
    if setup:
        setup(monkeypatch)
    before = (run / "metrics.jsonl").read_bytes()
    code, _, err, _ = resume(capsys, run)
    assert_one_line(code, err, f"{run}/config.json", *words)
    assert (run / "metrics.jsonl").read_bytes() == before


# ----------------------------------------------------------------------------------------------
# 7. bench.py reads the flags it hands a trainer
# ----------------------------------------------------------------------------------------------
def test_the_gpu_checks_trainer_flags_are_checked_before_any_step(tmp_path, capsys, monkeypatch):
    def ran(*a, **k):
        raise AssertionError("a step ran")
    monkeypatch.setattr(bench, "run_command", ran)
    out = tmp_path / "check"
    code, _, err, _ = command(capsys, "tools/bench.py", "gpu", "--check", "--dry-run", "--steps", "versions",
                              "--out", str(out), "--", "--bogus-flag", "3")
    assert_one_line(code, err, "unrecognized arguments: --bogus-flag 3")
    assert not out.exists()


def test_the_gpu_check_hands_its_trainer_flags_to_the_bench_gpu_step(tmp_path, capsys, monkeypatch):
    commands = []

    def ran(command, log=None, cores=None, timeout=None, env=None):
        commands.append(command)
        with open(log, "w") as f:
            f.write('{"policy_tokens": 8}\n')
        return 0
    monkeypatch.setattr(bench, "run_command", ran)
    code, _, err, _ = command(capsys, "tools/bench.py", "gpu", "--check", "--dry-run", "--steps", "bench-gpu",
                              "--out", str(tmp_path / "check"), "--", "--max-new-tokens", "2")
    assert code == 0, err[-2000:]
    assert commands == [[sys.executable, "tools/bench.py", "gpu", "--tiny", "--", "--max-new-tokens", "2"]]


def test_learnings_trainer_flags_are_checked_before_any_run(tmp_path, capsys, monkeypatch):
    def ran(*a, **k):
        raise AssertionError("a run started")
    monkeypatch.setattr(bench, "run_command", ran)
    out = tmp_path / "bench"
    code, _, err, _ = command(capsys, "tools/bench.py", "learning", "--out", str(out), "--iterations", "2",
                              "--window", "1", "--", "--bogus-flag", "3")
    assert_one_line(code, err, "unrecognized arguments: --bogus-flag 3")
    assert not out.exists()
