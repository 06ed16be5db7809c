"""What ppo.py and grpo.py share: their set-up checks, the batch, the log-prob passes, the
credit table (CREDITS: each turn's return) and the rewards it places, the loss aggregations, AdamW
with its warm-up, the iteration's report, and (at the end) the settings they build theirs on,
those of a dialogue shared with evaluate.py too.

Each trainer shows its whole method in its own file (the advantages, the policy's terms and the
losses, the optimizer step in its loop); what both do alike, in the same way, is here once. It
plays no dialogue (rollout.py) and writes no file (run.py).
"""
import math
import os
import random
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from cli import KEY_VARIABLE, above, at_least, env_name, fail, one_of, setting, within
from personas import DIFFICULTIES, SPLITS
from policy import DEFAULT_TARGETS, four_bit_problem, model_problem
from rollout import TOKEN_ARRAYS, summarize, unmoved_record
from simulator import simulator_problem


# ----------------------------------------------------------------------------------------------
# Set-up: what an iteration takes, decided before it runs
# ----------------------------------------------------------------------------------------------
def pick_personas(personas, n, seed, iteration):
    """The iteration's n personas, the same on every process (each then plays its own share)."""
    pick = random.Random(seed * 1_000_003 + iteration)
    if len(personas) >= n:
        return pick.sample(personas, n)
    return [pick.choice(personas) for _ in range(n)]


def old_logprobs_from_update(model, update_epochs, minibatch_size, batch_size):
    """Whether the update's own forward pass can give the old log-probs (step 2 of both trainers),
    decided once at set-up. It can with one optimizer step per batch (one pass, the whole batch of
    batch_size dialogues one minibatch): the weights that would score the rollout are then the ones
    the update runs, so the scoring pass is skipped (TRL skips it too; it was a fifth of an
    iteration of `tools/bench.py step --algo grpo`). Not with any dropout (LoRA's, or a rate in the
    model's config: attention dropout is a call, not a module), whose train-mode pass is not the
    sampling policy."""
    rates = [p for k, p in model.config.get_text_config().to_dict().items()
             if "dropout" in k or k.endswith("pdrop")]
    rates += [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    dropout = any(isinstance(p, (int, float)) and p > 0 for p in rates)
    return update_epochs == 1 and minibatch_size == batch_size and not dropout


# ----------------------------------------------------------------------------------------------
# Batches and log-probabilities
# ----------------------------------------------------------------------------------------------
def pad_records(records, pad_id, device):
    """Right-pad dialogues into tensors (B, T): input_ids, attention_mask, action_mask (1 on the
    tokens the loss trains on: the policy's own, none of an unread dialogue's) and
    sample_logprobs."""
    lengths = torch.tensor([len(r["token_ids"]) for r in records], device=device)          # (B,)
    read = torch.tensor([r["end_reason"] != "unread" for r in records], device=device)     # (B,)
    width = int(lengths.max())
    batch = {"attention_mask": (torch.arange(width, device=device) < lengths[:, None]).long()}
    # (B, T) each: every record's list, padded with its value
    for name, key, value, dtype in (("input_ids", "token_ids", pad_id, torch.long),
                                    ("action_mask", "action_mask", 0, torch.float32),
                                    ("sample_logprobs", "sample_logprobs", 0, torch.float32)):
        batch[name] = torch.tensor([r[key] + [value] * (width - len(r[key])) for r in records],
                                   dtype=dtype, device=device)
    batch["action_mask"] *= read[:, None]
    return batch


# agent tokens projected onto the vocabulary at once (token_logprobs): their logits, float32,
# are chunk x vocabulary (200 MB for SmolLM2's 49k words, 620 MB for Qwen2.5's 152k)
LOGITS_CHUNK_TOKENS = 1024


def _chunk_logprobs(head, hidden, targets, temperature, with_entropy, entropy_grad):
    """log-probs of `targets` (N,) and, with with_entropy, the entropy (N,) of the softmax over
    head(hidden) / temperature, for hidden (N, H): one chunk of token_logprobs."""
    logits = head(hidden).float()                                                           # (N, V)
    if temperature != 1:  # (the division would be a pass over the logits, and one back)
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, -1)                                                # (N, V)
    picked = logp_all.gather(-1, targets[:, None])[:, 0]                                      # (N,)
    if not with_entropy:
        return picked, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return picked, -(logp_all.exp() * logp_all).sum(-1)                                   # (N,)


def token_logprobs(model, input_ids, attention_mask, action_mask, temperature=1.0,
                   with_entropy=False, chunk_tokens=LOGITS_CHUNK_TOKENS, entropy_grad=True):
    """log p(token t | tokens < t) under `model`, aligned with input_ids (position 0 gets 0),
    computed as log softmax(logits / temperature), the distribution the rollout sampled from.
    Each row's values are its own agent tokens' (action_mask (B, T); 0 elsewhere, so that a
    difference of two passes is 0 off the mask before anything exponentiates it), and the
    vocabulary projection and softmax run only at the positions that predict one: N of them, not
    B x T (TRL projects the completion's positions only, each row as wide as the longest).
    The (N, vocab) logits are the largest tensor of the update (vocab is 49k for SmolLM2, 152k
    for Qwen2.5, N up to rows x 6,144 positions), so they are made in chunks of chunk_tokens
    tokens; with gradients and more than one chunk each chunk is recomputed in the backward pass
    (activation checkpointing), so at most one chunk's logits are alive at a time (chunk_tokens=
    None: one chunk). entropy_grad=False computes the entropy without a gradient (an entropy bonus
    of 0 needs none, and its backward through the softmax costs as much as the log-probs').
    No KV cache is built: nothing reads it. Returns (logprobs (B, T), entropy (B, T) or None)."""
    from torch.utils.checkpoint import checkpoint

    B, T = input_ids.shape
    rows, predictors = action_mask[:, 1:].nonzero(as_tuple=True)          # (N,) each: the tokens
    # with nothing to train on (every dialogue unread) one position still runs, so that the
    # backward pass gives zero gradients, not none, and every process sums the same gradients
    if not len(rows):
        rows = predictors = rows.new_zeros(1)
    # (a PeftModel hands get_decoder and get_output_embeddings on to its base model)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False).last_hidden_state[rows, predictors]     # (N, H)
    head, targets = model.get_output_embeddings(), input_ids[rows, predictors + 1]          # (N,)
    step = chunk_tokens or len(rows)                                              # tokens a chunk
    chunk = _chunk_logprobs
    if torch.is_grad_enabled() and len(rows) > step:  # only then is there a peak to bound
        chunk = partial(checkpoint, _chunk_logprobs, use_reentrant=False)
    logps, entropies = zip(*[chunk(head, hidden[c:c + step], targets[c:c + step],
                                   temperature, with_entropy, entropy_grad)
                             for c in range(0, len(rows), step)])
    # each one's chunks (N,) placed at their tokens in (B, T), 0 elsewhere (the where clears the
    # one position the fallback above ran on, which is on no mask)
    placed = []
    for chunks in (logps, entropies)[:1 + with_entropy]:
        values = torch.cat(chunks)                                                          # (N,)
        full = values.new_zeros(B, T).index_put((rows, predictors + 1), values)            # (B, T)
        placed.append(torch.where(action_mask.bool(), full, 0))
    return placed[0], placed[1] if with_entropy else None


@torch.no_grad()
def eval_forward(model, batch, micro_batch_size, forward):
    """forward(input_ids, attention_mask, action_mask) -> (b, width) over a padded batch (B, T), in
    eval mode and without gradients: the scoring passes of both trainers. The dialogues go longest
    first, in micro-batches of similar length, each at the width of its longest (the batch is
    right-padded), so that short dialogues are not run at the width of the longest one. Returns
    (B, T) float32."""
    out = torch.zeros_like(batch["action_mask"])                                    # (B, T) float32
    lengths = batch["attention_mask"].sum(1)                                                # (B,)
    order = torch.argsort(lengths, descending=True, stable=True)
    model.eval()  # no dropout (the trainers switch to train mode for the update)
    for i in range(0, len(order), micro_batch_size):
        rows = order[i:i + micro_batch_size]
        width = int(lengths[order[i]])  # the longest row's
        out[rows, :width] = forward(*(batch[k][rows, :width]
                                      for k in ("input_ids", "attention_mask", "action_mask")))
    return out


def eval_logprobs(model, batch, temperature=1.0, micro_batch_size=4):
    """token_logprobs over a padded batch (B, T), without gradients (eval_forward)."""
    return eval_forward(model, batch, micro_batch_size, lambda ids, att, m: token_logprobs(
        model, ids, att, m, temperature)[0])


# ----------------------------------------------------------------------------------------------
# Credits and rewards: CREDITS gives each turn's return, turn_rewards the rewards that sum to it
# ----------------------------------------------------------------------------------------------
def changes(record):
    """Each agent turn's emotion change / 100, from the record's start_emotion and emotions (the
    emotion after each agent turn)."""
    emotions = record["emotions"]
    return [(new - old) / 100 for old, new in zip([record["start_emotion"]] + emotions, emotions)]


def changes_to_go(record):
    """Each turn's change and every later one, / 100: the final emotion less the one before the
    turn, / 100."""
    later, to_go = 0.0, []
    for change in reversed(changes(record)):
        later += change
        to_go.append(later)
    return to_go[::-1]


def mixed_credit(record, mixed_alpha, mixed_gamma):
    """RLVER's public fork's turn credit (llsune/RLVER, its Scheme 2): each turn's change mixed with
    the discounted return of the changes from that turn on, (1 - alpha) x change_t + alpha x G_t,
    G_t = change_t + gamma x G_(t+1), alpha --mixed-alpha, gamma --mixed-gamma (a discount from turn
    to turn). The fork trains each agent turn as a row of its own, so this is exactly the return
    its turn gets."""
    credit, later = [], 0.0
    for change in reversed(changes(record)):
        later = change + mixed_gamma * later
        credit.append((1 - mixed_alpha) * change + mixed_alpha * later)
    return credit[::-1]


# --reward: the credit of each agent turn of a read dialogue, one value per agent turn, from its
# record and the mode's own coefficients (MODE_FLAGS, by name): the return that turn's tokens
# get. PPO places the differences of consecutive credits on the turns' last tokens, so that GAE
# (gamma = lambda = 1) returns each turn exactly its credit (turn_rewards); the first turn's credit
# is the dialogue's return, which GRPO compares. A fork adds a mode here, its coefficients to
# TrainerSettings and their names to MODE_FLAGS (mode_coefficients hands a mode its own).
CREDITS = {
    # the paper: every turn is credited with the final emotion / 100
    "final": lambda record: [record["emotions"][-1] / 100] * len(record["emotions"]),
    # each turn with the emotion changes from it on / 100: the final emotion less the mood the
    # turn met, so a turn is not credited with what came before it
    "turn": changes_to_go,
    # RLVER's fork: a turn's change and the discounted return from it (GRPO: each turn's return,
    # compared turn by turn, grpo.CREDIT_LEVEL)
    "mixed": mixed_credit,
}
MODE_FLAGS = {"mixed": ("mixed_alpha", "mixed_gamma")}  # a mode's own settings: no other mode's



def mode_coefficients(args):
    """The settings --reward's mode reads (MODE_FLAGS), by name: what CREDITS[mode] takes after
    the record."""
    return {name: getattr(args, name) for name in MODE_FLAGS.get(args.reward, ())}


def unmoved_return(persona, start_emotion, max_turns, mode, coefficients):
    """The return of a dialogue with `persona` that leaves the emotion at start_emotion, over every
    turn it may have (max_turns), under CREDITS[mode]: PPO's critic starts there. The record is
    made as a rollout's are (rollout.unmoved_record), so a mode that reads any field of a record
    reads it here too."""
    unmoved = unmoved_record(persona, start_emotion, max_turns)
    return CREDITS[mode](unmoved, **coefficients)[0]


def turn_rewards(record, mode, coefficients, format_penalty=0.0):
    """The reward each agent turn of a read dialogue gets on its last token, in order: its credit
    (CREDITS[mode], given its coefficients) less the next turn's, so that the rewards from a turn
    on add up to its credit; less format_penalty on each turn that broke the think format. Their
    sum is the dialogue's return. A mode that gives another number of values than agent turns is
    an error."""
    credit = CREDITS[mode](record, **coefficients)
    broke = [t["violation"] is not None for t in record["turns"] if t["role"] == "agent"]
    if len(credit) != len(broke):
        raise ValueError(f"CREDITS[{mode!r}] gave {len(credit)} values "
                         f"for {len(broke)} agent turns")
    placed = [now - later for now, later in zip(credit, credit[1:] + [0.0])]
    return [value - format_penalty * bad for value, bad in zip(placed, broke)]


# ----------------------------------------------------------------------------------------------
# The loss's aggregation weights and the optimizer
# ----------------------------------------------------------------------------------------------
def agg_weights(mask, mode, tokens, dialogues, token_budget=None):
    """Each agent token's weight (b, T) in the minibatch's loss under --loss-agg, from one
    micro-batch's mask and the minibatch's counts over every process (tokens: its agent tokens,
    dialogues: its dialogues that have one): the sum of weight x a per-token loss over the
    micro-batches is the minibatch's loss, whatever the split (each trainer offers some).
    token-mean: 1 / tokens; every agent token weighs the same (DAPO); long dialogues weigh more.
    seq-mean-token-mean: 1 / (the dialogue's own tokens x dialogues); every dialogue weighs the
                         same (the GRPO paper's choice).
    dr-grpo: 1 / (dialogues x token_budget), a fixed length budget per dialogue (Dr. GRPO): no
             length-dependent normalisation at all. GRPO takes the budget as the most tokens a
             dialogue can hold, max_turns x max_new_tokens."""
    if mode == "token-mean":
        return mask / tokens
    if mode == "seq-mean-token-mean":
        return mask / (mask.sum(1, keepdim=True).clamp(min=1) * dialogues)
    return mask / (dialogues * token_budget)  # dr-grpo


def adamw_with_warmup(groups):
    """AdamW over (parameters, learning rate, warm-up steps) groups, each group's rate rising
    linearly over its first warm-up steps, then constant, as verl's warm-up: counted by the
    scheduler's own steps (the trainers step it only after an optimizer step, so a skipped
    non-finite step advances neither, and --resume restores both). Unlike verl's, the first step
    takes 1 / warm-up of the rate, not 0."""
    optimizer = torch.optim.AdamW([{"params": params, "lr": lr} for params, lr, _ in groups],
                                  weight_decay=0.0)
    # a group's rate factor after `steps` steps; the default argument n binds each group's own
    # warm-up
    factors = [lambda steps, n=max(1, warmup): min(1.0, (steps + 1) / n) for *_, warmup in groups]
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factors)


# ----------------------------------------------------------------------------------------------
# The iteration's report
# ----------------------------------------------------------------------------------------------
def iteration_report(all_records, stats, update_tokens, update_seconds, mode, coefficients):
    """Step 5 of both trainers: (figures, dialogues) of an iteration, from every process's records
    and rollout counts (stats, a dict a process) and the update's tokens (those the loss trained on,
    every process's, x epochs) and seconds (the slowest process's). The figures: the read
    dialogues' returns' mean and std (CREDITS[mode], no format penalty; the std without Bessel's
    correction; None when every dialogue was unread), the update's tokens and their rate, and the
    rollout's summary. The dialogues: every record as rollouts.jsonl holds it."""
    rewards = np.array([sum(turn_rewards(r, mode, coefficients))
                        for r in all_records if r["end_reason"] != "unread"])
    read = len(rewards) > 0
    figures = {"reward_mean": float(rewards.mean()) if read else None,
               "reward_std": float(rewards.std()) if read else None,
               "update_tokens": int(update_tokens),
               "update_tokens_per_s": update_tokens / max(update_seconds, 1e-9),
               **summarize(all_records, stats)}
    return figures, [{k: v for k, v in r.items() if k not in TOKEN_ARRAYS} for r in all_records]


def figures_line(metrics, keys):
    """The iteration's line (each trainer prints it): "key value" for each of keys of its metrics
    line, to 4 significant digits, joined by " | "; "-" where the figure was not measured (None)."""
    return " | ".join(f"{key} {'-' if metrics[key] is None else f'{metrics[key]:.4g}'}"
                      for key in keys)


# ----------------------------------------------------------------------------------------------
# Settings the scripts share: each script declares its own on top of these (ppo.Settings,
# grpo.Settings, evaluate.Settings), with its presets beside them
# ----------------------------------------------------------------------------------------------
# The most agent turns a dialogue may have: ten times RLVER's 8 and SAGE's 9 to 10 judged replies.
# Every appraisal quotes the whole dialogue, so a user's work grows with the square of the turns,
# and PPO's critic starts from a record of every turn (unmoved_return): a bound keeps both sized.
MAX_TURNS = 100


@dataclass
class DialogueSettings:
    """What plays a dialogue, for both trainers and evaluate.py: the policy's base model, how its
    turns are sampled, and who plays the user."""
    title = "the dialogues"
    # the policy's base model (policy.load_policy): the reference and the `same` user run on it too
    model: str = setting(
        "Qwen/Qwen2.5-7B-Instruct", "policy base: hub id, path, or smollm2 (embedded)",
        model_problem, path=True)
    dtype: str = setting("auto", "auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16",
                         one_of("auto", "float32", "bfloat16"))
    load_in_4bit: bool = setting(
        False, "QLoRA: NF4 base weights via bitsandbytes (CUDA, or its CPU kernels)",
        lambda on: on and four_bit_problem() or None)
    trust_remote_code: bool = setting(
        False, "allow model code from the hub (off unless you trust it)")
    fp32_head: bool = setting(
        True, "in bf16: the output layer and its logits in float32, for the sampler and the "
              "trainer alike (less sampler-trainer mismatch, docs/gpu.md)")
    # how the agent's turns are sampled (rollout.play_dialogues)
    thinking: bool = setting(True, "think-then-say scaffold (the paper's best run)")
    temperature: float = setting(
        1.0, "sampling temperature; the trainer's log-probs use the same", above(0))
    max_new_tokens: int = setting(512, "tokens per agent turn", at_least(1))
    max_context: int = setting(
        6144, "tokens per dialogue; past it the dialogue ends with 'context'", at_least(2))
    # who plays the user, how an appraisal becomes a number, and the users (rollout.build_simulator)
    simulator: str = setting(
        "same", "same (the policy's frozen base) | rules | listener (held out: no preset trains "
                "against it) | http://host:port/v1", simulator_problem)
    api_model: str = setting("default", "model name sent to a URL simulator")
    api_key_env: str = setting(
        KEY_VARIABLE, "environment variable with the URL simulator's key", env_name)
    api_timeout: float = setting(
        60.0, "seconds a request to a URL simulator may take in all; a call, x (retries + 1)",
        within(0, 86400, low_open=True), operational=True)
    api_retries: int = setting(4, "tries after a failed request to a URL simulator", at_least(0),
                               operational=True)
    personas: str = setting(
        "personas.json", "persona file: personas.json or a SAGE / RLVER profile file", path=True)
    split: str = setting(
        "train", "persona split: train | test | adversarial (adversarial.json's users, for "
                 "evaluation) | all (every split of the file)", one_of(*SPLITS, "all"))
    difficulty: str = setting(
        "all", "all (each persona's own) | easy | normal | hard: every user plays at this level",
        one_of("all", *DIFFICULTIES))
    start_emotion: int = setting(
        30, "start emotion (RLVER training 30, SAGE benchmark 40)", within(0, 100))
    max_change: int = setting(10, "largest emotion change per turn", at_least(1))
    max_turns: int = setting(8, "agent turns per dialogue (RLVER: 8)", within(1, MAX_TURNS))
    user_reply_tokens: int = setting(96, "tokens per simulated user message", at_least(1))

    @staticmethod
    def check(args):
        # a prompt and a whole reply must fit; the URL user's key is named, never typed
        if args.max_context <= args.max_new_tokens:
            fail(f"--max-context {args.max_context}: must be more than --max-new-tokens "
                 f"{args.max_new_tokens} (a prompt and a whole reply must fit)")
        if "api_key_env" in args.given and args.api_key_env not in os.environ:
            fail("--api-key-env <redacted>: no environment variable of that name is set; give the "
                 "name of the variable that holds the key (exported), never the key itself")
        key = os.environ.get(args.api_key_env, "").strip()
        # http.client sends a header in Latin-1, and refuses a control character in an error that
        # quotes the key; a key of any length is sent (vLLM's placeholder EMPTY included)
        if not key.isprintable() or any(ord(c) > 0xFF for c in key):
            fail(f"${args.api_key_env} holds a character an HTTP header cannot carry (a line "
                 "break, a control character or one outside Latin-1): give the key as it was "
                 "issued")


@dataclass
class TrainerSettings(DialogueSettings):
    """What both trainers read alike; each declares its method's own on top."""
    title = "training (both trainers)"
    # the LoRA adapters the trainers train (policy.load_policy), and how their backward pass runs
    lora_r: int = setting(32, "LoRA rank of the trained adapters", at_least(1))
    lora_alpha: int = setting(64, "LoRA alpha (scale = alpha / r)", above(0))
    lora_dropout: float = setting(0.0, "LoRA dropout; 0 keeps the first importance ratio exactly 1",
                                  within(0, 1, high_open=True))
    target_modules: str = setting(DEFAULT_TARGETS, "comma-separated module names that get LoRA")
    gradient_checkpointing: bool = setting(True, "recompute activations in the backward pass",
                                           operational=True)
    # the update
    update_epochs: int = setting(
        1, "passes over each iteration's dialogues (GRPO's mu)", at_least(1))
    minibatch_size: int = setting(
        32, "dialogues an optimizer step, all processes (RLVER: 32)", at_least(1))
    clip_low: float = setting(0.2, "clip: ratio kept within [1 - clip_low, 1 + clip_high]",
                              within(0, 1, low_open=True, high_open=True))
    clip_high: float = setting(
        0.2, "upper clip; above clip_low = clip-higher (DAPO: 0.28)", above(0))
    dual_clip: float = setting(
        0.0, "dual clip (verl's clip_ratio_c, 3 there): with a negative advantage A a token's "
             "loss is at most -A x this; 0: off (RLVER's verl has none)",
        lambda c: None if c == 0 or 1 < c < math.inf
        else "must be 0 (off) or a finite number above 1")
    tis_cap: float = setting(
        2.0, "truncated importance sampling: each token's policy-gradient term x min(pi_old / "
             "pi_sampler, cap) (TRL: 2); 0: off",
        lambda cap: None if cap == 0 or 1 <= cap < math.inf
        else "must be 0 (off) or a finite number, at least 1")
    ent_coef: float = setting(0.001, "entropy bonus coefficient (RLVER: 0.001)", at_least(0))
    kl_loss_coef: float = setting(
        0.0, "k3 KL-to-reference loss coefficient (RLVER and TRL: 0)", at_least(0))
    max_grad_norm: float = setting(1.0, "gradient norm clipping, per trained part", above(0))
    greedy: bool = setting(
        False, "decode greedily: reproducible dialogues for tests and debugging (GRPO: a "
               "group's would be equal)")
    micro_batch_size: int = setting(
        2, "dialogues per forward pass (gradient accumulation)", at_least(1), operational=True)
    log_kl_every: int = setting(
        1, "log kl_ref every N iterations; with no KL term, N > 1 skips the "
           "reference pass in the others", at_least(1), operational=True)
    # what a dialogue earns (CREDITS)
    reward: str = setting(
        "final", "each turn's credit (CREDITS). final: the final emotion / 100 | turn: the changes "
                 "from the turn on / 100 | mixed: a turn's change and the discounted return from "
                 "it (RLVER's fork); GRPO: turn and mixed give each turn an advantage of its own",
        one_of(*CREDITS))
    format_penalty: float = setting(
        0.0, "subtracted per think-format violation (thinking on)", at_least(0))
    mixed_alpha: float = setting(
        0.4, "--reward mixed: the discounted return's share of a turn's credit", within(0, 1))
    mixed_gamma: float = setting(
        0.97, "--reward mixed: the discount from one turn to the next", within(0, 1))
    # the run: its length, folder, checkpoints and resume (run.Run)
    preset: str = setting("paper", "paper (Qwen2.5-7B on CUDA) | cpu (the embedded model, a few "
                                   "iterations) | cpu-learn (the embedded model, 20 iterations of "
                                   "one-turn dialogues, 14-27 min: the reward rises) | cpu-turns "
                                   "(the embedded model, three-turn dialogues: per-turn credit "
                                   "against the final emotion, tools/bench.py credit); explicit "
                                   "flags win",
                          one_of("paper", "cpu", "cpu-learn", "cpu-turns"))
    iterations: int = setting(1000, "training iterations (RLVER: 1,000 steps)", at_least(1))
    out: str = setting("", "a new run folder, created by the run (an empty one is taken); default "
                           "runs/<script>__<seed>__<time>", path=True)
    resume: str = setting("", "a run folder to continue from its newest checkpoint, "
                              "with its saved settings")
    save_every: int = setting(10, "checkpoint every N iterations (and at the end)", at_least(1))
    keep_checkpoints: int = setting(3, "keep the newest N checkpoints this run wrote (0 = all)",
                                    at_least(0))
    seed: int = setting(0, "random seed", within(0, 2**32 - 1))
    report_to: str = setting("none", "none | tensorboard | wandb: a tracker beside the files "
                                     "(numbers only)", one_of("none", "tensorboard", "wandb"))
    max_bad_updates: int = setting(3, "stop after this many non-finite updates in a row",
                                   at_least(1), operational=True)

    @staticmethod
    def check(args):
        for mode, names in MODE_FLAGS.items():
            for name in names:
                if name in args.given and args.reward != mode:
                    fail(f"--{name.replace('_', '-')} is --reward {mode}'s: with --reward "
                         f"{args.reward} it would be ignored")
