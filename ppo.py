"""PPO with GAE for RLVER: a LoRA actor and a LoRA critic that share one frozen base model.

Each iteration plays a batch of dialogues against the simulated user (rollout.py), puts on the last
token of each agent turn the difference between its credit and the next turn's (--reward: final,
the paper's, credits every turn with the final emotion / 100, so all of it lands on the last turn),
estimates advantages with GAE over the agent's own tokens, and takes clipped PPO steps on the actor
and the critic. One copy of the
weights serves four roles: the actor (adapter 'default'), the critic (adapter 'critic' plus a scalar
value head), the reference policy (adapters disabled) and, with --simulator same, the simulated user
(adapters disabled too). TRL's PPO holds four models.

grpo.py is this file with the critic taken out and the group advantage put in, in the same order, so
`diff ppo.py grpo.py` shows the methods' differences. The policy's terms (the clipped surrogate, its
truncated importance weight, the k3 KL: policy_terms) are written here and in grpo.py alike, so the
loss's maths is on the page. What both do alike otherwise (the old and reference log-probs, the
rewards, the loss aggregations, AdamW with its warm-up, the figures both log) is in rl.py, once.
In the loop the `run.` calls are the processes and the run folder (run.py); run.sum sets the loss
denominators over every process, and one line an iteration is printed (process 0's).

    python ppo.py               # the paper's setup on a CUDA machine (Qwen2.5-7B-Instruct)
    python ppo.py --preset cpu  # the embedded SmolLM2-135M, a few iterations on 2 CPU cores
    accelerate launch --num_processes 8 ppo.py  # data parallel on one node
"""
import contextlib
import copy
from dataclasses import dataclass

import numpy as np
import torch

from cli import (above, at_least, command, fail, one_of, parse_settings, setting, use_cpu_threads,
                 within)
from personas import load_personas
from policy import adapter_params, check_model, load_policy
from rl import (TrainerSettings, adamw_with_warmup, agg_weights, eval_forward, eval_logprobs,
                figures_line, iteration_report, mode_coefficients, old_logprobs_from_update,
                pad_records, pick_personas, token_logprobs, turn_rewards, unmoved_return)
from engine import Decoder
from rollout import (ChatTokens, build_simulator, check_openings_fit, play_dialogues,
                     reach_simulator)
from run import Run
from simulator import SimulatorError


@dataclass
class Settings(TrainerSettings):
    """PPO's settings: its own here, on top of what both trainers read (rl.TrainerSettings) and
    what plays a dialogue (rl.DialogueSettings). A preset below changes some of them."""
    title = "PPO"
    dialogues_per_iteration: int = setting(
        32, "dialogues per iteration, over all processes (RLVER: 32)", at_least(1))
    gamma: float = setting(1.0, "discount over agent tokens (RLVER's trainer: 1.0)", within(0, 1))
    lam: float = setting(1.0, "GAE lambda (RLVER's trainer: 1.0)", within(0, 1))
    whiten_advantages: bool = setting(True, "normalise advantages over the batch's agent tokens")
    value_clip: float = setting(
        0.5, "values move at most this far from the rollout's (RLVER: 0.5)", above(0))
    vf_coef: float = setting(
        1.0, "value loss coefficient (1: RLVER's 0.5 x the squared error's mean)", at_least(0))
    loss_agg: str = setting("token-mean", "token-mean | seq-mean-token-mean",
                            one_of("token-mean", "seq-mean-token-mean"))
    lr: float = setting(
        1e-5, "the policy's LoRA learning rate (paper, full fine-tune 1e-6)", above(0))
    critic_lr: float = setting(
        5e-5, "critic adapter and value head learning rate (5x --lr)", above(0))
    warmup_steps: int = setting(
        20, "optimizer steps of the policy's linear learning-rate warm-up (RLVER: 2%% "
            "of 1,000)", at_least(0))
    critic_warmup_steps: int = setting(
        50, "the critic's warm-up steps (RLVER: 5%% of 1,000)", at_least(0))

    @staticmethod
    def check(args):
        # mixed credits each turn with RLVER's fork's return, discounted from turn to turn by
        # --mixed-gamma; GAE returns a turn exactly its credit only undiscounted (gamma = lam = 1)
        if args.reward == "mixed" and (args.gamma < 1 or args.lam < 1):
            fail(f"--reward mixed with --gamma {args.gamma} --lam {args.lam}: mixed gives each "
                 "turn RLVER's fork's return (its discount is --mixed-gamma), which GAE returns "
                 "only with --gamma 1 --lam 1; below 1 it would discount it again, token by token")
        if args.dialogues_per_iteration % args.minibatch_size:
            fail(f"--dialogues-per-iteration {args.dialogues_per_iteration} must be a multiple of "
                 f"--minibatch-size {args.minibatch_size}")


PRESETS = {
    "paper": {},
    # Small enough that a few iterations run on 2 CPU cores in minutes. Thinking is off: the 135M
    # model never writes the tags, and the instructions about them only make its replies worse. The
    # rules user: the 135M model writes no appraisal a reasoned read-out can read.
    "cpu": dict(model="smollm2", simulator="rules", dialogues_per_iteration=4, max_turns=2,
                max_new_tokens=32, user_reply_tokens=24, max_context=1024, minibatch_size=4,
                micro_batch_size=2, gradient_checkpointing=False, thinking=False, lora_r=8,
                lora_alpha=16, lr=5e-5, critic_lr=2.5e-4, iterations=3, save_every=1,
                warmup_steps=0, critic_warmup_steps=0,
                # not RLVER's (0.5, 0.001, 1): the CPU results are measured with these
                value_clip=0.2, ent_coef=0.0, vf_coef=0.5),
}
# The cpu preset made to show learning in minutes: one turn, 20 iterations of two passes in
# minibatches of 8; measured, every seed rose (docs/results.md)
PRESETS["cpu-learn"] = {**PRESETS["cpu"], **dict(
    dialogues_per_iteration=16, max_turns=1, max_new_tokens=48, minibatch_size=8,
    update_epochs=2, micro_batch_size=4, lr=1e-3, critic_lr=1e-3, iterations=20, save_every=5)}
# cpu-learn over three agent turns, where a turn's own credit can differ from the final emotion's
# (the rules user gives a repeated reply nothing): tools/bench.py credit's preset. 8 dialogues an
# iteration in both trainers, one pass in minibatches of 2 (four steps an iteration, each on fresh
# dialogues: a second pass cost as much as the rollout and the scoring together), 8 iterations,
# kl_ref every other: 18 runs in two hours on two cores (docs/results.md)
PRESETS["cpu-turns"] = {**PRESETS["cpu-learn"], **dict(
    dialogues_per_iteration=8, max_turns=3, max_new_tokens=32, update_epochs=1,
    minibatch_size=2, micro_batch_size=2, iterations=8, save_every=4, log_kl_every=2)}


# ----------------------------------------------------------------------------------------------
# The method: small pure functions (tests/test_ppo.py holds each against a hand computation)
# ----------------------------------------------------------------------------------------------
def place_rewards(records, shape, mode, coefficients, format_penalty):
    """Per-token rewards (B, T): zero except on the last token of each agent turn of a read
    dialogue, which gets that turn's value of rl.turn_rewards (CREDITS[mode] given its
    coefficients, less format_penalty where the turn broke the think format). An unread dialogue
    earns nothing: it enters no loss."""
    rewards = torch.zeros(shape)
    for b, r in enumerate(records):
        if r["end_reason"] != "unread":
            placed = turn_rewards(r, mode, coefficients, format_penalty)
            rewards[b, r["turn_ends"]] = torch.tensor(placed)
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


def whiten(advantages, mask, total=lambda x: x):
    """Advantages (B, T) to zero mean and unit variance over the agent tokens; total sums a tensor
    over the processes (run.sum), so the moments are every process's tokens'."""
    n = total(mask.sum())
    mean = total((advantages * mask).sum()) / n
    var = total((((advantages - mean) * mask) ** 2).sum()) / n
    return (advantages - mean) * torch.rsqrt(var + 1e-8) * mask


def clipped_value_loss(values, old_values, returns, clip):
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped within clip of the rollout's values."""
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    loss = 0.5 * torch.maximum((values - returns) ** 2, (v_clipped - returns) ** 2)
    return loss, ((values - returns) ** 2 < (v_clipped - returns) ** 2).float()


def turn_advantages(advantages, record):
    """Each agent turn's advantage, the mean over its own tokens of a dialogue's advantages (T,)
    (whitened: what the loss weighs them by), in order: what its record shows."""
    mask = torch.tensor(record["action_mask"], dtype=torch.bool)
    starts = [0] + [end + 1 for end in record["turn_ends"][:-1]]
    return [advantages[start:end + 1][mask[start:end + 1]].mean().item()
            for start, end in zip(starts, record["turn_ends"])]


def explained_variance(values, returns):
    """1 - Var(R - V) / Var(R) over the agent tokens of every process (N,): 1 is a perfect critic,
    0 one no better than the mean return, below 0 worse; None where the returns do not vary (or
    there are none: every dialogue unread)."""
    spread = np.var(returns) if len(returns) else 0.0
    if spread > 0:
        return 1 - np.var(returns - values) / spread
    return None


def kl_k3(logprobs, ref_logprobs):
    """k3 estimator of KL(policy || reference) per token: exp(ref - lp) - (ref - lp) - 1. Unbiased,
    always >= 0, low variance (J. Schulman, "Approximating KL divergence", 2020). The exponent is
    clamped to [-20, 20] as verl clamps it, so that a token the policy has moved far from the
    reference gives a large, finite loss, never an infinite one."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    return torch.exp(d) - d - 1


def policy_terms(logprobs, old_logprobs, sample_logprobs, advantages, ref_logprobs, *,
                 clip_low, clip_high, dual_clip, tis_cap):
    """The policy's per-token terms (b, T), from the update's log-probs and the rollout's. The
    loss takes two: "policy_loss", the clipped surrogate times the truncated importance weight, and
    "kl_ref_loss", the k3 KL to the reference (None when no reference pass ran); the rest is logged
    (LOGGED). ppo.py and grpo.py hold the same two functions, on purpose (`diff` shows them alike).
    The surrogate (Schulman et al. 2017), with an asymmetric clip (clip-higher, DAPO): max(-A r,
    -A clip(r, 1 - clip_low, 1 + clip_high)). Until the iteration's first optimizer step the old
    log-probs are the current weights' own, so r = 1, nothing is clipped and the gradient is the
    plain policy gradient -A grad log p. dual_clip c > 1 (Ye et al. 2020; verl's clip_ratio_c):
    where A < 0 the term is at most -A c, so a token whose ratio has grown far past the clip adds
    no gradient; 0: off.
    Truncated importance sampling (TIS; Yao et al. 2025, as verl, TRL and OpenRLHF): the rollout
    sampled each token with its own computation (the decode step, bf16 kernels), whose log-prob
    sample_logprobs differs from old_logprobs by rounding, while the surrogate assumes the trainer's
    policy sampled. tis_weight = min(pi_old / pi_sampler, tis_cap), a constant (old_logprobs carry
    no gradient), corrects the expectation and caps the variance; tis_cap 0: 1."""
    ratio = torch.exp(logprobs - old_logprobs)                                            # (b, T)
    unclipped = -advantages * ratio                                                       # (b, T)
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)           # (b, T)
    surrogate = torch.maximum(unclipped, clipped)                                         # (b, T)
    if dual_clip:
        surrogate = torch.where(advantages < 0,
                                torch.minimum(surrogate, -advantages * dual_clip), surrogate)
    sampler_ratio = torch.exp(old_logprobs - sample_logprobs)  # 1 off the mask: both are 0 there
    tis_weight, tis_cut = torch.ones_like(ratio), torch.zeros_like(ratio)                 # (b, T)
    if tis_cap:
        tis_weight = sampler_ratio.clamp(max=tis_cap)
        tis_cut = (sampler_ratio > tis_cap).float()
    kl_ref = kl_ref_loss = None  # an iteration without the reference pass
    if ref_logprobs is not None:
        kl_ref, kl_ref_loss = kl_k3(old_logprobs, ref_logprobs), kl_k3(logprobs, ref_logprobs)
    return {"policy_loss": tis_weight * surrogate, "kl_ref_loss": kl_ref_loss,
            "approx_kl": kl_k3(old_logprobs, logprobs.detach()),  # KL(old || new)
            "clip_frac": (clipped > unclipped).float(), "kl_ref": kl_ref,
            "sample_logprob_gap": (old_logprobs - sample_logprobs).abs(),
            "mismatch_kl": kl_k3(sample_logprobs, old_logprobs),
            "tis_weight_mean": tis_weight, "tis_clip_frac": tis_cut}


# by the update; metrics.jsonl: their means over every trained token (a grad norm: over the steps)
LOGGED = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_frac", "value_clip_frac",
          "kl_ref", "kl_ref_loss", "sample_logprob_gap", "mismatch_kl", "tis_weight_mean",
          "tis_clip_frac", "actor_grad_norm", "critic_grad_norm")


# ----------------------------------------------------------------------------------------------
# The critic: a second adapter on the shared base, plus a value head
# ----------------------------------------------------------------------------------------------
def use_adapter(model, name):
    """Make one adapter active (the actor's, 'default', or the critic's). peft's set_adapter also
    freezes the other adapters, but autograd skips a parameter that no longer requires grad at
    backward time, so both stay trainable."""
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


def critic_values(model, value_head, input_ids, attention_mask):
    """V(s_t) for every position (B, T) under the 'critic' adapter, aligned with token_logprobs: the
    value at t is that of the state the token at t was sampled in, read from the hidden state at
    t - 1 (position 0 gets 0). Read at t, it would see the action it is a baseline for, and a critic
    that learned that would cancel the advantage. Call it, and the backward pass of its loss, inside
    `with adapter_active(model, "critic"):`."""
    if model.active_adapter != "critic":
        raise RuntimeError("critic_values runs under the 'critic' adapter: call it, and the "
                           "backward pass of its loss, inside "
                           "`with adapter_active(model, 'critic'):`")
    decoder = model.get_base_model().get_decoder()
    output = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    hidden = output.last_hidden_state[:, :-1].to(value_head.weight.dtype)             # (B, T-1, H)
    values = value_head(hidden).squeeze(-1)                                              # (B, T-1)
    return torch.nn.functional.pad(values, (1, 0))                                      # (B, T)


def main(argv=None):
    # --resume: the run's own settings
    args = parse_settings(Settings, argv, presets=PRESETS, prog="ppo.py")
    if args.preset == "paper" and not torch.cuda.is_available() and args.model != "smollm2":
        fail("the paper's setup needs CUDA; on this machine add --preset cpu (the embedded model)")
    personas = load_personas(args.personas, args.split, args.difficulty)
    coefficients = mode_coefficients(args)  # what --reward's mode reads besides a record
    reach_simulator(args.simulator, args)  # a URL user answers a short request, or one line
    # every check that needs no weights: each opening leaves room for a whole reply in the context,
    # and the model's config (--target-modules against its layers, no change to its logits after
    # lm_head)
    check_openings_fit(personas, args.model, args.thinking, args.max_new_tokens, args.max_context,
                       args.trust_remote_code)
    check_model(args.model, args.target_modules, args.trust_remote_code)
    run = Run(args, "ppo.py", adapters=["default", "critic"],
              per_process=["dialogues_per_iteration", "minibatch_size"])

    # --- the model: actor adapter, critic adapter + value head, frozen shared base ------------
    model, tokenizer = load_policy(args.model, device=run.device, dtype=args.dtype,
                                   load_in_4bit=args.load_in_4bit, fp32_head=args.fp32_head,
                                   trust_remote_code=args.trust_remote_code, lora_r=args.lora_r,
                                   lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                   target_modules=args.target_modules,
                                   gradient_checkpointing=args.gradient_checkpointing)
    # the critic: a second LoRA adapter of the actor's shape on the shared base, and a value head
    # that starts at the return of an unmoved emotion (rl.unmoved_return)
    model.add_adapter("critic", copy.deepcopy(model.peft_config["default"]))
    use_adapter(model, "default")
    value_head = torch.nn.Linear(model.config.get_text_config().hidden_size, 1).to(run.device)
    torch.nn.init.zeros_(value_head.weight)
    torch.nn.init.constant_(value_head.bias, unmoved_return(
        personas[0], args.start_emotion, args.max_turns, args.reward, coefficients))
    actor_params = adapter_params(model, "default")  # both adapters trainable: use_adapter above
    critic_params = adapter_params(model, "critic") + list(value_head.parameters())
    # one AdamW with a parameter group each, each warmed up over its own first optimizer steps
    optimizer, scheduler = adamw_with_warmup(
        [(actor_params, args.lr, args.warmup_steps),
         (critic_params, args.critic_lr, args.critic_warmup_steps)])
    simulator = build_simulator(args, model, tokenizer)
    if run.is_main:  # where the policy runs (its CPU threads), and which read-out the user gives
        print(f"policy {args.model} on {run.device} (CPU threads: {torch.get_num_threads()}) x "
              f"{run.world} process(es); simulator {args.simulator}, read-out {simulator.readout}")
    first_iteration = run.begin(model, optimizer, scheduler, modules={"value_head": value_head})
    # the agent's chat (the system prompt --thinking picks, the template's pieces) and its Decoder
    # (one KV cache for a rollout's dialogues, --max-context long)
    chat = ChatTokens(tokenizer, args.thinking)
    decoder = Decoder(model, chat.eos_ids, tokenizer.pad_token_id, args.max_context + 1)
    # whether the update's own pass gives the old log-probs (one step a batch, no dropout)
    from_update = old_logprobs_from_update(model, args.update_epochs, args.minibatch_size,
                                           args.dialogues_per_iteration)
    for iteration in range(first_iteration, args.iterations):
        # --- 1. collect dialogues: this process's share of the iteration's personas -------------
        chosen = run.share(pick_personas(personas, args.dialogues_per_iteration, args.seed,
                                         iteration))
        try:
            records, rstats = play_dialogues(model, simulator, chosen, chat=chat, decoder=decoder,
                                             temperature=args.temperature,
                                             max_new_tokens=args.max_new_tokens,
                                             max_context=args.max_context, greedy=args.greedy,
                                             progress=run.show_progress)
        except SimulatorError as e:
            run.stop(e)  # one line; a finished iteration not yet saved is saved first
        run.lap("rollout")

        # --- 2. score: old log-probs, reference log-probs, values, rewards ------------------------
        batch = pad_records(records, tokenizer.pad_token_id, run.device)
        mask = batch["action_mask"]                                                         # (B, T)
        # the old log-probs (B, T): a scoring pass in eval mode, unless the update's own pass runs
        # the weights that sampled (from_update: one step a batch, no dropout): step 4 takes them
        old_logprobs = None
        if not from_update:
            old_logprobs = eval_logprobs(model, batch, args.temperature, args.micro_batch_size)
        # the reference's (B, T) (the adapters off: the base, no second copy), for the KL term or,
        # every --log-kl-every iterations, for the kl_ref figure
        ref_logprobs = None
        if args.kl_loss_coef > 0 or iteration % args.log_kl_every == 0:
            with model.disable_adapter():
                ref_logprobs = eval_logprobs(model, batch, args.temperature,
                                             args.micro_batch_size)
        with adapter_active(model, "critic"):  # in length-sorted micro-batches, without gradients
            old_values = eval_forward(model, batch, args.micro_batch_size,                  # (B, T)
                                      lambda ids, att, _: critic_values(model, value_head, ids,
                                                                        att))
        old_values = old_values * mask                                                      # (B, T)
        # per-token rewards (B, T), on the CPU as the GAE loop runs there
        rewards = place_rewards(records, mask.shape, args.reward, coefficients, args.format_penalty)

        # --- 3. advantages: GAE over the agent's tokens ------------------------------------------
        advantages, returns = compute_gae(rewards, old_values.cpu(), mask.cpu(), args.gamma,
                                          args.lam)
        advantages, returns = advantages.to(run.device), returns.to(run.device)
        if args.whiten_advantages:  # over every process's agent tokens
            advantages = whiten(advantages, mask, run.sum)
        run.lap("score")

        # --- 4. update: epochs x minibatches x micro-batches ------------------------------------
        model.train()
        logs = {k: [0.0, 0.0] for k in LOGGED}  # each figure's sum and count (run.add_sums)
        local_mb = args.minibatch_size // run.world
        for epoch in range(args.update_epochs):
            order = torch.randperm(len(records)).tolist()
            for start in range(0, len(records), local_mb):
                mb_inds = order[start:start + local_mb]
                # the loss's denominators: the minibatch's agent tokens and dialogues, every process
                total_tokens = run.sum(mask[mb_inds].sum())
                total_seqs = run.sum(mask[mb_inds].any(1).sum())
                if not total_tokens:  # every dialogue unread: nothing to train on, no step
                    continue
                optimizer.zero_grad(set_to_none=True)
                for m0 in range(0, len(mb_inds), args.micro_batch_size):
                    idx = mb_inds[m0:m0 + args.micro_batch_size]
                    # the micro-batch's longest row: no pass runs over a padding-only tail
                    width = int(batch["attention_mask"][idx].sum(1).max())
                    ids = batch["input_ids"][idx, :width]                               # (b, width)
                    att = batch["attention_mask"][idx, :width]                          # (b, width)
                    m = mask[idx, :width]                                               # (b, width)
                    # each agent token's share of the minibatch's loss (--loss-agg)
                    agg_weight = agg_weights(m, args.loss_agg, total_tokens,            # (b, width)
                                             total_seqs)
                    newlogprob, entropy = token_logprobs(model, ids, att, m, args.temperature,
                                                         with_entropy=True,
                                                         entropy_grad=args.ent_coef > 0)
                    # the old log-probs: this pass's own (from_update), else step 2's
                    old = newlogprob.detach() if from_update else old_logprobs[idx, :width]
                    ref = None if ref_logprobs is None else ref_logprobs[idx, :width]
                    # the surrogate, its truncated importance weight and the k3 KL (policy_terms)
                    terms = policy_terms(newlogprob, old, batch["sample_logprobs"][idx, :width],
                                         advantages[idx, :width], ref, clip_low=args.clip_low,
                                         clip_high=args.clip_high, dual_clip=args.dual_clip,
                                         tis_cap=args.tis_cap)
                    actor_loss = (agg_weight * (terms["policy_loss"]
                                                - args.ent_coef * entropy)).sum()
                    if args.kl_loss_coef > 0:  # the k3 KL to the reference, in the loss
                        actor_loss = actor_loss + args.kl_loss_coef * (
                            agg_weight * terms["kl_ref_loss"]).sum()
                    actor_loss.backward()
                    with adapter_active(model, "critic"):  # forward and backward under the critic
                        values = critic_values(model, value_head, ids, att)
                        terms["value_loss"], terms["value_clip_frac"] = clipped_value_loss(
                            values, old_values[idx, :width], returns[idx, :width], args.value_clip)
                        (args.vf_coef * agg_weight * terms["value_loss"]).sum().backward()
                    terms["entropy"] = entropy
                    run.add_sums(logs, terms, m)  # for the log: global means over the tokens
                run.sum_gradients(actor_params + critic_params)  # over the processes
                actor_norm = torch.nn.utils.clip_grad_norm_(actor_params, args.max_grad_norm)
                critic_norm = torch.nn.utils.clip_grad_norm_(critic_params, args.max_grad_norm)
                if run.skip_or_stop(actor_norm + critic_norm):  # not finite: no step
                    optimizer.zero_grad(set_to_none=True)
                    continue
                optimizer.step()
                scheduler.step()
                run.add_sums(logs, {"actor_grad_norm": actor_norm, "critic_grad_norm": critic_norm},
                             torch.ones_like(actor_norm))
        t_update = run.lap("update")

        # --- 5. log: global figures over every process's dialogues -------------------------------
        # what explains each dialogue's reward, in its record: per agent turn the reward placed on
        # its last token and its advantage (turn_advantages; an unread dialogue has neither)
        for r, placed, adv in zip(records, rewards, advantages.cpu()):
            read = r["end_reason"] != "unread"
            r["rewards"] = [round(x, 6) for x in placed[r["turn_ends"]].tolist()] if read else None
            r["advantages"] = turn_advantages(adv, r) if read else None
        figures, dialogues = iteration_report(run.gather(records), run.gather([rstats]),
                                              run.sum(mask.sum()).item() * args.update_epochs,
                                              max(run.gather([t_update])), args.reward,
                                              coefficients)
        values = np.array(run.gather(old_values[mask > 0].tolist()))                       # (N,)
        targets = np.array(run.gather(returns[mask > 0].tolist()))                         # (N,)
        metrics = run.log({**figures, "explained_variance": explained_variance(values, targets),
                           "actor_lr": optimizer.param_groups[0]["lr"],
                           "critic_lr": optimizer.param_groups[1]["lr"]}, logs, dialogues)
        # one line an iteration, from the figures logged; process 0's only (nanochat's print0)
        if run.is_main:
            print(f"ppo {metrics['iteration']}/{args.iterations} | " + figures_line(
                metrics, ("reward_mean", "final_emotion_mean", "kl_ref", "clip_frac",
                          "explained_variance", "time_iteration")))

        # --- 6. checkpoint -----------------------------------------------------------------------
        run.save_if_due()  # every --save-every iterations and at the last
    run.finish()
    return model, value_head  # for tests and notebooks


if __name__ == "__main__":
    use_cpu_threads()  # on a CPU: half the usable cores, unless OMP_NUM_THREADS is set
    command(main)()  # the command line: a Stop is one line and its exit code
