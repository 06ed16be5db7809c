"""The paper's own data formats (issue 24), with files written for these tests:

  tests/data/rlver_sample.jsonl          RLVER-format training profiles, no first_talk (one Chinese)
  tests/data/sage_sample.jsonl           SAGE-format profiles with first_talk (sage-004 is Chinese)
  tests/data/sage_results/*_result.jsonl SAGE-format recorded dialogues of three invented "models"

The simulator-agreement check (evaluate.py --agreement: agreement.py), whose numbers are asserted against hand
computations with a fake OpenAI-compatible server that answers known changes. (The openings writer and
the profile files' own tests are in tests/test_simulator.py.)
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from personas import load_personas
from policy import load_tokenizer
import agreement
import evaluate
import cli
import simulator
import users
from conftest import ROOT, reply

DATA = os.path.join(ROOT, "tests", "data")
RLVER = os.path.join(DATA, "rlver_sample.jsonl")
SAGE = os.path.join(DATA, "sage_sample.jsonl")
RESULTS = [os.path.join(DATA, "sage_results", f"{name}_result.jsonl") for name in ("warm", "cold", "mixed")]


def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def run(script, *args, timeout=600):
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def chat_completion(text):
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def test_evaluate_refuses_profiles_without_openings_before_a_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(evaluate, "load_models", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as stop:
        cli.command(evaluate.main)(["--personas", RLVER, "--simulator", "rules"])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "--write-openings" in err


# ----------------------------------------------------------------------------------------------
# SAGE's protocol and the statistics of the agreement check
# ----------------------------------------------------------------------------------------------
def test_evaluate_judges_as_many_replies_as_sage_does():
    # SAGE's loop writes 10 agent replies and appraises 9: the 10th is never judged
    defaults = evaluate.parse_args([])
    assert defaults.max_turns == evaluate.SAGE_JUDGED_REPLIES == 9
    assert (defaults.start_emotion, defaults.max_change) == (evaluate.SAGE_START, 10) == (40, 10)
    sim = simulator.Simulator(users.RulesBackend())
    assert sim.leave_below == agreement.SAGE_LEAVE_BELOW == 10


def test_simulated_final_clamps_as_the_simulator_does():
    assert agreement.simulated_final(95, [8, 15, -30]) == 100  # 100 (ceiling): a success, SAGE stops there
    assert agreement.simulated_final(60, [15, -30, 4]) == 64  # +15 -> +10, -30 -> -10
    assert agreement.simulated_final(40, [-10] * 5) == 0  # 30, 20, 10, 0: below 10, the user leaves
    assert agreement.simulated_final(40, [7, 7], max_change=5) == 50


def recorded(id, points, label="a", final=None):
    """A recorded dialogue as read_sage_dialogues gives it, in the file {label}_result.jsonl: a user
    message with each emotion-point in turn, an agent reply after each (the last one never judged)."""
    history = [m for k in range(len(points)) for m in ({"role": "user", "text": f"user {k}"},
                                                       {"role": "agent", "text": f"agent {k}"})]
    return {"file": f"{label}_result.jsonl", "line": 1, "id": id,
            "final": points[-1] if final is None else final, "history": history,
            "points": {2 * k: p for k, p in enumerate(points)}}


def test_successes_and_failures_are_counted_from_the_final_emotion():
    # a recorded file keeps no end reason: 100 is a success, below 10 a failure (10 is neither)
    dialogues = [recorded(f"s{k}", [40, 40], final=final) for k, final in enumerate([100, 99, 10, 9.5, 0])]
    (file,) = agreement.agreement_report(dialogues, [[0]] * 5, n_boot=20)["files"]
    assert (file["recorded"]["successes"], file["recorded"]["failures"]) == (1, 2)
    assert (file["simulated"]["successes"], file["simulated"]["failures"]) == (0, 0)  # all stay at 40


def test_simulated_finals_stop_at_sages_exits_and_models_are_ranked_on_shared_scenarios():
    # Issue 30 item 3. Simulated along the whole recorded dialogue, s1 and s2 of file a would end at
    # 95 and 20 (no success, no failure, score 57.5); SAGE stops at 100 and below 10: 100 (a success)
    # and 5 (a failure), score 52.5.
    up, down, flat = [10] * 6 + [-5], [-10] * 3 + [-5] + [5] * 3, [0] * 7
    assert agreement.simulated_final(40, up) == 100 and agreement.simulated_final(40, down) == 5
    points = [40] * 7
    dialogues = [recorded("s1", points + [60]), recorded("s2", points + [50]),
                 recorded("s1", points + [30], "b"), recorded("s2", points + [20], "b"),
                 recorded("s1", points + [45], "c"), recorded("s3", points + [95], "c")]
    changes = [up, down, flat, [-1] * 7, [-2] * 7, flat]
    report = agreement.agreement_report(dialogues, changes, n_boot=50)
    a, b, c = report["files"]
    assert (a["simulated"]["value"], a["simulated"]["successes"], a["simulated"]["failures"]) == (52.5, 1, 1)
    assert (b["simulated"]["value"], c["simulated"]["value"]) == ((40 + 33) / 2, (26 + 40) / 2)
    assert report["final"]["mae"]["value"] == (40 + 45 + 10 + 13 + 19 + 55) / 6
    # Kendall's tau-b compares the files on the scenarios all of them hold: s1 alone. Recorded
    # a 60 > c 45 > b 30, simulated a 100 > b 40 > c 26: (a, b) and (a, c) concordant, (b, c)
    # discordant, so (2 - 1) / 3. (On whole files it would be -1/3: c's s3 lifts its recorded score.)
    models = report["models"]
    assert models["scenarios"] == 1 and models["kendall_tau_b"]["value"] == pytest.approx(1 / 3, abs=1e-12)


def personas_of(path=SAGE):
    return {p.id: p for p in load_personas(path)}


def test_recorded_state_sees_the_recorded_moods():
    dialogue = agreement.read_sage_dialogues(RESULTS[1], personas_of())[1]  # sage-003: 40 -> 35 -> 35 -> 28
    assert agreement.judged_replies(dialogue) == [(1, 40, 35), (3, 35, 35), (5, 35, 28)]
    persona = personas_of()["sage-003"]
    state = agreement.recorded_state(persona, dialogue, 5)
    assert (state.emotion, state.turns, len(state.history)) == (35, 2, 5)
    assert [(a["change"], a["emotion"]) for a in state.appraisals] == [(-5, 35), (0, 35)]
    messages = simulator.user_turn_messages(state)
    notes = re.findall(r"Your mood: (\d+)", "\n".join(m["content"] for m in messages))
    assert notes == ["40", "35", "35"]  # the mood before each of the two earlier agent replies, then now
    # the last reply of the warm sage-001 dialogue has no user message after it: never judged
    warm = agreement.read_sage_dialogues(RESULTS[0], personas_of())[0]
    assert [k for k, _, _ in agreement.judged_replies(warm)] == [1, 3] and len(warm["history"]) == 6


# ----------------------------------------------------------------------------------------------
# The agreement check end to end: a fake server with known changes, hand-computed numbers
# ----------------------------------------------------------------------------------------------
# The simulator's change for each recorded agent reply, dialogue by dialogue, and what SAGE recorded:
#   warm  sage-001 (40 45 52)              recorded +5 +7      simulated +3 +3     final 52 | 46
#   warm  sage-004 (40 40 48, Chinese)     recorded  0 +8      simulated +2 +4     final 48 | 46
#   cold  sage-002 (40 30 25)              recorded -10 -5     simulated -4  0     final 25 | 36
#   cold  sage-003 (40 35 35 28)           recorded -5 0 -7    simulated -2 +1 -3  final 28 | 36
#   mixed sage-001 (40 50 ... 100)         recorded +10 x 6    simulated +2 x 6    final 100 | 52
#   mixed sage-002 (40 30 20 10 4)         recorded -10 -10 -10 -6, simulated -6 -2 -10 -10 (its move
#                                          from 10 is -10), final 4 | 40-6-2-10-10 = 12
SIMULATED = [[3, 3], [2, 4], [-4, 0], [-2, 1, -3], [2] * 6, [-6, -2, -10, -10]]


def known_changes():
    """{the reply as the appraisal prompt quotes it: its change}."""
    changes = {}
    for path, dialogue_changes in zip(RESULTS, [SIMULATED[0:2], SIMULATED[2:4], SIMULATED[4:6]]):
        for dialogue, simulated in zip(agreement.read_sage_dialogues(path, personas_of()), dialogue_changes):
            for (k, _, _), change in zip(agreement.judged_replies(dialogue), simulated):
                changes[dialogue["history"][k]["text"].translate(simulator.AGENT_ESCAPE)] = change
    assert len(changes) == 19
    return changes


def appraising_server(server, fail_on=None):
    changes, asked = known_changes(), []

    def handle(handler, n, body):
        ask = body["messages"][-1]["content"]
        marker = next((m for m in ("The chatbot's newest reply:", "机器人的最新回复：") if m in ask), None)
        if marker is None:  # evaluate.py's first short request (rollout.reach_simulator)
            reply(handler, 200, chat_completion("ready"))
            return
        newest = json.loads(ask.split(marker + "\n", 1)[1].split("\n", 1)[0])
        asked.append(newest)
        if fail_on and fail_on[0] in newest:
            reply(handler, 400, b"{}")
            return
        appraisal = f"Got right: -\nMissed: -\nInner reaction: -\nChange: {changes[newest]:+d}"
        reply(handler, 200, chat_completion(appraisal))
    return server(handle), asked


def check_agreement(out, simulator_arg, *extra):
    argv = ["--agreement", *RESULTS, "--personas", SAGE, "--simulator", simulator_arg,
            "--bootstrap", "300", "--out", str(out), *extra]
    return cli.command(evaluate.main)(argv)


def test_agreement_numbers_equal_the_hand_computed_ones(tmp_path, server, capsys):
    srv, asked = appraising_server(server)
    out = tmp_path / "check"
    results = check_agreement(out, srv.url)
    assert len(asked) == 19  # one appraisal per judged reply, none for SAGE's unjudged last reply
    r = results["replies"]
    assert (r["n"], r["dialogues"], r["unread"]) == (19, 6, 0)
    # recorded r and simulated s, 19 pairs: sum r = 17, sum s = -12, sum r^2 = 1273, sum s^2 = 332,
    # sum rs = 499, so Pearson = (19*499 - 17*(-12)) / sqrt((19*1273 - 17^2) (19*332 - 12^2))
    assert r["pearson"]["value"] == pytest.approx(9685 / np.sqrt(23898 * 6164), abs=1e-12)
    # average ranks, by hand: recorded -10 x4 -> 2.5, -7 -> 5, -6 -> 6, -5 x2 -> 7.5, 0 x2 -> 9.5,
    # 5 -> 11, 7 -> 12, 8 -> 13, 10 x6 -> 16.5; simulated -10 x2 -> 1.5, -6 -> 3, -4 -> 4, -3 -> 5,
    # -2 x2 -> 6.5, 0 -> 8, 1 -> 9, 2 x7 -> 13, 3 x2 -> 17.5, 4 -> 19
    rank_r = [11, 12, 9.5, 13, 2.5, 7.5, 7.5, 9.5, 5] + [16.5] * 6 + [2.5, 2.5, 2.5, 6]
    rank_s = [17.5, 17.5, 13, 19, 4, 8, 6.5, 9, 5] + [13] * 6 + [3, 6.5, 1.5, 1.5]
    n, sx, sy = 19, sum(rank_r), sum(rank_s)
    sxx, syy, sxy = (sum(a * a for a in rank_r), sum(b * b for b in rank_s),
                     sum(a * b for a, b in zip(rank_r, rank_s)))
    rho = (n * sxy - sx * sy) / np.sqrt((n * sxx - sx ** 2) * (n * syy - sy ** 2))
    assert r["spearman"]["value"] == pytest.approx(rho, abs=1e-12)
    # same direction: 2 + 1 + 1 + 2 + 6 + 4 of 19 (0 vs +2, -5 vs 0 and 0 vs +1 differ)
    assert r["direction_agreement"]["value"] == 16 / 19
    assert r["mae"]["value"] == (6 + 6 + 11 + 8 + 48 + 16) / 19  # = 5
    # baselines: 9 of the 19 recorded changes go up (8 down, 2 flat); their sizes add up to 143
    assert r["direction_baseline"] == 9 / 19 and r["mae_of_no_change"] == 143 / 19
    for name in ("spearman", "pearson", "direction_agreement", "mae"):
        assert r[name]["low"] <= r[name]["value"] <= r[name]["high"]
    f = results["final"]
    assert f["mae"]["value"] == (6 + 2 + 11 + 8 + 48 + 8) / 6
    assert f["simulated_minus_recorded"]["value"] == pytest.approx((-6 - 2 + 11 + 8 - 48 + 8) / 6, abs=1e-12)
    files = {m["label"]: m for m in results["files"]}
    scores = [(m["recorded"]["value"], m["simulated"]["value"]) for m in files.values()]
    assert scores == [(50, 46), (26.5, 36), (52, 32)]
    assert (files["mixed"]["recorded"]["successes"], files["mixed"]["recorded"]["failures"]) == (1, 1)
    assert (files["mixed"]["simulated"]["successes"], files["mixed"]["simulated"]["failures"]) == (0, 0)
    # models: recorded mixed 52 > warm 50 > cold 26.5; simulated warm 46 > cold 36 > mixed 32. Kendall's
    # tau compares the models on the scenarios every file holds, and these share none (warm holds
    # sage-001 and -004, cold -002 and -003, mixed -001 and -002): no tau
    assert results["models"]["kendall_tau_b"] is None and results["models"]["scenarios"] == 0
    table = (out / "results.md").read_text()
    assert "recorded mixed > warm > cold, simulated warm > cold > mixed" in table
    for name in ("results.json", "results.md", "appraisals.jsonl"):
        assert (out / name).stat().st_size > 0
    assert "over the 0 scenarios every file holds: - (needs 2 files" in table
    assert len(read_lines(out / "appraisals.jsonl")) == 6  # every dialogue's appraisals, one line each


def test_an_interrupted_agreement_run_keeps_what_it_finished(tmp_path, server, capsys, monkeypatch):
    first_cold = agreement.read_sage_dialogues(RESULTS[1], personas_of())[0]["history"][1]["text"]
    srv, _ = appraising_server(server, fail_on=[first_cold])
    with pytest.raises(SystemExit) as stop:
        monkeypatch.setattr(agreement, "BATCH_DIALOGUES", 1)
        check_agreement(tmp_path / "check", srv.url)
    err = capsys.readouterr().err
    said = [line for line in re.split(r"[\r\n]", err) if line.startswith("error:")]
    assert stop.value.code == 2 and len(said) == 1 and "HTTP 400" in said[0], err
    kept = read_lines(tmp_path / "check" / "appraisals.jsonl")
    assert [row["id"] for row in kept] == ["sage-001", "sage-004"]
    assert not (tmp_path / "check" / "results.json").exists()


def test_agreement_with_the_rules_user_through_the_command_line(tmp_path):
    done = run("evaluate.py", "--agreement", *RESULTS, "--personas", SAGE, "--simulator", "rules",
               "--bootstrap", "200", "--dialogues", "1", "--out", tmp_path / "check")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "agreement: replies: 100%" in done.stderr  # the progress bar
    results = json.loads((tmp_path / "check" / "results.json").read_text())
    assert results["settings"]["readout"] == "rules"
    assert results["replies"]["dialogues"] == 3  # --dialogues 1: one per file
    rows = read_lines(tmp_path / "check" / "appraisals.jsonl")
    personas = personas_of()
    for path, row in zip(RESULTS, rows):
        dialogue = agreement.read_sage_dialogues(path, personas)[0]
        assert row["id"] == dialogue["id"]
        # the rules user's own verdict on each reply in a state built by hand from the record
        expected = []
        for k, before, _ in agreement.judged_replies(dialogue):
            state = simulator.UserState(persona=personas[dialogue["id"]], emotion=before,
                                        history=dialogue["history"][:k])
            change, *_ = users.rules_appraisal(state, dialogue["history"][k]["text"])
            expected.append(max(-10, min(10, change)))
        assert [change for change, _ in row["appraisals"]] == expected
    assert "| warm | 1 |" in (tmp_path / "check" / "results.md").read_text()


@pytest.mark.parametrize("broken,message", [
    (lambda lines: [{**lines[0], "id": "nobody"}] + lines[1:],
     "line 1: must be an object whose field 'id' names a persona of the --personas file"),
    (lambda lines: [{**lines[0], "history": [{k: v for k, v in m.items() if k != "emotion-point"}
                                             for m in lines[0]["history"]]}] + lines[1:],
     "line 1 (id sage-001): field 'history[0].emotion-point' must be a number from 0 to 100, not None"),
    (lambda lines: lines[:1] + ["{not json"], "line 2: not valid JSON"),
    (lambda lines: [{**lines[0], "emo_point": "high"}],
     "line 1 (id sage-001): field 'emo_point' must be a number"),
    (lambda lines: [{**lines[0], "history": lines[0]["history"][:1]}],
     "line 1 (id sage-001): field 'history' must be a list of messages with a judged reply"),
    (lambda lines: [{**lines[0], "history": lines[0]["history"][1:]}],
     "line 1 (id sage-001): field 'history[0]' must be {role: user, content: text}"),
    # issue 30 item 10: points outside 0-100 or not finite, a dialogue given twice in one file
    (lambda lines: [{**lines[0], "emo_point": 150}],
     "line 1 (id sage-001): field 'emo_point' must be a number from 0 to 100"),
    (lambda lines: [with_point(lines[0], 2, -5)],
     "line 1 (id sage-001): field 'history[2].emotion-point' must be a number from 0 to 100"),
    (lambda lines: [with_point(lines[0], 2, float("nan"))],
     "line 1 (id sage-001): field 'history[2].emotion-point' must be a number from 0 to 100"),
    (lambda lines: lines[:2] + lines[:1], "line 3 (id sage-001): field 'id' is on line 1 too"),
])
def test_bad_recorded_files_stop_before_a_model_loads(tiny_model_dir, tmp_path, monkeypatch, capsys, broken,
                                                      message):
    monkeypatch.setattr("policy.load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    lines = broken(read_lines(RESULTS[0]))
    path = tmp_path / "bad_result.jsonl"
    text = [x if isinstance(x, str) else json.dumps(x, ensure_ascii=False) for x in lines]
    path.write_text("".join(line + "\n" for line in text), encoding="utf-8")
    argv = ["--agreement", str(path), "--personas", SAGE, "--simulator", "same",
            "--model", tiny_model_dir, "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as stop:
        cli.command(evaluate.main)(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: {path}: ") and message in err, err
    assert not (tmp_path / "out").exists()


def with_point(line, k, point):
    """A recorded line whose message k carries another emotion-point."""
    history = [dict(m) for m in line["history"]]
    history[k]["emotion-point"] = point
    return {**line, "history": history}


def test_a_recorded_file_given_twice_is_refused(tmp_path, capsys):
    again = os.path.join(DATA, "sage_results", ".", "warm_result.jsonl")  # the same file, another spelling
    with pytest.raises(SystemExit) as stop:
        cli.command(evaluate.main)(["--agreement", RESULTS[0], RESULTS[1], again, "--personas", SAGE,
                       "--simulator", "rules", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"error: --agreement {again}: ") and RESULTS[0] in err, err
    assert not (tmp_path / "out").exists()


def test_agreement_results_are_strict_json_when_a_statistic_is_undefined(tmp_path, server):
    # a simulator that never moves: every correlation is undefined (NaN), which JSON cannot hold
    srv = server(lambda handler, n, body: reply(handler, 200, chat_completion("Change: 0")))
    results = check_agreement(tmp_path / "check", srv.url, "--dialogues", "1")
    assert np.isnan(results["replies"]["spearman"]["value"])

    def refuse(name):
        raise ValueError(f"{name} in results.json")
    saved = json.loads((tmp_path / "check" / "results.json").read_text(), parse_constant=refuse)
    assert saved["replies"]["spearman"]["value"] is None and saved["replies"]["mae"]["value"] > 0
    assert "undefined" in (tmp_path / "check" / "results.md").read_text()


def test_agreement_help_lists_its_own_settings():
    done = run("evaluate.py", "--help", timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("usage:")
    assert "--agreement" in done.stdout


# ----------------------------------------------------------------------------------------------
# Issue 30 item 14: the agreement check with a local model on SAGE-sized dialogues
# ----------------------------------------------------------------------------------------------
def sage_sized(folder, tokenizer, profile_tokens=3500, message_tokens=450):
    """An invented SAGE-sized scenario (a profile of about profile_tokens tokens, as SAGE's are in
    SmolLM2's tokenizer) and its recorded dialogue: 9 messages of about message_tokens each, 4 judged
    replies. Made-up syllables, so that the profile stays within a persona field's 20,000 characters."""
    syllables = [a + b for a in "bcdfgklmnprstvz" for b in "aeiou"]
    rng = np.random.default_rng(0)

    def text(n):
        words = []
        while len(tokenizer(" ".join(words))["input_ids"]) < n:
            words += ["".join(rng.choice(syllables, 2)) for _ in range(40)]
        return " ".join(words)
    profile = {"id": "big-1", "player": text(profile_tokens), "scene": "An invented scene.",
               "main_cha": "X", "topic": "work", "task": "to talk", "first_talk": "hello. i am tired."}
    history = [{"role": "user", "content": text(message_tokens), "emotion-point": 40 + k} if k % 2 == 0 else
               {"role": "assistant", "content": text(message_tokens)} for k in range(9)]
    (folder / "profiles.jsonl").write_text(json.dumps(profile) + "\n")
    recorded = {"id": "big-1", "emo_point": 48, "history": history}
    (folder / "big_result.jsonl").write_text(json.dumps(recorded) + "\n")
    return str(folder / "big_result.jsonl"), str(folder / "profiles.jsonl")


def with_window(model_dir, folder, window):
    """The tiny model as a folder of links, its config saying another window (max_position_embeddings)."""
    folder.mkdir()
    for name in os.listdir(model_dir):
        if name != "config.json":
            os.symlink(os.path.join(model_dir, name), folder / name)
    config = json.loads(open(os.path.join(model_dir, "config.json")).read())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": window}))
    return str(folder)


# Peak memory of evaluate.py in a process of its own, less what the process holds once its modules
# are imported (torch, transformers): what the command itself needs.
GROWTH = """import sys
import evaluate
import simulator
simulator.parse_change = lambda text: 0  # a random model writes no change line: read each as no change
with open("/proc/self/status") as f:
    start = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
try:
    evaluate.main(sys.argv[1:])
finally:
    # VmHWM, the peak of this process's own memory: ru_maxrss would also hold the peak of the parent
    # it was forked from, which Linux carries across exec (a pytest process that has grown for minutes)
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(f"grew {(peak - start) // 1024} MB", file=sys.stderr)
"""


def test_a_sage_sized_dialogue_is_appraised_in_memory_linear_in_its_context(tiny_model_dir, tmp_path):
    # Issue 30 item 14. Appraisal prompts of 3,800 to 7,700 tokens (a 3,500-token profile, a 4,000-token
    # history), 4 judged replies, the tiny model writing reasoned appraisals: one pass over a whole prompt
    # builds (4, T, T) masks, 0.9 GB in float32 alone and more than 1.5 GB in all; chunked prefill needs
    # (4, 1024, T) at most.
    model = with_window(tiny_model_dir, tmp_path / "model", 16384)
    recorded_file, profiles = sage_sized(tmp_path, load_tokenizer(model))
    command = ["--agreement", recorded_file, "--personas", profiles, "--simulator", "same", "--model", model,
               "--max-context", "16384", "--bootstrap", "20",
               "--out", str(tmp_path / "out")]
    done = subprocess.run([sys.executable, "-c", GROWTH, *command], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    grew = int(re.search(r"grew (\d+) MB", done.stderr)[1])
    assert grew < 900, done.stderr[-3000:]  # chunked: about 430 MB (290 for 2 short replies); one pass: 1,960
    assert "agreement: replies: 100%" in done.stderr and "4/4" in done.stderr  # the bar counts replies
    assert len(read_lines(tmp_path / "out" / "appraisals.jsonl")[0]["appraisals"]) == 4




def test_a_recorded_line_holding_a_unicode_line_separator_is_one_line(tmp_path):
    """JSON leaves U+2028 (and U+0085) unescaped inside strings, and SAGE's recorded files hold it
    (openai-o4mini_result.jsonl, line 41): a JSON line ends at "\\n" only."""
    entry = {**read_lines(RESULTS[0])[0]}
    entry["history"] = [dict(m) for m in entry["history"]]
    entry["history"][1]["content"] += "\u2028Take your time.\x85"
    path = tmp_path / "separators_result.jsonl"
    path.write_text(json.dumps(entry, ensure_ascii=False) + "\n", encoding="utf-8")
    (line, read), = cli.read_json_lines(str(path))
    assert line == 0 and read == entry
