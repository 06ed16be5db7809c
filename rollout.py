"""The dialogues: the agent and the simulated user in turn, token in, token out.

play_dialogues() plays a batch of dialogues in lockstep, one batched generate for every agent and
one batched simulator step, and returns one flat record per dialogue. This file holds the agent's
chat (its system prompt, the think split, the chat template's token deltas), generation with each
dialogue's KV cache kept between turns (generate_turn, for the policy and for the `same` user,
LocalBackend), the user's backends (make_backend) and the records. ppo.py, grpo.py and evaluate.py
all call it; it computes no loss and no advantage (rl.py, the trainers) and reads no file.

Token in, token out: the ids the policy sampled are kept exactly as sampled (never decoded and
re-tokenised), with the log-prob each had when it was sampled, and each user turn is appended as
the chat template's token delta for that message. The action mask is 1 exactly on the policy's
sampled tokens.
"""
import contextlib
import inspect
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field, fields

import torch
from tqdm import tqdm

from client import OpenAIBackend
from policy import (default_device, load_model, load_tokenizer, mergeable_layers, merged,
                    merged_weights)
from run import above, at_least, fail, setting
from simulator import RulesBackend, Simulator


# ----------------------------------------------------------------------------------------------
# The agent's system prompts and the think-then-say split (written for this project)
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
      unclosed       <think> without </think>: what follows the first tag is thought, the
                     reply is empty
      stray_tags     any other tag than one <think> at the start and one </think>; all text before
                     the last </think> is thought, and a <think> after it starts thought again
      empty_thought  the tags hold nothing
      empty_reply    nothing visible is left; the user sees SILENCE
    Every case is counted in the rollout statistics; --format-penalty in the trainers can punish
    it."""
    text = text.strip()
    if not text:
        return "", "", "empty_reply"
    if not thinking:  # tags are just text: the whole text is the reply
        return "", text, None
    tags = THINK_TAG.findall(text)
    parts = THINK_TAG.split(text)  # the text around the tags: parts[k] lies before tags[k]
    closes = [k for k, tag in enumerate(tags) if tag.startswith("</")]
    if not tags:
        return "", text, "no_think"
    if not closes:
        return " ".join(p.strip() for p in parts[1:] if p.strip()), "", "unclosed"
    last = closes[-1]
    # the reply: what follows the last </think>, up to a thought opened after it (never shown)
    reply = parts[last + 1].strip()
    thought = " ".join(p.strip() for p in parts[:last + 1] + parts[last + 2:] if p.strip())
    # well placed: one </think>, the last tag, after at most one <think>, which opens the text
    opened_at_start = len(tags) == 2 and not parts[0]
    well_placed = closes == [len(tags) - 1] and (len(tags) == 1 or opened_at_start)
    if not reply:
        return thought, "", "empty_reply"
    if not well_placed:
        return thought, reply, "stray_tags"
    return thought, reply, None if thought else "empty_thought"


# ----------------------------------------------------------------------------------------------
# Chat-template token deltas
# ----------------------------------------------------------------------------------------------
class ChatTokens:
    """The agent's chat: its tokenizer, its system prompt (thinking: the think-then-say scaffold's,
    else the plain one) and its template as token pieces that can be appended to a growing
    dialogue. The template is rendered once with marker strings; what lies between the markers is
    what the template adds after an agent turn and around a user message. Built once a run."""
    AGENT, USER = "@@AGENT_TURN@@", "@@USER_TURN@@"

    def __init__(self, tokenizer, thinking=True):
        self.tokenizer, self.thinking = tokenizer, thinking
        self.system_prompt = THINK_PROMPT if thinking else PLAIN_PROMPT
        base = [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": "hello"}, {"role": "assistant", "content": self.AGENT}]
        before = tokenizer.apply_chat_template(base, tokenize=False)
        after = tokenizer.apply_chat_template(base + [{"role": "user", "content": self.USER}],
                                              tokenize=False, add_generation_prompt=True)
        if not after.startswith(before) or self.USER not in after:
            raise ValueError("this chat template rewrites earlier turns when a turn is added, so "
                             "dialogues cannot grow token by token; use a ChatML-style template")
        # e.g. "<|im_end|>\n", then "<|im_start|>user\n" and "<|im_end|>\n<|im_start|>assistant\n"
        self.after_agent = before[before.index(self.AGENT) + len(self.AGENT):]
        self.user_prefix, self.user_suffix = after[len(before):].split(self.USER)
        self.eos_ids = eos_ids(tokenizer)

    def encode(self, text, plain=False):
        """Token ids of text; plain: as characters only, special-token strings included (a user's
        message is text from outside: it never puts a control token into the policy's context)."""
        return self.tokenizer(text, add_special_tokens=False, split_special_tokens=plain).input_ids

    def prompt(self, opening):
        """The first prompt: system message, the user's opening (plain text), the generation
        prompt."""
        return chat_ids(self.tokenizer, [{"role": "system", "content": self.system_prompt},
                                         {"role": "user", "content": opening}])

    def user_turn(self, text, agent_ended_with):
        """Tokens to append after an agent turn: the rest of the template's agent-turn ending
        (its end-of-turn token was sampled, so it is not repeated), then the user message (plain
        text) and the next generation prompt."""
        tail = self.after_agent
        if agent_ended_with in self.eos_ids:
            tail = tail.removeprefix(self.tokenizer.decode([agent_ended_with]))
        opening = self.encode(tail + self.user_prefix)
        return opening + self.encode(text, plain=True) + self.encode(self.user_suffix)


def eos_ids(tokenizer):
    """Token ids that end an agent turn: the tokenizer's EOS and the usual chat end-of-turn
    tokens."""
    turn_ends = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|eot_id|>", "<|endoftext|>"])
    # a token the vocabulary lacks comes back as unk (or None); the EOS itself may be unk (GPT-2)
    known = {t for t in turn_ends if t != tokenizer.unk_token_id}
    return sorted({tokenizer.eos_token_id, *known} - {None})


def chat_ids(tokenizer, messages):
    """The token ids of a chat in the tokenizer's template, with the generation prompt, where the
    template's own special tokens are the only control tokens: each message is tokenized as plain
    text (split_special_tokens), so that an "<|im_end|>" written inside it, by a persona file, a
    server or a model, stays those characters and never ends a turn."""
    contents = {f"@@{k}@@": m["content"] for k, m in enumerate(messages)}  # a mark: its message
    marked = [{**m, "content": mark} for m, mark in zip(messages, contents)]
    text = tokenizer.apply_chat_template(marked, tokenize=False, add_generation_prompt=True)
    ids = []
    for piece in re.split(r"(@@\d+@@)", text):
        # a message's text as plain text, the template's own with its special tokens
        ids += tokenizer(contents.get(piece, piece), add_special_tokens=False,
                         split_special_tokens=piece in contents).input_ids
    return ids


# ----------------------------------------------------------------------------------------------
# Generation: turn caches, and the `same` user, which runs on the policy's weights
# ----------------------------------------------------------------------------------------------
# Turn caches. A dialogue's prompt grows by a few dozen tokens a turn, yet a plain generate() runs
# the whole prompt again every turn: by turn 10 that prefill costs more than the reply. Each
# dialogue (and each model role in it: the policy, the `same` user) owns a `slot`, a dict holding
# the token ids whose keys/values it has and those keys/values. The next call reuses the longest
# common prefix of the stored ids and the new prompt, so it does not matter where prompts stop
# sharing: reuse is exact up to the first differing token and nothing after it is kept.
def cached_batch(rows, slots, pad_id, device):
    """Lay out a batch of prompts so that every row's reusable prefix lies in the first P columns
    (left-padded) and its new tokens in the last S (left-padded too): [pad, prefix, pad, new].
    Returns (input_ids, attention_mask, cache): a DynamicCache holding P positions for every row
    (zeros where a row has padding), ready for generate() or a forward pass on input_ids[:, P:].
    Position ids follow from the attention mask, so the holes do not shift any token."""
    from transformers import DynamicCache

    # each row's reusable prefix: what it shares with its slot's ids (commonprefix compares lists
    # element by element), all but its last token, which generate() must run to sample the next
    reuse = [min(len(os.path.commonprefix([slot.get("ids", []), row])), len(row) - 1)
             for row, slot in zip(rows, slots)]
    P, S = max(reuse), max(len(row) - n for row, n in zip(rows, reuse))
    ids, mask = [], []
    for row, n in zip(rows, reuse):
        new = row[n:]
        ids.append([pad_id] * (P - n) + row[:n] + [pad_id] * (S - len(new)) + new)
        mask.append([0] * (P - n) + [1] * n + [0] * (S - len(new)) + [1] * len(new))
    # Each row's layers move out of its slot into the batch's cache, which keep_cache hands back.
    # The slot is emptied here: what it held is in the batch now, or was not reusable.
    kept = [slot.pop("kv", []) for slot in slots]
    for slot in slots:
        slot.clear()

    # Each layer's keys and values (B, heads, P, head size), a row's prefix at the end, zeros
    # before, go into the cache (which copies them) one layer at a time, and each row's own copy of
    # the layer is dropped once it is in: the dialogues' caches and the batch's are never alive
    # whole at the same time, so a turn holds its KV cache once.
    cache = DynamicCache()
    longest = kept[reuse.index(P)] if P else []  # shaped as the slot with the longest prefix's
    for i in range(len(longest)):
        layer = [t.new_zeros(len(rows), t.shape[1], P, t.shape[3]) for t in longest[i]]
        for b, n in enumerate(reuse):
            if n:  # nothing to copy where a new dialogue's slot was empty
                for part, t in zip(layer, kept[b][i]):
                    part[b, :, P - n:] = t[0, :, :n]
            if kept[b]:
                kept[b][i] = None
        cache.update(*layer, i)
    return torch.tensor(ids, device=device), torch.tensor(mask, device=device), cache


def cache_keyword(model):
    """The keyword the installed transformers takes a KV cache by in forward() and generate():
    `cache` where the model's forward names it (newer releases, 5.24 among them, where the old
    `past_key_values` still works but warns, and goes in 5.40), else `past_key_values` (5.17 and
    earlier). A PeftModel is asked about its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def keep_cache(slots, cache, ids, mask):
    """After running ids (B, W) with attention mask (B, W) into `cache`, store in each row's slot
    the row's real tokens that have keys/values in the cache (the last sampled token of a
    generate() call has none yet) and those keys/values, without the padding. The cache is emptied
    a layer at a time as its rows are copied out, so the turn's cache and the dialogues' copies are
    never alive whole at the same time."""
    length = cache.get_seq_length()
    positions = [mask[b, :length].nonzero()[:, 0] for b in range(len(slots))]
    for slot, row, pos in zip(slots, ids, positions):
        slot["ids"] = row[pos].tolist()
        slot["kv"] = []
    while cache.layers:
        layer = cache.layers.pop(0)
        for b, (slot, pos) in enumerate(zip(slots, positions)):
            slot["kv"].append((layer.keys[b:b + 1, :, pos], layer.values[b:b + 1, :, pos]))


PREFILL_CHUNK = 1024  # prompt tokens a forward pass takes into the KV cache (generate_turn)


def generate_turn(model, rows, slots, pad_id, keep, **generation):
    """model.generate(**generation) after each row's prompt (a list of token ids), in one batch, for
    the policy and the `same` user alike. Each row's slot may hold the KV cache of an earlier prompt
    of its dialogue, reused up to where the two differ (cached_batch); with keep, each slot then
    holds its row's prompt and new tokens. The prompts run into the cache PREFILL_CHUNK tokens a
    pass, so each pass's attention mask is (batch, chunk, context), linear in the context (a single
    pass over an appraisal of SAGE's 15,000 tokens would build masks of 0.9 GB a row). Returns the
    new tokens (B, N) and (prompt tokens, those read from a cache)."""
    ids, mask, cache = cached_batch(rows, slots, pad_id, model.device)
    reused = cache.get_seq_length()  # the columns read from the cache
    position = mask.cumsum(1) - 1                                                        # (B, W)
    cached = {cache_keyword(model): cache}
    prefill_end = ids.shape[1] - 1  # generate() runs the last token itself, to sample the next
    for start in range(reused, prefill_end, PREFILL_CHUNK):
        end = min(start + PREFILL_CHUNK, prefill_end)
        model(input_ids=ids[:, start:end], attention_mask=mask[:, :end],
              position_ids=position[:, start:end], **cached, use_cache=True, logits_to_keep=1)
    # (B, W + N): the prompts and the new tokens
    sequences = model.generate(input_ids=ids, attention_mask=mask, **cached, **generation)
    new = sequences[:, ids.shape[1]:]                                                    # (B, N)
    if keep:
        keep_cache(slots, cache, sequences, torch.cat([mask, (new != pad_id).long()], 1))
    return new, (int(mask.sum()), int(mask[:, :reused].sum()))


@dataclass(eq=False)
class LocalBackend:
    """A local model plays the user, greedily: the policy's own PeftModel with its adapters
    disabled, the frozen base (use_base, --simulator same), or evaluate.py's --model alone
    (--agreement, --write-openings). With reuse_cache each dialogue's KV cache stays in its state's
    slot between calls: the appraisal, its re-ask and the reply share it, and so do the turns.
    The model runs in the mode it is in, which is eval (no dropout) wherever a user speaks: the
    rollout sets it (play_dialogues), and evaluate.py's models load in it."""
    model: object
    tokenizer: object
    use_base: bool = False
    reuse_cache: bool = True
    name = "local"
    micro_batch_size = 16  # conversations a generate() call takes
    counts: Counter = field(default_factory=Counter, init=False)  # generated, prompt, reused tokens

    @torch.no_grad()
    def chat(self, conversations, max_new_tokens, slots=None, repetition_penalty=1.2):
        """Greedy replies. The repetition penalty keeps a small model from looping in the user's
        messages; appraisals pass 1.0, since it would also push the number away from digits the
        prompt already holds."""
        rows = [chat_ids(self.tokenizer, c) for c in conversations]
        slots = slots or [{} for _ in rows]
        pad = self.tokenizer.pad_token_id
        out = []
        n = self.micro_batch_size
        with self.model.disable_adapter() if self.use_base else contextlib.nullcontext():
            for i in range(0, len(rows), n):
                new, (prompt, reused) = generate_turn(
                    self.model, rows[i:i + n], slots[i:i + n], pad, self.reuse_cache,
                    do_sample=False, max_new_tokens=max_new_tokens,
                    repetition_penalty=repetition_penalty, pad_token_id=pad)
                self.counts["simulator_prompt_tokens"] += prompt
                self.counts["simulator_reused_tokens"] += reused
                self.counts["simulator_tokens"] += int((new != pad).sum())
                out += [reply.strip()
                        for reply in self.tokenizer.batch_decode(new, skip_special_tokens=True)]
        return out


def make_backend(simulator, policy=None, tokenizer=None, reuse_cache=True, args=None):
    """--simulator same (the policy's frozen base) | rules | http(s)://host:port/v1. `same` without
    a policy (evaluate.py --agreement and --write-openings) is the --model of args alone. args: the
    URL client's limits (SimulatorSettings, needed for a URL) and trust_remote_code."""
    if simulator == "rules":
        return RulesBackend()
    if simulator != "same":
        return OpenAIBackend(simulator, args.api_model, args.api_key_env, args.api_timeout,
                             args.api_retries)
    if policy is None:
        policy, tokenizer = load_model(args.model, default_device(),
                                       trust_remote_code=args.trust_remote_code)
    # the frozen base: a PeftModel's with its adapters off; a plain model is its own base
    return LocalBackend(policy, tokenizer, use_base=hasattr(policy, "disable_adapter"),
                        reuse_cache=reuse_cache)


def build_simulator(args, policy, tokenizer, goodbye="closing", reuse_cache=True):
    """The simulated user of a script's SimulatorSettings (goodbye: see Simulator)."""
    backend = make_backend(args.simulator, policy, tokenizer, reuse_cache, args)
    return Simulator(backend, args.start_emotion, args.max_change, args.max_turns,
                     reply_tokens=args.user_reply_tokens, goodbye=goodbye)


def make_simulator(args, policy, tokenizer, run):
    """A trainer's simulated user (build_simulator); the main process says how the policy samples
    and which read-out the user gives."""
    simulator = build_simulator(args, policy, tokenizer)
    if run.is_main:
        print(f"policy {args.model} on {run.device} x {run.world} process(es), merged sampling "
              f"{bool(mergeable_layers(policy))}; simulator {args.simulator}, read-out "
              f"{simulator.readout}")
    return simulator


# ----------------------------------------------------------------------------------------------
# Dialogues
# ----------------------------------------------------------------------------------------------
@dataclass
class SampledLogprobs:
    """A logits processor that records log softmax(logits / temperature) of each token generate()
    samples, without keeping every step's logits: output_logits=True holds (B, N, vocabulary) fp32
    logits (about 9.3 GiB at 32 dialogues x 512 tokens x Qwen2.5's 152k vocabulary), this holds one
    step's (B, vocabulary). It runs one step behind: at step t the last column of input_ids is the
    token sampled at t - 1, so that is when its log-prob is read; finish() reads the last one.
    transformers runs processors passed to generate() before its own temperature and top-p warpers,
    so `scores` are the raw logits; the test against a fresh forward pass (temperature 0.7) holds
    it."""
    temperature: float
    last: torch.Tensor = None                          # the latest step's log-probs (B, V)
    picked: list = field(default_factory=list)         # the sampled tokens' log-probs, (B,) a step

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.picked.append(self.last.gather(-1, input_ids[:, -1:])[:, 0])           # (B,)
        self.last = torch.log_softmax(scores.float() / self.temperature, -1)            # (B, V)
        return scores

    def finish(self, sequences):
        """(B, N): the log-probs of the N tokens generate() appended to the prompt (a recorder
        serves one generate call)."""
        return torch.stack(self.picked + [self.last.gather(-1, sequences[:, -1:])[:, 0]], 1)


@dataclass
class Dialogue:
    """One agent-user dialogue as it grows. ids/action_mask/sample_logprobs stay aligned token by
    token."""
    persona: object
    sample: int                     # which sample of the persona (GRPO: its group of --group-size)
    state: object                   # simulator.UserState, paired with this dialogue for its life
    ids: list = field(default_factory=list)
    action_mask: list = field(default_factory=list)  # 1 on sampled policy tokens, else 0
    sample_logprobs: list = field(default_factory=list)  # an action token's when sampled, else 0
    turn_ends: list = field(default_factory=list)    # index of the last token of each agent turn
    agent_turns: list = field(default_factory=list)  # {raw, thought, reply, violation, tokens, cut}
    cache: dict = field(default_factory=dict, repr=False)  # the policy's KV cache between turns

    def add(self, tokens, sample_logprobs=None):
        """Append tokens: the policy's sampled ones with their log-probs (action tokens), else
        others."""
        self.ids += tokens
        self.action_mask += [int(sample_logprobs is not None)] * len(tokens)
        self.sample_logprobs += sample_logprobs or [0.0] * len(tokens)


@dataclass
class SamplingSettings:
    """How the agent's turns are sampled (play_dialogues)."""
    title = "sampling"
    thinking: bool = setting(True, "think-then-say scaffold (the paper's best run)")
    temperature: float = setting(
        1.0, "sampling temperature; the trainer's log-probs use the same", above(0))
    max_new_tokens: int = setting(512, "tokens per agent turn", at_least(1))
    max_context: int = setting(
        6144, "tokens per dialogue; past it the dialogue ends with 'context'", at_least(2))

    @staticmethod
    def check(args):
        if args.max_context <= args.max_new_tokens:
            fail(f"--max-context {args.max_context}: must be more than --max-new-tokens "
                 f"{args.max_new_tokens} (a prompt and a whole reply must fit)")


@torch.no_grad()
def play_dialogues(policy, simulator, personas, samples_per_persona=1, *, chat, temperature=1.0,
                   max_new_tokens=256, max_context=4096, greedy=False, reuse_cache=True, merge=(),
                   progress=True, desc="dialogues"):
    """Play len(personas) x samples_per_persona dialogues in lockstep: one batched generate for all
    active agents, then one batched simulator step; finished dialogues leave the batch.
    With reuse_cache each dialogue keeps its KV cache between turns, so a turn runs only the tokens
    added since the last one (generate_turn); without it every turn runs the whole prompt.
    merge: the layers of mergeable_layers(policy), where the agent samples from its adapter merged
    into a copy of their weights (merged_weights); none: through the adapter.
    chat: the agent's ChatTokens. Every persona's first prompt must leave room for a whole reply
    within max_context (check_openings_fit, which every script runs at set-up). Returns (records,
    stats): one flat dict per dialogue, and counts and timings."""
    from transformers import GenerationConfig

    tokenizer = chat.tokenizer
    # An explicit config, so that a model's own defaults (top_k=20, repetition_penalty=1.05 in
    # Qwen2.5's generation_config) cannot change the sampling distribution. top_k must be 0, not
    # None: transformers reads None as "unset" and fills in the model's top_k, or 50; top_p 1
    # (RLVER's) for the same reason. The stored log-probs are log softmax(logits / temperature), the
    # distribution sampled from, and the trainers compute theirs with the same temperature: a top-p
    # cut would make the sampled distribution another one than the trainers' log-probs, so there is
    # no --top-p.
    sampling = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
    if greedy:  # the most likely token (at any temperature), its log-prob at the temperature
        sampling = dict(do_sample=False)
    gen_config = GenerationConfig(**sampling, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                                  eos_token_id=chat.eos_ids, pad_token_id=tokenizer.pad_token_id)
    # each persona's samples one after another: GRPO's groups are consecutive --group-size dialogues
    dialogues = [Dialogue(persona, s, simulator.start(persona)) for persona in personas
                 for s in range(samples_per_persona)]
    for d in dialogues:  # each leaves room for a whole reply (check_openings_fit)
        d.add(chat.prompt(d.persona.opening))
    policy.eval()  # no dropout while sampling (the trainers switch to train mode for the update)
    swaps = []
    if merge:
        swaps = merged_weights(policy, merge)
    # the simulator's counts at the end, less those at the start
    stats = Counter()
    stats.subtract(simulator.counts)
    bar = tqdm(total=len(dialogues), desc=desc, disable=not progress, leave=False)  # finished ones
    while active := [d for d in dialogues if not d.state.end_reason]:
        t0 = time.time()
        recorder = SampledLogprobs(temperature)
        # the caches are kept only if a dialogue can go on: on its last allowed turn every one ends
        keep = reuse_cache and not all(d.state.turns + 1 >= simulator.max_turns for d in active)
        # the user's turns below run on the base's own weights
        with merged(policy, swaps) if swaps else contextlib.nullcontext():
            new, (prompt, reused) = generate_turn(policy, [d.ids for d in active],
                                                  [d.cache for d in active], tokenizer.pad_token_id,
                                                  keep, generation_config=gen_config,
                                                  logits_processor=[recorder])           # (B, N)
        new_logp = recorder.finish(new).cpu()                                           # (B, N)
        stats["policy_prompt_tokens"] += prompt
        stats["policy_reused_tokens"] += reused
        stats["policy_seconds"] += time.time() - t0
        replies = []
        for d, row, logp in zip(active, new.tolist(), new_logp):
            # the turn ends with its EOS, kept
            n = next((i + 1 for i, t in enumerate(row) if t in chat.eos_ids), len(row))
            tokens = row[:n]
            d.add(tokens, logp[:n].tolist())
            d.turn_ends.append(len(d.ids) - 1)
            raw = tokenizer.decode(tokens, skip_special_tokens=True)
            thought, reply, violation = split_thought(raw, chat.thinking)
            stats[violation or "format_ok"] += 1
            stats["policy_tokens"] += n
            # cut: no end-of-turn token, so the reply reached max_new_tokens unfinished (a thought
            # cut there reaches the user as "...")
            d.agent_turns.append({"thought": thought, "raw": raw, "violation": violation,
                                  "tokens": n, "cut": tokens[-1] not in chat.eos_ids})
            replies.append(reply or SILENCE)
        simulator.step([d.state for d in active], replies)
        for d in active:
            if not d.state.end_reason:
                delta = chat.user_turn(d.state.history[-1]["text"], d.ids[-1])
                if len(d.ids) + len(delta) + max_new_tokens > max_context:
                    # No room for the user's message and a full reply: end here, so that no stored
                    # sequence is longer than max_context and every one ends on an agent token.
                    simulator.end(d.state, "context")
                else:
                    d.add(delta)
            if d.state.end_reason:
                bar.update(1)
                d.cache.clear()  # free a finished dialogue's KV cache (the user frees its own)
    bar.close()
    stats.update(simulator.counts)
    return [to_record(d, simulator.start_emotion) for d in dialogues], dict(stats)


def to_record(d, start_emotion):
    """The flat per-dialogue record the trainers and evaluate.py consume: the tokens, and per agent
    turn its last token (turn_ends), the emotion after it and its change (None where the appraisal
    could not be read: such a dialogue ends there, end_reason "unread")."""
    s = d.state
    # the dialogue turn by turn; an agent turn with its sampling (agent_turns) and its appraisal
    agent = ({**a, **sampled} for a, sampled in zip(s.appraisals, d.agent_turns))
    turns = [dict(m) for m in s.history]  # copies, {role, text}
    for turn in turns:
        if turn["role"] == "agent":
            turn.update(next(agent))
    return {
        "persona_id": s.persona.id, "sample": d.sample,
        "token_ids": d.ids, "action_mask": d.action_mask, "sample_logprobs": d.sample_logprobs,
        "turn_ends": d.turn_ends,
        "start_emotion": start_emotion, "emotions": [a["emotion"] for a in s.appraisals],
        "changes": [a["change"] for a in s.appraisals],
        "final_emotion": s.emotion, "end_reason": s.end_reason,
        "violations": sum(a["violation"] is not None for a in d.agent_turns),
        "cut_replies": sum(a["cut"] for a in d.agent_turns),
        "policy_tokens": sum(d.action_mask),
        "turns": turns,
    }


# what rollouts.jsonl leaves out
TOKEN_ARRAYS = ("token_ids", "action_mask", "sample_logprobs", "turn_ends")


def summarize(records, per_process):
    """Batch-level numbers of every script's log, from the dialogues' records and each process's
    rollout counts and timings, which it holds too: counts add up; the *_seconds, spent at the same
    time, are the longest one's, so count / seconds is the whole job's rate (policy_tokens /
    policy_seconds; policy_reused_tokens / policy_prompt_tokens is the share of prompt tokens read
    from a dialogue's KV cache instead of being run again)."""
    # a count not reported is 0
    stats, reasons = Counter(), Counter(r["end_reason"] for r in records)
    for mine in per_process:
        for key, value in mine.items():
            if key.endswith("_seconds"):
                stats[key] = max(stats[key], value)
            else:
                stats[key] += value
    # every dialogue has an agent turn: its first prompt leaves room for one (check_openings_fit)
    agent_turns = sum(len(r["turn_ends"]) for r in records)
    # the emotions of unread dialogues enter no statistic
    emotions = [r["final_emotion"] for r in records if r["end_reason"] != "unread"]
    return {"final_emotion_mean": sum(emotions) / len(emotions) if emotions else None,
            "turns_mean": agent_turns / len(records),
            "think_violation_rate": sum(r["violations"] for r in records) / agent_turns,
            "cut_reply_rate": sum(r["cut_replies"] for r in records) / agent_turns,
            "unread_dialogues": reasons["unread"], **stats,
            **{f"end_{reason}": reasons[reason]
               for reason in ("success", "left", "goodbye", "max_turns", "context")}}


def check_openings_fit(args, personas):
    """Every persona's first prompt (system prompt and opening) with room for a whole reply must fit
    --max-context, or its dialogue would end before the agent speaks (and its metrics would be NaN).
    Needs only the tokenizer, so it runs before the weights load. Bad input: one line, exit 2."""
    chat = ChatTokens(load_tokenizer(args.model, args.trust_remote_code), args.thinking)
    for p in personas:
        n = len(chat.prompt(p.opening))
        if n + args.max_new_tokens > args.max_context:
            fail(f"persona {p.id}: its opening makes a first prompt of {n} tokens, which with "
                 f"--max-new-tokens {args.max_new_tokens} does not fit --max-context "
                 f"{args.max_context}")


def sampling_settings(args, policy, tokenizer):
    """play_dialogues' keyword arguments from a script's SamplingSettings (and a trainer's
    --greedy): the agent's chat, its system prompt as --thinking says, and how it samples: merged
    where the policy allows it (mergeable_layers: float32 weights only)."""
    sampling = {f.name: getattr(args, f.name) for f in fields(SamplingSettings)}
    sampling["chat"] = ChatTokens(tokenizer, sampling.pop("thinking"))
    sampling["merge"] = mergeable_layers(policy)
    sampling["greedy"] = getattr(args, "greedy", False)
    return sampling
