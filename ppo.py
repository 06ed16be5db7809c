"""PPO with GAE for RLVER: a LoRA actor and a LoRA critic that share one frozen base model.

Each iteration plays a batch of dialogues against the simulated user (rollout.py), puts the
reward (final emotion / 100) on the last token of the agent's last turn, estimates advantages
with GAE over the agent's own tokens, and takes clipped PPO steps on the actor and the critic.

One copy of the weights serves four roles: the actor (adapter 'default'), the critic (adapter
'critic' plus a scalar value head), the reference policy (adapters disabled) and, with
--simulator same, the simulated user (adapters disabled too). TRL's PPO holds four models.

    python ppo.py                      # the paper's setup on a CUDA machine (Qwen2.5-7B-Instruct)
    python ppo.py --preset cpu         # the embedded SmolLM2-135M, a few iterations on 2 CPU cores
    accelerate launch --num_processes 8 ppo.py   # data parallel on one node
"""
import contextlib
import sys
import time
from functools import partial
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout import (DEFAULT_TARGETS, adapter_params, all_rng_states, batched_logprobs, begin_run,
                     checkpoint_due, dropout_active, global_masked_mean, global_max, global_sum,
                     latest_checkpoint, length_sorted, load_policy, log_iteration, make_simulator,
                     masked_mean, pad_records, passes_to_run, pick_personas, play_dialogues, policy_settings,
                     prune_checkpoints, public_config, reduce_gradients, sampling_settings, save_checkpoint,
                     set_seed, start_or_resume, target_names, StepGuard, stop_on_simulator_error,
                     token_logprobs, training_personas)
from simulator import SimulatorError, fail, one_of


@dataclass
class Args:
    preset: str = field(default="paper", metadata={
        "help": "paper (Qwen2.5-7B on CUDA) | cpu (embedded model); explicit flags win"})
    # the policy
    model: str = field(default="Qwen/Qwen2.5-7B-Instruct", metadata={
        "help": "policy base: hub id, path, or smollm2 (embedded)"})
    lora_r: int = field(default=32, metadata={"help": "LoRA rank of actor and critic adapters"})
    lora_alpha: int = field(default=64, metadata={"help": "LoRA alpha (scale = alpha / r)"})
    lora_dropout: float = field(default=0.0, metadata={
        "help": "LoRA dropout; 0 keeps the first PPO ratio exactly 1"})
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
    dialogues_per_iteration: int = field(default=32, metadata={
        "help": "dialogues per iteration, over all processes (RLVER: 32)"})
    thinking: bool = field(default=True, metadata={"help": "think-then-say scaffold (the paper's best run)"})
    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature; the trainer's log-probs use the same"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (RLVER: 1.0)"})
    greedy: bool = field(default=False, metadata={
        "help": "decode greedily: reproducible dialogues for tests and debugging, not for training"})
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
        "help": "final: emotion/100 on the last agent token | turn: each change/100 on its turn"})
    format_penalty: float = field(default=0.0, metadata={
        "help": "subtracted per think-format violation (thinking on)"})
    kl_coef: float = field(default=0.0, metadata={
        "help": "per-token KL penalty to the reference in the reward (RLVER: 0)"})
    kl_loss_coef: float = field(default=0.0, metadata={"help": "k3 KL-to-reference loss term (RLVER: 0)"})
    # advantages
    gamma: float = field(default=1.0, metadata={"help": "discount over agent tokens (RLVER's trainer: 1.0)"})
    lam: float = field(default=1.0, metadata={"help": "GAE lambda (RLVER's trainer: 1.0)"})
    whiten_advantages: bool = field(default=True, metadata={
        "help": "normalise advantages over the batch's agent tokens"})
    # the update
    update_epochs: int = field(default=1, metadata={"help": "passes over each iteration's dialogues"})
    minibatch_size: int = field(default=32, metadata={
        "help": "dialogues per optimizer step, over all processes (RLVER: 32)"})
    micro_batch_size: int = field(default=2, metadata={
        "help": "dialogues per forward pass (gradient accumulation)"})
    clip_low: float = field(default=0.2, metadata={
        "help": "PPO clip: ratio kept within [1 - clip_low, 1 + clip_high]"})
    clip_high: float = field(default=0.2, metadata={
        "help": "upper clip; larger than clip_low = clip-higher (DAPO uses 0.28)"})
    value_clip: float = field(default=0.5, metadata={
        "help": "value predictions move at most this far from the rollout's (RLVER: 0.5)"})
    vf_coef: float = field(default=0.5, metadata={"help": "value loss coefficient"})
    ent_coef: float = field(default=0.001, metadata={"help": "entropy bonus coefficient (RLVER: 0.001)"})
    loss_agg: str = field(default="token-mean", metadata={
        "help": "token-mean | seq-mean-token-mean | seq-mean-token-sum"})
    lr: float = field(default=1e-5, metadata={
        "help": "actor LoRA learning rate (paper, full fine-tuning: 1e-6)"})
    critic_lr: float = field(default=5e-5, metadata={
        "help": "critic LoRA and value head learning rate (paper: 5x the actor's)"})
    critic_warmup: int = field(default=0, metadata={
        "help": "first iterations in which only the critic learns (verl's critic_warmup)"})
    warmup_steps: int = field(default=0, metadata={"help": "optimizer steps of linear learning-rate warm-up"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient norm clipping, per model part"})
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
    out: str = field(default="runs/ppo", metadata={"help": "run folder"})
    resume: str = field(default="", metadata={
        "help": "run folder to continue from its newest checkpoint that loads, with its saved settings"})
    overwrite: bool = field(default=False, metadata={"help": "let --out replace a run (deletes its files)"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    report_to: str = field(default="none", metadata={"help": "none | tensorboard | wandb | trackio | all"})


PRESETS = {
    "paper": {},
    # Small enough that a few iterations run on 2 CPU cores in minutes. Thinking is off: the 135M
    # model never writes the tags, and the instructions about them only make its replies worse.
    "cpu": dict(model="smollm2", dialogues_per_iteration=4, max_turns=2, max_new_tokens=32,
                user_reply_tokens=24, max_context=1024, minibatch_size=4, micro_batch_size=2,
                gradient_checkpointing=False, thinking=False, lora_r=8, lora_alpha=16,
                lr=5e-5, critic_lr=2.5e-4, iterations=3, save_every=1, out="runs/ppo-cpu",
                # the values before the paper preset took RLVER's (0.5, 0.001): the CPU results stand
                value_clip=0.2, ent_coef=0.0),
}


# ----------------------------------------------------------------------------------------------
# The method: small pure functions (tests/test_ppo.py holds each against a hand computation)
# ----------------------------------------------------------------------------------------------
# What the update logs, per micro-batch or optimizer step; metrics.jsonl has their means (docs/metrics.md).
LOGGED = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "value_clip_frac", "kl_ref_loss",
          "ratio_first", "actor_grad_norm", "critic_grad_norm")


def place_rewards(records, shape, mode="final", format_penalty=0.0):
    """Per-token rewards (B, T), zero except on the last token of agent turns.
    final: final emotion / 100 on the last token of the agent's last turn (the paper).
    turn:  each turn's emotion change / 100 on that turn's last token; with gamma = 1 the return
           is the same up to the constant start emotion / 100, with credit nearer its cause.
    The format penalty lands where the violating turn ends."""
    rewards = torch.zeros(shape)
    for b, r in enumerate(records):
        ends = r["turn_ends"]
        if not ends:
            continue
        if mode == "final":
            rewards[b, ends[-1]] += r["final_emotion"] / 100.0
        elif mode == "turn":
            for end, change in zip(ends, r["changes"]):
                rewards[b, end] += change / 100.0
        else:
            raise ValueError(f"--reward must be final or turn, got '{mode}'")
        if format_penalty:
            agent_turns = [t for t in r["turns"] if t["role"] == "agent"]
            for end, turn in zip(ends, agent_turns):
                rewards[b, end] -= format_penalty * (turn.get("violation") is not None)
    return rewards


def compute_gae(rewards, values, action_mask, gamma=1.0, lam=1.0):
    """GAE over agent tokens only. User and template tokens are not steps of the agent: the next
    value and the running advantage carry across them unchanged (as verl's multi-turn GAE does).
    rewards, values, action_mask: (B, T). Returns advantages, returns (B, T), zero off the mask."""
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros(B)
    running = torch.zeros(B)
    for t in reversed(range(T)):
        m = action_mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * running
        advantages[:, t] = gae * m
        running = torch.where(m > 0, gae, running)
        next_value = torch.where(m > 0, values[:, t], next_value)
    returns = (advantages + values) * action_mask
    return advantages, returns


def aggregate(loss, mask, mode, total_tokens, total_seqs):
    """Reduce per-token losses (b, T) of one micro-batch to its share of the minibatch loss, so
    that summing the micro-batches gives the minibatch loss whatever the split.
    token-mean: every agent token weighs the same (long dialogues weigh more).
    seq-mean-token-mean: every dialogue weighs the same (the GRPO paper's choice).
    seq-mean-token-sum: sum over a dialogue's tokens, mean over dialogues."""
    if mode == "token-mean":
        return (loss * mask).sum() / total_tokens
    if mode == "seq-mean-token-mean":
        return ((loss * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / total_seqs
    if mode == "seq-mean-token-sum":
        return (loss * mask).sum() / total_seqs
    raise ValueError(f"--loss-agg must be token-mean, seq-mean-token-mean or seq-mean-token-sum, got "
                     f"'{mode}'")


def clipped_policy_loss(logprobs, old_logprobs, advantages, clip_low, clip_high):
    """Per-token PPO surrogate (Schulman et al. 2017) with an asymmetric clip (clip-higher, DAPO).
    Returns (loss, ratio, clipped): loss = max(-A r, -A clip(r, 1 - low, 1 + high))."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), ratio, (clipped > unclipped).float()


def clipped_value_loss(values, old_values, returns, clip):
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped within clip of the rollout's values."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    return loss, ((values - returns) ** 2 < (v_clipped - returns) ** 2).float()


def kl_k3(logprobs, ref_logprobs):
    """k3 estimator of KL(policy || reference) per token: exp(ref - lp) - (ref - lp) - 1. Unbiased,
    always >= 0, low variance (J. Schulman, "Approximating KL divergence", 2020)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def variance_sums(values, returns):
    """(n, sum d, sum d^2, sum R, sum R^2) over the agent tokens (N,), d = R - V, in float64: the
    sums that processes add up, so that explained_variance covers every process's tokens."""
    d, r = (returns - values).double(), returns.double()
    n = torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device)
    return torch.stack([n, d.sum(), (d * d).sum(), r.sum(), (r * r).sum()])


def explained_variance(sums):
    """1 - Var(R - V) / Var(R) from (summed) variance_sums, with unbiased variances as torch.var:
    1 is a perfect critic, 0 one no better than the mean return, below 0 worse. NaN when undefined."""
    n, sd, sdd, sr, srr = sums.tolist()
    if n < 2:
        return float("nan")
    var_d, var_r = (sdd - sd * sd / n) / (n - 1), (srr - sr * sr / n) / (n - 1)
    return 1 - var_d / var_r if var_r > 0 else float("nan")


# ----------------------------------------------------------------------------------------------
# The critic: a second adapter on the shared base, plus a value head
# ----------------------------------------------------------------------------------------------
def use_adapter(model, name):
    """Make one adapter active. peft's set_adapter also freezes the other adapters, but autograd
    skips a parameter that no longer requires grad at backward time, so both stay trainable."""
    model.set_adapter(name)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)


@contextlib.contextmanager
def adapter_active(model, name):
    """Run a forward pass AND its backward pass under one adapter, then return to the actor's.
    With gradient checkpointing the backward pass reruns each layer's forward, and peft's LoRA
    layers then use whatever adapter is active at that moment: a critic loss whose backward ran
    after switching back to 'default' would get gradients of the actor's activations (same shapes,
    no error, a critic that learns from the wrong function). So the critic's loss.backward() goes
    inside this block."""
    use_adapter(model, name)
    try:
        yield
    finally:
        use_adapter(model, "default")


def value_prior(reward, start_emotion):
    """What the critic predicts before it has learned anything: the return of a dialogue in which
    the emotion never moves. With --reward final every agent token's return is final emotion / 100,
    so start_emotion / 100; with --reward turn it is the sum of the changes still to come, so 0.
    Starting at 0 instead, a critic with a small learning rate spends its first iterations
    climbing to the mean return, and its large early errors are a baseline worse than none."""
    return start_emotion / 100.0 if reward == "final" else 0.0


def whiten(advantages, mask, accelerator):
    """Advantages (B, T) to zero mean and unit variance over every process's agent tokens."""
    n = global_sum(mask.sum(), accelerator)
    mean = global_sum((advantages * mask).sum(), accelerator) / n
    var = global_sum((((advantages - mean) * mask) ** 2).sum(), accelerator) / n
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask


def critic_values(model, value_head, input_ids, attention_mask):
    """V(s_t) for every position (B, T) under the 'critic' adapter, aligned with token_logprobs:
    the value at position t is the value of the state the token at t was sampled in, so it is
    read from the hidden state at t - 1, which has not seen that token (position 0 gets 0).
    Read at t itself, the value would depend on the action it is a baseline for: a critic that
    learned it would predict each token's own return and cancel the advantage it should leave.
    Call it inside `with adapter_active(model, "critic"):`, together with the backward pass of any
    loss built on it (see adapter_active)."""
    if model.active_adapter != "critic":
        raise RuntimeError("critic_values runs under the 'critic' adapter: call it, and the backward pass "
                           "of its loss, inside `with adapter_active(model, 'critic'):`")
    decoder = model.get_base_model().get_decoder()
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask,
                     use_cache=False).last_hidden_state                                   # (B, T, H)
    values = value_head(hidden[:, :-1].to(value_head.weight.dtype)).squeeze(-1)           # (B, T-1)
    return torch.nn.functional.pad(values, (1, 0))                                        # (B, T)


@torch.no_grad()
def batched_values(model, value_head, batch, micro_batch_size):
    """critic_values over a padded batch (B, T), in length-sorted micro-batches, without gradients."""
    values = torch.zeros_like(batch["attention_mask"], dtype=torch.float32)                # (B, T)
    was_training = model.training
    model.eval()
    with adapter_active(model, "critic"):
        for rows, w in length_sorted(batch["attention_mask"], micro_batch_size):
            values[rows, :w] = critic_values(model, value_head, batch["input_ids"][rows, :w],
                                             batch["attention_mask"][rows, :w]).float()
    model.train(was_training)
    return values


def check_batch_shape(args, world):
    """Dialogues and minibatches must split evenly over the processes and into each other."""
    for name in ("dialogues_per_iteration", "minibatch_size"):
        if getattr(args, name) % world:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must divide by the {world} processes")
    if args.dialogues_per_iteration % args.minibatch_size:
        fail("--dialogues-per-iteration must be a multiple of --minibatch-size")


def actor_and_critic(args, model, device):
    """The critic beside the actor on the shared base: a second LoRA adapter and a value head that
    starts at value_prior; one AdamW with a parameter group each. Returns (value_head, actor
    params, critic params, optimizer, scheduler)."""
    from peft import LoraConfig  # here, not above: importing peft can print a bitsandbytes notice on CPU

    model.add_adapter("critic", LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
        target_modules=target_names(args.target_modules), task_type="CAUSAL_LM"))
    use_adapter(model, "default")
    hidden_size = model.get_base_model().config.get_text_config().hidden_size
    value_head = torch.nn.Linear(hidden_size, 1).to(device)
    torch.nn.init.zeros_(value_head.weight)
    torch.nn.init.constant_(value_head.bias, value_prior(args.reward, args.start_emotion))
    actor_params = adapter_params(model, "default")
    critic_params = adapter_params(model, "critic") + list(value_head.parameters())
    for p in actor_params + critic_params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW([{"params": actor_params, "lr": args.lr},
                                   {"params": critic_params, "lr": args.critic_lr}], weight_decay=0.0)
    # Linear warm-up over --warmup-steps optimizer steps. The actor's count starts when it starts to
    # learn, after --critic-warmup iterations of steps that only moved the critic.
    held = args.critic_warmup * args.update_epochs * (args.dialogues_per_iteration // args.minibatch_size)

    def warm(step):
        return min(1.0, max(0, step + 1) / max(1, args.warmup_steps))
    # one schedule per parameter group: actor, critic
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: warm(s - held), warm])
    return value_head, actor_params, critic_params, optimizer, scheduler


def main(argv=None):
    from accelerate.utils import gather_object
    from tqdm import tqdm

    args, accelerator, ckpt, state, resumed = begin_run(Args, PRESETS, argv, {"loss_agg": one_of(
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum")}, ["default", "critic"], "ppo.py")
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    check_batch_shape(args, world)
    set_seed(args.seed)  # the same adapter initialisation on every process
    personas = training_personas(args)

    # --- the model: actor adapter, critic adapter + value head, frozen shared base ------------
    model, tokenizer = load_policy(args.model, device=device, **policy_settings(args))
    value_head, actor_params, critic_params, optimizer, scheduler = actor_and_critic(args, model, device)
    simulator = make_simulator(args, model, tokenizer, accelerator)
    dropout = dropout_active(model)  # then the old log-probs need their own pass (passes_to_run)

    def save(iteration, name=None):  # every process calls it; the main process writes
        return _save(args, iteration, model, value_head, optimizer, scheduler, accelerator, name)

    # --- run folder and resume ---------------------------------------------------------------
    run, start_iteration = start_or_resume(args, accelerator, ckpt, state, model, ["default", "critic"],
                                           optimizer, scheduler, resumed, {"value_head": value_head})
    saved_at = start_iteration  # the iteration of the newest checkpoint
    guard = StepGuard(args.max_bad_updates, "Lower --lr / --critic-lr or use --dtype float32", args.out,
                      accelerator)
    bar = tqdm(range(start_iteration, args.iterations), desc="ppo", disable=not accelerator.is_main_process)
    t_run = time.time()  # --time-budget counts from here (on --resume: from the resume)
    for iteration in bar:
        t_start = time.time()
        # --- 1. collect dialogues: this process's share of the iteration's personas -------------
        chosen = pick_personas(personas, args.dialogues_per_iteration, args.seed, iteration)
        share = args.dialogues_per_iteration // world
        try:
            own = chosen[rank * share:(rank + 1) * share]
            records, rstats = play_dialogues(model, tokenizer, simulator, own, **sampling_settings(args),
                                             progress=accelerator.is_main_process and sys.stderr.isatty())
        except SimulatorError as e:  # one line; a finished iteration not yet saved is saved first
            due = iteration > saved_at and world == 1  # (a save is collective: one process only)
            stop_on_simulator_error(e, partial(save, iteration) if due else None)
        t_rollout = time.time() - t_start

        # --- 2. score: old log-probs, reference log-probs, values, rewards ------------------------
        t0 = time.time()
        batch = pad_records(records, tokenizer.pad_token_id, device)
        mask = batch["action_mask"]                                                         # (B, T)
        # only passes whose result is not known yet; --kl-coef reads old log-probs before the update
        old_from_update, need_ref = passes_to_run(args, iteration, old_first=args.kl_coef > 0,
                                                  dropout=dropout)
        old_logprobs = torch.zeros_like(mask) if old_from_update else \
            batched_logprobs(model, batch, args.temperature, args.micro_batch_size)         # (B, T)
        ref_logprobs = batched_logprobs(model, batch, args.temperature, args.micro_batch_size,
                                        reference=True) if need_ref else None               # (B, T)
        old_values = batched_values(model, value_head, batch, args.micro_batch_size) * mask  # (B, T)
        rewards = place_rewards(records, mask.shape, args.reward, args.format_penalty).to(device)
        if args.kl_coef > 0:  # the k1 estimate, per token, in the reward (both passes ran above)
            rewards = rewards - args.kl_coef * (old_logprobs - ref_logprobs) * mask           # (B, T)

        # --- 3. advantages: GAE over the agent's tokens ------------------------------------------
        advantages, returns = compute_gae(rewards.cpu(), old_values.cpu(), mask.cpu(), args.gamma, args.lam)
        advantages, returns = advantages.to(device), returns.to(device)
        if args.whiten_advantages:  # over every process's agent tokens
            advantages = whiten(advantages, mask, accelerator)
        t_score = time.time() - t0

        # --- 4. update: epochs x minibatches x micro-batches ------------------------------------
        t0 = time.time()
        model.train()
        logs = {k: [] for k in LOGGED}
        local_mb = args.minibatch_size // world
        train_actor = iteration >= args.critic_warmup  # during warm-up the actor's loss is only logged
        for epoch in range(args.update_epochs):
            order = torch.randperm(len(records)).tolist()
            for start in range(0, len(records), local_mb):
                mb_inds = order[start:start + local_mb]
                total_tokens = global_sum(mask[mb_inds].sum(), accelerator).clamp(min=1)
                optimizer.zero_grad(set_to_none=True)
                for m0 in range(0, len(mb_inds), args.micro_batch_size):
                    idx = mb_inds[m0:m0 + args.micro_batch_size]
                    w = int(batch["attention_mask"][idx].sum(1).max())  # the micro-batch's longest row
                    ids, att, m = batch["input_ids"][idx, :w], batch["attention_mask"][idx, :w], mask[idx, :w]
                    agg = partial(aggregate, mask=m, mode=args.loss_agg, total_tokens=total_tokens,
                                  total_seqs=float(args.minibatch_size))  # its share of the minibatch loss
                    with torch.set_grad_enabled(train_actor):
                        newlogprob, entropy = token_logprobs(model, ids, att, args.temperature, action_mask=m,
                                                             with_entropy=True,
                                                             entropy_grad=args.ent_coef > 0)
                        if old_from_update:
                            old_logprobs[idx, :w] = newlogprob.detach()
                        pg, ratio, clipped = clipped_policy_loss(newlogprob, old_logprobs[idx, :w],
                                                                 advantages[idx, :w], args.clip_low,
                                                                 args.clip_high)
                        kl_ref = None if ref_logprobs is None else kl_k3(newlogprob, ref_logprobs[idx, :w])
                        actor_loss = agg(pg) - args.ent_coef * agg(entropy)
                        if args.kl_loss_coef > 0:
                            actor_loss = actor_loss + args.kl_loss_coef * agg(kl_ref)
                    if train_actor:
                        actor_loss.backward()
                    with adapter_active(model, "critic"):  # forward and backward under the critic
                        values = critic_values(model, value_head, ids, att).float()
                        vl, vclipped = clipped_value_loss(values, old_values[idx, :w], returns[idx, :w],
                                                          args.value_clip)
                        (args.vf_coef * agg(vl)).backward()
                    with torch.no_grad():
                        logratio = newlogprob - old_logprobs[idx, :w]
                        # ratio_first: the weights that scored the rollout, so 1 (exactly, in float32)
                        for key, x in (("policy_loss", pg), ("value_loss", vl), ("entropy", entropy),
                                       ("approx_kl", torch.exp(logratio) - 1 - logratio),  # the k3 estimator
                                       ("clip_frac", clipped), ("value_clip_frac", vclipped),
                                       ("kl_ref_loss", kl_ref),
                                       ("ratio_first", ratio if epoch == start == m0 == 0 else None)):
                            if x is not None:
                                logs[key].append(masked_mean(x, m).item())
                # gradients: sum over processes (each loss was already divided by the global count)
                reduce_gradients(actor_params + critic_params, accelerator)
                actor_norm = torch.nn.utils.clip_grad_norm_(actor_params, args.max_grad_norm)
                critic_norm = torch.nn.utils.clip_grad_norm_(critic_params, args.max_grad_norm)
                if not guard.step_ok(actor_norm + critic_norm, iteration, partial(save, iteration)):
                    optimizer.zero_grad(set_to_none=True)  # a non-finite loss: skip this step
                    continue
                optimizer.step()
                scheduler.step()
                logs["actor_grad_norm"].append(actor_norm.item())
                logs["critic_grad_norm"].append(critic_norm.item())
        t_update = time.time() - t0

        # --- 5. log: global figures over every process's dialogues -------------------------------
        all_records = gather_object(records) if world > 1 else records
        final = np.array([r["final_emotion"] / 100.0 if args.reward == "final" else sum(r["changes"]) / 100.0
                          for r in all_records])
        with torch.no_grad():  # over every process's agent tokens
            on = mask > 0  # (B, T) agent tokens
            ev = explained_variance(global_sum(variance_sums(old_values[on], returns[on]), accelerator))
            update_tokens = global_sum(mask.sum(), accelerator).item() * args.update_epochs
            kl_ref = None if ref_logprobs is None else \
                global_masked_mean(kl_k3(old_logprobs, ref_logprobs), mask, accelerator)  # null: no pass
            gap = global_masked_mean((old_logprobs - batch["sample_logprobs"]).abs(), mask, accelerator)
        method = {"reward_mean": float(final.mean()), "reward_std": float(final.std()), "kl_ref": kl_ref,
                  "sample_logprob_gap": gap, "explained_variance": ev,
                  "actor_lr": optimizer.param_groups[0]["lr"], "critic_lr": optimizer.param_groups[1]["lr"],
                  "update_tokens": int(update_tokens),  # every process's agent tokens, x epochs
                  "update_tokens_per_s": update_tokens / max(global_max(t_update, accelerator), 1e-9)}
        times = {"time_rollout": t_rollout, "time_score": t_score, "time_update": t_update,
                 "time_iteration": time.time() - t_start}
        metrics = log_iteration(run, accelerator, iteration, all_records, rstats, logs,
                                actor_params + critic_params, method, times)
        bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                        emotion=f"{metrics['final_emotion_mean']:.1f}")

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
    return model, value_head  # for tests and notebooks


def _save(args, iteration, model, value_head, optimizer, scheduler, accelerator, name=None):
    """Every process hands in its RNG state; the main process writes the checkpoint."""
    rngs = all_rng_states(accelerator)
    if not accelerator.is_main_process:
        return None
    path = save_checkpoint(args.out, iteration, model, ["default", "critic"], {
        "value_head": value_head.state_dict(), "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(), "args": public_config(args),
        "rng": rngs if len(rngs) > 1 else rngs[0]}, name=name)
    if name is None:  # a complete checkpoint: older ones beyond --keep-checkpoints go
        prune_checkpoints(args.out, args.keep_checkpoints)
    return path


if __name__ == "__main__":
    main()
