"""The path our users run, an LLM user whose appraisals a parser reads, trained on in CI.

ppo.py and grpo.py train a tiny model for two iterations against a user behind an OpenAI-compatible
server on 127.0.0.1 (conftest.fake_user): each appraisal is a text of tests/data/appraisals.jsonl, in
the formats models write (a third of them unreadable), and each message of the user a text of
tests/data/farewells.jsonl. From what rollouts.jsonl stored, every dialogue is replayed with the
corpora's own values: each change, each end, each reward and the count of unread dialogues must be
exactly what the replay gives."""
import json

import numpy as np
import pytest

import grpo
import ppo
from conftest import corpus, read_metrics

MARK = "\n\n(re-asked for the change) "  # how the simulator stores an appraisal and its re-ask
STATED = {e["text"].strip(): None if e["change"] == "unread" else e["change"]
          for e in corpus("appraisals.jsonl")}
CLOSES = {e["text"].strip(): e["closes"] for e in corpus("farewells.jsonl")}
START, MAX_CHANGE, LEAVE_BELOW, MAX_TURNS = 30, 10, 10, 2


def replay(record):
    """(changes, end reason) of a stored dialogue, rebuilt from the corpora's values: the change a text
    states, re-asked when unread or off the scale, unread when still so, the mood clamped to [0, 100]."""
    emotion, changes = START, []
    agent = [t for t in record["turns"] if t["role"] == "agent"]
    users = [t["text"] for t in record["turns"] if t["role"] == "user"][1:]  # after the opening
    # the opening is the persona's own line, every later message the model's; a model's appraisal
    # text explains its change (no rules parts)
    assert [t["canned"] for t in record["turns"] if t["role"] == "user"] == [True] + [False] * len(users)
    assert all(turn["parts"] is None for turn in agent)
    for k, turn in enumerate(agent):
        first, asked, again = turn["appraisal"].partition(MARK)
        stated = STATED[first]
        assert bool(asked) == (stated is None or abs(stated) > MAX_CHANGE)  # re-asked exactly then
        if asked:
            stated = STATED[again.strip()]
        if stated is None or abs(stated) > MAX_CHANGE:
            return changes + [None], "unread"
        moved = max(0, min(100, emotion + stated)) - emotion
        emotion += moved
        changes.append(moved)
        for reason, ends in (("success", emotion >= 100),
                             ("left", emotion < LEAVE_BELOW),
                             ("max_turns", k + 1 >= MAX_TURNS),
                             ("goodbye", k < len(users) and CLOSES[users[k]])):
            if ends:
                return changes, reason
    raise AssertionError("a dialogue that never ended")


def rollouts(out):
    with open(out / "rollouts.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def common(model_dir, personas, server, out):
    return ["--preset", "cpu", "--model", str(model_dir), "--simulator", server.url, "--personas", personas,
            "--split", "test", "--iterations", "2", "--max-turns", str(MAX_TURNS), "--max-new-tokens", "6",
            "--max-context", "2048", "--lora-r", "4", "--lora-alpha", "8", "--lr", "1e-3", "--seed", "3",
            "--out", str(out)]


@pytest.fixture
def many_personas(write_personas, persona_entry):
    return write_personas([persona_entry(id=f"p{i}") for i in range(8)])


def check_replay(out):
    """Every stored dialogue against its replay; each iteration's reward and counts against the
    dialogues. Returns the dialogues and the metrics."""
    dialogues, metrics = rollouts(out), read_metrics(out)
    for d in dialogues:
        assert (d["changes"], d["end_reason"]) == replay(d), d["persona_id"]
        read = d["end_reason"] != "unread"
        assert d["emotions"][-1] == (d["final_emotion"] if read else None)
    for m in metrics:
        mine = [d for d in dialogues if d["iteration"] == m["iteration"]]
        read = [d for d in mine if d["end_reason"] != "unread"]
        assert m["unread_dialogues"] == len(mine) - len(read)
        assert m["reward_mean"] == pytest.approx(sum(d["final_emotion"] / 100 for d in read) / len(read))
        # only the read dialogues' tokens entered the loss
        assert m["update_tokens"] == sum(d["policy_tokens"] for d in read)
    return dialogues, metrics


def test_ppo_trains_on_an_llm_users_stated_judgments(tiny_model_dir, many_personas, fake_user, tmp_path):
    out = tmp_path / "run"
    ppo.main(common(tiny_model_dir, many_personas, fake_user, out) + ["--dialogues-per-iteration", "8",
                                                                        "--minibatch-size", "8"])
    dialogues, metrics = check_replay(out)
    reasons = {d["end_reason"] for d in dialogues}
    assert {"unread", "goodbye"} <= reasons and len(reasons) >= 3  # the corpora's cases do occur
    assert all(m["actor_grad_norm"] is not None for m in metrics)  # and the read ones were trained on


def test_grpo_trains_on_an_llm_users_stated_judgments(tiny_model_dir, many_personas, fake_user, tmp_path):
    out = tmp_path / "run"
    grpo.main(common(tiny_model_dir, many_personas, fake_user, out) + ["--personas-per-iteration", "4",
                                                                         "--group-size", "3",
                                                                         "--minibatch-size", "12"])
    dialogues, metrics = check_replay(out)
    assert any(d["end_reason"] == "unread" for d in dialogues)
    # a group's statistics are over its read dialogues: a group with fewer than two has nothing to learn
    for m in metrics:  # a group: 3 consecutive dialogues of an iteration
        mine = [d for d in dialogues if d["iteration"] == m["iteration"]]
        groups = [[d["final_emotion"] for d in mine[k:k + 3] if d["end_reason"] != "unread"]
                  for k in (0, 3, 6, 9)]
        assert m["zero_spread_groups"] == sum(len(set(g)) < 2 for g in groups)
        # the std of the groups with one: those with two read dialogues or more
        stds = [np.std(g, ddof=1) / 100 for g in groups if len(g) >= 2]
        assert m["group_reward_std"] == (pytest.approx(np.mean(stds)) if stds else None)
