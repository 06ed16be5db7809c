"""PPO with GAE for RLVER: a LoRA actor and a LoRA critic that share one frozen base model.

Each iteration plays a batch of dialogues against the simulated user (rollout.py), puts the
reward (final emotion / 100) on the last token of the agent's last turn, estimates advantages
with GAE over the agent's own tokens, and takes clipped PPO steps on the actor and the critic.
One copy of the weights serves four roles: the actor (adapter 'default'), the critic (adapter
'critic' plus a scalar value head), the reference policy (adapters disabled) and, with
--simulator same, the simulated user (adapters disabled too). TRL's PPO holds four models.

grpo.py is this file with the critic taken out and the group advantage put in, in the same order,
so `diff ppo.py grpo.py` shows the methods' differences. In the loop every `run.` call is plumbing
(run.py); what is left is the method.

    python ppo.py                      # the paper's setup on a CUDA machine (Qwen2.5-7B-Instruct)
    python ppo.py --preset cpu         # the embedded SmolLM2-135M, a few iterations on 2 CPU cores
    accelerate launch --num_processes 8 ppo.py   # data parallel on one node
"""
import contextlib
import time
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from rollout import (AdapterSettings, PolicySettings, SamplingSettings, adapter_params,
                     batched_logprobs, length_sorted, load_policy, pad_records, passes_to_run,
                     pick_personas, play_dialogues, policy_settings, sampling_settings, token_logprobs,
                     training_personas, use_adapter)
from run import (OutputSettings, Run, RunSettings, TrackerSettings, above, append_means, at_least, fail,
                 finite_above, one_of, parse_settings, setting, target_names, within)
from simulator import SimulatorError, SimulatorSettings, make_simulator


@dataclass
class PPOSettings:
    """PPO's own settings (the policy's, the user's and the run's are declared where they are read)."""
    group = "PPO"
    dialogues_per_iteration: int = setting(32, "dialogues per iteration, over all processes (RLVER: 32)",
                                           at_least(1))
    greedy: bool = setting(False, "decode greedily: reproducible dialogues for tests and debugging, not for "
                                  "training (GRPO: a group's dialogues would be identical)")
    # rewards
    reward: str = setting("final", "final: emotion/100 on the last agent token | turn: each change/100 on "
                                   "its turn", one_of("final", "turn"))
    format_penalty: float = setting(0.0, "subtracted per think-format violation (thinking on)", at_least(0))
    kl_coef: float = setting(0.0, "k1 KL-to-reference penalty in the reward (RLVER: 0)", at_least(0))
    kl_loss_coef: float = setting(0.0, "k3 KL-to-reference loss coefficient (RLVER and TRL: 0)", at_least(0))
    # advantages
    gamma: float = setting(1.0, "discount over agent tokens (RLVER's trainer: 1.0)", within(0, 1))
    lam: float = setting(1.0, "GAE lambda (RLVER's trainer: 1.0)", within(0, 1))
    whiten_advantages: bool = setting(True, "normalise advantages over the batch's agent tokens")
    # the update
    update_epochs: int = setting(1, "passes over each iteration's dialogues (GRPO's mu)", at_least(1))
    minibatch_size: int = setting(32, "dialogues an optimizer step, all processes (RLVER: 32)", at_least(1))
    micro_batch_size: int = setting(2, "dialogues per forward pass (gradient accumulation)", at_least(1))
    clip_low: float = setting(0.2, "clip: ratio kept within [1 - clip_low, 1 + clip_high]",
                              within(0, 1, low_open=True, high_open=True))
    clip_high: float = setting(0.2, "upper clip; above clip_low = clip-higher (DAPO: 0.28)", above(0))
    value_clip: float = setting(0.5, "values move at most this far from the rollout's (RLVER: 0.5)", above(0))
    vf_coef: float = setting(0.5, "value loss coefficient", at_least(0))
    ent_coef: float = setting(0.001, "entropy bonus coefficient (RLVER: 0.001)", at_least(0))
    loss_agg: str = setting("token-mean", "token-mean | seq-mean-token-mean | seq-mean-token-sum",
                            one_of("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"))
    lr: float = setting(1e-5, "the policy's LoRA learning rate (paper, full fine-tune 1e-6)", finite_above(0))
    critic_lr: float = setting(5e-5, "critic adapter and value head learning rate (5x --lr)", finite_above(0))
    critic_warmup: int = setting(0, "first iterations in which only the critic learns (verl)", at_least(0))
    warmup_steps: int = setting(0, "optimizer steps of linear learning-rate warm-up", at_least(0))
    max_grad_norm: float = setting(1.0, "gradient norm clipping, per trained part", above(0))
    log_kl_every: int = setting(1, "log kl_ref every N iterations; with no KL term, N > 1 skips the "
                                   "reference pass in the others", at_least(1))

    @staticmethod
    def check(args):
        if args.dialogues_per_iteration % args.minibatch_size:
            fail(f"--dialogues-per-iteration {args.dialogues_per_iteration} must be a multiple of "
                 f"--minibatch-size {args.minibatch_size}")


SETTINGS = (PolicySettings, AdapterSettings, SamplingSettings, SimulatorSettings, PPOSettings, RunSettings,
            OutputSettings, TrackerSettings)
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
    Returns (loss, ratio, clipped): loss = max(-A r, -A clip(r, 1 - low, 1 + high)).
    With one pass over the batch and one optimizer step per batch, old_logprobs are the current
    weights' own log-probs, so r = 1 exactly, nothing is clipped, and the gradient is the plain
    policy gradient -A grad log p (GRPO with mu = 1, as TRL's default)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), ratio, (clipped > unclipped).float()


def kl_k3(logprobs, ref_logprobs):
    """k3 estimator of KL(policy || reference) per token: exp(ref - lp) - (ref - lp) - 1. Unbiased,
    always >= 0, low variance (J. Schulman, "Approximating KL divergence", 2020)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def policy_objective(logprobs, entropy, old_logprobs, advantages, ref_logprobs, agg, args):
    """The policy's loss on one micro-batch, from per-token (b, T) tensors to its share of the
    minibatch loss (agg: aggregate with the minibatch's counts): the clipped surrogate, minus
    --ent-coef x the entropy, plus --kl-loss-coef x the k3 KL to the reference (ref_logprobs,
    None when no reference pass ran). Returns (loss, the per-token terms the update logs)."""
    pg, ratio, clipped = clipped_policy_loss(logprobs, old_logprobs, advantages, args.clip_low,
                                             args.clip_high)
    kl_ref = None if ref_logprobs is None else kl_k3(logprobs, ref_logprobs)
    loss = agg(pg) - args.ent_coef * agg(entropy)
    if args.kl_loss_coef > 0:
        loss = loss + args.kl_loss_coef * agg(kl_ref)
    with torch.no_grad():
        logratio = logprobs - old_logprobs
        approx_kl = torch.exp(logratio) - 1 - logratio  # the k3 estimator of KL(old || new)
    return loss, {"policy_loss": pg, "entropy": entropy, "approx_kl": approx_kl, "clip_frac": clipped,
                  "kl_ref_loss": kl_ref, "ratio": ratio}


def clipped_value_loss(values, old_values, returns, clip):
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped within clip of the rollout's values."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    return loss, ((values - returns) ** 2 < (v_clipped - returns) ** 2).float()


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


LOGGED = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "value_clip_frac", "kl_ref_loss",
          "ratio_first", "actor_grad_norm", "critic_grad_norm")  # by the update; metrics.jsonl: their means


# ----------------------------------------------------------------------------------------------
# The critic: a second adapter on the shared base, plus a value head
# ----------------------------------------------------------------------------------------------
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
    """What the critic predicts before it has learned anything: the return of a dialogue in which the
    emotion never moves (--reward final: start_emotion / 100; turn: 0). Starting at 0 instead, a
    critic with a small learning rate spends its first iterations climbing to the mean return."""
    return start_emotion / 100.0 if reward == "final" else 0.0


def whiten(advantages, mask, total=lambda x: x):
    """Advantages (B, T) to zero mean and unit variance over the agent tokens; total sums a
    tensor over the processes (run.sum), so the moments are every process's tokens'."""
    n = total(mask.sum())
    mean = total((advantages * mask).sum()) / n
    var = total((((advantages - mean) * mask) ** 2).sum()) / n
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask


def critic_values(model, value_head, input_ids, attention_mask):
    """V(s_t) for every position (B, T) under the 'critic' adapter, aligned with token_logprobs: the
    value at t is that of the state the token at t was sampled in, read from the hidden state at t - 1
    (position 0 gets 0). Read at t, it would see the action it is a baseline for, and a critic that
    learned that would cancel the advantage. Call it, and the backward pass of its loss, inside
    `with adapter_active(model, "critic"):`."""
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
    # Linear warm-up over --warmup-steps optimizer steps, each group's counted from the steps it really
    # took: AdamW's own step count of the group's first parameter. AdamW passes over a parameter with no
    # gradient (the actor's during --critic-warmup) and a skipped non-finite step steps nothing, so no
    # count set in advance can drift from the truth, and --resume restores it with the optimizer.
    def warm(params):
        return lambda _: min(1.0, (float(optimizer.state.get(params[0], {}).get("step", 0)) + 1)
                             / max(1, args.warmup_steps))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, [warm(actor_params), warm(critic_params)])
    return value_head, actor_params, critic_params, optimizer, scheduler


def main(argv=None):
    args = parse_settings(SETTINGS, PRESETS, argv, defaults={"out": "runs/ppo"}, prog="ppo.py")
    run = Run(args, "ppo.py", adapters=["default", "critic"],  # --out checked, --resume's settings taken
              per_process=["dialogues_per_iteration", "minibatch_size"])
    personas = training_personas(args)

    # --- the model: actor adapter, critic adapter + value head, frozen shared base ------------
    model, tokenizer = load_policy(args.model, device=run.device, **policy_settings(args))
    value_head, actor_params, critic_params, optimizer, scheduler = actor_and_critic(args, model, run.device)
    simulator = make_simulator(args, model, tokenizer, run)
    first_iteration = run.begin(model, optimizer, scheduler, modules={"value_head": value_head})
    for iteration in range(first_iteration, args.iterations):
        t_start = time.time()
        # --- 1. collect dialogues: this process's share of the iteration's personas -------------
        chosen = run.share(pick_personas(personas, args.dialogues_per_iteration, args.seed, iteration))
        try:
            records, rstats = play_dialogues(model, tokenizer, simulator, chosen, **sampling_settings(args),
                                             progress=run.show_progress)
        except SimulatorError as e:
            run.stop(e, iteration)  # one line; a finished iteration not yet saved is saved first
        t_rollout = time.time() - t_start

        # --- 2. score: old log-probs, reference log-probs, values, rewards ------------------------
        t0 = time.time()
        batch = pad_records(records, tokenizer.pad_token_id, run.device)
        mask = batch["action_mask"]                                                         # (B, T)
        # only passes whose result is not known yet; --kl-coef reads old log-probs before the update
        old_from_update, need_ref = passes_to_run(args, iteration, len(records) * run.world, model,
                                                  old_first=args.kl_coef > 0)
        old_logprobs = torch.zeros_like(mask) if old_from_update else \
            batched_logprobs(model, batch, args.temperature, args.micro_batch_size)         # (B, T)
        ref_logprobs = batched_logprobs(model, batch, args.temperature, args.micro_batch_size,
                                        reference=True) if need_ref else None               # (B, T)
        old_values = batched_values(model, value_head, batch, args.micro_batch_size) * mask  # (B, T)
        rewards = place_rewards(records, mask.shape, args.reward, args.format_penalty).to(run.device)
        if args.kl_coef > 0:  # the k1 estimate, per token, in the reward (both passes ran above)
            rewards = rewards - args.kl_coef * (old_logprobs - ref_logprobs) * mask           # (B, T)

        # --- 3. advantages: GAE over the agent's tokens ------------------------------------------
        advantages, returns = compute_gae(rewards.cpu(), old_values.cpu(), mask.cpu(), args.gamma, args.lam)
        advantages, returns = advantages.to(run.device), returns.to(run.device)
        if args.whiten_advantages:  # over every process's agent tokens
            advantages = whiten(advantages, mask, run.sum)
        t_score = time.time() - t0

        # --- 4. update: epochs x minibatches x micro-batches ------------------------------------
        t0 = time.time()
        model.train()
        logs = {k: [] for k in LOGGED}
        local_mb = args.minibatch_size // run.world
        train_actor = iteration >= args.critic_warmup  # during warm-up the actor's loss is only logged
        for epoch in range(args.update_epochs):
            order = torch.randperm(len(records)).tolist()
            for start in range(0, len(records), local_mb):
                mb_inds = order[start:start + local_mb]
                total_tokens = run.sum(mask[mb_inds].sum()).clamp(min=1)
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
                        actor_loss, terms = policy_objective(
                            newlogprob, entropy, old_logprobs[idx, :w], advantages[idx, :w],
                            None if ref_logprobs is None else ref_logprobs[idx, :w], agg, args)
                    if train_actor:
                        actor_loss.backward()
                    with adapter_active(model, "critic"):  # forward and backward under the critic
                        values = critic_values(model, value_head, ids, att).float()
                        terms["value_loss"], terms["value_clip_frac"] = clipped_value_loss(
                            values, old_values[idx, :w], returns[idx, :w], args.value_clip)
                        (args.vf_coef * agg(terms["value_loss"])).backward()
                    append_means(logs, terms, m, first=epoch == start == m0 == 0)  # their means, for the log
                run.step(optimizer, scheduler, {"actor_grad_norm": actor_params, "critic_grad_norm":
                                                critic_params}, args.max_grad_norm, iteration, logs)
        t_update = time.time() - t0

        # --- 5. log: global figures over every process's dialogues -------------------------------
        all_records = run.gather(records)
        final = np.array([r["final_emotion"] / 100.0 if args.reward == "final" else sum(r["changes"]) / 100.0
                          for r in all_records])
        ev = explained_variance(run.sum(variance_sums(old_values[mask > 0], returns[mask > 0])))
        update_tokens = run.sum(mask.sum()).item() * args.update_epochs
        kl_ref = None if ref_logprobs is None else \
            run.masked_mean(kl_k3(old_logprobs, ref_logprobs), mask)  # null: no reference pass
        gap = run.masked_mean((old_logprobs - batch["sample_logprobs"]).abs(), mask)
        method = {"reward_mean": float(final.mean()), "reward_std": float(final.std()), "kl_ref": kl_ref,
                  "sample_logprob_gap": gap, "explained_variance": ev,
                  "actor_lr": optimizer.param_groups[0]["lr"], "critic_lr": optimizer.param_groups[1]["lr"],
                  "update_tokens": int(update_tokens),  # every process's agent tokens, x epochs
                  "update_tokens_per_s": update_tokens / max(run.max(t_update), 1e-9)}
        times = {"time_rollout": t_rollout, "time_score": t_score, "time_update": t_update,
                 "time_iteration": time.time() - t_start}
        run.log(iteration, all_records, rstats, logs, method, times)

        # --- 6. checkpoint -----------------------------------------------------------------------
        run.save_if_due(iteration)  # every --save-every iterations, at the last, when --time-budget is up
        if run.time_is_up:
            break
    run.finish()
    return model, value_head  # for tests and notebooks


if __name__ == "__main__":
    main()
