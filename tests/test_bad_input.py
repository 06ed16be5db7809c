"""Bad input never gives a wrong result, a hang or lost data (issue 16). Each test holds one case
of that issue: the flag or file a careless or hostile user could give, and what happens now.

Most settings cases end before any model loads, so they run in-process through each script's
main() (the code the command line runs); one of each kind also runs as a real subprocess."""
import json
import os
import re
import subprocess
import sys
import time

import pytest

from rl import CREDITS
from conftest import ROOT, reply

import cli  # noqa: E402
import run  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def shell(*argv, timeout=300, env=None, cwd=ROOT):
    """Run a script as a user would; returns (returncode, stdout, the error lines of stderr, elapsed)."""
    t0 = time.time()
    done = subprocess.run([sys.executable, *map(str, argv)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)
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
        cli.command(main)(argv)
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
    (["--lerning-rate", "1"], ["unrecognized arguments: --lerning-rate"]),                               # 12
    (["--max-turnz", "3"], ["unrecognized arguments: --max-turnz"]),         # 12
    (["--save-every", "0"], ["--save-every", "0"]),                                           # 14
    (["--minibatch-size", "0"], ["--minibatch-size", "0"]),                                   # 14
    (["--micro-batch-size", "0"], ["--micro-batch-size", "0"]),                               # 14
    (["--dialogues-per-iteration", "0"], ["--dialogues-per-iteration", "0"]),                 # 14
    (["--temperature", "0"], ["--temperature", "0", "above 0"]),                       # 14
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
    (["--loss-agg", "seq-mean-token-sum"], ["--loss-agg", "dr-grpo"]),  # not one of GRPO's
    (["--group-advantage", "std"], ["--group-advantage", "mean-std"]),
    (["--personas-per-iteration", "0"], ["--personas-per-iteration"]),
    (["--max-context", "16"], ["--max-context 16", "--max-new-tokens"]),
])
def test_grpo_refuses_bad_settings(flags, words, capsys, tmp_path):
    argv = ["--preset", "cpu", "--out", str(tmp_path / "run"), *flags]
    exits_with_one_line(grpo.main, argv, capsys, *words)


@pytest.mark.parametrize("script, flags, words", [
    ("ppo.py", ["--preset", "cpu", "--lerning-rate", "1"], ["unrecognized arguments: --lerning-rate"]),
    ("grpo.py", ["--preset", "cpu", "--simulator", "rulez"], ["--simulator", "rulez"]),
    ("evaluate.py", ["--max-turns", "0"], ["--max-turns", "0"]),
])
def test_bad_settings_through_the_real_command_line(script, flags, words):
    code, _, err, elapsed = shell(script, *flags)
    assert_one_line(code, err, *words)
    assert elapsed < 40, elapsed  # no hub retries (they took 54 s for --simulator rulez)


def test_help_lists_the_choices():
    """Every choice of a table a fork adds to (CREDITS, grpo.ADVANTAGES) is a choice --help lists."""

    for script, table, flag in (("ppo.py", CREDITS, "--reward"),
                                ("grpo.py", CREDITS, "--reward"),
                                ("grpo.py", grpo.ADVANTAGES, "--group-advantage")):
        code, out, err, _ = shell(script, "--help")
        listed = re.search(rf"{flag} {{([^}}]*)}}", out).group(1).split(",")
        assert code == 0 and listed == list(table), (script, flag, listed)


# ----------------------------------------------------------------------------------------------
# A simulator server that fails mid-run (the URL client's own cases 9, 10, 11: tests/test_simulator.py)
# ----------------------------------------------------------------------------------------------
def chat(text):
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def test_a_simulator_error_mid_run_saves_the_last_iteration_then_one_line(server, tiny_model_dir,
                                                                         personas_file, tmp_path):
    def respond(handler, n, body):
        # the first short request (rollout.reach_simulator), iteration 1's 6 (2 dialogues: 2
        # appraisals, 2 user messages, 2 appraisals); then the server starts refusing the key in the
        # middle of iteration 2
        if n > 9:
            return reply(handler, 401, b"{}")
        appraisal = "Change: N" in body["messages"][-1]["content"]
        return reply(handler, 200, chat("It helps.\nChange: +2" if appraisal else "okay. go on."))
    s = server(respond)
    out = tmp_path / "run"
    argv = tiny(tiny_model_dir, personas_file, out, "--iterations", "3", "--save-every", "100",
                "--simulator", s.url, "--api-retries", "0", script="grpo")
    code, _, err, _ = shell("grpo.py", *argv)
    assert_one_line(code, err, "HTTP 401", s.url, "--resume")
    ckpts = os.listdir(out / "checkpoints")
    done = len(read_jsonl(out / "metrics.jsonl"))
    assert done >= 1 and ckpts == [f"iter_{done:06d}"]  # the last complete iteration is not lost
    # the run folder keeps the line and its advice (summary.txt)
    said = next(line for line in err.splitlines() if line.startswith("error: "))
    assert (out / "summary.txt").read_text().splitlines()[-1].split(" ", 2)[2] == said


# ----------------------------------------------------------------------------------------------
# Case 6: secrets are redacted whatever the setting is called
# ----------------------------------------------------------------------------------------------
def test_values_that_look_like_keys_are_redacted():
    from dataclasses import dataclass, field

    @dataclass
    class Settings:
        api_model: str = "sk-proj-abcdefghijklmnop"
        simulator: str = "https://alice:hunter2@example.org/v1"
        note: str = "Bearer abc.def.ghi"
        query: str = "http://h/v1?api_key=zzz123&x=1"
        adapter: list = field(default_factory=lambda: ["runs/a", "hf_abcdefghijklmnopqrs"])  # nargs="+"
        max_new_tokens: int = 64

    saved = json.dumps(cli.public_config(Settings(), "ppo.py"))
    for secret in ("abcdefghijklmnop", "hunter2", "alice", "abc.def.ghi", "zzz123", "hf_abcdefghijklmnopqrs"):
        assert secret not in saved, secret
    config = cli.public_config(Settings(), "ppo.py")
    assert config["simulator"] == "https://<redacted>@example.org/v1" and config["max_new_tokens"] == 64
    assert config["adapter"][0] == "runs/a"


def test_a_key_in_a_setting_is_neither_printed_nor_saved(tiny_model_dir, personas_file, tmp_path):
    out = tmp_path / "run"
    key = "sk-live-abcdef0123456789"
    code, stdout, err, _ = shell("grpo.py", *tiny(tiny_model_dir, personas_file, out, "--iterations", "1",
                                                "--api-model", key, script="grpo"))
    assert code == 0, err[-2000:]
    assert key not in stdout + err
    assert key not in (out / "config.json").read_text()
    assert json.loads((out / "config.json").read_text())["api_model"] == "<redacted>"
    with open(out / "checkpoints" / "iter_000001" / "state.pt", "rb") as f:
        assert key.encode() not in f.read()


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
def test_non_finite_metrics_are_written_as_null(tmp_path):
    row = {"iteration": 1, "a": float("nan"), "b": [1.0, float("inf")], "c": 2.5}
    run.append_lines(tmp_path / "metrics.jsonl", [row])

    def refuse(name):
        raise ValueError(f"{name} in strict JSON")
    with open(tmp_path / "metrics.jsonl") as f:
        row = json.loads(f.readline(), parse_constant=refuse)
    assert row == {"iteration": 1, "a": None, "b": [1.0, None], "c": 2.5}
