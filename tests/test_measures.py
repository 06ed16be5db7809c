"""The measures of issue 64 (measures.py, evaluate.MEASURES): the collapse rate, hidden intentions named
and the state tracking, by hand on small records and by persona type; the probe that asks the policy how
the user feels, which never changes a dialogue (the same dialogues with it on and off, on a tiny model);
bad persona types and an empty split, one line before any model loads.

    OMP_NUM_THREADS=1 python -m pytest tests/test_measures.py -q
"""
import json
import os

import pytest
import torch

import evaluate
from conftest import BASE_PERSONA, ROOT, in_process
from measures import (NAMED_CHANGE, hidden_named, probe_messages, probe_states, read_estimate, tracking,
                      tracking_gain)
from personas import Persona
from simulator import RE_ASKED
from test_bad_input import assert_one_line

ADVERSARIAL = os.path.join(ROOT, "adversarial.json")


def record(persona_id, kind, final, end_reason="max_turns", named=(), emotions=(), estimates=()):
    """The fields of a dialogue's record that model_summary and measures.py read."""
    return {"persona_id": persona_id, "type": kind, "final_emotion": final, "end_reason": end_reason,
            "turn_ends": list(range(max(1, len(emotions)))), "policy_tokens": 10, "violations": 0,
            "cut_replies": 0, "hidden_named": list(named), "emotions": list(emotions),
            "state_estimates": list(estimates)}


def turns(*pairs):
    """A record's turns: the opening, then (agent reply, its appraisal, the user's answer or None)."""
    out = [{"role": "user", "text": "my opening"}]
    for reply, appraisal, answer in pairs:
        out.append({"role": "agent", "text": reply, "appraisal": appraisal, "parts": None})
        if answer is not None:
            out.append({"role": "user", "text": answer})
    return out


# ----------------------------------------------------------------------------------------------
# By hand
# ----------------------------------------------------------------------------------------------
def test_collapse_and_hidden_named_are_shares_of_dialogues_by_hand_and_by_type():
    """collapse: the user left, or the dialogue ended below 10 for another reason (an unread appraisal
    at 8); hidden named: any reply of the dialogue named it. Each a mean over personas, by type too,
    and an adapter's gain the paired difference."""
    base = [record("a", "gaslighting", 5, "left"), record("b", "gaslighting", 50, named=[False, True]),
            record("c", "withdrawal", 8, "unread", named=[False])]
    adapter = [record("a", "gaslighting", 45), record("b", "gaslighting", 70, named=[True, True]),
               record("c", "withdrawal", 60, named=[True])]
    mine = evaluate.model_results(base, None, False, n_boot=200)
    assert mine["per_persona"]["collapse"] == {"a": 1.0, "b": 0.0, "c": 1.0}
    assert mine["per_persona"]["hidden_named"] == {"a": 0.0, "b": 1.0, "c": 0.0}
    assert mine["measures"]["collapse"]["value"] == pytest.approx(2 / 3)
    assert list(mine["by_type"]) == ["gaslighting", "withdrawal"] and "vs_base" not in mine
    gaslighting = mine["by_type"]["gaslighting"]
    assert gaslighting["dialogues"] == 2
    assert gaslighting["measures"]["collapse"] == {"value": 0.5, "low": 0.0, "high": 1.0}
    theirs = evaluate.model_results(adapter, base, False, n_boot=200)
    assert theirs["vs_base"]["collapse"]["value"] == pytest.approx(-2 / 3)
    assert theirs["vs_base"]["hidden_named"]["value"] == pytest.approx(1 / 3)  # c: named now; b: both
    assert theirs["by_type"]["withdrawal"]["vs_base"]["final_emotion"]["value"] == 52.0
    assert "tracking" not in theirs  # not probed


def test_state_tracking_by_hand():
    """Every turn of every dialogue pooled: a turn whose appraisal or estimate did not read is left out
    (the estimate counted unread). Pairs (40, 10), (50, 20), (60, 90), (30, 35): ranks 2 3 4 1 against
    1 2 4 3, rho = 1 - 6 x 6 / (4 x 15) = 0.4; MAE (30 + 30 + 30 + 5) / 4 = 23.75."""
    base = [record("a", "escalation", 60, emotions=[40, 50, 60], estimates=[10, 20, 90]),
            record("b", "escalation", 30, emotions=[30, None], estimates=[35, 70]),
            record("c", "escalation", 30, emotions=[30], estimates=[None])]
    found = tracking(base, n_boot=200)
    assert found["spearman"]["value"] == pytest.approx(0.4)
    assert found["mae"]["value"] == pytest.approx(23.75)
    assert (found["probes"], found["unread"]) == (6, 1)
    # an adapter that reads the user exactly: rho 1, MAE 0, paired with the base by persona
    exact = [{**r, "state_estimates": [e for e in r["emotions"]]} for r in base]
    gain = tracking_gain(exact, base, n_boot=200)
    assert gain["spearman"]["value"] == pytest.approx(0.6)
    assert gain["mae"]["value"] == pytest.approx(-23.75)
    assert gain["mae"]["low"] <= gain["mae"]["value"] <= gain["mae"]["high"]
    # nothing to compare: no figure, the count alone
    blind = tracking([record("a", "escalation", 40, emotions=[40], estimates=[None])])
    assert (blind["spearman"], blind["mae"], blind["unread"]) == (None, None, 1)


def test_a_model_user_names_the_hidden_intention_by_its_appraised_change():
    """A model user's appraisal names it at NAMED_CHANGE or more, read as the simulator reads it: the
    re-ask's answer where there was one; a change line the agent's reply supplied is the agent's, not
    the user's; an unread one names nothing."""
    persona = Persona(**BASE_PERSONA)
    r = {"turns": turns(("a reply", f"Got right: a lot.\nChange: +{NAMED_CHANGE}", "go on"),
                        ("a reply", f"Change: +{NAMED_CHANGE - 1}", "hm"),
                        ("I'd say Change: +9", "Inner reaction: yes\nChange: +9", "ok"),
                        ("a reply", "Change: 33" + RE_ASKED + "Change: +6", "ok"),
                        ("a reply", "I cannot say.", None))}
    assert hidden_named(r, persona, scripted=False) == [True, False, False, True, False]


def test_a_scripted_user_names_it_by_the_words_the_user_never_said():
    """BASE_PERSONA's hidden intention: "wants to hear that feeling hurt does not make her petty or
    ungrateful": a reply that says petty and ungrateful names it; once the user has said them, it
    does not."""
    persona = Persona(**BASE_PERSONA)
    reply = "Being hurt by this doesn't make you petty or ungrateful."
    r = {"turns": turns(("what happened?", "rules: asks+3", "i'm being so petty and ungrateful"),
                        (reply, "rules: ...", None))}
    assert hidden_named(r, persona, scripted=True) == [False, False]
    r = {"turns": turns((reply, "rules: ...", "maybe"), ("what happened?", "rules: asks+3", None))}
    assert hidden_named(r, persona, scripted=True) == [True, False]


def test_the_probe_asks_after_each_reply_with_the_users_answer_and_reads_a_number():
    r = {"turns": turns(("reply one", "", "answer one"), ("reply two", "", None))}
    chats = probe_messages(r, "en")
    assert len(chats) == 2  # one an agent turn
    first, second = (c[1]["content"] for c in chats)
    assert '"reply one"' in first and '"answer one"' in first and "reply two" not in first
    assert second.endswith(first[first.index("\n\nHow"):]) and '"reply two"' in second
    transcript = first[:first.index("\n\nHow")]
    assert second.startswith(transcript)  # the probe's cache runs only the new turn
    assert [c[0]["content"] for c in chats] == [chats[0][0]["content"]] * 2
    zh = probe_messages(r, "zh")[0][1]["content"]
    assert "对方" in zh and "支持伙伴" in zh
    answers = ("72", "about 40, maybe 50", "150", "none", "")
    assert [read_estimate(a) for a in answers] == [72, 40, None, None, None]


# ----------------------------------------------------------------------------------------------
# On a tiny model: the probe never changes a dialogue
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_types(tmp_path_factory):
    """Two users of adversarial.json, of two types, in their split."""
    entries = json.load(open(ADVERSARIAL, encoding="utf-8"))
    picked = [next(e for e in entries if e["type"] == kind) for kind in ("gaslighting", "withdrawal")]
    path = tmp_path_factory.mktemp("two_types") / "two.json"
    path.write_text(json.dumps(picked), encoding="utf-8")
    return str(path)


def test_the_same_dialogues_with_the_probe_on_and_off(tiny_model_dir, two_types, tmp_path, capsys):
    """evaluate.py, in process, on a tiny random model, the rules user: with --state-probe true and
    false, the transcripts are the same but for the estimates; on, one estimate an agent turn, counted
    in the results, and the tables by type."""
    runs = {}
    for probe in ("true", "false"):
        out = tmp_path / probe
        code, stdout, _ = in_process(evaluate.main, [
            "--model", tiny_model_dir, "--personas", two_types, "--split", "adversarial", "--simulator",
            "rules", "--max-turns", "2", "--max-new-tokens", "6", "--thinking", "false", "--bootstrap", "20",
            "--state-probe", probe, "--out", out], capsys)
        assert code == 0
        runs[probe] = ([json.loads(line) for line in open(out / "transcripts.jsonl", encoding="utf-8")],
                       json.load(open(out / "results.json", encoding="utf-8")), stdout)
    (probed, results, stdout), (plain, _, plain_stdout) = runs["true"], runs["false"]
    assert [{k: v for k, v in r.items() if k != "state_estimates"} for r in probed] == plain
    assert all("state_estimates" not in r for r in plain)
    # one estimate an agent turn
    assert [len(r["state_estimates"]) for r in probed] == [len(r["emotions"]) for r in probed]
    base = results["judges"][0]["models"][0]
    assert base["tracking"]["probes"] == sum(len(r["emotions"]) for r in probed)
    assert list(base["by_type"]) == ["gaslighting", "withdrawal"]
    for kind, dialogues in (("gaslighting", 1), ("withdrawal", 1), ("all", 2)):
        assert f"| {kind} | base | {dialogues} |" in stdout
    assert "not probed (--state-probe false)" in plain_stdout


def test_the_probe_draws_no_random_number(tiny_model):
    """Greedy and apart from the dialogue: torch's random stream is where it was."""
    model, tokenizer = tiny_model
    r = {"turns": turns(("reply one", "", "answer one"), ("reply two", "", None))}
    before = torch.random.get_rng_state()
    estimates = probe_states(model, tokenizer, [r, r], ["en", "en"], 512)
    assert torch.equal(before, torch.random.get_rng_state())
    assert [len(e) for e in estimates] == [2, 2] and estimates[0] == estimates[1]


# ----------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------
def test_a_bad_type_or_an_empty_split_is_one_line_before_any_model_loads(
        persona_entry, write_personas, tmp_path, capsys, monkeypatch):
    def loaded(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("policy.load_model", loaded)
    monkeypatch.setattr(evaluate, "load_policy", loaded)
    path = write_personas([persona_entry(id="p1", type="sulking")])
    out = tmp_path / "eval"
    argv = ["--personas", path, "--simulator", "rules", "--out", out]
    code, _, err = in_process(evaluate.main, argv, capsys)
    assert_one_line(code, err, path, "entry p1", "'type'", "'sulking'", "withdrawal")
    code, _, err = in_process(evaluate.main, ["--personas", os.path.join(ROOT, "personas.json"), "--split",
                                              "adversarial", "--simulator", "rules", "--out", out], capsys)
    assert_one_line(code, err, "personas.json", "no personas in split 'adversarial'", "splits: train, test")
    assert not out.exists()


def test_the_probe_flag_with_a_mode_that_plays_no_dialogue_is_refused(tmp_path, capsys):
    for mode in (["--agreement", "x.jsonl"], ["--write-openings", str(tmp_path / "o.jsonl")]):
        code, _, err = in_process(evaluate.main, [*mode, "--state-probe", "false"], capsys)
        assert_one_line(code, err, "--state-probe", "--agreement and --write-openings")
