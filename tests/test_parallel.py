"""Data parallel on CPU: two processes (`accelerate launch --multi_gpu`, gloo) against one."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, is_appraisal, read_metrics, reply


def run(cmd, out):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(out)


# Four personas, each judged alike every turn by the user behind the server below: three read (each
# its own change, so any two of them earn different rewards) and one never read (its dialogues end
# "unread" and enter no loss). Different openings: with one opening every dialogue's first turn is
# the same greedy reply, the whitened advantages cancel on it, and what is left of the gradient is
# round-off (about 1e-8), which Adam's first step (about lr x sign) turns into different weights in
# any two runs. PPO samples all four an iteration (2 a process), so each iteration one process holds
# an unread dialogue beside a read one and the other two read ones: a figure averaged per process,
# not over every trained token, would differ from one process's.
OPENINGS = {"i didn't get the promotion. they gave it to the new guy.": "Change: +4",
            "my sister hasn't spoken to me since the wedding and i don't know what i did.": "Change: -2",
            "i failed the driving test again today. third time.": "Change: +1",
            "my flatmate moved out without telling me and left me the rent.": "I'd rather not say."}


@pytest.fixture
def personas_file(write_personas, persona_entry):
    return write_personas([persona_entry(id=f"p{i}", opening=o) for i, o in enumerate(OPENINGS)])


@pytest.fixture
def user(server):
    """The user on 127.0.0.1: an appraisal (or its re-ask) gets its persona's line, found by the
    opening it holds; a message of the user is always the same."""
    def handle(handler, n, body):
        messages = json.dumps(body["messages"])
        text = next((line for opening, line in OPENINGS.items() if opening in messages), "")
        if not is_appraisal(body["messages"]):
            text = "okay. go on."
        reply(handler, 200, json.dumps({"choices": [{"message": {"content": text}}]}).encode())
    return server(handle)


def args_for(script, model, personas, user, out, *extra):
    # grpo: greedy groups are identical (zero advantages), so an entropy bonus makes the step move the adapter
    # a learning rate large enough that iteration 2's policy is measurably off the reference
    size = ["--dialogues-per-iteration", "4", "--lr", "2e-3"] if script == "ppo.py" else \
        ["--personas-per-iteration", "2", "--group-size", "2", "--ent-coef", "0.01", "--lr", "2e-3"]
    # one minibatch of the whole batch and greedy dialogues: both runs see the same dialogues and
    # take the same optimizer step, so their adapters must agree to float tolerance
    return [script, "--preset", "cpu", "--model", model, "--simulator", user.url, "--personas", personas,
            "--split", "test", *size, "--minibatch-size", "4", "--micro-batch-size", "1", "--max-turns", "2",
            "--max-new-tokens", "6", "--lora-r", "4", "--lora-alpha", "8", "--greedy", "true",
            "--iterations", "2", "--save-every", "1", "--out", str(out), *extra]


def launch_two(args):
    # accelerate 1.15's `launch --cpu` starts a single process unless MPI is set up; --multi_gpu
    # starts two through torchrun, and on a machine without CUDA they talk over gloo on the CPU
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(29500 + os.getpid() % 1000), *args]


# Every logged figure is global: the same with one process as with two, to float tolerance
# (timings aside; the token counts behind the rates must agree exactly).
SAME = {"both": ("reward_mean", "reward_std", "final_emotion_mean", "policy_loss", "entropy", "kl_ref",
                 "kl_ref_loss", "approx_kl", "turns_mean", "sample_logprob_gap", "mismatch_kl",
                 "tis_weight_mean", "tis_clip_frac", "clip_frac"),
        "ppo.py": ("value_loss", "explained_variance", "actor_grad_norm", "critic_grad_norm"),
        "grpo.py": ("group_reward_std", "zero_spread_groups", "grad_norm")}
COUNTS = ("policy_tokens", "update_tokens", "unread_dialogues", "end_max_turns", "end_left", "end_context",
          "policy_prompt_tokens", "policy_reused_tokens",
          "simulator_prompt_tokens", "simulator_reused_tokens")


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py"])
def test_two_processes_match_one(script, tiny_model_dir, personas_file, user, tmp_path):
    from safetensors.torch import load_file

    one, two = tmp_path / "one", tmp_path / "two"
    single = run([sys.executable, *args_for(script, tiny_model_dir, personas_file, user, one)], one)
    double = run(launch_two(args_for(script, tiny_model_dir, personas_file, user, two)), two)
    assert [m["processes"] for m in double] == [2, 2]
    with open(two / "rollouts.jsonl") as f:
        assert len([json.loads(line) for line in f]) == 2 * 4  # every process's dialogues, both iterations
    # the read dialogues (GRPO: the groups) differ in reward (GRPO's first iteration: one group read)
    assert all(m["reward_std"] > 0 for m in single[script == "grpo.py":])
    # PPO: an unread dialogue an iteration, beside a read one on its process; GRPO: a whole group
    assert [m["unread_dialogues"] for m in single] == ([1, 1] if script == "ppo.py" else [2, 0])
    assert single[1]["kl_ref"] > 0  # the adapter moved in iteration 1
    for a, b in zip(single, double):  # the same dialogues, so the same global metrics
        for key in SAME["both"] + SAME[script]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        for key in COUNTS:
            assert a[key] == b[key], key
        assert 0 < a["update_tokens"] <= a["policy_tokens"]  # one pass over the read dialogues
    for iteration in (1, 2):
        ckpt = os.path.join("checkpoints", f"iter_{iteration:06d}")
        for adapter in ("default", "critic") if script == "ppo.py" else ("default",):
            path = os.path.join(ckpt, adapter, "adapter_model.safetensors")
            w1, w2 = load_file(str(one / path)), load_file(str(two / path))
            # (the critic's B moves from iteration 2: before, the value head it feeds is still zero)
            if adapter == "default" or iteration == 2:
                assert any(w.abs().sum() > 0 for k, w in w1.items() if "lora_B" in k), (iteration, adapter)
            # Adam's first step moves every element by about lr (2e-3) whatever its gradient's size,
            # so round-off on an element whose gradient is near 0 can show; a real difference in the
            # gradients (a missing or doubled reduction, mixed-up groups) moves most elements by ~lr.
            for key in w1:
                torch.testing.assert_close(w1[key], w2[key], atol=1e-4, rtol=1e-3)
        if script == "ppo.py":
            h1, h2 = (torch.load(str(d / ckpt / "state.pt"), weights_only=False)["value_head"]
                      for d in (one, two))
            assert h1["weight"].abs().sum() > 0
            for key in h1:
                torch.testing.assert_close(h1[key], h2[key], atol=1e-5, rtol=1e-4)
