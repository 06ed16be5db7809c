"""Code that runs is not yet code that learns. Here ppo.py and grpo.py train a tiny random model
against a stand-in user whose reward has a known, reachable optimum: the fraction of the agent's
reply tokens that come from a target set (a quarter of the vocabulary, so a random policy scores
about 0.25 and the best policy 1.0). The scripts run through their real main(); only the
simulator is replaced. A sign error, a wrong mask or a detached loss keeps the reward flat."""
import json
import os

import numpy as np
import pytest

import simulator as sim_module


class TargetTokenSimulator(sim_module.Simulator):
    """One turn; the user's emotion becomes 100 x the fraction of reply tokens in the target set."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(sim_module.RulesBackend(), readout="rules", max_turns=1)
        self.tokenizer = tokenizer
        self.target = set(range(len(tokenizer) // 4))

    def step(self, states, replies):
        for s, reply in zip(states, replies):
            ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"]
            fraction = sum(t in self.target for t in ids) / max(1, len(ids))
            s.history.append({"role": "agent", "text": reply})
            s.turns += 1
            s.emotion = round(100 * fraction)
            s.appraisals.append({"change": 0, "emotion": s.emotion, "appraisal": f"target fraction {fraction:.2f}",
                                 "parsed": True})
            s.end_reason = "max_turns"


def install_stand_in(monkeypatch, trainer):
    """Replace the trainer's Simulator with the stand-in (it needs the policy's tokenizer)."""
    def make(backend, **kwargs):
        return TargetTokenSimulator(make.tokenizer)

    real_make_backend = trainer.make_backend

    def make_backend(name, policy=None, tokenizer=None, **kwargs):
        make.tokenizer = tokenizer
        return real_make_backend("rules")
    monkeypatch.setattr(trainer, "Simulator", make)
    monkeypatch.setattr(trainer, "make_backend", make_backend)


COMMON = ["--preset", "cpu", "--simulator", "rules", "--split", "test", "--max-turns", "1",
          "--max-new-tokens", "8", "--thinking", "false", "--lora-r", "8", "--lora-alpha", "16",
          "--target-modules", "q_proj,v_proj,lm_head", "--save-every", "1000"]


def rewards_of(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["reward_mean"] for line in f]


@pytest.fixture
def personas_file(write_personas, persona_entry):
    return write_personas([persona_entry(id=f"p{i}") for i in range(4)])


def assert_learned(rewards, name):
    first, last = np.mean(rewards[:3]), np.mean(rewards[-3:])
    print(f"{name}: reward {first:.3f} (first 3 iterations) -> {last:.3f} (last 3)")
    assert first < 0.45, f"{name}: a random policy should score about 0.25, got {first:.3f}"
    assert last > first + 0.2, f"{name}: reward did not rise clearly: {first:.3f} -> {last:.3f}"


def test_ppo_learns_a_known_reward(tiny_model_dir, personas_file, tmp_path, monkeypatch):
    import ppo

    install_stand_in(monkeypatch, ppo)
    out = tmp_path / "ppo"
    ppo.main(COMMON + ["--model", tiny_model_dir, "--personas", personas_file, "--out", str(out),
                       "--iterations", "16", "--dialogues-per-iteration", "8", "--minibatch-size", "8",
                       "--micro-batch-size", "8", "--actor-lr", "3e-2", "--critic-lr", "3e-2", "--ppo-epochs", "2"])
    assert_learned(rewards_of(out), "ppo")


def test_grpo_learns_a_known_reward(tiny_model_dir, personas_file, tmp_path, monkeypatch):
    import grpo

    install_stand_in(monkeypatch, grpo)
    out = tmp_path / "grpo"
    grpo.main(COMMON + ["--model", tiny_model_dir, "--personas", personas_file, "--out", str(out),
                        "--iterations", "16", "--personas-per-iteration", "2", "--group-size", "4",
                        "--minibatch-size", "8", "--micro-batch-size", "8", "--lr", "3e-2", "--num-iterations", "2"])
    assert_learned(rewards_of(out), "grpo")
