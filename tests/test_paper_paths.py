"""The paper preset's code paths, run on a tiny model in CI.

The paper preset (the dataclass defaults, what users run on GPUs) turns on switches that the CPU
preset (what CI and the benchmarks run) turns off: gradient checkpointing, thinking, several
micro-batches and minibatches, bf16. A bug behind one of them is invisible to every CPU-preset
run, so each is run here, and where a switch should not change the numbers (checkpointing,
the micro-batch split) the run with it on is held against the run with it off."""
import json
import os

import pytest
import torch

import grpo
import ppo
import cli
from conftest import read_metrics


TIMING = ("time_", "_per_s", "_seconds", "peak_memory")


def assert_same_metrics(a, b, rel=1e-5, abs=1e-6):
    assert [m["iteration"] for m in a] == [m["iteration"] for m in b]
    for ma, mb in zip(a, b):
        for key in ma:
            if not any(t in key for t in TIMING):
                assert ma[key] == pytest.approx(mb[key], rel=rel, abs=abs, nan_ok=True), \
                    (ma["iteration"], key)


def lora_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def assert_same_weights(a, b, atol=1e-6):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=k)


def ppo_args(model_dir, personas, out, *extra):
    return ["--preset", "cpu", "--model", str(model_dir), "--simulator", "rules", "--personas", personas,
            "--split", "test", "--dialogues-per-iteration", "2", "--minibatch-size", "2",
            "--micro-batch-size", "1", "--max-turns", "2", "--max-new-tokens", "6", "--max-context", "512",
            "--lora-r", "4", "--lora-alpha", "8", "--lr", "1e-3", "--critic-lr", "1e-3",
            "--out", str(out), *extra]


def grpo_args(model_dir, personas, out, *extra):
    return ["--preset", "cpu", "--model", str(model_dir), "--simulator", "rules", "--personas", personas,
            "--split", "test", "--personas-per-iteration", "2", "--group-size", "2", "--minibatch-size", "4",
            "--micro-batch-size", "2", "--max-turns", "2", "--max-new-tokens", "6", "--max-context", "512",
            "--lora-r", "4", "--lora-alpha", "8", "--lr", "1e-3", "--out", str(out), *extra]


# ----------------------------------------------------------------------------------------------
# Gradient checkpointing: the critic's backward pass must run under the critic's adapter
# ----------------------------------------------------------------------------------------------
def two_adapter_model(model_dir, checkpointing):
    """The tiny Llama with an actor and a critic adapter on every projection, both randomised
    (the same numbers in every call), and a random value head."""
    from peft import LoraConfig

    from policy import DEFAULT_TARGETS, load_policy

    model, _ = load_policy(model_dir, lora_r=4, lora_alpha=8, gradient_checkpointing=checkpointing)
    model.add_adapter("critic", LoraConfig(r=4, lora_alpha=8, target_modules=DEFAULT_TARGETS.split(","),
                                           task_type="CAUSAL_LM"))
    ppo.use_adapter(model, "default")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    head = torch.nn.Linear(model.config.hidden_size, 1)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=g))
        head.bias.zero_()
    model.train()
    return model, head


def critic_gradients(model, head, ids, backward_inside):
    model.zero_grad(set_to_none=True)
    head.zero_grad(set_to_none=True)
    with ppo.adapter_active(model, "critic"):
        loss = (ppo.critic_values(model, head, ids, torch.ones_like(ids)) ** 2).mean()
        if backward_inside:
            loss.backward()
    if not backward_inside:  # what ppo.py did: the backward pass after switching back to the actor
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if ".critic." in n and p.grad is not None}


def test_critic_gradients_are_the_same_with_and_without_checkpointing(tiny_model_dir):
    ids = torch.randint(5, 500, (2, 10), generator=torch.Generator().manual_seed(0))
    plain = critic_gradients(*two_adapter_model(tiny_model_dir, False), ids, backward_inside=True)
    model, head = two_adapter_model(tiny_model_dir, True)
    checkpointed = critic_gradients(model, head, ids, backward_inside=True)
    assert plain.keys() == checkpointed.keys() and len(plain) > 0
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)
    # The failure this guards against is real: the same backward pass run after the switch back to
    # the actor recomputes the critic's layers under the actor's adapter.
    wrong = critic_gradients(model, head, ids, backward_inside=False)
    assert max((wrong[n] - plain[n]).abs().max().item() for n in plain) > 1e-3


def test_critic_values_refuses_to_run_under_the_actor(tiny_model_dir):
    model, head = two_adapter_model(tiny_model_dir, False)
    ids = torch.randint(5, 500, (1, 6))
    with pytest.raises(RuntimeError, match="adapter_active"):
        ppo.critic_values(model, head, ids, torch.ones_like(ids))
    assert model.active_adapter == "default"


def test_ppo_is_the_same_with_and_without_checkpointing(tiny_model_dir, personas_file, tmp_path):
    # Same seed, three iterations: rewards, losses, gradient norms, both adapters and the value head.
    runs = {}
    for on in ("true", "false"):
        out = tmp_path / on
        model, head = ppo.main(ppo_args(tiny_model_dir, personas_file, out, "--iterations", "3",
                                        "--seed", "5", "--gradient-checkpointing", on))
        runs[on] = (read_metrics(out), lora_state(model), head.state_dict())
    assert_same_metrics(runs["true"][0], runs["false"][0])
    assert all(m["critic_grad_norm"] > 0 and m["actor_grad_norm"] > 0 for m in runs["true"][0])
    assert_same_weights(runs["true"][1], runs["false"][1])
    assert_same_weights(runs["true"][2], runs["false"][2])


def test_grpo_is_the_same_with_and_without_checkpointing(tiny_model_dir, personas_file, tmp_path):
    runs = {}
    for on in ("true", "false"):
        out = tmp_path / on
        model = grpo.main(grpo_args(tiny_model_dir, personas_file, out, "--iterations", "3", "--seed", "5",
                                    "--gradient-checkpointing", on))
        runs[on] = (read_metrics(out), lora_state(model))
    assert_same_metrics(runs["true"][0], runs["false"][0])
    assert_same_weights(runs["true"][1], runs["false"][1])


# ----------------------------------------------------------------------------------------------
# Every switch the CPU preset turns off runs here once, at the paper's value
# ----------------------------------------------------------------------------------------------
# CPU-preset values that only size the run (a smaller model, fewer and shorter dialogues, rates
# scaled to them): the same code runs either way.
SIZES = {"model", "dialogues_per_iteration", "personas_per_iteration", "group_size", "max_turns",
         "max_new_tokens", "user_reply_tokens", "max_context", "lora_r", "lora_alpha", "actor_lr",
         "critic_lr", "lr", "iterations", "save_every", "out", "minibatch_size", "micro_batch_size",
         "warmup_steps", "critic_warmup_steps"}  # the warm-up: a share of the run's steps
# Switches that change which code runs, with the flags that turn each on in the runs below. The
# split into micro-batches and minibatches is sized by the CPU preset but is a path of its own.
SWITCHES = {
    "gradient_checkpointing": ["--gradient-checkpointing", "true"],
    "thinking": ["--thinking", "true"],
    "simulator": ["--simulator", "same"],            # the paper's LLM user (the cpu preset: rules)
    "dtype": ["--dtype", "bfloat16"],                # what "auto" picks on CUDA
    "value_clip": ["--value-clip", "0.5"],           # PPO only: RLVER's value clip
    "vf_coef": ["--vf-coef", "1.0"],                 # PPO only: RLVER's critic loss scale
    "ent_coef": ["--ent-coef", "0.001"],             # RLVER's entropy bonus
}


@pytest.mark.parametrize("trainer", [ppo, grpo])
def test_every_switch_of_the_cpu_preset_is_covered_here(trainer):
    defaults = vars(cli.parse_settings(trainer.Settings, argv=['--preset', 'paper']))
    assert trainer.PRESETS["paper"] == {}  # the paper preset is the dataclass defaults
    turned = {k for k, v in trainer.PRESETS["cpu"].items() if v != defaults[k]}
    uncovered = turned - SIZES - set(SWITCHES)
    assert not uncovered, f"the cpu preset changes {sorted(uncovered)}: run the paper's value in this file"
    for name in SWITCHES.keys() & turned:
        assert SWITCHES[name][1] == str(defaults[name]).lower(), name   # the runs below use the paper's value
    assert defaults["gradient_checkpointing"] and defaults["thinking"] and defaults["simulator"] == "same"


def paper_path_args(trainer, model_dir, personas, out):
    names = vars(cli.parse_settings(trainer.Settings, argv=['--preset', 'paper'])).keys()
    switches = sum((flags for name, flags in SWITCHES.items() if name in names), [])
    # 2 minibatches x 2 micro-batches; the paper preset's read-out (reasoned, for a model that is not the
    # embedded one)
    common = [*switches, "--iterations", "2", "--micro-batch-size", "1", "--minibatch-size", "2",
              "--max-new-tokens", "8", "--user-reply-tokens", "6", "--seed", "2"]
    if trainer is ppo:
        return ppo_args(model_dir, personas, out, *common, "--dialogues-per-iteration", "4")
    # the tiny model's users all end alike (zero-spread groups, zero advantages): the entropy bonus
    # alone gives the update a gradient, enough to check that it flows
    return grpo_args(model_dir, personas, out, *common)


@pytest.mark.parametrize("trainer", [ppo, grpo])
def test_the_paper_preset_paths_run_on_a_tiny_model(trainer, tiny_model_dir, personas_file, tmp_path,
                                                     fake_user):
    # checkpointing, thinking, bf16 weights, 2 minibatches of 2 micro-batches, the default loss aggregation
    # (and PPO's whitening), and an LLM user: the paper preset's `same` user on a random model writes no
    # appraisal that can be read (the next test), so the user is a server that writes as models do
    out = tmp_path / "run"
    args = paper_path_args(trainer, tiny_model_dir, personas_file, out)
    trainer.main(args + ["--simulator", fake_user.url])
    metrics = read_metrics(out)
    config = json.load(open(out / "config.json"))
    defaults = vars(cli.parse_settings(trainer.Settings, argv=['--preset', 'paper']))
    assert config["loss_agg"] == defaults["loss_agg"] and config["dtype"] == "bfloat16"
    assert [m["iteration"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["sample_logprob_gap"] < 0.1                           # generate vs training pass, bf16
        assert m["mismatch_kl"] < 0.05 and m["tis_weight_mean"] > 0.9   # bf16 round-off, corrected
        assert m["think_violation_rate"] > 0                           # a random model writes no tags
        assert (m["end_max_turns"] + m["end_goodbye"] + m["end_left"] + m["end_success"]
                + m["end_context"] + m["unread_dialogues"] == 4)
    grad_norm = "actor_grad_norm" if trainer is ppo else "grad_norm"
    assert metrics[0][grad_norm] > 0 and metrics[1]["kl_ref"] > 0   # the policy moved in iteration 1
    # two minibatches: the second one's old log-probs are the scoring pass's, from before the first
    # step, so its ratios move off 1 (old log-probs taken from the current pass would keep them at 1)
    assert any(m["approx_kl"] > 0 for m in metrics)
    if trainer is ppo:
        assert defaults["whiten_advantages"] and metrics[1]["critic_grad_norm"] is not None  # it stepped


@pytest.mark.parametrize("trainer", [ppo, grpo])
def test_the_same_user_on_a_random_model_reads_nothing_and_trains_nothing(trainer, tiny_model_dir,
                                                                          personas_file, tmp_path):
    """The paper preset's own user, the frozen base, on a random model: no appraisal can be read, every
    dialogue ends at its first turn as unread, and none is trained on: no token enters the loss, no
    optimizer step is taken, no reward is reported."""
    out = tmp_path / "run"
    model = trainer.main(paper_path_args(trainer, tiny_model_dir, personas_file, out) + ["--iterations", "1"])
    m = read_metrics(out)[0]
    grad_norm = "actor_grad_norm" if trainer is ppo else "grad_norm"
    assert m["unread_dialogues"] == 4 and m["turns_mean"] == 1 and m["update_tokens"] == 0
    assert m[grad_norm] is None and m["reward_mean"] is None and m["final_emotion_mean"] is None
    policy = model[0] if trainer is ppo else model
    assert all((p == 0).all() for n, p in policy.named_parameters() if "lora_B" in n)  # never stepped
    dialogues = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    assert [d["end_reason"] for d in dialogues] == ["unread"] * 4
    assert all(d["changes"] == [None] and "(re-asked for the change)" in d["turns"][1]["appraisal"]
               for d in dialogues)


@pytest.mark.parametrize("trainer", [ppo, grpo])
def test_qlora_trains_on_the_cpu(trainer, tiny_model_dir, personas_file, tmp_path, capsys):
    """--load-in-4bit: NF4 base weights through bitsandbytes' CPU kernels, one iteration."""
    import bitsandbytes

    make = ppo_args if trainer is ppo else grpo_args
    out = tmp_path / "run"
    # (a group's dialogues may all end alike: the entropy bonus gives the update a gradient anyway)
    model = trainer.main(make(tiny_model_dir, personas_file, out, "--load-in-4bit", "true",
                              "--iterations", "1", "--ent-coef", "0.01"))
    policy = model[0] if trainer is ppo else model
    assert sum(isinstance(m, bitsandbytes.nn.Linear4bit) for m in policy.modules()) == 14
    m = read_metrics(out)[0]
    assert m["actor_grad_norm" if trainer is ppo else "grad_norm"] > 0 and m["update_tokens"] > 0
    assert any((p != 0).any() for n, p in policy.named_parameters() if "lora_B" in n)  # the adapter moved


def test_a_4bit_policy_trains_alike_after_a_rollout(tiny_model_dir):
    """The update's gradients through NF4 weights are those of a policy that never sampled. On a CPU
    with AVX512-BF16, bitsandbytes repacks 4-bit weights at their first eval-mode pass without
    gradients (a rollout) into a layout whose kernel has no backward: the gradients of the first layer
    came out 43% off (this machine, 2026-12-02), and a model with biases stopped. load_model keeps the
    layout (on other CPUs there is no repacking, and this test passes either way)."""
    from policy import load_policy

    def first_layer_grads(sampled_first):
        torch.manual_seed(0)
        policy, tokenizer = load_policy(tiny_model_dir, device="cpu", lora_r=4, load_in_4bit=True)
        with torch.no_grad():  # an adapter as if trained: with B = 0 no gradient reaches layer 0's A
            for name, p in policy.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        ids = torch.tensor([tokenizer("i feel so stupid for hoping")["input_ids"]])
        if sampled_first:
            with torch.no_grad():
                policy.eval()(input_ids=ids)
        policy.train()
        policy(input_ids=ids).logits.float().pow(2).mean().backward()
        return {n: p.grad for n, p in policy.named_parameters() if p.grad is not None and "layers.0." in n}

    fresh, after = first_layer_grads(False), first_layer_grads(True)
    assert fresh.keys() == after.keys() and fresh
    for name in fresh:
        torch.testing.assert_close(after[name], fresh[name], atol=0, rtol=0, msg=name)


# ----------------------------------------------------------------------------------------------
# Micro-batches and minibatches
# ----------------------------------------------------------------------------------------------
def test_the_micro_batch_split_does_not_change_the_update(tiny_model_dir, personas_file, tmp_path):
    # Greedy dialogues, one minibatch of 4: micro-batches of 1, 2 or 4 accumulate to the same step.
    # Unwhitened advantages: whitened ones sum to zero over the batch, the gradient is then a small
    # difference of large terms, and Adam's first step (about lr x sign) magnifies its round-off.
    results = []
    for micro in ("1", "2", "4"):
        out = tmp_path / micro
        model, head = ppo.main(ppo_args(tiny_model_dir, personas_file, out, "--iterations", "1",
                                        "--greedy", "true", "--dialogues-per-iteration", "4",
                                        "--minibatch-size", "4", "--whiten-advantages", "false",
                                        "--micro-batch-size", micro))
        results.append((read_metrics(out), lora_state(model), head.state_dict()))
    for metrics, actor_critic, head in results[1:]:
        assert metrics[0]["reward_mean"] == results[0][0][0]["reward_mean"]
        assert_same_weights(actor_critic, results[0][1], atol=1e-5)
        for key in ("actor_grad_norm", "critic_grad_norm"):
            assert metrics[0][key] == pytest.approx(results[0][0][0][key], rel=1e-4), key
        assert_same_weights(head, results[0][2], atol=1e-5)
    assert any(w.abs().sum() > 0 for k, w in results[0][1].items() if "lora_B" in k)  # it did move


@pytest.mark.parametrize("trainer", [ppo, grpo])
def test_two_minibatches_step_the_learning_rate_warmup_twice_an_iteration(trainer, tiny_model_dir,
                                                                          personas_file, tmp_path):
    # --warmup-steps counts optimizer steps, one per minibatch: with 2 minibatches an iteration the
    # logged rate (the one the next step will use) is base x min(1, (steps taken + 1) / warmup).
    lr_key = "actor_lr" if trainer is ppo else "lr"
    make = ppo_args if trainer is ppo else grpo_args
    sizes = ["--dialogues-per-iteration", "4"] if trainer is ppo else []
    out = tmp_path / "run"
    trainer.main(make(tiny_model_dir, personas_file, out, "--iterations", "2", "--minibatch-size", "2",
                      "--micro-batch-size", "2", "--warmup-steps", "8", *sizes))
    metrics = read_metrics(out)
    assert [m[lr_key] for m in metrics] == pytest.approx([1e-3 * 3 / 8, 1e-3 * 5 / 8])


# ----------------------------------------------------------------------------------------------
# The stop after non-finite updates never overwrites a complete checkpoint
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trainer", [ppo, grpo])
def test_the_stop_after_non_finite_updates_keeps_the_last_complete_checkpoint(trainer, tiny_model_dir,
                                                                              personas_file, tmp_path,
                                                                              monkeypatch, capsys):
    from run import checkpoints

    # 3 optimizer steps an iteration. Iteration 1 is clean and saved; in iteration 2 the first step
    # is clean (the weights move on) and every later one is non-finite, so the run stops part-way.
    real, calls = trainer.policy_terms, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        terms = real(*args, **kwargs)
        poison = float("nan") if len(calls) > 4 else 1.0
        return {**terms, "policy_loss": terms["policy_loss"] * poison}
    monkeypatch.setattr(trainer, "policy_terms", poisoned)
    make = ppo_args if trainer is ppo else grpo_args
    out = tmp_path / "run"
    sizes = ["--dialogues-per-iteration", "6"] if trainer is ppo else ["--personas-per-iteration", "3"]
    args = make(tiny_model_dir, personas_file, out, "--iterations", "4", "--save-every", "1",
                "--minibatch-size", "2", "--micro-batch-size", "2", "--max-bad-updates", "2", *sizes)
    with pytest.raises(SystemExit) as stop:
        cli.command(trainer.main)(args)
    assert stop.value.code == 1
    err = capsys.readouterr().err
    folder = out / "checkpoints"
    assert "stopped in iteration 2" in err
    assert f"the newest complete checkpoint is {folder / 'iter_000001'}" in err
    assert os.listdir(folder) == ["iter_000001"] and checkpoints(str(out)) == [str(folder / "iter_000001")]
    clean = torch.load(folder / "iter_000001" / "state.pt", weights_only=False)
    steps = [int(s["step"]) for s in clean["optimizer"]["state"].values()]
    assert clean["iteration"] == 1 and set(steps) == {3}             # the steps of iteration 1, no more
