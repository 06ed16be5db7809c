"""The dialogues: the agent and the simulated user in turn, token in, token out.

play_dialogues() plays a batch of dialogues in lockstep, one batched decode for every agent (one
generate(rows, ...) call of the policy's engine.Decoder, the engine in a room of its own) and
one batched simulator step, and returns one flat record per dialogue. This file holds the agent's
chat (its system prompt, the think split, the chat template's token deltas), the `same` user's
model (LocalBackend, through a Decoder of its own), the choice of the user's backend
(make_backend) and the records. ppo.py, grpo.py and evaluate.py all call it; it computes no loss
and no advantage (rl.py, the trainers) and reads no file.

Token in, token out: the ids the policy sampled are kept exactly as sampled (never decoded and
re-tokenised), with the log-prob each had when it was sampled, and each user turn is appended as
the chat template's token delta for that message. The action mask is 1 exactly on the policy's
sampled tokens.
"""
import contextlib
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from client import OpenAIBackend
from engine import Decoder
from policy import default_device, load_model, load_tokenizer, model_positions
from cli import fail
from simulator import Simulator, SimulatorError, UserState
from users import SCRIPTED_USERS


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
# The users that run here: the `same` user's model (through a Decoder of its own), and the choice
# ----------------------------------------------------------------------------------------------
@dataclass(eq=False)
class LocalBackend:
    """A local model plays the user, greedily: the policy's own PeftModel with its adapters
    disabled, the frozen base (use_base, --simulator same), or evaluate.py's --model alone
    (--agreement, --write-openings). Its conversations run through a Decoder of its own, whose
    KV cache stays between calls: each conversation takes the cache row that shares the longest
    start with it (its dialogue's last appraisal, which a re-ask extends, or its last message
    request), and runs from where they differ; the frozen weights never change what the cache
    holds. The model runs in the mode it is in, which is eval (no dropout) wherever a user speaks:
    the rollout sets it (play_dialogues), and evaluate.py's models load in it."""
    model: object
    tokenizer: object
    use_base: bool = False
    name = "local"
    counts: Counter = field(default_factory=Counter, init=False)  # generated, prompt, reused tokens

    def __post_init__(self):
        self.decoder = Decoder(self.model, eos_ids(self.tokenizer), self.tokenizer.pad_token_id)

    @torch.no_grad()
    def chat(self, conversations, max_new_tokens, repetition_penalty=1.2):
        """Greedy replies. The repetition penalty keeps a small model from looping in the user's
        messages; appraisals pass 1.0, since it would also push the number away from digits the
        prompt already holds."""
        rows = [chat_ids(self.tokenizer, c) for c in conversations]
        if not rows:
            return []
        with self.model.disable_adapter() if self.use_base else contextlib.nullcontext():
            new = self.decoder.generate(rows, max_new_tokens, greedy=True,
                                        penalty=repetition_penalty, seat=True)
        self.counts["simulator_prompt_tokens"] += self.decoder.prompt_tokens
        self.counts["simulator_reused_tokens"] += self.decoder.reused_tokens
        self.counts["simulator_tokens"] += sum(len(t) for t, _ in new)
        return [self.tokenizer.decode(t, skip_special_tokens=True).strip() for t, _ in new]


def make_backend(simulator, policy=None, tokenizer=None, args=None):
    """--simulator same (the policy's frozen base) | rules | listener | http(s)://host:port/v1
    (simulator.simulator_problem has refused anything else). `same` without
    a policy (evaluate.py --agreement and --write-openings) is the --model of args alone. args: the
    URL client's limits (rl.DialogueSettings, needed for a URL) and trust_remote_code."""
    if simulator in SCRIPTED_USERS:
        return SCRIPTED_USERS[simulator]()
    if simulator != "same":
        return OpenAIBackend(simulator, args.api_model, args.api_key_env, args.api_timeout,
                             args.api_retries)
    if policy is None:
        policy, tokenizer = load_model(args.model, default_device(),
                                       trust_remote_code=args.trust_remote_code)
    # the frozen base: a PeftModel's with its adapters off; a plain model is its own base
    return LocalBackend(policy, tokenizer, use_base=hasattr(policy, "disable_adapter"))


def reach_simulator(simulator, args):
    """A URL user answers one short request (client.OpenAIBackend.check), else one line (exit 2):
    every script calls this before any model loads and before it makes a folder, for each user it
    will ask (args: the URL client's limits, as make_backend takes them). A user that is not a URL
    (the `same` model, a scripted user) has nothing to reach."""
    if not simulator.startswith(("http://", "https://")):
        return
    try:
        make_backend(simulator, args=args).check()
    except SimulatorError as e:
        fail(f"--simulator: {e}; no model loaded, nothing written")


def build_simulator(args, policy, tokenizer, goodbye="closing"):
    """The simulated user of a script's settings (rl.DialogueSettings; goodbye: see Simulator)."""
    backend = make_backend(args.simulator, policy, tokenizer, args)
    return Simulator(backend, args.start_emotion, args.max_change, args.max_turns,
                     reply_tokens=args.user_reply_tokens, goodbye=goodbye)


# ----------------------------------------------------------------------------------------------
# Dialogues
# ----------------------------------------------------------------------------------------------
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

    def add(self, tokens, sample_logprobs=None):
        """Append tokens: the policy's sampled ones with their log-probs (action tokens), else
        others."""
        self.ids += tokens
        self.action_mask += [int(sample_logprobs is not None)] * len(tokens)
        self.sample_logprobs += sample_logprobs or [0.0] * len(tokens)



@torch.no_grad()
def play_dialogues(policy, simulator, personas, samples_per_persona=1, *, chat, decoder=None,
                   temperature=1.0, max_new_tokens=256, max_context=4096, greedy=False,
                   progress=True, desc="dialogues"):
    """Play len(personas) x samples_per_persona dialogues in lockstep: one batched decode for every
    agent (decoder, the policy's Decoder, a new one if None: each dialogue one of its rows, kept
    between turns, so a turn runs only the tokens added since the last one), then one batched
    simulator step; a finished dialogue sits the next turns out. The policy samples from
    log softmax(logits / temperature), the full softmax (no top-k, no top-p: the trainers' log-probs
    are of that distribution), greedy: its argmax, and each sampled token's log-prob is kept.
    chat: the agent's ChatTokens. Every persona's first prompt must leave room for a whole reply
    within max_context (check_openings_fit, which every script runs at set-up). Returns (records,
    stats): one flat dict per dialogue, and counts and timings."""
    tokenizer = chat.tokenizer
    decoder = decoder or Decoder(policy, chat.eos_ids, tokenizer.pad_token_id, max_context + 1)
    # each persona's samples one after another: GRPO's groups are consecutive --group-size dialogues
    dialogues = [Dialogue(persona, s, simulator.start(persona)) for persona in personas
                 for s in range(samples_per_persona)]
    for d in dialogues:  # each leaves room for a whole reply (check_openings_fit)
        d.add(chat.prompt(d.persona.opening))
    policy.eval()  # no dropout while sampling (the trainers switch to train mode for the update)
    # the simulator's counts at the end, less those at the start
    stats = Counter()
    stats.subtract(simulator.counts)
    # the work done, in agent turns (a dialogue that has ended counts all of its turns), so that the
    # bar's time estimate is the rest of the turns at the pace of those played
    bar = tqdm(total=len(dialogues) * simulator.max_turns, desc=desc, unit="turn",
               disable=not progress, leave=False)
    fresh = True  # the cache's keys and values are of weights an update may have changed
    while active := [d for d in dialogues if not d.state.end_reason]:
        t0 = time.time()
        rows = [d.ids if not d.state.end_reason else None for d in dialogues]
        new = decoder.generate(rows, max_new_tokens, temperature, greedy, fresh=fresh)
        fresh = False
        stats["policy_prompt_tokens"] += decoder.prompt_tokens
        stats["policy_reused_tokens"] += decoder.reused_tokens
        stats["policy_seconds"] += time.time() - t0
        replies = []
        for d in active:
            tokens, logprobs = new[dialogues.index(d)]  # the turn ends with its EOS, kept
            d.add(tokens, logprobs)
            d.turn_ends.append(len(d.ids) - 1)
            raw = tokenizer.decode(tokens, skip_special_tokens=True)
            thought, reply, violation = split_thought(raw, chat.thinking)
            stats[violation or "format_ok"] += 1
            stats["policy_tokens"] += len(tokens)
            # cut: no end-of-turn token, so the reply reached max_new_tokens unfinished (a thought
            # cut there reaches the user as "...")
            d.agent_turns.append({"thought": thought, "raw": raw, "violation": violation,
                                  "tokens": len(tokens), "cut": tokens[-1] not in chat.eos_ids})
            replies.append(reply or SILENCE)
        simulator.step([d.state for d in active], replies)
        for d in active:
            if not d.state.end_reason:
                delta = chat.user_turn(d.state.history[-1]["text"], d.ids[-1])
                if len(d.ids) + len(delta) + max_new_tokens > max_context:
                    # No room for the user's message and a full reply: end here, so that no stored
                    # sequence is longer than max_context and every one ends on an agent token.
                    d.state.end_reason = "context"
                else:
                    d.add(delta)
        played = [simulator.max_turns if d.state.end_reason else d.state.turns for d in dialogues]
        bar.update(sum(played) - bar.n)
    bar.close()
    stats.update(simulator.counts)
    return [to_record(d, simulator.start_emotion) for d in dialogues], dict(stats)


def to_record(d, start_emotion):
    """The flat per-dialogue record the trainers and evaluate.py consume: the tokens, the persona's
    difficulty (which weighs the rules user's parts), and per agent turn its last token
    (turn_ends), the emotion after it and its change (None where the appraisal could not be read:
    such a dialogue ends there, end_reason "unread"); in turns, each agent turn with its appraisal
    (and the rules user's parts) and each user message marked canned or not."""
    s = d.state
    # the dialogue turn by turn; an agent turn with its sampling (agent_turns) and its appraisal
    agent = ({**a, **sampled} for a, sampled in zip(s.appraisals, d.agent_turns))
    turns = [dict(m) for m in s.history]  # copies, {role, text}
    for turn in turns:
        if turn["role"] == "agent":
            turn.update(next(agent))
    return {
        "persona_id": s.persona.id, "difficulty": s.persona.difficulty, "sample": d.sample,
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


def unmoved_record(persona, start_emotion, max_turns):
    """The record of a dialogue with persona in which the agent says nothing for max_turns turns
    and the emotion never moves, made by to_record as a rollout's are (every field there): for what
    must be known before any rollout (the critic's start, rl.unmoved_return)."""
    state = UserState(persona, start_emotion, [{"role": "user", "text": persona.opening}])
    d = Dialogue(persona, 0, state)
    for _ in range(max_turns):
        state.history.append({"role": "agent", "text": SILENCE})
        state.appraisals.append({"change": 0, "emotion": start_emotion, "appraisal": ""})
        d.agent_turns.append({"thought": "", "raw": "", "violation": None, "tokens": 0,
                              "cut": False})
        d.turn_ends.append(0)
    state.turns, state.end_reason = max_turns, "max_turns"
    return to_record(d, start_emotion)


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


def check_openings_fit(personas, model, thinking, max_new_tokens, max_context,
                       trust_remote_code=False):
    """max_context must be within the model's positions (its config's, model_positions: the KV
    cache and every sequence are max_context long), and every persona's first prompt (system
    prompt and opening) with room for a whole reply of max_new_tokens must fit it, or its dialogue
    would end before the agent speaks (and its metrics would be NaN). Needs only the model's config
    and tokenizer, so it runs before the weights load. Bad input: one line, exit 2."""
    stated = model_positions(model, trust_remote_code)
    if stated and max_context > stated[1]:
        fail(f"--max-context {max_context}: more than the {stated[1]} positions of --model {model} "
             f"(its config's {stated[0]}); give at most {stated[1]}")
    chat = ChatTokens(load_tokenizer(model, trust_remote_code), thinking)
    for p in personas:
        n = len(chat.prompt(p.opening))
        if n + max_new_tokens > max_context:
            fail(f"persona {p.id}: its opening makes a first prompt of {n} tokens, which with "
                 f"--max-new-tokens {max_new_tokens} does not fit --max-context {max_context}")
