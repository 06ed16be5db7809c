"""GRPO for RLVER: group-relative advantages over the same multi-turn rollouts, no critic.

Each iteration takes --personas-per-iteration personas and plays --group-size dialogues with each,
all from the persona's fixed opening (rollout.py). A dialogue's reward is its final emotion / 100;
its advantage is the reward minus the mean of its group, divided by the group's std (Shao et al.
2024, DeepSeekMath, arXiv 2402.03300), broadcast over every token the agent sampled in it. Then
clipped policy-gradient steps on the LoRA adapter. No value model: the group mean is the baseline.

One copy of the weights serves three roles: the policy (adapter 'default'), the reference policy
(adapter disabled) and, with --simulator same, the simulated user (adapter disabled too).

This file is ppo.py with the critic taken out and the group advantage put in; the two are kept
parallel line by line so that `diff ppo.py grpo.py` shows exactly what GRPO changes.

    python grpo.py                      # the paper's GRPO setup on a CUDA machine (Qwen2.5-7B-Instruct)
    python grpo.py --preset cpu         # the embedded SmolLM2-135M, a few iterations on 2 CPU cores
    accelerate launch --num_processes 8 grpo.py   # data parallel on one node
"""
import sys
import time
from functools import partial
from dataclasses import dataclass, field

import torch

from rollout import (DEFAULT_TARGETS, adapter_params, all_rng_states, batched_logprobs, begin_run,
                     checkpoint_due, dropout_active, gather_tensor, global_masked_mean, global_max,
                     global_sum, latest_checkpoint, load_policy, log_iteration, make_simulator, masked_mean,
                     pad_records, passes_to_run, pick_personas, play_dialogues, policy_settings,
                     prune_checkpoints, public_config, reduce_gradients, sampling_settings, save_checkpoint,
                     set_seed, start_or_resume, StepGuard, stop_on_simulator_error, token_logprobs,
                     training_personas)
from simulator import SimulatorError, fail, one_of


@dataclass
class Args:
    preset: str = field(default="paper", metadata={
        "help": "paper (Qwen2.5-7B on CUDA) | cpu (embedded model); explicit flags win"})
    # the policy
    model: str = field(default="Qwen/Qwen2.5-7B-Instruct", metadata={
        "help": "policy base: hub id, path, or smollm2 (embedded)"})
    lora_r: int = field(default=32, metadata={"help": "LoRA rank of the policy adapter"})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (scale = alpha / r)"})
    lora_dropout: float = field(default=0.0, metadata={
        "help": "LoRA dropout; 0 keeps the first ratio exactly 1"})
    target_modules: str = field(default=DEFAULT_TARGETS, metadata={
        "help": "comma-separated module names that get LoRA"})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "QLoRA: NF4 base weights via bitsandbytes (CUDA only)"})
    gradient_checkpointing: bool = field(default=True, metadata={
        "help": "recompute activations in the backward pass"})
    dtype: str = field(default="auto", metadata={
        "help": "auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16"})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "allow model code from the hub (off unless you trust it)"})
    # the simulated user
    simulator: str = field(default="same", metadata={
        "help": "same | rules | model id/path | http://host:port/v1"})
    simulator_device_map: str = field(default="auto", metadata={
        "help": "where a local simulator model goes: auto spreads it over the GPUs after the first"})
    readout: str = field(default="auto", metadata={
        "help": "auto | reasoned | likelihood | rules (see docs/simulator.md: read-outs)"})
    api_model: str = field(default="default", metadata={"help": "model name sent to a URL simulator"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "environment variable with the URL simulator's key"})
    api_timeout: float = field(default=60.0, metadata={
        "help": "seconds a request to a URL simulator may take in all; a call, x (retries + 1)"})
    api_retries: int = field(default=4, metadata={"help": "tries after a failed request to a URL simulator"})
    api_concurrency: int = field(default=8, metadata={"help": "requests in flight at once to a URL server"})
    personas: str = field(default="personas.json", metadata={"help": "persona file"})
    split: str = field(default="train", metadata={"help": "persona split to train on"})
    difficulty: str = field(default="all", metadata={
        "help": "all (each persona's own) | easy | normal | hard: every user plays at this level"})
    start_emotion: int = field(default=30, metadata={
        "help": "start emotion (RLVER training 30, SAGE benchmark 40)"})
    max_change: int = field(default=10, metadata={"help": "largest emotion change per turn"})
    max_turns: int = field(default=8, metadata={"help": "agent turns per dialogue (RLVER: 8)"})
    user_reply_tokens: int = field(default=96, metadata={"help": "tokens per simulated user message"})
    # rollouts
    personas_per_iteration: int = field(default=8, metadata={
        "help": "personas (groups) per iteration, over all processes (RLVER: 32 dialogues = 8 x 4)"})
    group_size: int = field(default=4, metadata={
        "help": "dialogues per persona, all from its opening (RLVER: 4); at least 2"})
    thinking: bool = field(default=True, metadata={"help": "think-then-say scaffold (the paper's best run)"})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature; the trainer's log-probs use the same"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (RLVER: 1.0)"})
    greedy: bool = field(default=False, metadata={
        "help": "decode greedily: reproducible dialogues for tests and debugging, not for training "
                "(a group's dialogues would be identical)"})
    merged_sampling: bool = field(default=True, metadata={
        "help": "sample from the adapter merged into a copy of the weights: faster, the update stays "
                "exact (off: less memory; 4-bit bases never merge)"})
    static_cache: bool = field(default=False, metadata={
        "help": "decode into a fixed-size KV cache, which transformers compiles on a GPU (CUDA graphs); "
                "turn caches off. Not yet measured on a GPU"})
    max_new_tokens: int = field(default=512, metadata={"help": "tokens per agent turn"})
    max_context: int = field(default=6144, metadata={
        "help": "tokens per dialogue; past it the dialogue ends with 'context'"})
    # rewards
    reward: str = field(default="final", metadata={
        "help": "final: final emotion / 100 | turn: sum of the turns' changes / 100"})
    format_penalty: float = field(default=0.0, metadata={
        "help": "subtracted per think-format violation (thinking on)"})
    kl_loss_coef: float = field(default=0.0, metadata={
        "help": "k3 KL-to-reference loss coefficient (RLVER and TRL: 0)"})
    # advantages
    scale_rewards: str = field(default="group", metadata={
        "help": "group: (r - group mean) / group std | batch: / batch std | none: r - group mean (Dr. GRPO)"})
    drop_zero_spread: bool = field(default=False, metadata={
        "help": "leave groups whose rewards are all equal out of the loss (default: keep, they weigh zero)"})
    # the update
    update_epochs: int = field(default=1, metadata={
        "help": "passes over each iteration's dialogues (GRPO's mu); 1 = plain policy gradient"})
    minibatch_size: int = field(default=32, metadata={
        "help": "dialogues per optimizer step, over all processes; the whole batch = one step per batch"})
    micro_batch_size: int = field(default=2, metadata={
        "help": "dialogues per forward pass (gradient accumulation)"})
    clip_low: float = field(default=0.2, metadata={
        "help": "clip: ratio kept within [1 - clip_low, 1 + clip_high]"})
    clip_high: float = field(default=0.2, metadata={
        "help": "upper clip; larger than clip_low = clip-higher (DAPO uses 0.28)"})
    ent_coef: float = field(default=0.001, metadata={"help": "entropy bonus coefficient (RLVER: 0.001)"})
    loss_agg: str = field(default="seq-mean-token-mean", metadata={
        "help": "seq-mean-token-mean (GRPO paper) | token-mean | dr-grpo (token sum / fixed budget)"})
    lr: float = field(default=1e-5, metadata={"help": "LoRA learning rate (paper, full fine-tuning: 1e-6)"})
    warmup_steps: int = field(default=0, metadata={"help": "optimizer steps of linear learning-rate warm-up"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient norm clipping"})
    max_bad_updates: int = field(default=3, metadata={
        "help": "stop after this many non-finite updates in a row"})
    log_kl_every: int = field(default=1, metadata={
        "help": "log kl_ref every N iterations; with no KL term, N > 1 skips the reference pass in the "
                "others"})
    # the run
    iterations: int = field(default=200, metadata={"help": "training iterations"})
    save_every: int = field(default=10, metadata={"help": "checkpoint every N iterations (and at the end)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "keep the newest N checkpoints (0 = all)"})
    time_budget: float = field(default=0.0, metadata={
        "help": "minutes: stop (with a checkpoint) after the iteration that uses them up; 0 = off"})
    out: str = field(default="runs/grpo", metadata={"help": "run folder"})
    resume: str = field(default="", metadata={
        "help": "run folder to continue from its newest checkpoint that loads, with its saved settings"})
    overwrite: bool = field(default=False, metadata={"help": "let --out replace a run (deletes its files)"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    report_to: str = field(default="none", metadata={"help": "none | tensorboard | wandb | trackio | all"})


PRESETS = {
    "paper": {},
    # Small enough that a few iterations run on 2 CPU cores in minutes. Thinking is off: the 135M
    # model never writes the tags, and the instructions about them only make its replies worse.
    "cpu": dict(model="smollm2", personas_per_iteration=2, group_size=2, max_turns=2, max_new_tokens=32,
                user_reply_tokens=24, max_context=1024, minibatch_size=4, micro_batch_size=2,
                gradient_checkpointing=False, thinking=False, lora_r=8, lora_alpha=16,
                lr=5e-5, iterations=3, save_every=1, out="runs/grpo-cpu",
                # the value before the paper preset took RLVER's (0.001): the CPU results stand
                ent_coef=0.0),
}


# ----------------------------------------------------------------------------------------------
# The method: small pure functions (tests/test_grpo.py holds each against a hand computation)
# ----------------------------------------------------------------------------------------------
def dialogue_rewards(records, mode="final", format_penalty=0.0):
    """One reward per dialogue (B,), the scalar GRPO compares within a group.
    final: final emotion / 100 (the paper).
    turn:  sum of the turns' emotion changes / 100; GRPO has no per-token credit, so this differs
           from final only by the constant start emotion / 100 (and where a clamp at 0 or 100 ate
           part of a change), which the group mean removes anyway. Kept for parity with ppo.py.
    The format penalty is subtracted once per violating agent turn."""
    out = []
    for r in records:
        if mode == "final":
            reward = r["final_emotion"] / 100.0
        elif mode == "turn":
            reward = sum(r["changes"]) / 100.0
        else:
            raise ValueError(f"--reward must be final or turn, got '{mode}'")
        if format_penalty:
            reward -= format_penalty * sum(t.get("violation") is not None for t in r["turns"]
                                           if t["role"] == "agent")
        out.append(reward)
    return torch.tensor(out, dtype=torch.float64)


def group_stats(rewards, group_ids):
    """Per dialogue (B,): its group's mean reward, std (with Bessel's correction, as torch.std,
    TRL and verl use) and whether every reward in the group is the same (zero spread)."""
    mean, std = torch.zeros_like(rewards), torch.zeros_like(rewards)
    flat = torch.zeros(len(rewards), dtype=torch.bool)
    for g in group_ids.unique():
        members = group_ids == g
        if members.sum() < 2:
            raise ValueError(f"group {int(g)} has {int(members.sum())} dialogue(s); GRPO needs at least 2 "
                             f"per group (--group-size >= 2)")
        r = rewards[members]
        mean[members], std[members] = r.mean(), r.std()
        flat[members] = bool(r.max() == r.min())
    return mean, std, flat


def group_advantages(rewards, group_ids, scale="group", eps=1e-4):
    """Advantage of each dialogue (B,) from its reward and its group.
    group: (r - group mean) / (group std + eps)   GRPO (DeepSeekMath); eps 1e-4 as TRL
    batch: (r - group mean) / (batch std + eps)   the std of all rewards of the iteration (TRL's
                                                  scale_rewards="batch"); a group with a small
                                                  spread is not blown up to unit scale
    none:  r - group mean                         Dr. GRPO (Liu et al. 2025, arXiv 2503.20783):
                                                  dividing by the std favours too-easy/too-hard groups
    A group whose rewards are all equal gets exactly 0 (not round-off / eps) in every mode."""
    rewards = rewards.double()
    mean, std, flat = group_stats(rewards, group_ids)
    if scale == "group":
        advantages = (rewards - mean) / (std + eps)
    elif scale == "batch":
        advantages = (rewards - mean) / (rewards.std() + eps)
    elif scale == "none":
        advantages = rewards - mean
    else:
        raise ValueError(f"--scale-rewards must be group, batch or none, got '{scale}'")
    return torch.where(flat, torch.zeros_like(advantages), advantages)


def aggregate(loss, mask, mode, total_tokens, total_seqs, token_budget=None):
    """Reduce per-token losses (b, T) of one micro-batch to its share of the minibatch loss, so
    that summing the micro-batches gives the minibatch loss whatever the split.
    seq-mean-token-mean: every dialogue weighs the same (the GRPO paper's choice); a token of a
                         short dialogue weighs more than one of a long dialogue.
    token-mean: every agent token weighs the same (DAPO); long dialogues weigh more.
    dr-grpo: token sum over a fixed length budget per dialogue, total_seqs x token_budget (Dr. GRPO):
             no length-dependent normalisation at all. We take the budget as the most tokens a
             dialogue can hold, max_turns x max_new_tokens."""
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / total_seqs
    if mode == "token-mean":
        return (loss * mask).sum() / total_tokens
    if mode == "dr-grpo":
        if not token_budget:
            raise ValueError("loss aggregation 'dr-grpo' needs a token budget")
        return (loss * mask).sum() / (total_seqs * token_budget)
    raise ValueError(f"--loss-agg must be seq-mean-token-mean, token-mean or dr-grpo, got '{mode}'")


def clipped_policy_loss(logprobs, old_logprobs, advantages, clip_low, clip_high):
    """Per-token PPO surrogate (Schulman et al. 2017) with an asymmetric clip (clip-higher, DAPO).
    Returns (loss, ratio, clipped): loss = max(-A r, -A clip(r, 1 - low, 1 + high)).
    With one pass over the batch and one optimizer step per batch, old_logprobs are the current
    weights' own log-probs, so r = 1 exactly, nothing is clipped, and the gradient is the plain
    policy gradient -A grad log p (GRPO with mu = 1, as TRL's default)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), ratio, (clipped > unclipped).float()


# What the update logs, per micro-batch or optimizer step; metrics.jsonl has their means (docs/metrics.md).
LOGGED = ("policy_loss", "entropy", "approx_kl", "clip_frac", "kl_ref_loss", "ratio_first", "grad_norm")


def policy_and_optimizer(args, model):
    """The policy adapter's parameters, AdamW on them, and a linear warm-up over --warmup-steps
    optimizer steps."""
    params = adapter_params(model, "default")
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer,
                                                  lambda s: min(1.0, (s + 1) / max(1, args.warmup_steps)))
    return params, optimizer, scheduler


def kl_k3(logprobs, ref_logprobs):
    """k3 estimator of KL(policy || reference) per token: exp(ref - lp) - (ref - lp) - 1. Unbiased,
    always >= 0, low variance (J. Schulman, "Approximating KL divergence", 2020); GRPO's KL term."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1




def check_batch_shape(args, world):
    """A group is played and scored inside one process, never split: each gets whole personas; and
    minibatches split the batch evenly."""
    for name in ("personas_per_iteration", "minibatch_size"):
        if getattr(args, name) % world:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must divide by the {world} processes")
    if args.group_size < 2:
        fail(f"--group-size {args.group_size}: GRPO compares dialogues within a group; use 2 or more")
    batch_size = args.personas_per_iteration * args.group_size
    if batch_size % args.minibatch_size:
        fail(f"--minibatch-size {args.minibatch_size} must divide the batch of {batch_size} dialogues "
             f"(--personas-per-iteration x --group-size)")


def main(argv=None):
    from accelerate.utils import gather_object
    from tqdm import tqdm

    args, accelerator, ckpt, state, resumed = begin_run(Args, PRESETS, argv, {"loss_agg": one_of(
        "seq-mean-token-mean", "token-mean", "dr-grpo")}, ["default"], "grpo.py")
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    check_batch_shape(args, world)
    set_seed(args.seed)  # the same adapter initialisation on every process
    personas = training_personas(args)

    # --- the model: policy adapter on a frozen base; no critic --------------------------------
    model, tokenizer = load_policy(args.model, device=device, **policy_settings(args))
    params, optimizer, scheduler = policy_and_optimizer(args, model)
    simulator = make_simulator(args, model, tokenizer, accelerator,
                               f"; {args.personas_per_iteration} personas x {args.group_size} dialogues")
    dropout = dropout_active(model)  # then the old log-probs need their own pass (passes_to_run)

    def save(iteration, name=None):  # every process calls it; the main process writes
        return _save(args, iteration, model, optimizer, scheduler, accelerator, name)

    # --- run folder and resume ---------------------------------------------------------------
    run, start_iteration = start_or_resume(args, accelerator, ckpt, state, model, ["default"],
                                           optimizer, scheduler, resumed)
    saved_at = start_iteration  # the iteration of the newest checkpoint
    guard = StepGuard(args.max_bad_updates, "Lower --lr or use --dtype float32", args.out, accelerator)
    token_budget = args.max_turns * args.max_new_tokens  # Dr. GRPO's constant: the most a dialogue holds
    bar = tqdm(range(start_iteration, args.iterations), desc="grpo", disable=not accelerator.is_main_process)
    t_run = time.time()  # --time-budget counts from here (on --resume: from the resume)
    for iteration in bar:
        t_start = time.time()
        # --- 1. collect dialogues: this process's whole groups (its share of the personas) --------
        chosen = pick_personas(personas, args.personas_per_iteration, args.seed, iteration)
        share = args.personas_per_iteration // world
        try:
            own = chosen[rank * share:(rank + 1) * share]
            records, rstats = play_dialogues(model, tokenizer, simulator, own, **sampling_settings(args),
                                             samples_per_persona=args.group_size,
                                             progress=accelerator.is_main_process and sys.stderr.isatty())
        except SimulatorError as e:  # one line; a finished iteration not yet saved is saved first
            due = iteration > saved_at and world == 1  # (a save is collective: one process only)
            stop_on_simulator_error(e, partial(save, iteration) if due else None)
        t_rollout = time.time() - t_start

        # --- 2. score: old log-probs, reference log-probs, rewards --------------------------------
        t0 = time.time()
        batch = pad_records(records, tokenizer.pad_token_id, device)
        mask = batch["action_mask"]                                                         # (B, T)
        # only passes whose result is not known yet; --drop-zero-spread trims the update's mask
        old_from_update, need_ref = passes_to_run(args, iteration, old_first=args.drop_zero_spread,
                                                  dropout=dropout)
        old_logprobs = torch.zeros_like(mask) if old_from_update else \
            batched_logprobs(model, batch, args.temperature, args.micro_batch_size)         # (B, T)
        ref_logprobs = batched_logprobs(model, batch, args.temperature, args.micro_batch_size,
                                        reference=True) if need_ref else None               # (B, T)
        rewards = dialogue_rewards(records, args.reward, args.format_penalty)               # (B,)
        group_ids = torch.tensor([rank * share + r["group"] for r in records])              # (B,)

        # --- 3. advantages: each dialogue against its group --------------------------------------
        # Over the whole iteration, on every process (batch scaling needs the std of all rewards);
        # the gather is in rank order, so this process's rows are one slice.
        all_rewards, all_groups = gather_tensor(rewards, accelerator), gather_tensor(group_ids, accelerator)
        all_advantages = group_advantages(all_rewards, all_groups, args.scale_rewards)      # (N,)
        _, all_std, all_flat = group_stats(all_rewards, all_groups)                         # (N,)
        mine = slice(rank * len(records), (rank + 1) * len(records))
        if args.drop_zero_spread:  # advantage 0 anyway; out of the loss's denominators and other terms
            mask = mask * (~all_flat[mine].to(device)).float()[:, None]                     # (B, T)
        keep = (mask.sum(1) > 0).float()                                                    # (B,)
        advantages = all_advantages[mine].float().to(device)[:, None] * mask                # (B, T)
        t_score = time.time() - t0

        # --- 4. update: passes x minibatches x micro-batches ------------------------------------
        t0 = time.time()
        model.train()
        logs = {k: [] for k in LOGGED}
        skipped_steps = 0
        local_mb = args.minibatch_size // world
        for epoch in range(args.update_epochs):
            order = torch.randperm(len(records)).tolist()
            for start in range(0, len(records), local_mb):
                mb_inds = order[start:start + local_mb]
                total_tokens = global_sum(mask[mb_inds].sum(), accelerator).clamp(min=1)
                total_seqs = global_sum(keep[mb_inds].sum(), accelerator)  # = minibatch_size unless dropped
                if total_seqs.item() == 0:
                    # every dialogue of this minibatch was dropped (or has no agent token): no step,
                    # which also keeps Adam's momentum from moving the weights on a zero gradient
                    skipped_steps += 1
                    continue
                optimizer.zero_grad(set_to_none=True)
                for m0 in range(0, len(mb_inds), args.micro_batch_size):
                    idx = mb_inds[m0:m0 + args.micro_batch_size]
                    if not mask[idx].any():  # only dropped dialogues: no term of the loss, nothing to run
                        continue
                    w = int(batch["attention_mask"][idx].sum(1).max())  # the micro-batch's longest row
                    ids, att, m = batch["input_ids"][idx, :w], batch["attention_mask"][idx, :w], mask[idx, :w]
                    agg = partial(aggregate, mask=m, mode=args.loss_agg, total_tokens=total_tokens,
                                  total_seqs=total_seqs, token_budget=token_budget)  # its share of the loss
                    newlogprob, entropy = token_logprobs(model, ids, att, args.temperature, action_mask=m,
                                                         with_entropy=True, entropy_grad=args.ent_coef > 0)
                    if old_from_update:
                        old_logprobs[idx, :w] = newlogprob.detach()
                    pg, ratio, clipped = clipped_policy_loss(newlogprob, old_logprobs[idx, :w],
                                                             advantages[idx, :w], args.clip_low,
                                                             args.clip_high)
                    kl_ref = None if ref_logprobs is None else kl_k3(newlogprob, ref_logprobs[idx, :w])
                    loss = agg(pg) - args.ent_coef * agg(entropy)
                    if args.kl_loss_coef > 0:
                        loss = loss + args.kl_loss_coef * agg(kl_ref)
                    loss.backward()
                    with torch.no_grad():
                        logratio = newlogprob - old_logprobs[idx, :w]
                        # ratio_first: the weights that scored the rollout, so 1 (exactly, in float32)
                        for key, x in (("policy_loss", pg), ("entropy", entropy),
                                       ("approx_kl", torch.exp(logratio) - 1 - logratio),  # the k3 estimator
                                       ("clip_frac", clipped), ("kl_ref_loss", kl_ref),
                                       ("ratio_first", ratio if epoch == start == m0 == 0 else None)):
                            if x is not None:
                                logs[key].append(masked_mean(x, m).item())
                # gradients: sum over processes (each loss was already divided by the global count);
                # a process whose dialogues here were all dropped adds zeros (reduce_gradients wants
                # every process to hold gradients for the same parameters)
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                reduce_gradients(params, accelerator)
                grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                if not guard.step_ok(grad_norm, iteration, partial(save, iteration)):
                    optimizer.zero_grad(set_to_none=True)  # a non-finite loss: skip this step
                    continue
                optimizer.step()
                scheduler.step()
                logs["grad_norm"].append(grad_norm.item())
        t_update = time.time() - t0

        # --- 5. log: global figures over every process's dialogues -------------------------------
        all_records = gather_object(records) if world > 1 else records
        final = dialogue_rewards(all_records, args.reward).numpy()  # as in ppo.py: no format penalty
        first_of_group = torch.tensor([int((all_groups == g).nonzero()[0]) for g in all_groups.unique()])
        with torch.no_grad():  # over every process's agent tokens
            acted = batch["action_mask"]  # (B, T) every agent token, dropped groups' too
            update_tokens = global_sum(mask.sum(), accelerator).item() * args.update_epochs
            kl_ref = None if ref_logprobs is None else \
                global_masked_mean(kl_k3(old_logprobs, ref_logprobs), acted, accelerator)  # null: no pass
            gap = global_masked_mean((old_logprobs - batch["sample_logprobs"]).abs(), acted, accelerator)
        method = {"reward_mean": float(final.mean()), "reward_std": float(final.std()),
                  "group_reward_std": float(all_std[first_of_group].mean()),
                  "zero_spread_groups": int(all_flat[first_of_group].sum()), "kl_ref": kl_ref,
                  "sample_logprob_gap": gap, "skipped_steps": skipped_steps,
                  "lr": optimizer.param_groups[0]["lr"],
                  "update_tokens": int(update_tokens),  # every process's agent tokens, x epochs
                  "update_tokens_per_s": update_tokens / max(global_max(t_update, accelerator), 1e-9)}
        times = {"time_rollout": t_rollout, "time_score": t_score, "time_update": t_update,
                 "time_iteration": time.time() - t_start}
        metrics = log_iteration(run, accelerator, iteration, all_records, rstats, logs, params, method, times)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                        emotion=f"{metrics['final_emotion_mean']:.1f}", flat=metrics["zero_spread_groups"])

        # --- 6. checkpoint -----------------------------------------------------------------------
        due, out_of_time = checkpoint_due(args, iteration, t_run, accelerator)
        if due:
            saved_at = iteration + 1
            save(iteration + 1)
        accelerator.wait_for_everyone()
        if out_of_time:
            break
    accelerator.end_training()  # closes the trackers
    if accelerator.is_main_process:
        print(f"done: {args.out} (adapter: {latest_checkpoint(args.out)}/default)")
    return model  # the trained PeftModel, for tests and notebooks


def _save(args, iteration, model, optimizer, scheduler, accelerator, name=None):
    """Every process hands in its RNG state; the main process writes the checkpoint."""
    rngs = all_rng_states(accelerator)
    if not accelerator.is_main_process:
        return None
    path = save_checkpoint(args.out, iteration, model, ["default"], {
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "args": public_config(args),
        "rng": rngs if len(rngs) > 1 else rngs[0]}, name=name)
    if name is None:  # a complete checkpoint: older ones beyond --keep-checkpoints go
        prune_checkpoints(args.out, args.keep_checkpoints)
    return path


if __name__ == "__main__":
    main()
