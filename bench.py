"""Benchmarks of this codebase itself, one subcommand each.

    python bench.py rollout [--dialogues 4] [--max-turns 3] [--max-new-tokens 48] [--threads 2]
    python bench.py learning [--seeds 0,1,2] [--iterations 30] [--out runs/bench-learning] [-- TRAINER FLAGS]
    python bench.py gpu [--dialogues 32] [--max-turns 3] [--max-new-tokens 128]    (one CUDA GPU)
    python bench.py gpu --tiny                                                      (CPU smoke test)

rollout: how much of plain batched generation speed a full multi-turn rollout keeps. The rollout
(rollout.play_dialogues: the LoRA policy on the embedded SmolLM2-135M-Instruct against the
'same' simulator, its frozen base, with the default read-out) is timed over its whole wall time
and its generated tokens (policy + simulator) counted; the baseline is one plain batched
`generate` call on the same policy, the same batch size and the same first-turn prompts, sampling
exactly --max-new-tokens tokens per row. The ratio of the two rates is the figure of merit
(target >= 0.8); the time split says where the rest went.

learning: evidence that the trainers learn, on an environment whose answer is known. `ppo.py
--preset cpu --simulator rules` and `grpo.py --preset cpu --simulator rules` (the embedded
SmolLM2-135M against the deterministic lexicon user of simulator.py, 3 agent turns) run for each
seed as subprocesses into OUT/{algo}-seed{S}; then OUT/learning.png (mean reward per iteration,
mean over seeds with a min-max band) and OUT/learning.md (mean reward over the first and last
--window iterations, mean and std over seeds, and whether the rise reaches 0.15) are written and
the table printed. Budget: the default 30 iterations are sized for about 20 minutes per run on 2
free CPU cores (about 35-40 s per iteration at 3 turns; one iteration took 50 s for PPO and 36 s
for GRPO on one thread of a busy 2-core machine), so the 6 runs take about 2 hours. A run whose
metrics.jsonl already holds every iteration is skipped and a partial one resumes from its newest
checkpoint, so an interrupted benchmark continues where it stopped. Flags after `--` go to both
trainers, e.g. `python bench.py learning -- --actor-lr 1e-4` (a flag only one trainer knows
makes the other one fail).

gpu: one PPO iteration of Qwen2.5-7B-Instruct's architecture on one GPU, with random bf16 weights
(QWEN25_7B_CONFIG below; nothing is downloaded) and the embedded SmolLM2 tokenizer (ChatML, as
Qwen's; its ids all lie below Qwen's vocabulary size). The model is built in memory and handed to
ppo.main() by replacing rollout.load_model for the one name RANDOM_MODEL, so no 15 GB folder is
written; the run goes through ppo.main() unchanged otherwise (--simulator rules, --iterations 1,
its checkpoint lands in a temporary folder). It prints rollout tokens/s (policy tokens / rollout
time), update tokens/s, peak GPU memory, and the ratio of the rollout's speed to one plain
batched generate of the same batch size and new tokens. Random weights sample every id of the
152064-row vocabulary nearly uniformly: about two thirds lie past the tokenizer's 49152 and decode
to nothing, and end-of-turn is almost never drawn, so every turn runs to --max-new-tokens. That is
what a throughput benchmark wants; the text itself is noise. Sized to finish well inside 8 minutes
on one H200 (not yet run on a GPU). --tiny swaps in a 2-layer, 64-wide model of the same family
and runs on CPU, so the tests can run the same code path.
"""
import argparse
import json
import sys
import time

import torch


# ----------------------------------------------------------------------------------------------
# rollout: multi-turn rollout throughput against plain batched generation
# ----------------------------------------------------------------------------------------------
def plain_generate_rate(policy, tokenizer, prompts, max_new_tokens):
    """Tokens per second of one batched, sampled generate call of exactly max_new_tokens per row."""
    from transformers import GenerationConfig

    from rollout import _pad_left, eos_ids

    config = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=None, repetition_penalty=1.0,
                              max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                              eos_token_id=eos_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    ids, mask = _pad_left(prompts, tokenizer.pad_token_id, next(policy.parameters()).device)
    t0 = time.time()
    with torch.no_grad():
        out = policy.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    seconds = time.time() - t0
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return tokens / seconds, tokens, seconds


def time_calls(obj, method, clock):
    """Wrap obj.method so that clock[method] accumulates its wall time."""
    inner = getattr(obj, method)

    def timed(*a, **k):
        t0 = time.time()
        try:
            return inner(*a, **k)
        finally:
            clock[method] += time.time() - t0

    setattr(obj, method, timed)


def bench_rollout(args):
    import rollout
    from simulator import Simulator, load_personas_or_exit, make_backend

    rollout.set_seed(args.seed)
    device = rollout.default_device()
    policy, tokenizer = rollout.load_policy(args.model, device=device, trainable=False)
    personas = load_personas_or_exit(args.personas, "train")[:args.dialogues]
    backend = make_backend("same", policy=policy, tokenizer=tokenizer, device=device)
    simulator = Simulator(backend, start_emotion=30, max_turns=args.max_turns)
    sim_clock = {"score": 0.0, "chat": 0.0}  # the likelihood read-out; written replies (and reasoned appraisals)
    for method in sim_clock:
        time_calls(backend, method, sim_clock)
    chat = rollout.ChatTokens(tokenizer, rollout.THINK_PROMPT)
    prompts = [chat.prompt(p.opening) for p in personas]
    print(f"bench rollout: {args.model} on {device} ({torch.get_num_threads()} threads), {len(personas)} dialogues, "
          f"{args.max_turns} turns, {args.max_new_tokens} new tokens per agent turn, "
          f"simulator 'same' with the {simulator.readout} read-out")

    plain_generate_rate(policy, tokenizer, prompts, 4)  # warm-up: first-call allocations and kernels
    # The baseline runs before and after the rollout and the two are averaged, so that a machine
    # whose load changes during the run (shared CPUs) tilts the ratio less.
    before = plain_generate_rate(policy, tokenizer, prompts, args.max_new_tokens)
    t0 = time.time()
    records, stats = rollout.play_dialogues(policy, tokenizer, simulator, personas, max_new_tokens=args.max_new_tokens,
                                            progress=False)
    wall = time.time() - t0
    after = plain_generate_rate(policy, tokenizer, prompts, args.max_new_tokens)
    base_rate = (before[0] + after[0]) / 2
    policy_s, sim_s = stats["policy_seconds"], stats["simulator_seconds"]
    tokens = stats["policy_tokens"] + stats["simulator_tokens"]
    rate = tokens / wall
    result = {
        "plain_tokens_per_s": base_rate, "plain_tokens_per_s_before_after": [round(before[0], 3), round(after[0], 3)],
        "rollout_tokens_per_s": rate, "ratio": rate / base_rate,
        "rollout_seconds": wall, "policy_seconds": policy_s, "simulator_seconds": sim_s,
        "other_seconds": wall - policy_s - sim_s, "policy_tokens": stats["policy_tokens"],
        "simulator_tokens": stats["simulator_tokens"], "agent_turns": sum(len(r["turn_ends"]) for r in records),
        "simulator_score_seconds": sim_clock["score"], "simulator_chat_seconds": sim_clock["chat"],
        "policy_tokens_per_s": stats["policy_tokens"] / max(policy_s, 1e-9),
        "simulator_tokens_per_s": stats["simulator_tokens"] / max(sim_s, 1e-9),
    }
    print(f"  plain generate : {before[1]} tokens in {before[2]:.1f} s before, {after[2]:.1f} s after "
          f"the rollout = {base_rate:.1f} tok/s ({before[0]:.1f} and {after[0]:.1f})")
    print(f"  rollout        : {tokens} tokens ({stats['policy_tokens']} policy + {stats['simulator_tokens']} "
          f"simulator, {result['agent_turns']} agent turns) in {wall:.1f} s = {rate:.1f} tok/s")
    print(f"  ratio          : {result['ratio']:.2f} (target >= 0.8)")
    for name in ("policy", "simulator", "other"):
        seconds = result[f"{name}_seconds"]
        print(f"    {name:<10} {seconds:6.1f} s  {seconds / wall:4.0%}")
        if name == "simulator":
            print(f"      score (likelihood read-out, no tokens generated) {sim_clock['score']:6.1f} s, "
                  f"chat (generated user replies) {sim_clock['chat']:6.1f} s")
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    return result


# ----------------------------------------------------------------------------------------------
# Subcommands still to be written: they say so and exit, they never pretend to run
# ----------------------------------------------------------------------------------------------
def not_written(args):
    sys.exit(f"bench.py {args.command}: not written yet")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = ap.add_subparsers(dest="command", required=True)

    r = commands.add_parser("rollout", help="multi-turn rollout speed vs plain batched generate")
    r.add_argument("--dialogues", type=int, default=4, help="dialogues played together (train personas)")
    r.add_argument("--max-turns", type=int, default=3, help="agent turns per dialogue")
    r.add_argument("--max-new-tokens", type=int, default=48, help="tokens per agent turn")
    r.add_argument("--threads", type=int, default=2, help="torch intra-op CPU threads")
    r.add_argument("--model", default="smollm2", help="policy: smollm2 (embedded), a hub id or a path")
    r.add_argument("--personas", default="personas.json")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(run=bench_rollout)

    for name, what in (("learning", "learning curve on an environment with a known answer"),
                       ("gpu", "throughput and memory on a GPU")):
        commands.add_parser(name, help=f"{what} (not written yet)").set_defaults(run=not_written)

    args = ap.parse_args(argv)
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    args.run(args)


if __name__ == "__main__":
    main()
