"""GRPO for RLVER: group-relative advantages over the same multi-turn rollouts, no critic.

Each iteration plays --group-size dialogues with each of --personas-per-iteration personas, all from
the persona's opening (rollout.py). With --reward final a dialogue's advantage is its reward (final
emotion / 100) minus its group's mean, over the group's std (Shao et al. 2024, DeepSeekMath, arXiv
2402.03300), on every token the agent sampled in it. With --reward turn or mixed each agent turn has
its own: its return (the user's changes from it on) against the returns of its group's turns at the
same place and against the batch's, mixed (MAPO, arXiv 2603.06194), on every token of the turn. Then
clipped policy-gradient steps on the LoRA adapter. No value model: the group is the baseline. One
copy of the weights serves three roles: the policy (adapter 'default'), the reference (adapter
disabled) and, with --simulator same, the user.

This is ppo.py with the critic taken out and the group advantage put in, in the same order, so `diff
ppo.py grpo.py` shows the methods' differences. The policy's terms (the clipped surrogate, its
truncated importance weight, the k3 KL: policy_terms) are written here and in ppo.py alike, so the
loss's maths is on the page. What both do alike otherwise (the old and reference log-probs, the
rewards, the loss aggregations, AdamW with its warm-up, the figures both log) is in rl.py, once. In
the loop the `run.` calls are the processes and the run folder (run.py); run.sum sets the loss
denominators over every process, and one line an iteration is printed (process 0's).

    python grpo.py               # the paper's GRPO setup on a CUDA machine (Qwen2.5-7B-Instruct)
    python grpo.py --preset cpu  # the embedded SmolLM2-135M, a few iterations on 2 CPU cores
    accelerate launch --num_processes 8 grpo.py  # data parallel on one node
"""
from dataclasses import dataclass

import torch

from cli import (above, at_least, command, fail, one_of, parse_settings, setting, use_cpu_threads,
                 within)
from personas import load_personas
from policy import adapter_params, check_model, load_policy
from rl import (TrainerSettings, adamw_with_warmup, agg_weights, eval_logprobs, figures_line,
                iteration_report, mode_coefficients, old_logprobs_from_update, pad_records,
                pick_personas, token_logprobs, turn_rewards)
from engine import Decoder
from rollout import (ChatTokens, build_simulator, check_openings_fit, play_dialogues,
                     reach_simulator)
from run import Run
from simulator import SimulatorError


# --group-advantage: a dialogue's advantage from its reward r and its group's mean, std and size
# (over the group's read dialogues, group_stats); each row one choice of the flag
ADVANTAGES = {
    # GRPO (Shao et al. 2024, DeepSeekMath); eps 1e-4 as TRL
    "mean-std": lambda r, mean, std, size: (r - mean) / (std + 1e-4),
    # Dr. GRPO (Liu et al. 2025, arXiv 2503.20783): dividing by the std favours too-easy and
    # too-hard groups
    "mean": lambda r, mean, std, size: r - mean,
}

# --reward: how many advantages a dialogue gets under each mode of rl.CREDITS. final credits every
# turn with the outcome: one advantage a dialogue, against its group (group_advantages). turn and
# mixed credit each turn with a return of its own: one advantage a turn (per_turn_advantages).
CREDIT_LEVEL = {"final": "dialogue", "turn": "turn", "mixed": "turn"}


@dataclass
class Settings(TrainerSettings):
    """GRPO's settings: its own here, on top of what both trainers read (rl.TrainerSettings) and
    what plays a dialogue (rl.DialogueSettings). A preset below changes some of them."""
    title = "GRPO"
    personas_per_iteration: int = setting(
        8, "personas (groups) per iteration, over all processes: 8 x 4 = PPO's 32 dialogues "
           "(RLVER's GRPO: 32 x 4)", at_least(1))
    group_size: int = setting(
        4, "dialogues per persona, all from its opening (RLVER: 4)", at_least(2))
    group_advantage: str = setting(
        "mean-std", "a dialogue's advantage against its group (ADVANTAGES): "
                    "mean-std (GRPO) | mean (Dr. GRPO)", one_of(*ADVANTAGES))
    loss_agg: str = setting(
        "seq-mean-token-mean", "seq-mean-token-mean (GRPO paper) | token-mean | dr-grpo "
                               "(token sum / fixed budget)",
        one_of("seq-mean-token-mean", "token-mean", "dr-grpo"))
    lr: float = setting(
        1e-5, "the policy's LoRA learning rate (paper, full fine-tune 1e-6)", above(0))
    warmup_steps: int = setting(
        20, "optimizer steps of linear learning-rate warm-up (RLVER: 2%% of 1,000)", at_least(0))
    turn_level_weight: float = setting(
        0.4, "--reward turn or mixed: each turn's advantage is this x its turn-level advantage "
             "(against its group's turns at the same place) + the rest x its batch-level one "
             "(MAPO's script: 0.4)", within(0, 1))

    @staticmethod
    def check(args):
        if args.reward not in CREDIT_LEVEL:  # a mode a fork added to rl.CREDITS
            fail(f"--reward {args.reward}: grpo.CREDIT_LEVEL does not say whether GRPO credits it "
                 "a dialogue or a turn at a time: add it there")
        if CREDIT_LEVEL[args.reward] == "dialogue" and "turn_level_weight" in args.given:
            fail(f"--turn-level-weight mixes per-turn advantages: with --reward {args.reward} a "
                 "dialogue has one advantage, so it would be ignored")
        batch = args.personas_per_iteration * args.group_size
        if batch % args.minibatch_size:
            fail(f"--minibatch-size {args.minibatch_size} must divide the batch of {batch} "
                 "dialogues (--personas-per-iteration x --group-size)")


PRESETS = {
    "paper": {},
    # Small enough that a few iterations run on 2 CPU cores in minutes. Thinking is off: the 135M
    # model never writes the tags, and the instructions about them only make its replies worse. The
    # rules user: the 135M model writes no appraisal a reasoned read-out can read.
    "cpu": dict(model="smollm2", simulator="rules", personas_per_iteration=2, group_size=2,
                max_turns=2, max_new_tokens=32, user_reply_tokens=24, max_context=1024,
                minibatch_size=4, micro_batch_size=2, gradient_checkpointing=False, thinking=False,
                lora_r=8, lora_alpha=16, lr=5e-5, iterations=3, save_every=1, warmup_steps=0,
                # not RLVER's 0.001: the CPU results are measured without an entropy bonus
                ent_coef=0.0),
}
# The cpu preset made to show learning in minutes: one turn, 20 iterations of two passes in
# minibatches of 8; measured, every seed rose (docs/results.md)
PRESETS["cpu-learn"] = {**PRESETS["cpu"], **dict(
    personas_per_iteration=4, group_size=4, max_turns=1, max_new_tokens=48, minibatch_size=8,
    update_epochs=2, micro_batch_size=4, lr=1e-3, iterations=20, save_every=5)}
# cpu-learn over three agent turns, where a turn's own credit can differ from the final emotion's
# (the rules user gives a repeated reply nothing): tools/bench.py credit's preset. 8 dialogues an
# iteration in both trainers, one pass in minibatches of 2 (four steps an iteration, each on fresh
# dialogues: a second pass cost as much as the rollout and the scoring together), 8 iterations,
# kl_ref every other: 18 runs in two hours on two cores (docs/results.md)
PRESETS["cpu-turns"] = {**PRESETS["cpu-learn"], **dict(
    personas_per_iteration=2, group_size=4, max_turns=3, max_new_tokens=32, update_epochs=1,
    minibatch_size=2, micro_batch_size=2, iterations=8, save_every=4, log_kl_every=2)}


# ----------------------------------------------------------------------------------------------
# The method: small pure functions (tests/test_grpo.py holds each against a hand computation)
# ----------------------------------------------------------------------------------------------
def dialogue_rewards(records, mode, coefficients, format_penalty):
    """One reward per dialogue (B,), the scalar a group compares under --reward final: the sum of
    its rl.turn_rewards, its return (CREDITS[mode]'s credit of its first turn: the final emotion /
    100 for final, less the start emotion for turn) less format_penalty per violating agent turn;
    NaN for an unread dialogue, which its group leaves out."""
    return torch.tensor([sum(turn_rewards(r, mode, coefficients, format_penalty))
                         if r["end_reason"] != "unread" else torch.nan for r in records],
                        dtype=torch.float64)


def group_stats(rewards, group_ids):
    """Per dialogue (B,): its group's mean reward, std (with Bessel's correction, as torch.std, TRL
    and verl use) and size over the group's read dialogues (an unread one's reward is NaN), and
    whether the group has nothing to learn from: fewer than two read dialogues, or all their
    rewards equal."""
    mean, std, size = torch.zeros(3, len(rewards), dtype=rewards.dtype)
    flat = torch.zeros_like(rewards, dtype=torch.bool)
    for g in group_ids.unique():
        members = group_ids == g
        r = rewards[members & ~rewards.isnan()]
        if len(r) > 1:
            mean[members], std[members], size[members] = r.mean(), r.std(), len(r)
        flat[members] = len(r) < 2 or r.max() == r.min()
    return mean, std, size, flat


def group_advantages(rewards, group_ids, kind):
    """Advantage of each dialogue (B,) from its reward and its group's statistics
    (ADVANTAGES[kind]). A group with nothing to learn from (group_stats) and an unread dialogue get
    exactly 0. In the dtype of rewards (dialogue_rewards: float64)."""
    mean, std, size, flat = group_stats(rewards, group_ids)
    return ADVANTAGES[kind](rewards, mean, std, size).masked_fill(flat | rewards.isnan(), 0.0)


def turn_returns(records, mode, coefficients, format_penalty):
    """Each agent turn's Monte Carlo return, a list a read dialogue (None for an unread one): the
    sum of the rl.turn_rewards from the turn on, which is its credit (CREDITS[mode]) less
    format_penalty per violating turn from it on. turn: the user's changes from the turn on / 100;
    mixed: the fork's m_t. The first turn's is the dialogue's reward (dialogue_rewards)."""
    returns = []
    for r in records:
        if r["end_reason"] == "unread":
            returns.append(None)
            continue
        later, to_go = 0.0, []
        for reward in reversed(turn_rewards(r, mode, coefficients, format_penalty)):
            later += reward
            to_go.append(later)
        returns.append(to_go[::-1])
    return returns


def per_turn_advantages(returns, group_ids, kind, turn_level_weight):
    """Each turn's advantage from the returns of every read dialogue's turns (turn_returns), lists
    like them (None for an unread dialogue), as MAPO mixes them (arXiv 2603.06194):
    turn_level_weight x A_turn + (1 - turn_level_weight) x A_batch, where
    A_turn compares a turn's return with those of its group's read dialogues at the same turn (the
        group and the turn's place are the group of group_advantages): a turn that one read
        dialogue of its group reached, or whose returns there are all equal, gets A_turn = 0;
    A_batch compares it with every read turn of the iteration (one group: all of them);
    both by ADVANTAGES[kind] of those returns' mean, std and count. A dialogue that ended early
    has no later turns and counts in no later place; an unread one counts nowhere."""
    rows = [(i, t) for i, r in enumerate(returns) if r is not None for t in range(len(r))]
    values = torch.tensor([returns[i][t] for i, t in rows], dtype=torch.float64)         # (n,)
    # each (group, turn) pair's own id: the turn level's groups
    places = {}
    place_ids = torch.tensor([places.setdefault((int(group_ids[i]), t), len(places))     # (n,)
                              for i, t in rows], dtype=torch.long)
    turn_level = group_advantages(values, place_ids, kind)                                # (n,)
    batch_level = group_advantages(values, torch.zeros_like(place_ids), kind)             # (n,)
    weighted = turn_level_weight * turn_level + (1 - turn_level_weight) * batch_level     # (n,)
    advantages = [None if r is None else [] for r in returns]
    for (i, _), value in zip(rows, weighted.tolist()):
        advantages[i].append(value)
    return advantages


def token_advantages(turn_values, turn_ends, mask):
    """(B, T): every agent token of a dialogue's turn t gets turn_values[b][t], every other token
    0 (the mask (B, T)), and every token of an unread dialogue (None) 0. A turn's tokens run from
    the one after the previous turn's last (turn_ends) to its own last."""
    advantages = torch.zeros_like(mask)                                                    # (B, T)
    for b, (values, ends) in enumerate(zip(turn_values, turn_ends)):
        if values is None:
            continue
        for value, start, end in zip(values, [0] + [e + 1 for e in ends[:-1]], ends):
            advantages[b, start:end + 1] = value
    return advantages * mask


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


# by the update; metrics.jsonl: their means over every trained token (grad_norm: over the steps)
LOGGED = ("policy_loss", "entropy", "approx_kl", "clip_frac", "kl_ref", "kl_ref_loss",
          "sample_logprob_gap", "mismatch_kl", "tis_weight_mean", "tis_clip_frac", "grad_norm")


def main(argv=None):
    # --resume: the run's own settings
    args = parse_settings(Settings, argv, presets=PRESETS, prog="grpo.py")
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
    run = Run(args, "grpo.py", adapters=["default"],  # a group stays in one process
              per_process=["personas_per_iteration", "minibatch_size"])

    # --- the model: policy adapter on a frozen base; no critic --------------------------------
    model, tokenizer = load_policy(args.model, device=run.device, dtype=args.dtype,
                                   load_in_4bit=args.load_in_4bit, fp32_head=args.fp32_head,
                                   trust_remote_code=args.trust_remote_code, lora_r=args.lora_r,
                                   lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                   target_modules=args.target_modules,
                                   gradient_checkpointing=args.gradient_checkpointing)
    params = adapter_params(model, "default")  # trainable as get_peft_model made them
    optimizer, scheduler = adamw_with_warmup([(params, args.lr, args.warmup_steps)])
    simulator = build_simulator(args, model, tokenizer)
    if run.is_main:  # where the policy runs (its CPU threads), and which read-out the user gives
        print(f"policy {args.model} on {run.device} (CPU threads: {torch.get_num_threads()}) x "
              f"{run.world} process(es); simulator {args.simulator}, read-out {simulator.readout}")
    first_iteration = run.begin(model, optimizer, scheduler)
    # the agent's chat (the system prompt --thinking picks, the template's pieces) and its Decoder
    # (one KV cache for a rollout's dialogues, --max-context long)
    chat = ChatTokens(tokenizer, args.thinking)
    decoder = Decoder(model, chat.eos_ids, tokenizer.pad_token_id, args.max_context + 1)
    # whether the update's own pass gives the old log-probs (one step a batch, no dropout)
    batch_size = args.personas_per_iteration * args.group_size  # dialogues an iteration, in all
    from_update = old_logprobs_from_update(model, args.update_epochs, args.minibatch_size,
                                           batch_size)
    for iteration in range(first_iteration, args.iterations):
        # --- 1. collect dialogues: this process's whole groups (its share of the personas) --------
        chosen = run.share(pick_personas(personas, args.personas_per_iteration, args.seed,
                                         iteration))
        try:
            records, rstats = play_dialogues(model, simulator, chosen, args.group_size,
                                             chat=chat, decoder=decoder,
                                             temperature=args.temperature,
                                             max_new_tokens=args.max_new_tokens,
                                             max_context=args.max_context, greedy=args.greedy,
                                             progress=run.show_progress)
        except SimulatorError as e:
            run.stop(e)  # one line; a finished iteration not yet saved is saved first
        run.lap("rollout")

        # --- 2. score: old log-probs, reference log-probs, rewards --------------------------------
        batch = pad_records(records, tokenizer.pad_token_id, run.device)
        mask = batch["action_mask"]                                                         # (B, T)
        # the old log-probs (B, T): a scoring pass in eval mode, unless the update's own pass runs
        # the weights that sampled (from_update: one step a batch, no dropout): step 4 takes them
        old_logprobs = None
        if not from_update:
            old_logprobs = eval_logprobs(model, batch, args.temperature, args.micro_batch_size)
        # the reference's (B, T) (the adapter off: the base, no second copy), for the KL term or,
        # every --log-kl-every iterations, for the kl_ref figure
        ref_logprobs = None
        if args.kl_loss_coef > 0 or iteration % args.log_kl_every == 0:
            with model.disable_adapter():
                ref_logprobs = eval_logprobs(model, batch, args.temperature,
                                             args.micro_batch_size)
        # The rewards of the whole iteration, on every process (its figures are global). The
        # gather is in rank order, so this process's rows are its share (run.share), and each
        # process's dialogues come group after group, --group-size each (play_dialogues), so a
        # row's place names its group.
        all_records = run.gather(records)
        all_rewards = dialogue_rewards(all_records, args.reward, coefficients,             # (N,)
                                       args.format_penalty)
        all_groups = torch.arange(len(all_records)) // args.group_size                      # (N,)

        # --- 3. advantages: each dialogue against its group, or each turn (CREDIT_LEVEL) ----------
        # a list a dialogue, one advantage an agent turn (None: unread)
        if CREDIT_LEVEL[args.reward] == "dialogue":  # every turn of a dialogue gets the dialogue's
            by_dialogue = group_advantages(all_rewards, all_groups, args.group_advantage)   # (N,)
            all_advantages = [None if r["end_reason"] == "unread" else [a] * len(r["turn_ends"])
                              for r, a in zip(all_records, by_dialogue.tolist())]
        else:  # each turn's return against its group's turns at the same place and the batch's
            returns = turn_returns(all_records, args.reward, coefficients, args.format_penalty)
            all_advantages = per_turn_advantages(returns, all_groups, args.group_advantage,
                                                 args.turn_level_weight)
        _, all_std, all_size, all_flat = group_stats(all_rewards, all_groups)               # (N,)
        advantages = token_advantages(run.share(all_advantages),                            # (B, T)
                                      [r["turn_ends"] for r in records], mask)
        run.lap("score")

        # --- 4. update: passes x minibatches x micro-batches ------------------------------------
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
                    # each agent token's share of the minibatch's loss (--loss-agg; dr-grpo's
                    # budget: the most tokens a dialogue can hold)
                    agg_weight = agg_weights(m, args.loss_agg, total_tokens,            # (b, width)
                                             total_seqs, args.max_turns * args.max_new_tokens)
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
                    loss = (agg_weight * (terms["policy_loss"] - args.ent_coef * entropy)).sum()
                    if args.kl_loss_coef > 0:  # the k3 KL to the reference, in the loss
                        loss = loss + args.kl_loss_coef * (agg_weight * terms["kl_ref_loss"]).sum()
                    loss.backward()
                    terms["entropy"] = entropy
                    run.add_sums(logs, terms, m)  # for the log: global means over the tokens
                run.sum_gradients(params)  # over the processes
                grad_norm = torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                if run.skip_or_stop(grad_norm):  # not finite: no step
                    optimizer.zero_grad(set_to_none=True)
                    continue
                optimizer.step()
                scheduler.step()
                run.add_sums(logs, {"grad_norm": grad_norm}, torch.ones_like(grad_norm))
        t_update = run.lap("update")

        # --- 5. log: global figures over every process's dialogues -------------------------------
        # what explains each dialogue's reward, in its record: its return (NaN, written as null:
        # unread) and the advantage every token of each agent turn got (null: unread)
        for r, reward, by_turn in zip(all_records, all_rewards.tolist(), all_advantages):
            r["reward"], r["advantages"] = reward, by_turn
        figures, dialogues = iteration_report(all_records, run.gather([rstats]),
                                              run.sum(mask.sum()).item() * args.update_epochs,
                                              max(run.gather([t_update])), args.reward,
                                              coefficients)
        # a group's figures, read off its first dialogue (each of its dialogues holds them); the
        # reward std over the groups with a std, those with two read dialogues or more
        first = slice(None, None, args.group_size)
        spread = all_std[first][all_size[first] >= 2]                                    # (groups,)
        # (no group with a std: NaN, which the log writes as null)
        metrics = run.log({**figures, "group_reward_std": float(spread.mean()),
                           "zero_spread_groups": int(all_flat[first].sum()),
                           "lr": optimizer.param_groups[0]["lr"]}, logs, dialogues)
        # one line an iteration, from the figures logged; process 0's only (nanochat's print0)
        if run.is_main:
            print(f"grpo {metrics['iteration']}/{args.iterations} | " + figures_line(
                metrics, ("reward_mean", "final_emotion_mean", "kl_ref", "clip_frac",
                          "zero_spread_groups", "time_iteration")))

        # --- 6. checkpoint -----------------------------------------------------------------------
        run.save_if_due()  # every --save-every iterations and at the last
    run.finish()
    return model  # the trained PeftModel, for tests and notebooks


if __name__ == "__main__":
    use_cpu_threads()  # on a CPU: half the usable cores, unless OMP_NUM_THREADS is set
    command(main)()  # the command line: a Stop is one line and its exit code
