"""Bad input never gives a wrong result, a hang or lost data (issue 16). Each test holds one case
of that issue: the flag or file a careless or hostile user could give, and what happens now.

Most settings cases end before any model loads, so they run in-process through each script's
main() (the code the command line runs); one of each kind also runs as a real subprocess."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT, reply

import run  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
import rollout  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def cli(*argv, timeout=300, env=None, cwd=ROOT):
    """Run a script as a user would; returns (returncode, stdout, the error lines of stderr, elapsed)."""
    t0 = time.time()
    done = subprocess.run([sys.executable, *argv], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env or ENV)
    return done.returncode, done.stdout, done.stderr, time.time() - t0


def error_lines(stderr):
    """The lines that start with error: (a progress bar may share the terminal line, after a \\r)."""
    return [line for line in re.split(r"[\r\n]", stderr) if line.startswith("error:")]


def assert_one_line(code, stderr, *words):
    """Exit code 2, exactly one error line holding every word, no traceback."""
    assert code == 2, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-2000:]
    for word in words:
        assert word in lines[0], (word, lines[0])


def exits_with_one_line(main, argv, capsys, *words):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert_one_line(stop.value.code, capsys.readouterr().err, *words)


def tiny(model_dir, personas, out, *extra, script="ppo"):
    """The smallest run of a trainer: tiny random Llama, rules user, one or two turns."""
    size = (["--dialogues-per-iteration", "2", "--minibatch-size", "2"] if script == "ppo" else
            ["--personas-per-iteration", "1", "--group-size", "2", "--minibatch-size", "2"])
    return ["--preset", "cpu", "--model", model_dir, "--simulator", "rules", "--personas", personas,
            "--split", "test", *size, "--micro-batch-size", "1", "--max-turns", "2", "--max-new-tokens", "6",
            "--max-context", "512", "--lora-r", "4", "--out", str(out), *extra]


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------------------------
# Cases 3, 4, 7, 12, 14, 16: every setting checked before any model loads
# ----------------------------------------------------------------------------------------------
BAD_SETTINGS = [  # (flags, words the error line must hold)
    (["--clip-low", "-1"], ["--clip-low", "-1", "(0, 1)"]),                              # 4
    (["--iterations", "0"], ["--iterations", "0", "at least 1"]),                            # 7
    (["--reward", "bogus"], ["--reward", "bogus", "final"]),                                 # 12
    (["--loss-agg", "dr-grpo"], ["--loss-agg", "dr-grpo", "token-mean"]),                    # 12: GRPO's only
    (["--lerning-rate", "1"], ["unknown flag --lerning-rate"]),                               # 12
    (["--max-turnz", "3"], ["unknown flag --max-turnz", "did you mean --max-turns"]),         # 12
    (["--save-every", "0"], ["--save-every", "0"]),                                           # 14
    (["--minibatch-size", "0"], ["--minibatch-size", "0"]),                                   # 14
    (["--micro-batch-size", "0"], ["--micro-batch-size", "0"]),                               # 14
    (["--dialogues-per-iteration", "0"], ["--dialogues-per-iteration", "0"]),                 # 14
    (["--temperature", "0"], ["--temperature", "0", "greater than 0"]),                       # 14
    (["--max-new-tokens", "0"], ["--max-new-tokens", "0"]),                                   # 14
]


@pytest.mark.parametrize("flags, words", BAD_SETTINGS, ids=[" ".join(f) for f, _ in BAD_SETTINGS])
def test_ppo_refuses_bad_settings_before_any_model_loads(flags, words, capsys, monkeypatch, tmp_path):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(ppo, "load_policy", no_model)
    exits_with_one_line(ppo.main, ["--preset", "cpu", "--out", str(tmp_path / "run"), *flags], capsys, *words)
    assert not os.path.exists(tmp_path / "run")
    if "sk-live" in " ".join(flags):
        assert "sk-live" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, words", [
    (["--group-size", "1"], ["--group-size", "1"]),
    (["--clip-low", "-1"], ["--clip-low"]),
    (["--loss-agg", "seq-mean-token-sum"], ["--loss-agg", "dr-grpo"]),
    (["--scale-rewards", "std"], ["--scale-rewards", "group"]),
    (["--personas-per-iteration", "0"], ["--personas-per-iteration"]),
    (["--max-context", "16"], ["--max-context 16", "--max-new-tokens"]),
])
def test_grpo_refuses_bad_settings(flags, words, capsys, tmp_path):
    argv = ["--preset", "cpu", "--out", str(tmp_path / "run"), *flags]
    exits_with_one_line(grpo.main, argv, capsys, *words)


@pytest.mark.parametrize("main, flags, words", [
    (rollout.main, ["--temperature", "-1"], ["--temperature"]),
    (rollout.main, ["--simulator", "rulez"], ["--simulator", "rulez"]),
])
def test_other_commands_refuse_bad_settings(main, flags, words, capsys):
    exits_with_one_line(main, flags, capsys, *words)


@pytest.mark.parametrize("script, flags, words", [
    ("ppo.py", ["--preset", "cpu", "--lerning-rate", "1"], ["unknown flag --lerning-rate"]),
    ("grpo.py", ["--preset", "cpu", "--simulator", "rulez"], ["--simulator", "rulez"]),
    ("rollout.py", ["--max-turns", "0"], ["--max-turns", "0"]),
])
def test_bad_settings_through_the_real_command_line(script, flags, words):
    code, _, err, elapsed = cli(script, *flags)
    assert_one_line(code, err, *words)
    assert elapsed < 40, elapsed  # no hub retries (they took 54 s for --simulator rulez)


def test_help_lists_the_choices():
    for script, choice in (("ppo.py", "{auto,reasoned,likelihood,rules}"), ("grpo.py", "{group,batch,none}")):
        code, out, err, _ = cli(script, "--help")
        assert code == 0 and choice in out.replace(" ", ""), err[-500:]


# ----------------------------------------------------------------------------------------------
# Cases 1 and 2: a run folder cannot be clobbered or silently changed
# ----------------------------------------------------------------------------------------------
def test_out_on_an_existing_run_stops_unless_overwrite(tiny_model_dir, personas_file, tmp_path, capsys):
    out = tmp_path / "run"
    grpo.main(tiny(tiny_model_dir, personas_file, out, "--iterations", "2", script="grpo"))
    before = {name: (out / name).read_bytes() for name in ("config.json", "metrics.jsonl", "rollouts.jsonl")}
    capsys.readouterr()
    again = tiny(tiny_model_dir, personas_file, out, "--iterations", "1", script="grpo")
    exits_with_one_line(grpo.main, again, capsys, "--out", "holds a run", "--resume", "--overwrite")
    assert {name: (out / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(out / "checkpoints")) == ["iter_000001", "iter_000002"]
    (out / "notes.txt").write_text("mine")
    grpo.main(tiny(tiny_model_dir, personas_file, out, "--iterations", "1", "--overwrite", script="grpo"))
    assert [m["iteration"] for m in read_jsonl(out / "metrics.jsonl")] == [1]
    assert sorted(os.listdir(out / "checkpoints")) == ["iter_000001"]  # the old run's iter_000002 is gone
    assert (out / "notes.txt").read_text() == "mine"  # only the run's own files are cleared


def test_resume_keeps_the_runs_settings_and_records_what_changed(tiny_model_dir, personas_file, tmp_path,
                                                                  capsys):
    out = tmp_path / "run"
    first = tiny(tiny_model_dir, personas_file, out, "--iterations", "1", "--lora-alpha", "32",
                 "--lr", "5e-4")
    ppo.main(first)
    # resumed without repeating them: the run's alpha and learning rate, not the defaults
    ppo.main(["--preset", "cpu", "--resume", str(out), "--iterations", "2"])
    config = json.loads((out / "config.json").read_text())
    assert config["lora_alpha"] == 32 and config["lr"] == 5e-4 and config["iterations"] == 2
    assert config["resumed_with"][-1]["changed"] == {"iterations": [1, 2]}
    state = torch.load(out / "checkpoints" / "iter_000002" / "state.pt", weights_only=False)
    assert state["args"]["lora_alpha"] == 32 and state["optimizer"]["param_groups"][0]["lr"] == 5e-4
    adapter = json.loads((out / "checkpoints/iter_000002/default/adapter_config.json").read_text())
    assert adapter["lora_alpha"] == 32
    capsys.readouterr()
    # a flag that would change the adapter or the optimizer is an error naming it
    for flag, value in (("--lora-alpha", "16"), ("--lr", "0.001"), ("--lora-r", "8")):
        argv = ["--preset", "cpu", "--resume", str(out), "--iterations", "3", flag, value]
        exits_with_one_line(ppo.main, argv, capsys, flag, value)
    assert len(read_jsonl(out / "metrics.jsonl")) == 2


# ----------------------------------------------------------------------------------------------
# Case 8: trimming the logs on resume is atomic
# ----------------------------------------------------------------------------------------------
def test_a_trim_killed_midway_leaves_the_whole_file(tmp_path, monkeypatch):
    folder = run.RunFolder(str(tmp_path), None, resume=True, enabled=False)
    folder.enabled = True
    rows = [{"iteration": i // 4 + 1, "text": "x" * 1000} for i in range(400)]
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"iteration": 101, "te', encoding="utf-8")
    original = path.read_bytes()

    def killed(fd):
        raise KeyboardInterrupt  # the kill arrives after the kept lines were written, before the rename
    monkeypatch.setattr(run.os, "fsync", killed)
    with pytest.raises(KeyboardInterrupt):
        folder.truncate("rollouts.jsonl", 50)
    assert path.read_bytes() == original
    assert sorted(os.listdir(tmp_path)) == ["rollouts.jsonl"]  # no temporary file left behind
    monkeypatch.undo()
    folder.truncate("rollouts.jsonl", 50)
    kept = read_jsonl(path)
    assert len(kept) == 200 and kept[-1]["iteration"] == 50  # and the torn last line is gone


def test_a_trim_killed_by_a_signal_leaves_the_whole_file(tmp_path):
    """The same with a real kill -9 of a process stopped in the middle of the trim."""
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "pad": "y" * 5000}) + "\n" for i in range(1, 2001)))
    original = path.read_bytes()
    script = (f"import os, sys, time\nsys.path.insert(0, {ROOT!r})\nimport run\n"
              "def stall(fd):\n    print('writing', flush=True)\n    time.sleep(120)\n"
              "os.fsync = stall\n"
              f"folder = run.RunFolder({str(tmp_path)!r}, None, enabled=False)\nfolder.enabled = True\n"
              "folder.truncate('metrics.jsonl', 10)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=ENV)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait(30)
    assert path.read_bytes() == original


# ----------------------------------------------------------------------------------------------
# Case 15: resume falls back to the newest checkpoint that loads
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_checkpoints(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    personas = root / "personas.json"
    from conftest import BASE_PERSONA
    personas.write_text(json.dumps([{**BASE_PERSONA, "id": f"p{i}"} for i in range(3)]))
    ppo.main(tiny(tiny_model_dir, str(personas), root / "run", "--iterations", "2", "--save-every", "1"))
    return root / "run"


def truncate_file(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def other_rank(path):
    from safetensors.torch import load_file, save_file
    weights = load_file(path)
    save_file({k: torch.zeros(8, w.shape[1]) if "lora_A" in k else torch.zeros(w.shape[0], 8)
               for k, w in weights.items()}, path)


CORRUPTIONS = {
    "truncated state.pt": (lambda c: truncate_file(c / "state.pt"), "state.pt does not load"),
    "missing adapter": (lambda c: os.remove(c / "critic" / "adapter_model.safetensors"), "is missing"),
    "truncated adapter": (lambda c: truncate_file(c / "default/adapter_model.safetensors"), "does not load"),
    "another --lora-r": (lambda c: other_rank(c / "default/adapter_model.safetensors"), "rank [8]"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_resume_skips_a_broken_checkpoint_saying_why(two_checkpoints, corruption, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    breaks, why = CORRUPTIONS[corruption]
    breaks(run / "checkpoints" / "iter_000002")
    ppo.main(["--preset", "cpu", "--resume", str(run), "--iterations", "2"])
    err = capsys.readouterr().err
    assert "skipping" in err and "iter_000002" in err and why in err, err[-2000:]
    assert [m["iteration"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2]  # iteration 2 played again
    assert json.loads((run / "config.json").read_text())["resumed_with"][-1]["from"] == "iter_000001"


def test_resume_with_no_loadable_checkpoint_is_one_line(two_checkpoints, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    for c in ("iter_000001", "iter_000002"):
        truncate_file(run / "checkpoints" / c / "state.pt")
    code, _, err, _ = cli("ppo.py", "--preset", "cpu", "--resume", str(run), "--iterations", "3")
    assert_one_line(code, err, "--resume", "no checkpoint", "loads")
    assert err.count("skipping") == 2


# ----------------------------------------------------------------------------------------------
# A simulator server that fails mid-run (the URL client's own cases 9, 10, 11: tests/test_simulator.py)
# ----------------------------------------------------------------------------------------------
def chat(text):
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def test_a_simulator_error_mid_run_saves_the_last_iteration_then_one_line(server, tiny_model_dir,
                                                                         personas_file, tmp_path):
    def respond(handler, n, body):
        # iteration 1 asks 6 times (2 dialogues: 2 appraisals, 2 user messages, 2 appraisals); then
        # the server starts refusing the key in the middle of iteration 2
        if n > 8:
            return reply(handler, 401, b"{}")
        appraisal = "Change: N" in body["messages"][-1]["content"]
        return reply(handler, 200, chat("It helps.\nChange: +2" if appraisal else "okay. go on."))
    s = server(respond)
    out = tmp_path / "run"
    argv = tiny(tiny_model_dir, personas_file, out, "--iterations", "3", "--save-every", "100",
                "--simulator", s.url, "--api-retries", "0", script="grpo")
    code, _, err, _ = cli("grpo.py", *argv)
    assert_one_line(code, err, "HTTP 401", s.url, "saved in")
    ckpts = os.listdir(out / "checkpoints")
    done = len(read_jsonl(out / "metrics.jsonl"))
    assert done >= 1 and ckpts == [f"iter_{done:06d}"]  # the last complete iteration is not lost


# ----------------------------------------------------------------------------------------------
# Case 6: secrets are redacted whatever the setting is called
# ----------------------------------------------------------------------------------------------
def test_values_that_look_like_keys_are_redacted():
    from dataclasses import dataclass

    @dataclass
    class Settings:
        api_model: str = "sk-proj-abcdefghijklmnop"
        simulator: str = "https://alice:hunter2@example.org/v1"
        note: str = "Bearer abc.def.ghi"
        query: str = "http://h/v1?api_key=zzz123&x=1"
        adapter: tuple = ("runs/a", "hf_abcdefghijklmnopqrs")
        max_new_tokens: int = 64

    saved = json.dumps(run.public_config(Settings()))
    for secret in ("abcdefghijklmnop", "hunter2", "alice", "abc.def.ghi", "zzz123", "hf_abcdefghijklmnopqrs"):
        assert secret not in saved, secret
    config = run.public_config(Settings())
    assert config["simulator"] == "https://<redacted>@example.org/v1" and config["max_new_tokens"] == 64
    assert config["adapter"][0] == "runs/a"


def test_a_key_in_a_setting_is_neither_printed_nor_saved(tiny_model_dir, personas_file, tmp_path):
    out = tmp_path / "run"
    key = "sk-live-abcdef0123456789"
    code, stdout, err, _ = cli("grpo.py", *tiny(tiny_model_dir, personas_file, out, "--iterations", "1",
                                                "--api-model", key, script="grpo"))
    assert code == 0, err[-2000:]
    assert key not in stdout + err
    assert key not in (out / "config.json").read_text()
    state = torch.load(out / "checkpoints" / "iter_000001" / "state.pt", weights_only=False)
    assert key not in json.dumps(state["args"]) and state["args"]["api_model"] == "<redacted>"


def test_an_opening_that_cannot_fit_the_context_is_refused_before_the_weights(
        persona_entry, write_personas, tmp_path, tiny_model_dir, monkeypatch, capsys):
    path = write_personas([persona_entry(id="long1", opening="word " * 600), persona_entry(id="ok")])

    def no_model(*args, **kwargs):
        raise AssertionError("the weights were loaded")
    monkeypatch.setattr(grpo, "load_policy", no_model)
    exits_with_one_line(grpo.main, ["--preset", "cpu", "--model", tiny_model_dir, "--simulator", "rules",
                                    "--personas", path, "--split", "test", "--max-context", "512",
                                    "--out", str(tmp_path / "run")],
                        capsys, "persona long1", "--max-context 512", "--max-new-tokens 32")


# ----------------------------------------------------------------------------------------------
# Case 13 (NaN): no NaN or Infinity in metrics.jsonl
# ----------------------------------------------------------------------------------------------
def test_non_finite_metrics_are_written_as_null_and_counted(tmp_path):
    from dataclasses import dataclass

    @dataclass
    class Settings:
        seed: int = 0
    folder = run.RunFolder(str(tmp_path), Settings())
    folder.append("metrics.jsonl", [{"iteration": 1, "a": float("nan"), "b": [1.0, float("inf")], "c": 2.5}])

    def refuse(name):
        raise ValueError(f"{name} in strict JSON")
    with open(tmp_path / "metrics.jsonl") as f:
        row = json.loads(f.readline(), parse_constant=refuse)
    assert row == {"iteration": 1, "a": None, "b": [1.0, None], "c": 2.5, "nonfinite_metrics": 2}
