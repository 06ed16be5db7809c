"""The policy and its multi-turn dialogues with the simulated user, token in, token out.

This is the one place where the agent meets the simulated user; ppo.py, grpo.py and evaluate.py
all call play_dialogues(). It also holds what those scripts share: loading the LoRA policy,
per-token log-probabilities, padding dialogues into a batch, run folders and checkpoints.

Token in, token out: the ids the policy sampled are kept exactly as sampled (never decoded and
re-tokenised), and each user turn is appended as the chat template's token delta for that
message. The action mask is 1 exactly on the policy's sampled tokens.

    python rollout.py --model smollm2 --simulator same --personas personas.json --split train \\
        --dialogues 4 --max-turns 3 --out runs/rollout
"""
import json
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from tqdm import tqdm

from simulator import (Simulator, cached_batch, keep_cache, load_model, load_personas_or_exit, make_backend,
                       prompt_counts, transcript_turns)

# ----------------------------------------------------------------------------------------------
# System prompts (written for this project; --system-prompt-file replaces them)
# ----------------------------------------------------------------------------------------------
THINK_PROMPT = (
    "You are a caring, perceptive companion talking with someone who is going through something "
    "hard. Before each reply, think privately between <think> and </think>: what the person feels, "
    "what they want from you, what they may need but have not said, and how best to answer. Then, "
    "after </think>, write your reply to them: warm, natural and short (two to four sentences). "
    "Only the text after </think> is shown to them.")
PLAIN_PROMPT = (
    "You are a caring, perceptive companion talking with someone who is going through something "
    "hard. Reply warmly and naturally in two to four sentences: show that you understand how they "
    "feel and answer what they actually said.")
SILENCE = "..."  # what the user sees when the agent's visible reply is empty


THINK_TAG = re.compile(r"</?think\s*>", re.IGNORECASE)


def split_thought(text, thinking):
    """(thought, reply, violation). With thinking on, the reply is the text after the last
    </think>, so that no thought can reach the simulated user. violation is None or one of:
      no_think       no tags at all: the whole text is the reply
      unclosed       <think> without </think>: all of it is thought, the reply is empty
      stray_tags     any other tag than one <think> at the start and one </think>; all text before
                     the last </think> is thought, and a <think> after it starts thought again
      empty_thought  the tags hold nothing
      empty_reply    nothing visible is left; the user sees SILENCE
    Every case is counted in the rollout statistics; --format-penalty in the trainers can punish it."""
    text = text.strip()
    if not thinking:
        return "", text, None if text else "empty_reply"
    tags = list(THINK_TAG.finditer(text))
    closes = [t for t in tags if t.group().startswith("</")]
    if not closes:
        if tags:
            return THINK_TAG.sub(" ", text[tags[0].end():]).strip(), "", "unclosed"
        return "", text, "no_think" if text else "empty_reply"
    last = closes[-1]
    before, reply = text[:last.start()], text[last.end():]
    opening = THINK_TAG.search(reply)  # a thought opened after the last close is never shown
    if opening:
        before, reply = before + " " + reply[opening.end():], reply[:opening.start()]
    inner = [t for t in tags if t is not last]
    well_placed = not inner or (len(inner) == 1 and inner[0].start() == 0 and inner[0].group()[1] != "/")
    stray = opening is not None or not well_placed
    thought = " ".join(part.strip() for part in THINK_TAG.split(before) if part.strip())
    reply = reply.strip()
    if not reply:
        return thought, "", "empty_reply"
    if stray:
        return thought, reply, "stray_tags"
    return thought, reply, None if thought else "empty_thought"


# ----------------------------------------------------------------------------------------------
# The policy: a causal LM with a LoRA adapter; the reference is the same weights, adapter off
# ----------------------------------------------------------------------------------------------
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # Qwen2.5 / Llama names


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_policy(model_name, device=None, lora_r=16, lora_alpha=32, lora_dropout=0.0,
                target_modules=DEFAULT_TARGETS, adapter=None, load_in_4bit=False,
                gradient_checkpointing=False, trust_remote_code=False, trainable=True):
    """A PeftModel with one adapter named 'default' (fresh, or loaded from `adapter`).
    LoRA dropout defaults to 0 so that the importance ratio is exactly 1 before the first update."""
    from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training

    device = device or default_device()
    base, tokenizer = load_model(model_name, device=device, load_in_4bit=load_in_4bit,
                                 trust_remote_code=trust_remote_code)
    if load_in_4bit:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=gradient_checkpointing)
    if gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    if adapter:
        model = PeftModel.from_pretrained(base, adapter, is_trainable=trainable)
    else:
        config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                            target_modules=[t.strip() for t in target_modules.split(",")],
                            task_type="CAUSAL_LM")
        model = get_peft_model(base, config)
    return model, tokenizer


# ----------------------------------------------------------------------------------------------
# Chat-template token deltas
# ----------------------------------------------------------------------------------------------
class ChatTokens:
    """Turns a chat template into token pieces that can be appended to a growing dialogue.
    The template is rendered once with marker strings; what lies between the markers is what the
    template adds after an agent turn and around a user message."""
    AGENT, USER = "@@AGENT_TURN@@", "@@USER_TURN@@"

    def __init__(self, tokenizer, system_prompt):
        self.tokenizer, self.system_prompt = tokenizer, system_prompt
        base = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "hello"},
                {"role": "assistant", "content": self.AGENT}]
        before = tokenizer.apply_chat_template(base, tokenize=False)
        after = tokenizer.apply_chat_template(base + [{"role": "user", "content": self.USER}],
                                              tokenize=False, add_generation_prompt=True)
        if not after.startswith(before) or self.USER not in after:
            raise ValueError("this chat template rewrites earlier turns when a turn is added, so "
                             "dialogues cannot grow token by token; use a ChatML-style template")
        self.after_agent = before[before.index(self.AGENT) + len(self.AGENT):]    # e.g. "<|im_end|>\n"
        self.user_prefix, self.user_suffix = after[len(before):].split(self.USER)  # "<|im_start|>user\n", ...
        self.eos_ids = eos_ids(tokenizer)

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, opening):
        """The first prompt: system message, the user's opening, the generation prompt."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": opening}],
            tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def user_turn(self, text, agent_ended_with):
        """Tokens to append after an agent turn: the rest of the template's agent-turn ending
        (its end-of-turn token was sampled, so it is not repeated), then the user message and
        the next generation prompt."""
        tail = self.after_agent
        eos_text = self.tokenizer.decode([agent_ended_with]) if agent_ended_with in self.eos_ids else ""
        if eos_text and tail.startswith(eos_text):
            tail = tail[len(eos_text):]
        return self.encode(tail + self.user_prefix + text + self.user_suffix)


def eos_ids(tokenizer):
    """Token ids that end an agent turn: the tokenizer's EOS and the usual chat end-of-turn tokens."""
    ids = {tokenizer.eos_token_id}
    for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


# ----------------------------------------------------------------------------------------------
# Dialogues
# ----------------------------------------------------------------------------------------------
@dataclass
class Dialogue:
    """One agent-user dialogue as it grows. ids/action_mask/logprobs stay aligned token by token."""
    persona: object
    group: int                      # index of the persona in this batch; GRPO groups by it
    sample: int                     # which sample of that persona
    state: object                   # simulator.UserState, paired with this dialogue for its life
    ids: list = field(default_factory=list)
    action_mask: list = field(default_factory=list)  # 1 on sampled policy tokens, else 0
    logprobs: list = field(default_factory=list)     # sampling log-prob of each action token, else 0
    turn_ends: list = field(default_factory=list)    # index of the last token of each agent turn
    agent_turns: list = field(default_factory=list)  # {"raw", "thought", "reply", "violation", "tokens"}
    cache: dict = field(default_factory=dict, repr=False)  # the policy's KV cache between turns


@torch.no_grad()
def play_dialogues(policy, tokenizer, simulator, personas, samples_per_persona=1, *, thinking=True,
                   system_prompt=None, temperature=1.0, top_p=1.0, max_new_tokens=256,
                   max_context=4096, greedy=False, reuse_cache=True, progress=True, desc="dialogues"):
    """Play len(personas) x samples_per_persona dialogues in lockstep: one batched generate for all
    active agents, then one batched simulator step; finished dialogues leave the batch.
    With reuse_cache each dialogue keeps its KV cache between turns, so a turn runs only the tokens
    added since the last one (simulator.cached_batch); without it every turn runs the whole prompt.
    Returns (records, stats): one flat dict per dialogue, and counts and timings."""
    from transformers import GenerationConfig

    chat = ChatTokens(tokenizer, system_prompt or (THINK_PROMPT if thinking else PLAIN_PROMPT))
    device = next(policy.parameters()).device
    # An explicit config, so that a model's own defaults (top_k=20, repetition_penalty=1.05 in
    # Qwen2.5's generation_config) cannot change the sampling distribution. top_k must be 0, not
    # None: transformers reads None as "unset" and fills in the model's top_k, or 50. The stored
    # log-probs are log softmax(logits / temperature), the distribution we sample from when
    # top_p = 1; the trainers must compute theirs with the same temperature.
    gen_config = GenerationConfig(
        do_sample=not greedy, temperature=temperature if not greedy else None, top_p=top_p if not greedy else None,
        top_k=0 if not greedy else None, repetition_penalty=1.0, max_new_tokens=max_new_tokens, eos_token_id=chat.eos_ids,
        pad_token_id=tokenizer.pad_token_id, return_dict_in_generate=True, output_logits=True)
    dialogues = []
    for g, persona in enumerate(personas):
        for s in range(samples_per_persona):
            ids = chat.prompt(persona.opening)
            dialogues.append(Dialogue(persona=persona, group=g, sample=s, state=simulator.start(persona),
                                      ids=ids, action_mask=[0] * len(ids), logprobs=[0.0] * len(ids)))
    was_training = policy.training
    policy.eval()
    stats = Counter()
    t_policy = 0.0
    sim_seconds_before, sim_tokens_before = simulator.seconds, simulator.backend.generated_tokens
    sim_prompt_before = (getattr(simulator.backend, "prompt_tokens", 0), getattr(simulator.backend, "reused_tokens", 0))
    bar = tqdm(total=len(dialogues), desc=desc, disable=not progress, leave=False)
    while True:
        active = [d for d in dialogues if not d.state.done]
        for d in active:  # the next prompt must leave room for a full reply
            if len(d.ids) + max_new_tokens > max_context:
                d.state.end_reason = "context"
                bar.update(1)
        for d in dialogues:
            if d.state.done:
                d.cache.clear()  # free a finished dialogue's KV cache
        active = [d for d in active if not d.state.done]
        if not active:
            break
        t0 = time.time()
        slots = [d.cache if reuse_cache else {} for d in active]
        ids, mask, cache = cached_batch([d.ids for d in active], slots, tokenizer.pad_token_id, device)
        prompt, reused = prompt_counts(mask, cache)
        stats["policy_prompt_tokens"] += prompt
        stats["policy_reused_tokens"] += reused
        out = policy.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, generation_config=gen_config)
        new = out.sequences[:, ids.shape[1]:]                                    # (B, N)
        logits = torch.stack(out.logits, 1).float() / temperature                 # (B, N, V)
        new_logp = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0].cpu()  # (B, N)
        lengths = [next((i + 1 for i, t in enumerate(row) if t in chat.eos_ids), len(row))  # keep the EOS
                   for row in new.tolist()]
        if reuse_cache:
            sampled = (torch.arange(new.shape[1], device=device)[None] < torch.tensor(lengths, device=device)[:, None])
            keep_cache(slots, cache, out.sequences, torch.cat([mask, sampled.long()], 1))
        new = new.cpu()
        t_policy += time.time() - t0
        replies = []
        for k, d in enumerate(active):
            row, n = new[k].tolist(), lengths[k]
            tokens, lps = row[:n], new_logp[k, :n].tolist()
            d.ids += tokens
            d.action_mask += [1] * n
            d.logprobs += lps
            d.turn_ends.append(len(d.ids) - 1)
            raw = tokenizer.decode(tokens, skip_special_tokens=True)
            thought, reply, violation = split_thought(raw, thinking)
            stats[violation or "format_ok"] += 1
            stats["policy_tokens"] += n
            d.agent_turns.append({"raw": raw, "thought": thought, "reply": reply,
                                  "violation": violation, "tokens": n})
            replies.append(reply or SILENCE)
        simulator.step([d.state for d in active], replies)
        for d in active:
            if not d.state.done:
                delta = chat.user_turn(d.state.history[-1]["text"], d.ids[-1])
                if len(d.ids) + len(delta) + max_new_tokens > max_context:
                    # No room for the user's message and a full reply: end here, so that no stored
                    # sequence is longer than max_context and every one ends on an agent token.
                    d.state.end_reason = "context"
                else:
                    d.ids += delta
                    d.action_mask += [0] * len(delta)
                    d.logprobs += [0.0] * len(delta)
            if d.state.done:
                bar.update(1)
    bar.close()
    policy.train(was_training)
    stats["policy_seconds"] = t_policy
    stats["simulator_seconds"] = simulator.seconds - sim_seconds_before
    stats["simulator_tokens"] = simulator.backend.generated_tokens - sim_tokens_before
    stats["simulator_prompt_tokens"] = getattr(simulator.backend, "prompt_tokens", 0) - sim_prompt_before[0]
    stats["simulator_reused_tokens"] = getattr(simulator.backend, "reused_tokens", 0) - sim_prompt_before[1]
    return [to_record(d) for d in dialogues], dict(stats)


def to_record(d):
    """The flat per-dialogue record the trainers and evaluate.py consume."""
    s = d.state
    turns = transcript_turns(s)
    agent = iter(d.agent_turns)
    for t in turns:
        if t["role"] == "agent":
            a = next(agent)
            t.update(thought=a["thought"], raw=a["raw"], violation=a["violation"], tokens=a["tokens"])
    return {
        "persona_id": s.persona.id, "group": d.group, "sample": d.sample,
        "token_ids": d.ids, "action_mask": d.action_mask, "logprobs": d.logprobs,
        "turn_ends": d.turn_ends,
        "emotions": [a["emotion"] for a in s.appraisals],
        "changes": [a["change"] for a in s.appraisals],
        "final_emotion": s.emotion, "end_reason": s.end_reason,
        "fallbacks": s.fallbacks,
        "violations": sum(a["violation"] is not None for a in d.agent_turns),
        "policy_tokens": sum(d.action_mask),
        "turns": turns,
    }


def transcript_record(r, **extra):
    """What goes to rollouts.jsonl: the record without the token-level arrays."""
    keep = {k: v for k, v in r.items() if k not in ("token_ids", "action_mask", "logprobs", "turn_ends")}
    return {**extra, **keep}


def summarize(records, stats):
    """Batch-level numbers shared by every script's log."""
    finals = np.array([r["final_emotion"] for r in records], dtype=float)
    reasons = Counter(r["end_reason"] for r in records)
    agent_turns = sum(len(r["turn_ends"]) for r in records)
    out = {
        "final_emotion_mean": float(finals.mean()),
        "success_rate": float(np.mean([r["end_reason"] == "success" for r in records])),
        "failure_rate": float(np.mean([r["end_reason"] == "left" for r in records])),
        "turns_mean": agent_turns / len(records),
        "think_violation_rate": sum(r["violations"] for r in records) / max(1, agent_turns),
        "simulator_fallbacks": sum(r["fallbacks"] for r in records),
        "policy_tokens": int(stats.get("policy_tokens", 0)),
        "policy_tokens_per_s": stats.get("policy_tokens", 0) / max(1e-9, stats.get("policy_seconds", 0)),
        "simulator_tokens_per_s": stats.get("simulator_tokens", 0) / max(1e-9, stats.get("simulator_seconds", 0)),
        "policy_seconds": stats.get("policy_seconds", 0.0),
        "simulator_seconds": stats.get("simulator_seconds", 0.0),
        # the share of prompt tokens read from a dialogue's KV cache instead of being run again
        "policy_cache_hit": stats.get("policy_reused_tokens", 0) / max(1, stats.get("policy_prompt_tokens", 0)),
        "simulator_cache_hit": stats.get("simulator_reused_tokens", 0) / max(1, stats.get("simulator_prompt_tokens", 0)),
    }
    for reason in ("success", "left", "goodbye", "max_turns", "context"):
        out[f"end_{reason}"] = reasons.get(reason, 0)
    return out


# ----------------------------------------------------------------------------------------------
# Batches and log-probabilities, shared by the trainers
# ----------------------------------------------------------------------------------------------
def pad_records(records, pad_id, device):
    """Right-pad dialogues into tensors: input_ids, attention_mask, action_mask, logprobs (B, T)."""
    width = max(len(r["token_ids"]) for r in records)

    def pad(key, value, dtype):
        return torch.tensor([r[key] + [value] * (width - len(r[key])) for r in records], dtype=dtype, device=device)

    return {
        "input_ids": pad("token_ids", pad_id, torch.long),                                  # (B, T)
        "attention_mask": torch.tensor([[1] * len(r["token_ids"]) + [0] * (width - len(r["token_ids"]))
                                        for r in records], device=device),                  # (B, T)
        "action_mask": pad("action_mask", 0, torch.float32),                                # (B, T)
        "sample_logprobs": pad("logprobs", 0.0, torch.float32),                             # (B, T)
    }


def token_logprobs(model, input_ids, attention_mask, temperature=1.0, with_entropy=False, action_mask=None):
    """log p(token t | tokens < t) under `model`, aligned with input_ids (position 0 gets 0),
    computed as log softmax(logits / temperature), the distribution the rollout sampled from.
    With action_mask (B, T), the vocabulary projection and softmax run only at the positions that
    predict an agent token in some row (the rest get 0): the losses read nothing else, and the
    (B, T, vocab) logits are the largest tensor of the update (vocab is 49k for SmolLM2, 152k for
    Qwen2.5). Returns (logprobs (B, T), entropy (B, T) or None). Gradients flow if enabled."""
    B, T = input_ids.shape
    if action_mask is None:
        keep = torch.arange(T - 1, device=input_ids.device)                                   # every position
    else:
        keep = action_mask[:, 1:].bool().any(0).nonzero()[:, 0]                                # (K,) predictors
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   logits_to_keep=keep).logits.float() / temperature                          # (B, K, V)
    logp_all = torch.log_softmax(logits, -1)                                                  # (B, K, V)
    picked = logp_all.gather(-1, input_ids[:, keep + 1, None])[..., 0]                        # (B, K)
    logp = torch.zeros(B, T, dtype=picked.dtype, device=picked.device)
    logp = logp.index_copy(1, keep + 1, picked)                                               # (B, T)
    entropy = None
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)                                            # (B, K)
        entropy = torch.zeros_like(logp).index_copy(1, keep + 1, ent)                         # (B, T)
    return logp, entropy


@torch.no_grad()
def batched_logprobs(model, batch, temperature=1.0, micro_batch_size=4, reference=False):
    """token_logprobs over a padded batch in micro-batches, without gradients. reference=True runs
    the base weights with every adapter disabled: the reference policy, no second copy."""
    import contextlib

    ctx = model.disable_adapter() if reference else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    out = []
    with ctx:
        for i in range(0, batch["input_ids"].shape[0], micro_batch_size):
            lp, _ = token_logprobs(model, batch["input_ids"][i:i + micro_batch_size],
                                   batch["attention_mask"][i:i + micro_batch_size], temperature,
                                   action_mask=batch["action_mask"][i:i + micro_batch_size])
            out.append(lp)
    model.train(was_training)
    return torch.cat(out)


def masked_mean(x, mask, dim=None):
    """Mean of x over the positions where mask is 1."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# ----------------------------------------------------------------------------------------------
# Settings, run folders and checkpoints, shared by the trainers
# ----------------------------------------------------------------------------------------------
def parse_settings(args_class, presets, argv=None):
    """Parse a settings dataclass with transformers.HfArgumentParser. A preset only changes
    defaults: any flag given explicitly on the command line wins over it."""
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else list(argv)
    # No abbreviated flags: "--max-t 5" would set max_turns without being seen as given below.
    (args,) = HfArgumentParser(args_class, allow_abbrev=False).parse_args_into_dataclasses(argv)
    if args.preset not in presets:
        sys.exit(f"error: --preset must be one of {sorted(presets)}, got '{args.preset}'")
    given = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    given |= {g[3:] for g in given if g.startswith("no_")}  # --no_thinking / --no-thinking set `thinking`
    for key, value in presets[args.preset].items():
        if key not in given:
            setattr(args, key, value)
    return args


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state():
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


SECRET_WORDS = {"key", "token", "secret", "password"}  # whole words of a setting's name


def public_config(args):
    """Settings as a dict for config.json: names of environment variables are kept, values that
    look like secrets are not (keys only ever come from the environment anyway)."""
    out = {}
    for f in fields(args):
        value = getattr(args, f.name)
        # "api_key" is hidden, "api_key_env" (the variable's name) and "max_new_tokens" are not
        if SECRET_WORDS & set(f.name.lower().split("_")) and not f.name.endswith("_env"):
            value = "<redacted>"
        out[f.name] = value
    return out


class RunFolder:
    """config.json, metrics.jsonl, rollouts.jsonl and checkpoints/ of one run. Each JSON line is
    written whole and flushed, so a killed run leaves no torn line."""

    def __init__(self, path, args, resume=False, enabled=True):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        os.makedirs(os.path.join(path, "checkpoints"), exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(public_config(args), f, indent=2)
        if not resume:
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                open(os.path.join(path, name), "w").close()

    def append(self, name, rows):
        if not self.enabled:
            return
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        with open(os.path.join(self.path, name), "a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, name, iterations):
        """On resume: drop lines of iterations after the checkpoint (written after it was saved)."""
        path = os.path.join(self.path, name)
        if not self.enabled or not os.path.exists(path):
            return
        with open(path, encoding="utf-8") as f:
            keep = [line for line in f if line.strip() and json.loads(line)["iteration"] <= iterations]
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(keep)


def save_checkpoint(run_dir, iteration, model, adapters, state):
    """checkpoints/iter_XXXXXX/: each adapter in peft's format (loadable with
    PeftModel.from_pretrained), and state.pt (optimizer, scheduler, value head, RNG, settings).
    Written to a temporary folder and renamed, so a kill leaves the last complete one intact."""
    final = os.path.join(run_dir, "checkpoints", f"iter_{iteration:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in adapters:
        model.save_pretrained(os.path.join(tmp, name), selected_adapters=[name])
        nested = os.path.join(tmp, name, name)  # peft nests non-default adapters one level down
        if os.path.isdir(nested):
            for item in os.listdir(nested):
                os.replace(os.path.join(nested, item), os.path.join(tmp, name, item))
            os.rmdir(nested)
    torch.save({"rng": rng_state(), **state, "iteration": iteration}, os.path.join(tmp, "state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def latest_checkpoint(run_dir):
    """The newest complete checkpoint folder, or None (a folder still named *.tmp is ignored)."""
    folder = os.path.join(run_dir, "checkpoints")
    done = sorted(d for d in os.listdir(folder) if d.startswith("iter_") and not d.endswith(".tmp")) \
        if os.path.isdir(folder) else []
    return os.path.join(folder, done[-1]) if done else None


def load_adapter_weights(model, folder, name):
    """Copy a saved adapter's weights into the adapter `name` of a live PeftModel."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, name, "adapter_model.safetensors"), device=str(next(model.parameters()).device))
    result = set_peft_model_state_dict(model, weights, adapter_name=name)
    if getattr(result, "unexpected_keys", None):
        raise RuntimeError(f"{folder}/{name}: adapter weights do not fit this model")


# ----------------------------------------------------------------------------------------------
# Data parallel and bookkeeping helpers, shared by the trainers
# ----------------------------------------------------------------------------------------------
def adapter_params(model, name):
    """The LoRA parameters of one adapter."""
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]


def global_sum(x, accelerator):
    """Sum of a tensor over every process (itself with one process)."""
    return accelerator.reduce(x, "sum") if accelerator.num_processes > 1 else x


def time_budget_used(t_run, minutes, accelerator):
    """--time-budget: True on every process once any of them has run `minutes` since t_run (0 = no
    budget), so all stop after the same iteration."""
    if minutes <= 0:
        return False
    late = torch.tensor(float(time.time() - t_run >= 60 * minutes), device=accelerator.device)
    return global_sum(late, accelerator).item() > 0


def global_mean(values, accelerator):
    """The mean of a logged quantity over every process (each process's own mean, averaged)."""
    local = torch.tensor(float(np.mean(values)) if values else float("nan"), device=accelerator.device)
    return (accelerator.reduce(local, "mean") if accelerator.num_processes > 1 else local).item()


def all_rng_states(accelerator):
    """Every process's RNG state, gathered (a collective call: every process must make it)."""
    from accelerate.utils import gather_object

    return gather_object([rng_state()]) if accelerator.num_processes > 1 else [rng_state()]


def fingerprint(params):
    """A hash of parameter values: equal on every process iff the replicas are bit-identical."""
    import hashlib

    h = hashlib.sha1()
    for p in params:
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def gpus_after_the_first():
    """A max_memory map for device_map='auto' that leaves GPU 0 to the policy."""
    n = torch.cuda.device_count()
    return {0: 0, **{i: int(torch.cuda.get_device_properties(i).total_memory * 0.9) for i in range(1, n)}}


def peak_memory_gb():
    """Peak GPU memory on CUDA, else the process's peak resident memory (Linux reports KiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ----------------------------------------------------------------------------------------------
# Command line: play and save a few dialogues
# ----------------------------------------------------------------------------------------------
@dataclass
class RolloutArgs:
    model: str = field(default="smollm2", metadata={"help": "policy: smollm2 (embedded), a hub id or a path"})
    adapter: str = field(default=None, metadata={"help": "a saved LoRA adapter folder to play with"})
    simulator: str = field(default="same", metadata={"help": "same | rules | model id/path | http://host:port/v1"})
    readout: str = field(default="auto", metadata={"help": "auto | reasoned | likelihood | rules"})
    personas: str = field(default="personas.json", metadata={"help": "personas.json or a SAGE profile file"})
    split: str = field(default="train", metadata={"help": "train | test | all"})
    dialogues: int = field(default=4, metadata={"help": "personas to play (0 = all of the split)"})
    samples: int = field(default=1, metadata={"help": "dialogues per persona"})
    max_turns: int = field(default=3, metadata={"help": "agent turns per dialogue"})
    start_emotion: int = field(default=30, metadata={"help": "the simulated user's starting emotion"})
    thinking: bool = field(default=True, metadata={"help": "think-then-say scaffold"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling"})
    max_new_tokens: int = field(default=96, metadata={"help": "tokens per agent turn"})
    max_context: int = field(default=2048, metadata={"help": "tokens per dialogue before it ends with 'context'"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    out: str = field(default="runs/rollout", metadata={"help": "output folder"})


def main(argv=None):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(RolloutArgs).parse_args_into_dataclasses(argv)
    set_seed(args.seed)
    personas = load_personas_or_exit(args.personas, None if args.split == "all" else args.split)
    personas = personas[:args.dialogues] if args.dialogues else personas
    policy, tokenizer = load_policy(args.model, adapter=args.adapter, trainable=False)
    backend = make_backend(args.simulator, policy=policy, tokenizer=tokenizer, device=default_device())
    simulator = Simulator(backend, readout=args.readout, start_emotion=args.start_emotion, max_turns=args.max_turns)
    t0 = time.time()
    records, stats = play_dialogues(policy, tokenizer, simulator, personas, args.samples, thinking=args.thinking,
                                    temperature=args.temperature, top_p=args.top_p,
                                    max_new_tokens=args.max_new_tokens, max_context=args.max_context)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rollouts.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(transcript_record(r), ensure_ascii=False) + "\n")
    s = summarize(records, stats)
    print(f"{len(records)} dialogues in {time.time() - t0:.0f} s -> {args.out}/rollouts.jsonl")
    print(f"mean final emotion {s['final_emotion_mean']:.1f}; end reasons "
          + ", ".join(f"{k[4:]} {v}" for k, v in s.items() if k.startswith("end_") and v))
    print(f"policy {s['policy_tokens_per_s']:.1f} tok/s, simulator {s['simulator_tokens_per_s']:.1f} tok/s, "
          f"think-format violations {s['think_violation_rate']:.0%} of turns, simulator fallbacks {s['simulator_fallbacks']}")


if __name__ == "__main__":
    main()
