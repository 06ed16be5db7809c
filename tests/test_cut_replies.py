"""A reply cut off mid-sentence, read as a person reads it (issue 62): the scripted users see only the
reply's text, so users.stops_mid_sentence decides from it (no sentence end, quote or emoji at its
end), both users count it against the reply as a part of its own, and on real rollouts of the
embedded model the text rule agrees with the record's `cut` flag (the reply met --max-new-tokens).

    python -m pytest tests/test_cut_replies.py -q
"""
import pytest
import torch

from personas import load_personas
from rollout import ChatTokens, play_dialogues
from simulator import Simulator
from users import (LISTENER_WEIGHTS, RULES_WEIGHTS, ListenerBackend, RulesBackend,
                   listener_appraisal, rules_appraisal, stops_mid_sentence)

FINISHED = ["That sounds exhausting. What happened on Sunday?", "I'm here. 😊", "You said \"enough.\"",
            "Take your time...", "Wow!!", "(That matters.)", "**That matters.**", "你辛苦了。",
            "你愿意多说一点吗？", "加油哦~", "Okay.\n", "...", "", "   ", "Love that ❤️", "ok :)",
            "Well done 👍🏽"]
CUT = ["That sounds exhausting, and I can imagine that", "I hear you. It must be hard when your",
       "Here is what I would try:", "You deserve a break,", "1. Talk to your manager\n2. Ask for",
       "你一定很累，因为", "I'm sorry 😊 but the"]


@pytest.mark.parametrize("reply", FINISHED)
def test_a_finished_reply_is_not_cut(reply):
    assert not stops_mid_sentence(reply)


@pytest.mark.parametrize("reply", CUT)
def test_a_reply_that_stops_mid_sentence_is_cut(reply):
    assert stops_mid_sentence(reply)


@pytest.mark.parametrize("difficulty", ["easy", "normal", "hard"])
@pytest.mark.parametrize("appraisal, points, weights", [(rules_appraisal, -4, RULES_WEIGHTS),
                                                        (listener_appraisal, -3, LISTENER_WEIGHTS)])
def test_both_users_count_a_cut_reply_against_it_as_a_part_of_its_own(appraisal, points, weights,
                                                                        difficulty, persona_entry,
                                                                        write_personas):
    """The same words finished and cut off: the cut one has the part cut_off, its points in the
    line, its weight the difficulty's for bad parts, what set it off the reply's last words; its
    other parts are the finished one's (a part of its own, not a discount on them)."""
    persona, = load_personas(write_personas([persona_entry(difficulty=difficulty)]))
    state = Simulator(RulesBackend()).start(persona)
    words = "I'm sorry, that sounds so painful after that promotion. What hurts the most"
    finished, why_finished, parts_finished = appraisal(state, words + "?")
    cut, why_cut, parts_cut = appraisal(state, words + " about it, and")
    user = why_cut.split(":")[0]
    assert f"cut_off{points}" in why_cut and "cut_off" not in why_finished
    weight = weights[difficulty][1]
    assert parts_cut["cut_off"] == {"points": points, "weight": weight,
                                    "value": round(points * weight, 2),
                                    "found": ["most about it, and"]}
    others = {k: p for k, p in parts_cut.items() if k not in ("cut_off", "one_question", "asks")}
    assert others == {k: p for k, p in parts_finished.items()
                      if k not in ("one_question", "asks")}, user
    assert cut < finished


@pytest.mark.smollm2
def test_the_text_rule_agrees_with_the_records_cut_flag_on_real_rollouts(smollm2):
    """16 one-turn dialogues of the embedded model at 48 tokens (the cpu-learn preset's), sampled at
    seed 0: most replies meet the limit, some end first. The text rule agrees with the record's
    `cut` on most replies (95% of 104 when it was written), and the rules user's cut_off part is
    set exactly where the text rule says so."""
    model, tokenizer = smollm2
    personas = load_personas("personas.json", "train")[:8]
    torch.manual_seed(0)
    records, _ = play_dialogues(model, Simulator(RulesBackend(), start_emotion=30, max_turns=1),
                                personas, 2, chat=ChatTokens(tokenizer, False), max_new_tokens=48,
                                max_context=1024, progress=False)
    turns = [t for r in records for t in r["turns"] if t["role"] == "agent"]
    flags = [t["cut"] for t in turns]
    read = [stops_mid_sentence(t["text"]) for t in turns]
    agree = sum(f == r for f, r in zip(flags, read)) / len(turns)
    print(f"\n{len(turns)} replies, {sum(flags)} cut by the record, {sum(read)} by the text; "
          f"agreement {agree:.2f}")
    assert 2 <= sum(flags) <= len(turns) - 2  # both kinds are there to agree on
    assert agree >= 0.8
    assert [("cut_off" in t["parts"]) for t in turns] == read


def test_the_listener_plays_as_a_scripted_user_with_its_own_line(persona):
    sim = Simulator(ListenerBackend(), start_emotion=50)
    state = sim.start(persona)
    sim.step([state], ["I'm sorry to hear that, it sounds hard and"])
    appraisal = state.appraisals[-1]
    assert sim.readout == "listener" and appraisal["appraisal"].startswith("listener: ")
    assert "cut_off-3" in appraisal["appraisal"] and state.history[-1]["canned"] is True
