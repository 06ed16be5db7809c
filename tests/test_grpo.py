"""grpo.py: the method's pure functions against hand computation, group rollouts, then the script
end to end at tiny sizes (a 2-layer random Llama on the smollm2 tokenizer, the rules user).

    OMP_NUM_THREADS=1 python -m pytest tests/test_grpo.py -q
"""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import grpo
import rl
import cli
from conftest import ROOT, read_metrics
from personas import load_personas
from rollout import ChatTokens, play_dialogues
from simulator import Simulator
from users import RulesBackend


# ----------------------------------------------------------------------------------------------
# Rewards and group advantages
# ----------------------------------------------------------------------------------------------
def fake_record(changes, final, violations=(), end_reason="max_turns"):
    """A dialogue's record as play_dialogues writes it, for dialogue_rewards."""
    turns, emotions = [], [final - sum(changes[k + 1:]) for k in range(len(changes))]
    for i in range(len(changes)):
        turns += [{"role": "user", "text": "u"}, {"role": "agent", "text": "a",
                                                  "violation": "no_think" if i in violations else None}]
    return {"changes": changes, "final_emotion": final, "turns": turns, "emotions": emotions,
            "start_emotion": final - sum(changes), "end_reason": end_reason}


def test_dialogue_rewards_final_turn_and_format_penalty():
    records = [fake_record([4, -2, 8], 70, violations=(0, 2)), fake_record([10], 40),
               fake_record([3], 33, end_reason="unread")]
    final = grpo.dialogue_rewards(records, "final", {}, 0.0)
    turn = grpo.dialogue_rewards(records, "turn", {}, 0.0)
    penalised = grpo.dialogue_rewards(records, "final", {}, 0.1)
    assert final.tolist()[:2] == pytest.approx([0.70, 0.40]) and final[2].isnan()  # unread: no reward
    assert turn.tolist()[:2] == pytest.approx([0.10, 0.10])
    assert penalised.tolist()[:2] == pytest.approx([0.70 - 2 * 0.1, 0.40])  # two violating turns


def test_a_groups_statistics_are_over_its_read_dialogues():
    """An unread dialogue (NaN) is left out of its group's mean and std and gets 0; a group with fewer
    than two read dialogues has nothing to compare and gets 0."""
    nan = float("nan")
    rewards = torch.tensor([0.3, nan, 0.5, 0.6, nan, nan], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    advantages = grpo.group_advantages(rewards, groups, "mean")
    assert advantages.tolist() == pytest.approx([-0.1, 0.0, 0.1, 0.0, 0.0, 0.0])
    scaled = grpo.group_advantages(rewards, groups, "mean-std")
    std = torch.tensor([0.3, 0.5]).std().item()
    assert scaled.tolist() == pytest.approx([-0.1 / (std + 1e-4), 0.0, 0.1 / (std + 1e-4), 0.0, 0.0, 0.0])


# Group 0 has a spread, group 1 is flat (every dialogue ended the same). Interleaved on purpose:
# groups are found by id, not by position.
GROUP_REWARDS = torch.tensor([0.3, 0.4, 0.5, 0.4, 0.7, 0.4], dtype=torch.float64)
GROUPS = torch.tensor([0, 1, 0, 1, 0, 1])
EPS = 1e-4
STD0 = math.sqrt(((0.3 - 0.5) ** 2 + 0 + (0.7 - 0.5) ** 2) / 2)  # Bessel: n - 1 = 2 -> 0.2


@pytest.mark.parametrize("kind,expected", [
    ("mean-std", [-0.2 / (STD0 + EPS), 0, 0, 0, 0.2 / (STD0 + EPS), 0]),
    ("mean", [-0.2, 0, 0, 0, 0.2, 0]),
])
def test_group_advantages_by_hand(kind, expected):
    adv = grpo.group_advantages(GROUP_REWARDS, GROUPS, kind)
    assert torch.isfinite(adv).all()
    assert adv.tolist() == pytest.approx(expected, abs=1e-12)
    # the flat group gets exactly zero, not round-off divided by eps
    assert (adv[GROUPS == 1] == 0).all()


def test_group_advantages_flat_group_alone():
    flat = grpo.group_advantages(torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64), torch.tensor([5, 5, 5]),
                                "mean-std")
    assert flat.tolist() == [0.0, 0.0, 0.0]  # not round-off / eps
    unit = grpo.group_advantages(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0, 0, 0]), "mean-std")
    # std (Bessel) of 1, 2, 3 is 1
    assert unit.tolist() == pytest.approx([-1 / (1 + EPS), 0.0, 1 / (1 + EPS)])


@pytest.mark.parametrize("kind", list(grpo.ADVANTAGES))
def test_each_advantage_is_against_its_own_group_only(kind):
    """Every choice of --group-advantage (a fork adds one as a row of ADVANTAGES: leave-one-out, say)
    compares a dialogue with its own group: another group's rewards never move its advantage, as a
    baseline taken over the whole batch would."""
    rewards = torch.tensor([0.3, 0.5, 0.6, 0.1, 0.9, 0.2], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    moved = rewards.clone()
    moved[3:] += torch.tensor([0.5, -0.3, 0.4], dtype=torch.float64)
    a, b = grpo.group_advantages(rewards, groups, kind), grpo.group_advantages(moved, groups, kind)
    assert a[:3].tolist() == b[:3].tolist() and a[:3].abs().sum() > 0


def test_group_stats():
    mean, std, size, flat = grpo.group_stats(GROUP_REWARDS, GROUPS)
    assert size.tolist() == [3] * 6
    assert mean.tolist() == pytest.approx([0.5, 0.4, 0.5, 0.4, 0.5, 0.4])
    assert std.tolist() == pytest.approx([STD0, 0, STD0, 0, STD0, 0], abs=1e-12)
    assert flat.tolist() == [False, True, False, True, False, True]


# ----------------------------------------------------------------------------------------------
# Per-turn credit (--reward turn, mixed): each turn's return against its group's turns at the same
# place and against the batch's (MAPO), on every token of the turn
# ----------------------------------------------------------------------------------------------
# One group of four dialogues from emotion 30, of 3, 2, 3 and 3 turns (B ends after two). D ends
# below the group's mean (35 against 38.75) but gains more than the others in its later turns.
UNEVEN = [fake_record([10, 10, -5], 45), fake_record([10, 5], 45, end_reason="left"),
          fake_record([5, -5, 0], 30), fake_record([-10, 10, 5], 35)]
# Each turn's return, the changes from it on / 100 (--reward turn), by hand:
#   A .15 .05 -.05 | B .15 .05 | C 0 -.05 0 | D .05 .15 .05
# The turn level (--group-advantage mean: the return less the mean at the same place):
#   turn 1 (A B C D): mean .0875; turn 2 (A B C D): mean .05; turn 3 (A C D, B has none): mean 0
TURN_LEVEL = [[0.0625, 0.0, -0.05], [0.0625, 0.0], [-0.0875, -0.1, 0.0], [-0.0375, 0.1, 0.05]]
# The batch level: less the mean of all 11 returns, .55 / 11 = .05
BATCH_LEVEL = [[0.1, 0.0, -0.1], [0.1, 0.0], [-0.05, -0.1, -0.05], [0.0, 0.1, 0.0]]
# Mixed, 0.4 x the turn level + 0.6 x the batch level (MAPO's script's weights, the default)
MIXED = [[0.085, 0.0, -0.08], [0.085, 0.0], [-0.065, -0.1, -0.03], [-0.015, 0.1, 0.02]]


def test_turn_returns_are_the_changes_from_each_turn_on_less_later_penalties():
    records = UNEVEN + [fake_record([3], 33, end_reason="unread")]
    returns = grpo.turn_returns(records, "turn", {}, 0.0)
    assert returns[:4] == [pytest.approx(r) for r in
                           ([0.15, 0.05, -0.05], [0.15, 0.05], [0.0, -0.05, 0.0], [0.05, 0.15, 0.05])]
    assert returns[4] is None  # unread: no return
    # the first turn's is the dialogue's reward; a violation costs it and every turn before it
    rewards = grpo.dialogue_rewards(UNEVEN, "turn", {}, 0.0)
    assert [r[0] for r in returns[:4]] == pytest.approx(rewards.tolist())
    penalised = grpo.turn_returns([fake_record([10, 10, -5], 45, violations=(1,))], "turn", {}, 0.1)
    assert penalised == [pytest.approx([0.05, -0.05, -0.05])]
    # mixed: the fork's credit of each turn (rl.mixed_credit)
    assert grpo.turn_returns(UNEVEN[:1], "mixed", {"mixed_alpha": 0.4, "mixed_gamma": 0.97}, 0.0) == [
        pytest.approx(rl.mixed_credit(UNEVEN[0], 0.4, 0.97))]


@pytest.mark.parametrize("weight,expected", [(1.0, TURN_LEVEL), (0.0, BATCH_LEVEL), (0.4, MIXED)])
def test_per_turn_advantages_on_a_group_of_uneven_dialogues_by_hand(weight, expected):
    returns = grpo.turn_returns(UNEVEN, "turn", {}, 0.0)
    advantages = grpo.per_turn_advantages(returns, torch.zeros(4), "mean", weight)
    assert [len(a) for a in advantages] == [3, 2, 3, 3]
    for got, by_hand in zip(advantages, expected):
        assert got == pytest.approx(by_hand, abs=1e-12)


def test_per_turn_advantages_with_the_std_by_hand():
    """--group-advantage mean-std divides each level by its own std (Bessel): turn 1's returns
    .15 .15 0 .05 have std .075, the batch's 11 returns std sqrt(.055 / 10)."""
    returns = grpo.turn_returns(UNEVEN, "turn", {}, 0.0)
    turn_level = grpo.per_turn_advantages(returns, torch.zeros(4), "mean-std", 1.0)
    batch_level = grpo.per_turn_advantages(returns, torch.zeros(4), "mean-std", 0.0)
    assert [a[0] for a in turn_level] == pytest.approx([x / (0.075 + EPS)
                                                        for x in (0.0625, 0.0625, -0.0875, -0.0375)])
    batch_std = math.sqrt(0.055 / 10)
    assert batch_level[3] == pytest.approx([x / (batch_std + EPS) for x in (0.0, 0.1, 0.0)])


def test_a_dialogue_that_ends_low_but_gained_later_is_credited_for_its_later_turns():
    """D ends below its group's mean: --reward final gives every turn of it the same negative
    advantage; per-turn credit gives its first turn (which lost 10) a negative one and the two
    after it (which gained more than the group's turns at the same place) positive ones."""
    groups = torch.zeros(4)
    final = grpo.group_advantages(grpo.dialogue_rewards(UNEVEN, "final", {}, 0.0), groups, "mean")
    assert final[3].item() == pytest.approx(-0.0375)  # 0.35 against the mean 0.3875
    per_turn = grpo.per_turn_advantages(grpo.turn_returns(UNEVEN, "turn", {}, 0.0), groups, "mean", 0.4)
    assert per_turn[3][0] < 0 < min(per_turn[3][1:])
    for kind in grpo.ADVANTAGES:  # with the std too
        d = grpo.per_turn_advantages(grpo.turn_returns(UNEVEN, "turn", {}, 0.0), groups, kind, 0.4)[3]
        assert d[0] < 0 < min(d[1:]), kind


def test_a_turn_alone_an_early_end_and_an_unread_dialogue():
    """Group 0: E of three turns, F of one (it ended early), G unread. E's second and third turns are
    the only ones of their group at their place: no turn-level comparison (0), only the batch level.
    G has no advantage and counts in no statistic: the others' are those of the group without it.
    Group 1 (H, I) moves the batch level alone, never the turn level."""
    e, f = fake_record([5, 5, 5], 45), fake_record([-5], 25, end_reason="left")
    g = fake_record([10, 10], 50, end_reason="unread")
    h, i = fake_record([10], 40), fake_record([0], 30)
    returns = grpo.turn_returns([e, f, g, h, i], "turn", {}, 0.0)
    groups = torch.tensor([0, 0, 0, 1, 1])
    turn_level = grpo.per_turn_advantages(returns, groups, "mean", 1.0)
    # turn 1 of group 0: E .15, F -.05 -> mean .05; turns 2 and 3: E alone -> 0; group 1: .1 and 0
    assert turn_level == [pytest.approx([0.1, 0.0, 0.0]), pytest.approx([-0.1]), None,
                          pytest.approx([0.05]), pytest.approx([-0.05])]
    # the batch: .15 .10 .05 | -.05 | .10 | 0, mean .0583..
    mean = (0.15 + 0.10 + 0.05 - 0.05 + 0.10 + 0.0) / 6
    batch_level = grpo.per_turn_advantages(returns, groups, "mean", 0.0)
    assert batch_level[0] == pytest.approx([0.15 - mean, 0.10 - mean, 0.05 - mean])
    assert batch_level[2] is None
    # without the unread dialogue nothing changes
    assert grpo.per_turn_advantages(returns[:2] + returns[3:], groups[[0, 1, 3, 4]], "mean", 0.4) == (
        grpo.per_turn_advantages(returns, groups, "mean", 0.4)[:2]
        + grpo.per_turn_advantages(returns, groups, "mean", 0.4)[3:])
    # another group's returns move a turn's turn-level advantage never
    moved = returns[:3] + [[0.9], [-0.4]]
    assert grpo.per_turn_advantages(moved, groups, "mean-std", 1.0)[:2] == (
        grpo.per_turn_advantages(returns, groups, "mean-std", 1.0)[:2])
    # every dialogue unread: nothing to compare, nothing given
    assert grpo.per_turn_advantages([None, None], torch.zeros(2), "mean-std", 0.4) == [None, None]


def test_token_advantages_put_each_turns_advantage_on_its_own_agent_tokens():
    # two dialogues: turns end at 3 and 7 (tokens 2-3 and 6-7 the agent's, 4-5 a user's) and at 2
    mask = torch.tensor([[0, 0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0, 0, 0],
                         [0, 1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.float32)
    placed = grpo.token_advantages([[0.5, -0.25], [2.0], None], [[3, 7], [2], [2]], mask)
    assert placed.tolist() == [[0, 0, 0.5, 0.5, 0, 0, -0.25, -0.25, 0], [0, 2.0, 2.0, 0, 0, 0, 0, 0, 0],
                               [0] * 9]


def test_the_turn_level_weight_is_refused_where_a_dialogue_has_one_advantage(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.command(grpo.main)(["--preset", "cpu", "--reward", "final", "--turn-level-weight", "0.5"])
    assert stop.value.code == 2
    assert "error: --turn-level-weight mixes per-turn advantages" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------
# Three dialogues, right-padded; the mask also leaves out user tokens inside a dialogue.
LOSS = torch.tensor([[1.0, 2.0, 9.0, 3.0], [4.0, 9.0, 9.0, 9.0], [5.0, 6.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
BUDGET = 8


@pytest.mark.parametrize("mode,expected", [
    ("seq-mean-token-mean", ((1 + 2 + 3) / 3 + 4 / 1 + (5 + 6) / 2) / 3),
    ("token-mean", (1 + 2 + 3 + 4 + 5 + 6) / 6),
    ("dr-grpo", (1 + 2 + 3 + 4 + 5 + 6) / (3 * BUDGET)),
])
def test_loss_aggregation_by_hand(mode, expected):
    whole = (LOSS * rl.agg_weights(MASK, mode, MASK.sum(), 3, BUDGET)).sum()
    assert whole.item() == pytest.approx(expected)
    # split into micro-batches, the shares add up to the same minibatch loss
    parts = ((LOSS[:1] * rl.agg_weights(MASK[:1], mode, MASK.sum(), 3, BUDGET)).sum()
             + (LOSS[1:] * rl.agg_weights(MASK[1:], mode, MASK.sum(), 3, BUDGET)).sum())
    assert parts.item() == pytest.approx(expected)


def test_clipped_policy_loss_and_k3_by_hand():
    old = torch.zeros(5)
    new = torch.log(torch.tensor([1.5, 0.5, 1.1, 0.7, 1.0]))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0])
    # the sampler's log-probs are the old ones: every truncated importance weight is 1
    terms = grpo.policy_terms(new, old, old, adv, None, clip_low=0.2, clip_high=0.28, dual_clip=0.0,
                              tis_cap=2.0)
    # A>0: -A min(r, 1.28) -> -1.28, -0.5 ; A<0: -A max(r, 0.8) -> 1.1, 0.8 ; r = 1: -A
    torch.testing.assert_close(terms["policy_loss"], torch.tensor([-1.28, -0.5, 1.1, 0.8, -2.0]))
    assert terms["clip_frac"].tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    lp, ref = torch.log(torch.tensor([0.5, 0.2])), torch.log(torch.tensor([0.5, 0.4]))
    k3 = grpo.kl_k3(lp, ref)   # ratio ref/p = 1 and 2: 1 - 0 - 1 = 0 ; 2 - ln 2 - 1
    assert k3[0].item() == pytest.approx(0.0, abs=1e-7) and k3[1].item() == pytest.approx(1 - math.log(2))


# ----------------------------------------------------------------------------------------------
# Groups in the rollout
# ----------------------------------------------------------------------------------------------
def test_group_members_share_persona_and_opening_and_differ_in_samples(tiny_model, persona_entry,
                                                                        write_personas):
    model, tokenizer = tiny_model
    personas = load_personas(write_personas([persona_entry(id="a"),
                                             persona_entry(id="b",
                                                           opening="my sister stopped talking to me.")]))
    torch.manual_seed(0)
    records, _ = play_dialogues(model, Simulator(RulesBackend(), max_turns=2), personas,
                                chat=ChatTokens(tokenizer, False),
                                samples_per_persona=3, temperature=1.0, max_new_tokens=6,
                                max_context=512, progress=False)
    assert len(records) == 6
    for g, persona in enumerate(personas):
        group = records[3 * g:3 * g + 3]  # each persona's samples one after another
        assert [r["sample"] for r in group] == [0, 1, 2]
        assert {r["persona_id"] for r in group} == {persona.id}
        assert {r["turns"][0]["text"] for r in group} == {persona.opening}
        prompts = {tuple(r["token_ids"][:r["action_mask"].index(1)]) for r in group}
        assert len(prompts) == 1                                   # the same opening tokens
        samples = {tuple(r["token_ids"]) for r in group}
        assert len(samples) == 3                                   # three different dialogues
    assert records[0]["persona_id"] != records[3]["persona_id"]


# ----------------------------------------------------------------------------------------------
# The script, at tiny sizes
# ----------------------------------------------------------------------------------------------
def tiny_args(model_dir, personas, out, *extra):
    return ["--preset", "cpu", "--model", str(model_dir), "--simulator", "rules", "--personas", personas,
            "--split", "test", "--personas-per-iteration", "2", "--group-size", "2", "--minibatch-size", "4",
            "--micro-batch-size", "2", "--max-turns", "2", "--max-new-tokens", "4", "--max-context", "512",
            "--lora-r", "4", "--lora-alpha", "8", "--out", str(out), *extra]


@pytest.fixture(scope="module")
def warm_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny random Llama rewired so that every position says ' sorry' with p ~ 0.26 and ends
    the turn with p ~ 0.16. The rules user scores a reply with 'sorry' +3 and one without -3, so
    dialogues of one group get different rewards, which a random model's replies never do.
    How: a constant 100 in dimension 0 of every embedding dominates the residual stream, so the
    final norm's output is ~8 there at every position; lm_head's column 0 then acts as a bias."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    sorry = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" sorry"))
    assert len(sorry) == 1
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 100.0
        model.lm_head.weight[:, 0] = 0.0
        h0 = model.model(torch.arange(100, 140)[None]).last_hidden_state[..., 0].mean()
        model.lm_head.weight[sorry[0], 0] = 10.0 / h0
        model.lm_head.weight[tokenizer.convert_tokens_to_ids("<|im_end|>"), 0] = 9.5 / h0
    folder = tmp_path_factory.mktemp("warm_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def warm_run(warm_model_dir, personas_file, tmp_path_factory):
    """One iteration of 2 personas x 4 dialogues on the warm model, in this process."""
    out = tmp_path_factory.mktemp("grpo_warm") / "run"
    model = grpo.main(tiny_args(warm_model_dir, personas_file, out, "--group-size", "4",
                                "--minibatch-size", "8", "--micro-batch-size", "4", "--iterations", "1",
                                "--seed", "1"))
    return model, out


def test_first_ratio_is_one_and_kl_zero_before_the_first_update(warm_run):
    _, out = warm_run
    (m,) = read_metrics(out)
    assert m["zero_spread_groups"] < 2, "no group had a reward spread: the update had nothing to learn"
    assert m["group_reward_std"] > 0 and m["grad_norm"] > 0
    # one pass, one minibatch: the update's one step runs the weights that sampled (ratio 1), and in
    # float32 the trainer's log-probs are the sampler's
    assert m["clip_frac"] == 0.0 and m["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch_kl"] < 1e-9 and m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert m["kl_ref"] == pytest.approx(0.0, abs=1e-7)        # LoRA B starts at zero: policy == reference
    assert m["kl_ref_loss"] == pytest.approx(0.0, abs=1e-7)
    for key in ("value_loss", "explained_variance", "critic_grad_norm", "critic_lr"):
        assert key not in m


def test_base_frozen_adapter_moves_and_loads(warm_run, warm_model_dir):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model, out = warm_run
    base = AutoModelForCausalLM.from_pretrained(warm_model_dir).state_dict()
    live = {k.replace("base_model.model.", "").replace(".base_layer", ""): v
            for k, v in model.state_dict().items() if "lora_" not in k}
    assert set(base) <= set(live)
    for name in base:
        torch.testing.assert_close(live[name], base[name], atol=0, rtol=0)
    folder = os.path.join(out, "checkpoints", "iter_000001", "default")
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)          # only the adapter is saved
    lora_b = [w for k, w in saved.items() if "lora_B" in k]
    assert lora_b and all(w.abs().sum() > 0 for w in lora_b)    # B starts at zero; every one moved
    # loadable as a plain peft adapter, with the weights the run ended with
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(warm_model_dir), folder)
    trained = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    for k, v in loaded.state_dict().items():
        if "lora_" in k:
            torch.testing.assert_close(v, trained[k], atol=0, rtol=0)
    state = torch.load(os.path.join(out, "checkpoints", "iter_000001", "state.pt"), weights_only=False)
    assert state["iteration"] == 1 and {"optimizer", "scheduler", "rng", "log_sizes"} <= set(state)


def test_settings_errors_say_what_to_change(tiny_model_dir, personas_file, tmp_path, capsys):
    cases = [(["--group-size", "1"], "--group-size"),
             (["--minibatch-size", "3"], "--minibatch-size"),
             (["--group-advantage", "rank"], "--group-advantage"),
             (["--loss-agg", "seq-mean-token-sum"], "--loss-agg")]
    for extra, flag in cases:
        with pytest.raises(SystemExit) as stop:
            cli.command(grpo.main)(tiny_args(tiny_model_dir, personas_file, tmp_path / "run", *extra))
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.startswith("error:") and flag in err, extra
    if not torch.cuda.is_available():  # the paper's setup points to the cpu preset instead of a traceback
        with pytest.raises(SystemExit) as stop:
            cli.command(grpo.main)([])
        assert stop.value.code == 2 and "--preset cpu" in capsys.readouterr().err


E2E = ("--iterations", "2", "--save-every", "1", "--seed", "3", "--ent-coef", "0.01", "--kl-loss-coef", "0.1",
       "--lr", "5e-3", "--update-epochs", "2", "--group-advantage", "mean", "--loss-agg", "dr-grpo",
       "--reward", "turn")


@pytest.fixture(scope="module")
def script_run(tiny_model_dir, personas_file, tmp_path_factory):
    """grpo.py as a subprocess, 2 iterations. The entropy bonus and the KL term move the adapter
    even though every reply of the random model scores the same."""
    out = tmp_path_factory.mktemp("grpo_script") / "run"
    proc = subprocess.run([sys.executable, "grpo.py", *tiny_args(tiny_model_dir, personas_file, out, *E2E)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def test_grpo_script_end_to_end(script_run, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = script_run
    metrics = read_metrics(out)
    assert [m["iteration"] for m in metrics] == [1, 2]
    for key in ("reward_mean", "group_reward_std", "zero_spread_groups", "policy_loss", "entropy",
                "approx_kl", "kl_ref", "kl_ref_loss", "clip_frac", "mismatch_kl", "tis_weight_mean",
                "tis_clip_frac", "sample_logprob_gap", "grad_norm", "lr",
                "time_rollout", "time_update", "peak_memory_gb", "final_emotion_mean"):
        assert key in metrics[0], key
    assert metrics[1]["kl_ref"] > 0                             # the adapter moved in iteration 1
    # two passes: the scoring pass gives the old log-probs, which in float32 are the sampler's (in
    # iteration 2 too, after an update), and the second pass moves off them
    assert all(m["mismatch_kl"] < 1e-9 and m["approx_kl"] > 0 for m in metrics)
    with open(out / "rollouts.jsonl") as f:
        rows = [json.loads(line) for line in f]
    expected = [(i, s) for i in (1, 2) for g in (0, 1) for s in (0, 1)]
    assert [(r["iteration"], r["sample"]) for r in rows] == expected
    config = json.load(open(out / "config.json"))
    assert config["loss_agg"] == "dr-grpo" and config["group_size"] == 2 and config["model"] == tiny_model_dir
    adapter = os.path.join(out, "checkpoints", "iter_000002", "default")
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), adapter)  # loadable as-is


def test_resume_gives_the_same_second_iteration(script_run, tiny_model_dir, personas_file, tmp_path):
    # 1 iteration + --resume 1 more: the script run's folder as it was after iteration 1 (its
    # iteration-2 checkpoint removed; its metrics and rollouts of iteration 2 are stale lines that
    # resume must drop), resumed in this process.
    split = tmp_path / "split"
    shutil.copytree(script_run, split)
    shutil.rmtree(split / "checkpoints" / "iter_000002")
    grpo.main(tiny_args(tiny_model_dir, personas_file, split, *E2E, "--resume", str(split)))
    a, b = read_metrics(script_run), read_metrics(split)
    assert [m["iteration"] for m in b] == [1, 2]
    timing = ("time_", "_per_s", "_seconds", "peak_memory")
    assert set(a[1]) == set(b[1])
    for key in a[1]:
        if not any(t in key for t in timing):
            assert a[1][key] == pytest.approx(b[1][key], rel=1e-6, abs=1e-9, nan_ok=True), key
    with open(script_run / "rollouts.jsonl") as fa, open(split / "rollouts.jsonl") as fb:
        assert fa.read() == fb.read()
    from safetensors.torch import load_file
    first, second = (load_file(os.path.join(d, "checkpoints", "iter_000002", "default",
                                            "adapter_model.safetensors"))
                     for d in (script_run, split))
    for k in first:
        torch.testing.assert_close(first[k], second[k], atol=0, rtol=0)


# ----------------------------------------------------------------------------------------------
# A pass whose result only a diagnostic reads is skipped, and the run is the same
# ----------------------------------------------------------------------------------------------
def adapter_of(out, iteration):
    from safetensors.torch import load_file

    folder = os.path.join(out, "checkpoints", f"iter_{iteration:06d}", "default")
    return load_file(os.path.join(folder, "adapter_model.safetensors"))


def test_log_kl_every_skips_the_reference_pass_and_nothing_else(warm_model_dir, personas_file, tmp_path):
    # With no KL term the reference pass only feeds the kl_ref diagnostic: logged every 2nd
    # iteration, the others write null, and the adapters are bit for bit those of logging it always.
    argv = ["--group-size", "4", "--minibatch-size", "8", "--micro-batch-size", "4", "--iterations", "2",
            "--seed", "1", "--lr", "5e-3"]
    grpo.main(tiny_args(warm_model_dir, personas_file, tmp_path / "every", *argv))
    grpo.main(tiny_args(warm_model_dir, personas_file, tmp_path / "second", *argv, "--log-kl-every", "2"))
    every, second = read_metrics(tmp_path / "every"), read_metrics(tmp_path / "second")
    assert second[0]["kl_ref"] == every[0]["kl_ref"] and every[1]["kl_ref"] > 0
    assert second[1]["kl_ref"] is None and second[1]["kl_ref_loss"] is None
    assert second[1]["reward_mean"] == every[1]["reward_mean"]
    for k, w in adapter_of(tmp_path / "every", 2).items():
        assert torch.equal(w, adapter_of(tmp_path / "second", 2)[k]), k


def test_old_logprobs_from_the_update_pass_give_the_run_of_the_scoring_pass(warm_model_dir, personas_file,
                                                                             tmp_path, monkeypatch):
    # One step per batch (minibatch = batch, one pass): the old log-probs are the update's own forward
    # pass. Forcing the separate scoring pass must give the same run: rewards, losses, diagnostics and
    # adapters, iteration after iteration. The learning rate is high enough that iteration 2's
    # dialogues depend on iteration 1's step.
    argv = ["--group-size", "4", "--minibatch-size", "8", "--micro-batch-size", "4", "--iterations", "2",
            "--seed", "1", "--lr", "5e-2", "--ent-coef", "0.01"]
    grpo.main(tiny_args(warm_model_dir, personas_file, tmp_path / "skip", *argv))
    # without the shortcut: the separate scoring pass every iteration
    monkeypatch.setattr(grpo, "old_logprobs_from_update", lambda *_: False)
    grpo.main(tiny_args(warm_model_dir, personas_file, tmp_path / "pass", *argv))
    skip, full = read_metrics(tmp_path / "skip"), read_metrics(tmp_path / "pass")
    assert full[1]["kl_ref"] > 1e-6 and full[0]["grad_norm"] > 0  # the policy moved: a real comparison
    for a, b in zip(skip, full):
        for key in ("reward_mean", "final_emotion_mean", "policy_tokens"):
            assert a[key] == b[key], key
        for key in ("policy_loss", "entropy", "kl_ref", "kl_ref_loss", "grad_norm", "sample_logprob_gap",
                    "mismatch_kl", "tis_weight_mean", "approx_kl"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key
    for it in (1, 2):
        skipped, forced = adapter_of(tmp_path / "skip", it), adapter_of(tmp_path / "pass", it)
        for k in forced:
            torch.testing.assert_close(skipped[k], forced[k], atol=1e-7, rtol=1e-5)
