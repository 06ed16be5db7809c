"""A dialogue's record explains its reward (issue 54): rollouts.jsonl of a real run holds the
persona's difficulty, each agent turn's change and the rules user's parts it adds up from (each with
its points, its difficulty weight and what set it off: issue 66), each user
message marked canned or not, and what the trainer made of it: PPO the reward placed on each agent
turn (rl.turn_rewards) and the turn's advantage, GRPO the dialogue's reward and each turn's advantage
(--reward final: grpo.group_advantages over the records' own rewards, the same on every turn;
turn: grpo.per_turn_advantages over their turns' returns)."""
import argparse
import json

import pytest
import torch

import grpo
import ppo
from rl import mode_coefficients, turn_rewards
from simulator import apply_change
from test_learning import install_stand_in
from users import RULES_WEIGHTS


def trained(trainer, tiny_model_dir, personas_file, out, *flags):
    """One iteration of trainer on the tiny model against the rules user, two turns: the run's
    settings and its rollouts.jsonl."""
    trainer.main(["--preset", "cpu", "--model", tiny_model_dir, "--simulator", "rules",
                  "--personas", personas_file, "--split", "test", "--max-turns", "2",
                  "--max-new-tokens", "6", "--max-context", "512", "--lora-r", "4",
                  "--lora-alpha", "8", "--iterations", "1", "--out", str(out), *flags])
    with open(out / "config.json", encoding="utf-8") as f:
        args = argparse.Namespace(**json.load(f))
    with open(out / "rollouts.jsonl", encoding="utf-8") as f:
        return args, [json.loads(line) for line in f]


def check_the_users_side(record, max_change=10):
    """The difficulty, each agent turn's change from its parts by the record's own arithmetic (each
    part's value its points x its weight, the weight its side's for the record's difficulty; their
    sum rounded, then clamped as apply_change clamps, from the emotion before the turn) and the
    canned user lines. A tiny model's reply always has a part: it is off topic at least."""
    assert record["difficulty"] in ("easy", "normal", "hard")
    agent = [t for t in record["turns"] if t["role"] == "agent"]
    assert [t["change"] for t in agent] == record["changes"]
    emotion = record["start_emotion"]
    for turn in agent:
        good, bad = RULES_WEIGHTS[record["difficulty"]]
        good *= not turn["appraisal"].startswith("rules: repeats")  # a repeat's good parts: 0
        parts = turn["parts"].values()
        assert parts and all(p["value"] == round(p["points"] * p["weight"], 2) for p in parts), turn
        assert all(p["weight"] == (bad if p["points"] < 0 else good) for p in parts), turn
        stated = round(sum(p["value"] for p in parts))
        assert apply_change(emotion, stated, max_change) == (turn["emotion"], turn["change"]), turn
        emotion = turn["emotion"]
    users = [t for t in record["turns"] if t["role"] == "user"]
    assert users and all(t["canned"] is True for t in users)  # the opening, then the band lines
    return agent


def test_ppo_records_the_reward_placed_on_each_turn_and_its_advantage(tiny_model_dir,
                                                                       personas_file, tmp_path):
    args, records = trained(ppo, tiny_model_dir, personas_file, tmp_path / "run",
                            "--dialogues-per-iteration", "3", "--minibatch-size", "3",
                            "--format-penalty", "0.1", "--thinking", "true")
    weighted = []
    for r in records:
        agent = check_the_users_side(r)
        placed = turn_rewards(r, args.reward, mode_coefficients(args), args.format_penalty)
        assert r["rewards"] == pytest.approx(placed, abs=1e-6)
        assert len(r["advantages"]) == len(agent)
        weighted += [(a, t["tokens"]) for a, t in zip(r["advantages"], agent)]
    # each a turn's mean of the whitened advantages: weighted by the turns' tokens they average to 0
    mean = sum(a * n for a, n in weighted) / sum(n for _, n in weighted)
    assert abs(mean) < 1e-5 and any(abs(a) > 0.1 for a, _ in weighted)


@pytest.mark.parametrize("reward", ["final", "turn"])
def test_grpo_records_each_dialogues_reward_and_each_turns_advantage(tiny_model_dir, personas_file,
                                                                    tmp_path, monkeypatch, reward):
    # the rules user gives the tiny model's replies one reward in a group (all off topic): the
    # learning tests' user, whose reward is the share of a quarter of the vocabulary, varies
    install_stand_in(monkeypatch, grpo, turns=2)
    args, records = trained(grpo, tiny_model_dir, personas_file, tmp_path / "run",
                            "--personas-per-iteration", "2", "--group-size", "3",
                            "--minibatch-size", "6", "--reward", reward)
    coefficients = mode_coefficients(args)
    for r in records:
        assert r["reward"] == pytest.approx(sum(turn_rewards(r, args.reward, coefficients)))
    rewards = torch.tensor([r["reward"] for r in records], dtype=torch.float64)
    groups = torch.arange(len(records)) // args.group_size
    if reward == "final":  # the dialogue's advantage against its group, on each of its turns
        by_dialogue = grpo.group_advantages(rewards, groups, args.group_advantage).tolist()
        expected = [[a] * len(r["changes"]) for r, a in zip(records, by_dialogue)]
    else:  # each turn's own: its return against its group's at the same turn, and the batch's
        returns = grpo.turn_returns(records, args.reward, coefficients, args.format_penalty)
        expected = grpo.per_turn_advantages(returns, groups, args.group_advantage,
                                            args.turn_level_weight)
    assert [len(r["advantages"]) for r in records] == [2] * len(records)
    for r, by_turn in zip(records, expected):
        assert r["advantages"] == pytest.approx(by_turn)
    assert sum(a != 0 for by_turn in expected for a in by_turn) >= 3
    if reward == "turn":  # the turns of a dialogue differ: each has its own
        assert any(a != b for a, b in (r["advantages"] for r in records))
