"""The paper preset's code paths, run on a tiny model in CI.

The paper preset (the dataclass defaults, what users run on GPUs) turns on switches that the CPU
preset (what CI and the benchmarks run) turns off: gradient checkpointing, thinking, several
micro-batches and minibatches, bf16. A bug behind one of them is invisible to every CPU-preset
run, so each is run here, and where a switch should not change the numbers (checkpointing,
the micro-batch split) the run with it on is held against the run with it off."""
import json
import os
from dataclasses import fields

import pytest
import torch

import grpo
import ppo


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


TIMING = ("time_", "_per_s", "_seconds", "peak_memory")


def assert_same_metrics(a, b, rel=1e-5, abs=1e-6):
    assert [m["iteration"] for m in a] == [m["iteration"] for m in b]
    for ma, mb in zip(a, b):
        for key in ma:
            if not any(t in key for t in TIMING):
                assert ma[key] == pytest.approx(mb[key], rel=rel, abs=abs, nan_ok=True), (ma["iteration"], key)


def lora_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}


def assert_same_weights(a, b, atol=1e-6):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=1e-5, msg=k)


@pytest.fixture(scope="module")
def personas_file(tmp_path_factory):
    from conftest import BASE_PERSONA

    entries = []
    for i, difficulty in enumerate(["easy", "normal", "hard"]):
        entry = json.loads(json.dumps(BASE_PERSONA))
        entry.update(id=f"p{i}", difficulty=difficulty)
        entries.append(entry)
    path = tmp_path_factory.mktemp("paper_personas") / "personas.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return str(path)


def ppo_args(model_dir, personas, out, *extra):
    return ["--preset", "cpu", "--model", str(model_dir), "--simulator", "rules", "--personas", personas,
            "--split", "test", "--dialogues-per-iteration", "2", "--minibatch-size", "2", "--micro-batch-size", "1",
            "--max-turns", "2", "--max-new-tokens", "6", "--max-context", "512", "--lora-r", "4",
            "--lora-alpha", "8", "--actor-lr", "1e-3", "--critic-lr", "1e-3", "--out", str(out), *extra]


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

    from rollout import DEFAULT_TARGETS, load_policy

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
        model, head = ppo.main(ppo_args(tiny_model_dir, personas_file, out, "--iterations", "3", "--seed", "5",
                                        "--gradient-checkpointing", on))
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
