"""Data parallel on CPU: `accelerate launch --num_processes 2 --cpu` (gloo) against one process."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT


def run(cmd, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def personas_file(write_personas, persona_entry):
    return write_personas([persona_entry(id=f"p{i}", difficulty=d) for i, d in enumerate(["easy", "normal", "hard", "easy"])])


def args_for(script, model, personas, out, *extra):
    # grpo: greedy groups are identical (zero advantages), so an entropy bonus makes the step move the adapter
    size = ["--dialogues-per-iteration", "4"] if script == "ppo.py" else \
        ["--personas-per-iteration", "2", "--group-size", "2", "--ent-coef", "0.01"]
    # one minibatch of the whole batch and greedy dialogues: both runs see the same dialogues and
    # take the same optimizer step, so their adapters must agree to float tolerance
    return [script, "--preset", "cpu", "--model", model, "--simulator", "rules", "--personas", personas,
            "--split", "test", *size, "--minibatch-size", "4", "--micro-batch-size", "1", "--max-turns", "2",
            "--max-new-tokens", "6", "--lora-r", "4", "--lora-alpha", "8", "--greedy", "true",
            "--iterations", "2", "--save-every", "1", "--out", str(out), *extra]


def launch_two(args):
    # accelerate 1.15's `launch --cpu` starts a single process unless MPI is set up; --multi_gpu
    # starts two through torchrun, and on a machine without CUDA they talk over gloo on the CPU
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(29500 + os.getpid() % 1000), *args]


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py"])
def test_two_processes_match_one(script, tiny_model_dir, personas_file, tmp_path):
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    single = run([sys.executable, *args_for(script, tiny_model_dir, personas_file, one)], one)
    double = run(launch_two(args_for(script, tiny_model_dir, personas_file, two)), two)
    assert [m["processes"] for m in double] == [2, 2]
    assert all(m["replicas_identical"] for m in double)  # bit-identical adapters on both processes
    with open(two / "rollouts.jsonl") as f:
        assert len([json.loads(line) for line in f]) == 2 * 4  # every process's dialogues, both iterations
    for a, b in zip(single, double):  # the same dialogues, so the same global metrics
        for key in ("reward_mean", "final_emotion_mean", "policy_loss", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    adapter = os.path.join("checkpoints", "iter_000001", "default", "adapter_model.safetensors")
    w1, w2 = load_file(str(one / adapter)), load_file(str(two / adapter))
    assert any(w.abs().sum() > 0 for k, w in w1.items() if "lora_B" in k)
    for key in w1:
        torch.testing.assert_close(w1[key], w2[key], atol=1e-5, rtol=1e-4)


def test_critic_warmup_then_an_actor_step_matches_one_process(tiny_model_dir, personas_file, tmp_path):
    """Two iterations of --critic-warmup, then one in which the actor learns. The actor has no
    gradients during the warm-up; had they become zeros on the way through the all-reduce, AdamW
    would have counted two steps on them with two processes and none with one, and the actor's
    first real step would differ by about a third (Adam's bias correction; a large --actor-lr so
    that the difference is far above float noise)."""
    from safetensors.torch import load_file

    extra = ("--iterations", "3", "--critic-warmup", "2", "--actor-lr", "1e-3")
    one, two = tmp_path / "one", tmp_path / "two"
    run([sys.executable, *args_for("ppo.py", tiny_model_dir, personas_file, one, *extra)], one)
    double = run(launch_two(args_for("ppo.py", tiny_model_dir, personas_file, two, *extra)), two)
    assert all(m["replicas_identical"] for m in double)
    folder = os.path.join("checkpoints", "iter_000003")
    for adapter in ("default", "critic"):
        name = os.path.join(folder, adapter, "adapter_model.safetensors")
        w1, w2 = load_file(str(one / name)), load_file(str(two / name))
        assert any(w.abs().max() > 1e-4 for k, w in w1.items() if "lora_B" in k), adapter  # it learned
        for key in w1:
            torch.testing.assert_close(w1[key], w2[key], atol=1e-6, rtol=1e-4)
    warm = load_file(str(one / "checkpoints" / "iter_000002" / "default" / "adapter_model.safetensors"))
    assert all((w == 0).all() for k, w in warm.items() if "lora_B" in k)  # the actor was still during warm-up
