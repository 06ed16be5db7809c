"""The held-out scripted user, `--simulator listener` (users.listener_appraisal, issue 62): its own
cues, lexicon and weights, each cue able to fail; deterministic across processes; a user the
scripts take like `rules` (read-out, canned lines, records whose parts reproduce each change) that
no preset trains against.

    python -m pytest tests/test_listener.py -q
"""
import json
import os
import subprocess
import sys

import pytest

import grpo
import ppo
import rollout
import users
from conftest import ROOT
from personas import load_personas
from simulator import Simulator, apply_change, simulator_problem
from users import LISTENER_WEIGHTS, ListenerBackend, listener_appraisal, rules_appraisal

# the conftest persona's opening: "i didn't get the promotion. they gave it to the new guy. i feel so
# stupid for hoping."
NAMED_BACK = "It makes sense that you feel stupid for hoping when it was promised to you."
STOCK = "I'm sorry to hear that. Stay strong, things will get better."


def state_of(persona_entry, write_personas, difficulty="normal", **fields):
    persona, = load_personas(write_personas([persona_entry(difficulty=difficulty, **fields)]))
    return Simulator(ListenerBackend()).start(persona)


def parts_of(state, reply):
    return listener_appraisal(state, reply)[2]


def test_its_lexicon_is_its_own_and_it_can_disagree_with_the_rules_user(persona):
    """No list of the listener is one of the rules user's, and on stock sympathy the two disagree:
    the rules user's acknowledgement phrases are the listener's stock formulas."""
    theirs = [users.ACKNOWLEDGE, users.DISMISSIVE, users.ADVICE]
    mine = [users.FEELINGS, users.STOCK, users.VALIDATION, users.SUGGESTIONS]
    assert not any(set(a) == set(b) for a in mine for b in theirs)
    state = Simulator(ListenerBackend()).start(persona)
    reply = "I'm sorry to hear that. That sounds hard, I understand how you feel."
    rules, why_rules, _ = rules_appraisal(state, reply)
    listener, why_listener, _ = listener_appraisal(state, reply)
    assert rules > 0 > listener, (why_rules, why_listener)
    assert why_listener == "listener: stock_phrase-2"


def test_naming_the_users_own_feeling_beats_stock_sympathy_and_a_guessed_feeling(persona):
    state = Simulator(ListenerBackend()).start(persona)
    named, why_named, parts = listener_appraisal(state, NAMED_BACK)
    stock, why_stock, stock_parts = listener_appraisal(state, STOCK)
    guessed, why_guessed, guessed_parts = listener_appraisal(state, "You must feel angry.")
    assert named > guessed > 0 > stock, (why_named, why_guessed, why_stock)
    assert parts["reflects_feeling"]["found"] == ["stupid"]
    assert parts["validates"]["found"] == ["it makes sense", "makes sense that"]
    assert guessed_parts == {"names_feeling": {"points": 1, "weight": 1.0, "value": 1.0,
                                               "found": ["angry"]}}
    # each formula found is listed; at most two count
    assert stock_parts["stock_phrase"]["found"] == ["sorry to hear", "stay strong",
                                                    "things will get better"]
    assert stock_parts["stock_phrase"]["points"] == -2


def test_one_question_at_a_time(persona):
    state = Simulator(ListenerBackend()).start(persona)
    one, why_one, _ = listener_appraisal(state, "What was the worst part of it?")
    three, why_three, parts = listener_appraisal(state, "What happened? Why now? Did you tell them?")
    assert why_one == "listener: one_question+2" and one == 2
    assert why_three == "listener: many_questions-4" and three == -4
    assert parts["many_questions"]["found"] == ["What happened?", "Why now?",
                                                "Did you tell them?"]


def test_validation_before_advice_and_advice_before_it(persona):
    state = Simulator(ListenerBackend()).start(persona)
    first = "It makes sense that you feel stupid. You could try asking your manager why."
    later = "You could try asking your manager why. It makes sense that you feel stupid."
    good, why_good, _ = listener_appraisal(state, first)
    bad, why_bad, parts = listener_appraisal(state, later)
    assert "validates+2" in why_good and "advice_first" not in why_good
    assert "advice_first-3" in why_bad and "validates" not in why_bad and good - bad == 5
    assert parts["advice_first"]["found"] == ["you could try"]
    advice_only, why, _ = listener_appraisal(state, "You should update your CV.")
    assert why == "listener: advice_first-3" and advice_only == -3


def test_a_formula_or_a_sentence_said_again_counts_against_a_later_turn(persona):
    sim = Simulator(ListenerBackend(), start_emotion=50, max_turns=3)
    state = sim.start(persona)
    sim.step([state], ["I'm here for you. It makes sense that you feel stupid about the promotion."])
    sim.step([state], ["I'm here for you. It makes sense that you feel stupid about the promotion."])
    first, second = [a["parts"] for a in state.appraisals]
    assert "repeats_formula" not in first
    assert second["repeats_formula"]["found"] == [
        "i'm here for you", "it makes sense that you feel stupid about the promotion"]
    assert second["repeats_formula"]["points"] == -6
    fresh = "Waiting that long for it was not stupid. What did they tell you?"
    assert "repeats_formula" not in listener_appraisal(state, fresh)[2]


def test_rambling_and_empty_replies(persona):
    state = Simulator(ListenerBackend()).start(persona)
    short = "It makes sense that you feel stupid."
    assert "rambles" not in parts_of(state, short)
    long = parts_of(state, short + " That was a lot to carry." * 16)
    assert long["rambles"] == {"points": -2, "weight": 1.0, "value": -2.0, "found": ["103 words"]}
    assert listener_appraisal(state, "...")[:2] == (-5, "listener: empty-5")


def test_it_reads_chinese(persona_entry, write_personas):
    """SAGE's dialogues are Chinese: its feeling words, stock formulas, validation and questions."""
    state = state_of(persona_entry, write_personas, opening="我觉得很委屈，付出了那么多，结果什么都没有。")
    change, why, parts = listener_appraisal(state, "付出那么多却落空，觉得委屈很正常。你最难受的是哪一部分？")
    assert parts["reflects_feeling"]["found"] == ["委屈"] and "validates+2" in why
    assert "one_question+2" in why and change > 0
    stock, why_stock, _ = listener_appraisal(state, "抱抱，加油，一切都会好起来的！")
    assert stock < 0 and "stock_phrase-2" in why_stock


@pytest.mark.parametrize("difficulty", ["easy", "normal", "hard"])
def test_its_parts_and_weights_reproduce_the_change(difficulty, persona_entry, write_personas):
    state = state_of(persona_entry, write_personas, difficulty)
    good, bad = LISTENER_WEIGHTS[difficulty]
    for reply in (NAMED_BACK, STOCK, "What? Why?", "You should move on", "", "It makes sense. How?"):
        change, why, parts = listener_appraisal(state, reply)
        assert why.startswith("listener: ")
        for name, p in parts.items():
            assert p["weight"] == (bad if p["points"] < 0 else good), name
            assert p["value"] == round(p["points"] * p["weight"], 2) and f"{name}{p['points']:+d}" in why
        assert change == round(sum(p["value"] for p in parts.values()))


def test_the_same_appraisals_in_any_process():
    """Deterministic: nothing hangs on the order of a set of strings (Python salts their hashes per
    process)."""
    code = ("import json, users\nfrom simulator import UserState\nfrom personas import load_personas\n"
            "p = load_personas('personas.json', 'train')\n"
            "replies = ['I am sorry to hear that. It makes sense you feel nervous and scared. What now? "
            "Why?', 'You should try to rest. Stay strong, you are not alone, and']\n"
            "print(json.dumps([users.listener_appraisal(UserState(q, 30, [{'role': 'user', 'text': "
            "q.opening}]), r) for q in p for r in replies]))")
    runs = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                           env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120)
            for seed in ("1", "2")]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and len(json.loads(runs[0].stdout)) > 40


def test_listener_is_a_simulator_choice_that_no_preset_trains_against():
    assert simulator_problem("listener") is None and "listener" in simulator_problem("lisener")
    assert isinstance(rollout.make_backend("listener"), ListenerBackend)
    for trainer in (ppo, grpo):
        for name, preset in trainer.PRESETS.items():
            assert preset.get("simulator", "same") != "listener", (trainer.__name__, name)


def test_a_trainer_takes_listener_when_typed_and_its_records_explain_each_change(
        tiny_model_dir, personas_file, tmp_path):
    out = tmp_path / "run"
    grpo.main(["--preset", "cpu", "--model", tiny_model_dir, "--simulator", "listener",
               "--personas", personas_file, "--split", "test", "--max-turns", "2",
               "--max-new-tokens", "6", "--max-context", "512", "--lora-r", "4", "--lora-alpha", "8",
               "--iterations", "1", "--out", str(out)])
    assert json.loads((out / "config.json").read_text())["simulator"] == "listener"
    with open(out / "rollouts.jsonl", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    turns = 0
    for r in records:
        good, bad = LISTENER_WEIGHTS[r["difficulty"]]
        emotion = r["start_emotion"]
        for turn in (t for t in r["turns"] if t["role"] == "agent"):
            assert turn["appraisal"].startswith("listener: ")
            parts = turn["parts"].values()
            assert all(p["weight"] == (bad if p["points"] < 0 else good) for p in parts)
            stated = round(sum(p["value"] for p in parts))
            assert apply_change(emotion, stated, 10) == (turn["emotion"], turn["change"])
            emotion, turns = turn["emotion"], turns + 1
    assert turns >= len(records)


def test_agreement_with_the_listener_through_the_command_line(tmp_path):
    results = os.path.join(ROOT, "tests", "data", "sage_results")
    done = subprocess.run(
        [sys.executable, "evaluate.py", "--agreement",
         *(os.path.join(results, f"{m}_result.jsonl") for m in ("warm", "cold", "mixed")),
         "--personas", os.path.join(ROOT, "tests", "data", "sage_sample.jsonl"),
         "--simulator", "listener", "--bootstrap", "200", "--out", str(tmp_path / "check")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "check" / "results.json").read_text())
    assert report["settings"]["readout"] == "listener" and report["replies"]["unread"] == 0
    rows = [json.loads(line) for line in open(tmp_path / "check" / "appraisals.jsonl")]
    assert all(text.startswith("listener: ") for row in rows for _, text in row["appraisals"])
