"""Hostile cases, round 4 (issue 37): nothing on disk or on the command line is trusted, and every
command ends in one line. Each test holds one of the issue's cases, through the command line (the
script's main(argv) in this process, or a subprocess where the process is part of the case), as
tests/test_hostile.py does for the earlier rounds."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from client import OpenAIBackend
from personas import load_personas
import simulator
from conftest import ROOT, read_metrics, reply
from test_bad_input import ENV, assert_one_line, tiny
from test_hostile import command, copy_run, produce

KEY = "sk-abcdefghijklmnop1234"


@pytest.fixture(scope="module")
def two_checkpoints(tiny_model_dir, personas_file, tmp_path_factory):
    """A PPO run of 2 iterations with a checkpoint after each (not itself a case)."""
    out = tmp_path_factory.mktemp("r4") / "run"
    produce("ppo.py", *tiny(tiny_model_dir, personas_file, out, "--iterations", "2", "--save-every", "1"))
    return out


def resume(capsys, run, *extra):
    return command(capsys, "ppo.py", "--resume", str(run), "--iterations", "3", *extra)


# ----------------------------------------------------------------------------------------------
# 1. No secret on any output
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [["--report-to", KEY], [f"--lerning-rate={KEY}"], [KEY]])
def test_no_secret_in_argparses_own_errors(argv, capsys):
    code, out, err, _ = command(capsys, "ppo.py", *argv)
    assert code == 2 and KEY not in out + err and "<redacted>" in err, err


def test_a_servers_echo_of_the_key_is_never_stored(server, persona_entry, write_personas, monkeypatch):
    """A proxy that echoes the Authorization header: what is stored holds no key, whatever its form. The
    reply is refused (issue 61: it was scrubbed, which rewrote text equal to the key), retried, then one
    line naming the server, never the key."""
    monkeypatch.setenv("OPENAI_API_KEY", "plainsecret7")
    srv = server(lambda handler, n, body: reply(handler, 200, json.dumps({"choices": [{"message": {
        "content": f"seen {handler.headers['Authorization']}\nChange: +1"}}]}).encode()))
    persona = load_personas(write_personas([persona_entry()]))[0]
    sim = simulator.Simulator(OpenAIBackend(srv.url, max_retries=1, backoff=0.01), max_turns=1)
    state = sim.start(persona)
    with pytest.raises(simulator.SimulatorError) as error:
        sim.step([state], ["hello"])
    assert "plainsecret7" not in str(error.value) and "after 2 tries" in str(error.value)
    assert srv.count == 2 and state.appraisals == [] and state.emotion == 40


# ----------------------------------------------------------------------------------------------
# 2. Resume trusts nothing it did not check
# ----------------------------------------------------------------------------------------------
def test_a_folder_moved_in_that_does_not_load_is_named_moved_aside_and_the_one_before_taken(
        two_checkpoints, tmp_path, capsys):
    # the checkpoints are the folders named iter_NNNNNN: a stranger moved in (here a whole run folder) is
    # tried first, as the newest, and does not load (a name past --iterations is refused: issue 55)
    run = copy_run(two_checkpoints, tmp_path)
    stranger = run / "checkpoints" / "iter_000003"
    shutil.copytree(two_checkpoints, stranger)
    code, _, err, _ = resume(capsys, run)
    assert code == 0, err[-2000:]
    assert f"the checkpoint {stranger} does not load" in err and f"moved to {stranger}.broken" in err
    assert f"from {run}/checkpoints/iter_000002" in err
    assert [m["iteration"] for m in read_metrics(run)] == [1, 2, 3]
    assert (run / "checkpoints" / "iter_000003.broken" / "config.json").exists()  # kept, out of the way


@pytest.mark.parametrize("damage", ["truncated state", "truncated adapter", "another trainer's state"])
def test_a_checkpoint_that_does_not_load_is_named_and_the_one_before_is_taken(damage, two_checkpoints,
                                                                              tmp_path, capsys):
    run = copy_run(two_checkpoints, tmp_path)
    newest = run / "checkpoints" / "iter_000002"
    path = {"truncated state": newest / "state.pt",
            "truncated adapter": newest / "default" / "adapter_model.safetensors"}.get(damage)
    if path:
        path.write_bytes(path.read_bytes()[:100])
    else:  # GRPO's state: no value head
        state = torch.load(newest / "state.pt", weights_only=False)
        del state["value_head"]
        torch.save(state, newest / "state.pt")
    code, _, err, _ = resume(capsys, run)
    assert code == 0 and "Traceback" not in err, err[-2000:]
    before = run / "checkpoints" / "iter_000001"
    assert f"the checkpoint {newest} does not load" in err and "from " + str(before) in err
    assert [m["iteration"] for m in read_metrics(run)] == [1, 2, 3]  # iteration 2 ran again, from 1


def test_no_checkpoint_that_loads_is_one_line(two_checkpoints, tmp_path, capsys):
    run = copy_run(two_checkpoints, tmp_path)
    for name in ("iter_000001", "iter_000002"):
        (run / "checkpoints" / name / "state.pt").write_bytes(b"broken")
    code, _, err, _ = resume(capsys, run)
    assert_one_line(code, err, "none of its 2 checkpoints loads")


@pytest.mark.parametrize("field, value, words", [("lr", "abc", ["'lr'", "'abc'", "must be float"]),
                                                 ("lr", -1.0, ["'lr'", "-1.0", "above 0"]),
                                                 ("max_turns", True, ["'max_turns'", "must be int"])])
def test_saved_settings_are_checked_as_flags_are(field, value, words, two_checkpoints, tmp_path, capsys):
    run = copy_run(two_checkpoints, tmp_path)
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, field: value}))
    code, _, err, _ = resume(capsys, run)
    assert_one_line(code, err, "config.json", *words)


def test_a_log_cut_shorter_than_its_checkpoint_is_never_appended_to(two_checkpoints, tmp_path, capsys):
    run = copy_run(two_checkpoints, tmp_path)
    log = run / "metrics.jsonl"
    cut = log.read_bytes()[:-40]  # the last line torn
    log.write_bytes(cut)
    code, _, err, _ = resume(capsys, run)
    assert_one_line(code, err, "metrics.jsonl", "shorter", "iter_000002")
    assert log.read_bytes() == cut  # nothing glued to it


# ----------------------------------------------------------------------------------------------
# 3. Paths mean one thing
# ----------------------------------------------------------------------------------------------
def test_resume_from_another_folder_uses_the_runs_own_files(tiny_model_dir, write_personas, persona_entry,
                                                            tmp_path, capsys):
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    shutil.copy(write_personas([persona_entry(id="mine")]), here / "p.json")
    shutil.copy(write_personas([persona_entry(id="stranger")], name="other.json"), elsewhere / "p.json")
    argv = tiny(tiny_model_dir, "p.json", "run", "--iterations", "1")
    code, _, err, _ = command(capsys, "ppo.py", *argv, cwd=here)
    assert code == 0, err[-2000:]
    config = json.loads((here / "run" / "config.json").read_text())
    assert (config["personas"], config["out"]) == (str(here / "p.json"), str(here / "run"))
    code, _, err, _ = command(capsys, "ppo.py", "--resume", str(here / "run"), "--iterations", "2",
                              cwd=elsewhere)
    assert code == 0, err[-2000:]
    with open(here / "run" / "rollouts.jsonl") as f:
        assert {json.loads(line)["persona_id"] for line in f} == {"mine"}


def test_a_linked_out_into_another_runs_checkpoints_is_refused(two_checkpoints, tmp_path, capsys,
                                                               tiny_model_dir, personas_file):
    link = tmp_path / "link"
    link.symlink_to(two_checkpoints / "checkpoints")
    code, _, err, _ = command(capsys, "ppo.py", *tiny(tiny_model_dir, personas_file, link / "new"))
    assert_one_line(code, err, "inside the run folder")


def test_a_run_folder_deleted_while_it_writes_ends_with_one_line(tiny_model_dir, personas_file, tmp_path,
                                                                 monkeypatch, capsys):
    import run as run_module

    # a relative --out: the parent of "run" is "", which never exists, so a search for the nearest
    # folder still there must start from the absolute path
    monkeypatch.chdir(tmp_path)
    out, real = "run", run_module.Run.save_if_due

    def then_deleted(self):  # someone removes the folder after the first iteration
        real(self)
        shutil.rmtree(out)
    monkeypatch.setattr(run_module.Run, "save_if_due", then_deleted)
    started = time.time()
    argv = tiny(tiny_model_dir, personas_file, out, "--iterations", "2")
    code, _, err, _ = command(capsys, "ppo.py", *argv)
    assert code == 1 and len([x for x in err.splitlines() if x.startswith("error:")]) == 1, err[-2000:]
    assert time.time() - started < 120


# ----------------------------------------------------------------------------------------------
# 4. Every number is in range and finite
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script, flags", [
    ("ppo.py", ["--seed", "-1"]),
    ("ppo.py", ["--seed", str(2**70)]),
    ("grpo.py", ["--kl-loss-coef", "inf"]),
    ("ppo.py", ["--ent-coef", "inf"]),
    ("ppo.py", ["--vf-coef", "inf"]),
    ("grpo.py", ["--format-penalty", "inf"]),
    ("ppo.py", ["--api-timeout", "1e300"]),
    ("evaluate.py", ["--seed", "-1"]),
    ("tools/bench.py", ["rollout", "--max-new-tokens", "100000000000"])])
def test_numbers_out_of_range_are_one_line_before_a_folder_is_made(script, flags, tmp_path, capsys):
    out = ["--out", str(tmp_path / "run")] * (script != "tools/bench.py")
    code, _, err, _ = command(capsys, script, *flags, *out)
    assert_one_line(code, err, flags[-2])
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------------------------
# 5. Hostile files are one line
# ----------------------------------------------------------------------------------------------
def deep(n=100_000):
    return "[" * n + "]" * n


@pytest.mark.parametrize("kind", ["personas deep", "profiles deep", "surrogate", "pipe"])
def test_hostile_persona_files_are_one_line_before_a_model_loads(kind, tmp_path, capsys, persona_entry):
    path = tmp_path / "p.json"
    if kind == "personas deep":
        path.write_text(deep())
    elif kind == "profiles deep":
        path.write_text('{"id": 1, "player": ' + deep() + "}\n")
    elif kind == "surrogate":  # an escape JSON allows and no tokenizer takes
        path.write_text(json.dumps([persona_entry()]).replace("i didn't get", "i didn\\ud800t get"))
    else:
        os.mkfifo(path)
    started = time.time()
    code, _, err, _ = command(capsys, "ppo.py", "--preset", "cpu", "--personas", str(path), "--split", "test",
                              "--out", str(tmp_path / "run"))
    assert_one_line(code, err, str(path))
    assert time.time() - started < 30 and not (tmp_path / "run").exists()


def test_a_recorded_file_nested_deep_is_one_line(tmp_path, capsys):
    path = tmp_path / "deep_result.jsonl"
    path.write_text('{"id": "x", "history": ' + deep() + "}\n")
    sage = os.path.join(ROOT, "tests", "data", "sage_sample.jsonl")
    code, _, err, _ = command(capsys, "evaluate.py", "--agreement", str(path), "--personas", sage,
                              "--simulator", "rules", "--out", str(tmp_path / "check"))
    assert_one_line(code, err, str(path), "nested too deep")


# ----------------------------------------------------------------------------------------------
# 6. Signals from the first line: model loading included
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("number, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_while_the_model_loads_is_one_line(number, code, tmp_path, personas_file):
    # evaluate.py's benchmark, stopped while its (here: slow) model loads
    script = ("import sys, time, evaluate, cli\n"
              "def slow(*a, **k):\n    print('loading', flush=True)\n    time.sleep(120)\n"
              "evaluate.load_models = slow\n"
              f"cli.command(evaluate.main)(['--personas', {personas_file!r}, '--simulator', 'rules', "
              f"'--out', {str(tmp_path / 'e')!r}])\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "loading"
    proc.send_signal(number)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code and "Traceback" not in err, err[-2000:]
    assert [line for line in err.splitlines() if line.startswith("stopped by")] == [
        f"stopped by {signal.Signals(number).name}"]


# ----------------------------------------------------------------------------------------------
# 7. evaluate.py knows what it scores
# ----------------------------------------------------------------------------------------------
def test_a_critic_copied_under_another_name_is_not_scored(two_checkpoints, tmp_path, capsys):
    copied = tmp_path / "value"
    shutil.copytree(two_checkpoints / "checkpoints" / "iter_000002" / "critic", copied)
    code, _, err, _ = command(capsys, "evaluate.py", "--adapter", str(copied), "--out", str(tmp_path / "e"))
    assert_one_line(code, err, "not a policy adapter")


def test_a_hard_link_of_a_recorded_file_is_the_same_file(tmp_path, capsys):
    original = os.path.join(ROOT, "tests", "data", "sage_results", "warm_result.jsonl")
    shutil.copy(original, tmp_path / "a_result.jsonl")
    os.link(tmp_path / "a_result.jsonl", tmp_path / "b_result.jsonl")
    sage = os.path.join(ROOT, "tests", "data", "sage_sample.jsonl")
    code, _, err, _ = command(capsys, "evaluate.py", "--agreement", str(tmp_path / "a_result.jsonl"),
                              str(tmp_path / "b_result.jsonl"), "--personas", sage,
                              "--simulator", "rules", "--out", str(tmp_path / "check"))
    assert_one_line(code, err, "b_result.jsonl", "again")


def test_an_adapter_of_a_run_is_judged_by_the_runs_own_user(two_checkpoints, tmp_path, capsys,
                                                            personas_file):
    code, _, err, _ = command(capsys, "evaluate.py", "--adapter", str(two_checkpoints),
                              "--personas", personas_file, "--dialogues", "1", "--max-turns", "1",
                              "--out", str(tmp_path / "e"))
    assert code == 0, err[-2000:]
    assert "simulator rules (read-out rules)" in err  # the run trained against the rules user
    assert json.loads((tmp_path / "e" / "results.json").read_text())["settings"]["simulator"] == "rules"


# ----------------------------------------------------------------------------------------------
# 8. bench.py gpu --check writes only its own files
# ----------------------------------------------------------------------------------------------
def test_the_gpu_check_never_replaces_a_file_that_is_not_its_own(two_checkpoints, tmp_path, capsys):
    # --out is a new folder, or an empty one (issue 55): a run's file is inside a run folder
    run = copy_run(two_checkpoints, tmp_path)
    before = (run / "config.json").read_bytes()
    code, _, err, _ = command(capsys, "tools/bench.py", "gpu", "--check", "--dry-run", "--steps", "versions",
                              "--out", str(run / "config.json"))
    assert_one_line(code, err, "config.json", "inside the run folder")
    assert (run / "config.json").read_bytes() == before
    folder = tmp_path / "results"
    folder.mkdir()
    code, _, err, _ = command(capsys, "tools/bench.py", "gpu", "--check", "--dry-run", "--steps", "versions",
                              "--out", str(folder))
    assert code == 0, err[-2000:]
    assert json.loads((folder / "check.json").read_text())["steps"][0]["name"] == "versions"
