"""A user backend's contract (docs/forks.md, "a new judge / user backend"): chat(conversations,
max_new_tokens[, repetition_penalty]) answers one text per conversation asked, in order.
Simulator.ask holds every backend to it where the answers come back (the appraisal, its re-ask, the
user's next message): a backend that answers another number of times is a SimulatorError, one line,
never a dialogue that silently loses its turn (zip would pair the answers with the first
conversations and drop the rest).

    python -m pytest tests/test_user_backends.py -q
"""
from collections import Counter

import pytest
import torch

import cli
from personas import load_personas
from rollout import ChatTokens, play_dialogues
from simulator import PROMPTS, Simulator, SimulatorError


def kind(conversation):
    """Which of the simulator's three questions a conversation asks."""
    last = conversation[-1]["content"]
    if last == PROMPTS["en"]["retry"].format(m=10):
        return "re-ask"
    return "appraisal" if "Change: N" in last else "user message"


class CachingBackend:
    """A backend that keeps the contract (dedupe None), or answers each distinct conversation of
    one kind once, as a cache in front of a server might: two identical conversations, one answer."""
    name = "url"

    def __init__(self, dedupe=None, appraisal="Got right: it listened.\nChange: +2", extra=0):
        self.dedupe, self.appraisal, self.extra = dedupe, appraisal, extra
        self.counts = Counter()

    def chat(self, conversations, max_new_tokens, repetition_penalty=None):
        asked = conversations
        if conversations and kind(conversations[0]) == self.dedupe:
            asked = list({repr(c): c for c in conversations}.values())
        answers = {"appraisal": self.appraisal, "re-ask": "Change: +1", "user message": "Go on."}
        return [answers[kind(c)] for c in asked] + ["Change: +9"] * self.extra


def twins(persona_entry, write_personas):
    """Two users alike in every way: their conversations with the simulator are identical."""
    return load_personas(write_personas([persona_entry(id="a"), persona_entry(id="b")]))


@pytest.mark.parametrize("where", ["appraisal", "re-ask", "user message"])
def test_a_backend_that_answers_identical_conversations_once_is_one_line(where, persona_entry,
                                                                        write_personas):
    a, b = twins(persona_entry, write_personas)
    # the re-ask: every first appraisal unread (no change line), so both are asked again, alike
    appraisal = "Got right: nothing." if where == "re-ask" else "Change: +2"
    for dedupe in (None, where):
        sim = Simulator(CachingBackend(dedupe, appraisal), max_turns=3)
        states = [sim.start(a), sim.start(b)]
        if dedupe is None:
            sim.step(states, ["That sounds hard.", "That sounds hard."])
            assert [s.turns for s in states] == [1, 1] and states[0].history == states[1].history
            assert states[0].history[-1]["text"] == "Go on."
            continue
        with pytest.raises(SimulatorError) as stop:
            sim.step(states, ["That sounds hard.", "That sounds hard."])
        assert "answered 1 time(s) for 2 conversation(s)" in str(stop.value)
        assert isinstance(stop.value, cli.Stop)  # a script ends with this one line, exit 2


def test_a_backend_that_answers_too_often_is_one_line(persona_entry, write_personas):
    sim = Simulator(CachingBackend(extra=1))
    states = [sim.start(p) for p in twins(persona_entry, write_personas)]
    with pytest.raises(SimulatorError, match="answered 3 time.s. for 2 conversation"):
        sim.appraise(states, ["Okay.", "Okay."])


def test_a_rollout_never_loses_a_turn_to_a_backend_that_breaks_it(tiny_model, persona_entry,
                                                                  write_personas):
    """Two greedy dialogues of one persona are the same conversation turn by turn: a deduplicating
    backend stops the rollout with the one line; the backend that keeps the contract plays both."""
    model, tokenizer = tiny_model
    persona, = load_personas(write_personas([persona_entry()]))
    for dedupe in (None, "appraisal"):
        torch.manual_seed(0)
        play = lambda: play_dialogues(model, Simulator(CachingBackend(dedupe), max_turns=2),
                                      [persona], 2, chat=ChatTokens(tokenizer, False), greedy=True,
                                      max_new_tokens=4, max_context=512, progress=False)
        if dedupe:
            with pytest.raises(SimulatorError, match="a backend answers each conversation asked"):
                play()
        else:
            records, _ = play()
            assert [len(r["changes"]) for r in records] == [2, 2]
