"""The fork points (docs/forks.md): each test holds what the method computes from a fork's edit, so
that a fork done the wrong way fails here, before a model loads, not after an hour of training.

- A group advantage (grpo.ADVANTAGES): every row against a hand computation on a group that holds an
  unread dialogue; a row without its hand computation fails too.
- A per-turn advantage (grpo.per_turn_advantages): on real records, each turn's advantage on its own
  agent tokens.
- A reward mode (rl.CREDITS): every mode run on real records of a rollout (not made-up ones), the
  return GAE gives each turn equal to the mode's credit, the critic's start read off a real record.
- The critic's reading position (ppo.critic_values): a turn's value, at its first token, does not
  change when that turn's own tokens do.
- A persona filter (personas.load_personas): the trainers and evaluate.py play exactly the personas
  of --split and --difficulty.
- An evaluation measure (evaluate.MEASURES): on a real evaluation, every figure written with an
  interval has the interval of its own numbers.

    python -m pytest tests/test_forks.py -q
"""
import copy
import json
import math
import os

import pytest
import torch

import evaluate
import grpo
import ppo
import rl
import cli
from conftest import read_metrics
from personas import load_personas
from rollout import ChatTokens, play_dialogues
from simulator import Simulator
from users import RulesBackend

# ----------------------------------------------------------------------------------------------
# Group advantages
# ----------------------------------------------------------------------------------------------
# Group 0: rewards 0.2, 0.5, 0.8 and one unread dialogue (NaN); group 1: 0.1 and 0.7. A row of
# ADVANTAGES sees each group's read dialogues only (mean, std with Bessel's correction, size).
GROUP_REWARDS = torch.tensor([0.2, float("nan"), 0.5, 0.8, 0.1, 0.7], dtype=torch.float64)
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])
STD0, STD1 = 0.3, math.sqrt(0.18)
# Each row's advantages, by hand; a fork that adds a row adds its line here (RLOO, the mean of the
# others as the baseline: (r - mean) x n / (n - 1)).
BY_HAND = {
    "mean-std": [-0.3 / (STD0 + 1e-4), 0.0, 0.0, 0.3 / (STD0 + 1e-4), -0.3 / (STD1 + 1e-4),
                 0.3 / (STD1 + 1e-4)],
    "mean": [-0.3, 0.0, 0.0, 0.3, -0.3, 0.3],
}


@pytest.mark.parametrize("kind", list(grpo.ADVANTAGES))
def test_every_group_advantage_against_its_hand_computation(kind):
    """The unread dialogue gets exactly 0 and counts in no statistic; every other dialogue the row's
    formula of its own group's read dialogues."""
    assert kind in BY_HAND, (f"grpo.ADVANTAGES[{kind!r}] has no hand computation: add the "
                             "advantages it gives this group to BY_HAND (docs/forks.md)")
    advantages = grpo.group_advantages(GROUP_REWARDS, GROUPS, kind)
    assert advantages.tolist() == pytest.approx(BY_HAND[kind], abs=1e-9)
    assert advantages[1] == 0.0


@pytest.mark.parametrize("mode", [m for m, level in grpo.CREDIT_LEVEL.items() if level == "turn"])
def test_per_turn_advantages_on_real_records_land_on_each_turns_own_tokens(mode,
                                                                          real_records_ending_early):
    """GRPO's per-turn credit (grpo.per_turn_advantages, the modes CREDIT_LEVEL gives one advantage
    a turn) on records of a real rollout, three turns, one dialogue ending early: every agent token
    of turn k carries turn k's advantage, every other token 0; the dialogue that ended early has
    one advantage for each turn it played. The hand computations are in test_grpo.py."""
    records, tokenizer, _ = real_records_ending_early
    assert len({len(r["turn_ends"]) for r in records}) > 1  # one ended early
    args = cli.parse_settings(grpo.Settings, ["--reward", mode])
    returns = grpo.turn_returns(records, mode, rl.mode_coefficients(args), 0.0)
    by_turn = grpo.per_turn_advantages(returns, torch.zeros(len(records)), "mean",
                                       args.turn_level_weight)
    mask = rl.pad_records(records, tokenizer.pad_token_id, "cpu")["action_mask"]
    placed = grpo.token_advantages(by_turn, [r["turn_ends"] for r in records], mask)
    for b, record in enumerate(records):
        assert len(by_turn[b]) == len(record["turn_ends"])
        start = 0
        for k, end in enumerate(record["turn_ends"]):
            turn = [t for t in range(start, end + 1) if record["action_mask"][t]]
            assert turn and placed[b, turn].tolist() == pytest.approx([by_turn[b][k]] * len(turn))
            start = end + 1
        assert (placed[b][mask[b] == 0] == 0).all()
    assert any(a != 0 for a in placed.flatten().tolist())


# ----------------------------------------------------------------------------------------------
# Reward modes, on real records
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_records(tiny_model, persona_entry_module):
    """Records of a real rollout: three dialogues of three turns with the rules user, one that
    ends early (a hard user who leaves), as the trainers get them."""
    model, tokenizer = tiny_model
    personas = persona_entry_module
    torch.manual_seed(0)
    records, _ = play_dialogues(model, Simulator(RulesBackend(), start_emotion=30, max_turns=3),
                                personas, chat=ChatTokens(tokenizer, False), max_new_tokens=6,
                                max_context=512, progress=False)
    return records, tokenizer, personas


@pytest.fixture(scope="module")
def real_records_ending_early(tiny_model, persona_entry_module):
    """As real_records, from emotion 15: the rules user's replies to the tiny model's off-topic
    text take the normal and hard users below 10 before the third turn, so they leave early."""
    model, tokenizer = tiny_model
    torch.manual_seed(0)
    records, _ = play_dialogues(model, Simulator(RulesBackend(), start_emotion=15, max_turns=3),
                                persona_entry_module, chat=ChatTokens(tokenizer, False),
                                max_new_tokens=6, max_context=512, progress=False)
    return records, tokenizer, persona_entry_module


@pytest.fixture(scope="module")
def persona_entry_module(tmp_path_factory):
    from conftest import BASE_PERSONA

    entries = [{**BASE_PERSONA, "id": f"r{i}", "difficulty": d}
               for i, d in enumerate(("easy", "normal", "hard"))]
    path = tmp_path_factory.mktemp("forks") / "personas.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return load_personas(str(path))


@pytest.mark.parametrize("mode", list(rl.CREDITS))
def test_every_reward_mode_on_real_records_returns_each_turn_its_credit(mode, real_records):
    """place_rewards and GAE (gamma = lambda = 1, values 0) on records of a real rollout: every
    agent token of turn k returns the mode's credit of turn k, a user token nothing, and the
    critic's start (rl.unmoved_return) is a number. A mode that reads a field records do not have,
    or gives another number of values than turns, fails here."""
    records, tokenizer, personas = real_records
    # the mode's coefficients at their defaults, as the trainers hand them (a fork's mode too: the
    # flag's choices are fixed when rl.py is imported)
    args = cli.parse_settings(rl.TrainerSettings, [])
    args.reward = mode
    coefficients = rl.mode_coefficients(args)
    batch = rl.pad_records(records, tokenizer.pad_token_id, "cpu")
    mask = batch["action_mask"]
    rewards = ppo.place_rewards(records, mask.shape, mode, coefficients, 0.0)
    _, returns = ppo.compute_gae(rewards, torch.zeros_like(mask), mask)
    for b, record in enumerate(records):
        credit = rl.CREDITS[mode](record, **coefficients)
        start = record["action_mask"].index(1)
        for k, end in enumerate(record["turn_ends"]):
            turn = [t for t in range(start, end + 1) if record["action_mask"][t]]
            assert returns[b, turn].tolist() == pytest.approx([credit[k]] * len(turn), abs=1e-6)
            start = end + 1
        assert (returns[b][mask[b] == 0] == 0).all()
    assert math.isfinite(rl.unmoved_return(personas[0], 30, 3, mode, coefficients))


# ----------------------------------------------------------------------------------------------
# The critic's reading position, on real records
# ----------------------------------------------------------------------------------------------
def test_a_turns_value_is_read_before_the_turn_so_its_own_tokens_never_change_it(real_records,
                                                                                tiny_model_dir):
    """The values GAE takes (ppo.critic_values through rl.eval_forward, as step 2 scores them), on
    the records of a real rollout: an agent turn's value, at its first token, is the state's
    before the turn, so giving that turn other tokens leaves it exactly as it was, while the
    values after the turn's first token move. A critic read at the turn's last token (or at the
    token itself) has seen the turn it is the baseline for, and fails here."""
    from policy import load_policy

    records, tokenizer, _ = real_records
    model, _ = load_policy(tiny_model_dir, lora_r=4, lora_alpha=8)
    model.add_adapter("critic", copy.deepcopy(model.peft_config["default"]))
    torch.manual_seed(0)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    batch = rl.pad_records(records, tokenizer.pad_token_id, "cpu")
    mask = batch["action_mask"]                                                           # (B, T)

    def values(input_ids):
        with ppo.adapter_active(model, "critic"):
            return rl.eval_forward(model, {**batch, "input_ids": input_ids}, 2,          # (B, T)
                                   lambda ids, att, _: ppo.critic_values(model, head, ids, att))
    before = values(batch["input_ids"])
    turns = 0
    for b, record in enumerate(records):
        for start, end in zip([0] + [e + 1 for e in record["turn_ends"][:-1]], record["turn_ends"]):
            own = (mask[b, start:end + 1] > 0).nonzero()[:, 0] + start  # the turn's agent tokens
            changed = batch["input_ids"].clone()                                          # (B, T)
            changed[b, own] = (changed[b, own] + 1) % len(tokenizer)
            after = values(changed)
            first = int(own[0])
            assert after[b, first] == before[b, first], (b, start)
            assert not torch.equal(after[b, first + 1:], before[b, first + 1:]), (b, start)
            turns += 1
    assert turns >= 6  # three dialogues of one to three turns


# ----------------------------------------------------------------------------------------------
# A persona filter, honoured by training and evaluation alike
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def split_personas(write_personas, persona_entry):
    """Four train personas (two easy, two hard) and two test ones."""
    entries = [persona_entry(id=f"tr{i}", split="train", difficulty=d)
               for i, d in enumerate(("easy", "hard", "easy", "hard"))]
    entries += [persona_entry(id=f"te{i}", split="test", difficulty="normal") for i in range(2)]
    return write_personas(entries)


def test_trainers_and_evaluate_play_the_personas_of_the_split(split_personas, tiny_model_dir,
                                                              tmp_path):
    """Trained on the train split at --difficulty hard, evaluated on the test split at --difficulty
    easy: every dialogue of each is of its own split, at its own difficulty."""
    common = ["--model", tiny_model_dir, "--simulator", "rules", "--personas", split_personas,
              "--max-turns", "1", "--max-new-tokens", "4", "--max-context", "512"]
    ppo.main(["--preset", "cpu", *common, "--split", "train", "--difficulty", "hard",
              "--iterations", "1", "--dialogues-per-iteration", "4", "--out", str(tmp_path / "ppo")])
    with open(tmp_path / "ppo" / "rollouts.jsonl", encoding="utf-8") as f:
        trained = [json.loads(line) for line in f]
    assert {r["persona_id"] for r in trained} <= {"tr0", "tr1", "tr2", "tr3"} and len(trained) == 4
    assert read_metrics(tmp_path / "ppo")[0]["iteration"] == 1
    played = []
    real_play = evaluate.play_dialogues

    def spy(policy, simulator, personas, *args, **kwargs):
        played.extend((p.id, p.split, p.difficulty) for p in personas)
        return real_play(policy, simulator, personas, *args, **kwargs)
    evaluate.play_dialogues = spy
    try:
        evaluate.main([*common, "--split", "test", "--difficulty", "easy",
                       "--out", str(tmp_path / "eval")])
    finally:
        evaluate.play_dialogues = real_play
    assert played and {p for p in played} == {("te0", "test", "easy"), ("te1", "test", "easy")}
    assert os.path.exists(tmp_path / "eval" / "results.json")


# ----------------------------------------------------------------------------------------------
# An evaluation measure, on a real evaluation
# ----------------------------------------------------------------------------------------------
def intervals(tree, where="results"):
    """(where, figure) for every figure with an interval ({value, low, high}) in a results tree."""
    if isinstance(tree, dict):
        if {"value", "low", "high"} <= tree.keys():
            yield where, tree
        for key, value in tree.items():
            yield from intervals(value, f"{where}.{key}")
    elif isinstance(tree, list):
        for k, value in enumerate(tree):
            yield from intervals(value, f"{where}[{k}]")


def off_their_own_numbers(results):
    """The figures whose interval is not of their own numbers. Over two personas a mean (or a paired
    difference) resampled 2000 times has its 2.5% and 97.5% quantiles at the two personas' own
    numbers (each end has probability 1/4), so its value is the middle of its interval; a figure
    whose interval came from another array ("0% [4000%, 6000%]") is not."""
    return [where for where, x in intervals(results)
            if not x["low"] <= x["value"] <= x["high"]
            or x["value"] != pytest.approx((x["low"] + x["high"]) / 2, abs=1e-9)]


@pytest.fixture(scope="module")
def moved_adapter(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter on the tiny model whose B matrices are random, so it is not the base."""
    from policy import load_policy

    policy, _ = load_policy(tiny_model_dir, lora_r=4, device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    folder = tmp_path_factory.mktemp("moved") / "adapter"
    policy.save_pretrained(str(folder))
    return str(folder)


def test_every_measure_of_an_evaluation_has_the_interval_of_its_own_numbers(
        tiny_model_dir, moved_adapter, tmp_path, monkeypatch):
    """A new measure is an entry of evaluate.MEASURES (here the reply length, the right fork): on a
    real evaluation of two personas, base and an adapter, every figure written with an interval
    (each model's measures, each adapter's gain over the base) has the interval of its own
    numbers, and the score's is the hand computation: the two finals' mean, from the lower to the
    higher. A figure given another array's interval fails (the wrong fork, last)."""
    monkeypatch.setitem(evaluate.MEASURES, "reply_tokens",
                        lambda record: record["policy_tokens"] / len(record["turn_ends"]))
    # an easy and a normal user of the test split: the rules user weighs their replies apart
    from conftest import BASE_PERSONA

    path = tmp_path / "personas.json"
    path.write_text(json.dumps([{**BASE_PERSONA, "id": f"r{i}", "difficulty": d}
                                for i, d in enumerate(("easy", "normal"))]), encoding="utf-8")
    results = evaluate.main(["--model", tiny_model_dir, "--adapter", moved_adapter, "--personas",
                             str(path), "--split", "test", "--simulator", "rules", "--max-turns", "3",
                             "--max-new-tokens", "6", "--thinking", "false", "--out",
                             str(tmp_path / "eval"),
                             # the state tracking's figures are correlations over turns, not means
                             # over personas (tests/test_measures.py holds them by hand)
                             "--state-probe", "false"])
    base, adapter = results["judges"][0]["models"]
    finals = base["per_persona"]["final_emotion"]
    assert len(finals) == 2 and len(set(finals.values())) == 2  # two numbers: the test has teeth
    low, high = sorted(finals.values())
    assert base["measures"]["final_emotion"] == {"value": (low + high) / 2, "low": low, "high": high}
    assert off_their_own_numbers(results) == []
    # every measure, the fork's too, for each model and as each adapter's gain over the base
    assert set(adapter["measures"]) == set(adapter["vs_base"]) == set(evaluate.MEASURES)
    assert {"final_emotion", "collapse", "hidden_named", "reply_tokens"} <= set(evaluate.MEASURES)
    adapter["measures"]["success_rate"] = {"value": 0.5, "low": 40.0, "high": 60.0}  # wrong fork
    assert off_their_own_numbers(results) == ["results.judges[0].models[1].measures.success_rate"]
