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
import contextlib
import json
import os
import random
import re
import shutil
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field, fields

import numpy as np
import torch
from tqdm import tqdm

from simulator import (DIFFICULTIES, READOUTS, REDACTED, Simulator, SimulatorError, above, at_least,
                       cache_keyword, cached_batch, check_rules, env_name, fail, four_bit_problem, keep_cache,
                       load_model, load_personas_or_exit, make_backend, model_problem, one_line_errors,
                       one_of, prompt_counts, random_streams_kept, readout_problem, redact, resolve_model,
                       simulator_kind, simulator_problem, transcript_turns, unknown_arguments, within)

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
                gradient_checkpointing=False, trust_remote_code=False, trainable=True, dtype="auto"):
    """A PeftModel with one adapter named 'default' (fresh, or loaded from `adapter`).
    LoRA dropout defaults to 0 so that the importance ratio is exactly 1 before the first update.
    With load_in_4bit the linear layers are NF4 and everything else stays in the compute dtype
    (bf16). peft's prepare_model_for_kbit_training is not called on purpose: it casts the
    embeddings, the output layer and the norms to float32, and since the 4-bit layers return their
    input's dtype, the whole residual stream and the KV cache would become float32 (twice the
    memory per token); TRL removed the same upcast (huggingface/trl#4457). The rest of what it
    does is done anyway: get_peft_model freezes the base, and with gradient checkpointing the
    inputs are made to require grad below.
    dtype: auto (bfloat16 on CUDA, float32 on CPU), float32 or bfloat16 (the base weights)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    device = device or default_device()
    dtypes = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {' | '.join(dtypes)}, got '{dtype}'")
    base, tokenizer = load_model(model_name, device=device, load_in_4bit=load_in_4bit, dtype=dtypes[dtype],
                                 trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    if adapter:
        model = PeftModel.from_pretrained(base, adapter, is_trainable=trainable)
    else:
        config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                            target_modules=target_names(target_modules),
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
class SampledLogprobs:
    """A logits processor that records log softmax(logits / temperature) of each token generate()
    samples, without keeping every step's logits: output_logits=True holds (B, N, vocabulary) fp32
    logits (about 9.3 GiB at 32 dialogues x 512 tokens x Qwen2.5's 152k vocabulary), this holds one
    step's (B, vocabulary). It runs one step behind: at step t the last column of input_ids is the
    token sampled at t - 1, so that is when its log-prob is read; finish() reads the last one.
    transformers runs processors passed to generate() before its own temperature and top-p warpers,
    so `scores` are the raw logits; the test against a fresh forward pass (temperature 0.7) holds it."""

    def __init__(self, temperature):
        self.temperature, self.last, self.picked = temperature, None, []

    def __call__(self, input_ids, scores):
        if self.last is not None:
            self.picked.append(self.last.gather(-1, input_ids[:, -1:])[:, 0])           # (B,)
        self.last = torch.log_softmax(scores.float() / self.temperature, -1)            # (B, V)
        return scores

    def finish(self, sequences):
        """(B, N): the log-probs of the N tokens generate() appended to the prompt."""
        self.picked.append(self.last.gather(-1, sequences[:, -1:])[:, 0])
        out, self.last, self.picked = torch.stack(self.picked, 1), None, []
        return out


KEPT_BUFFERS = weakref.WeakKeyDictionary()  # model -> MergedAdapter's buffers, with --static-cache


class MergedAdapter:
    """The policy's active LoRA adapter folded into a copy of every adapted weight, W + s B A, to
    sample from: a decode step then runs one matmul per projection instead of three (about 20%
    more tokens/s for SmolLM2 on 2 CPU cores; on a GPU, where decoding is launch-bound, the
    adapter's extra kernels cost more). The base weights are never written: inside `with`, each
    projection points at its merged copy and the adapter is switched off; on leaving, it points at
    its own weight again, so the base is bit for bit what it was (merging and then subtracting
    is not exact, and the reference model and the 'same' user would drift).
    The trainers recompute every log-prob they train on with the adapter itself, so the update
    stays exact; what the merge changes is which tokens are sampled, by the rounding of W + s B A
    (logged as sample_logprob_gap: about 1e-6 in float32). Costs one copy of the adapted weights
    while the rollout lasts. of() answers None where W + s B A is not the adapter's function, and the
    rollout samples through the adapter: 4-bit weights, DoRA, a LoRA bias (lora_bias=True: not in
    the delta weight), a base weight another module shares (lm_head on a model with tied embeddings:
    its merged copy would change the input embeddings too), and modules_to_save or trainable-token
    copies, which the adapter-off context inside bypasses. (LoraConfig's bias="all" only makes the
    base biases trainable: the merged layers use them as the adapter does.)
    of(model, keep=True) (--static-cache) fills the same buffers at every rollout, kept for the run
    (in KEPT_BUFFERS, by model): a compiled decode step on a GPU is recorded against the weights'
    addresses (CUDA graphs), and a new buffer per rollout would have it recorded again."""

    def __init__(self, model, swaps):
        self.model, self.swaps = model, swaps  # swaps: (projection, its merged weight)
        self.own, self.off = [], None  # while inside: each projection's own weight; the adapter-off context

    @classmethod
    @torch.no_grad()
    def of(cls, model, keep=False):
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
        from peft.utils import AuxiliaryTrainingWrapper

        adapter = getattr(model, "active_adapter", None)
        layers = [m for m in model.modules() if isinstance(m, LoraLayer) and adapter in m.lora_A]
        if not layers or layers[0].disable_adapters:
            return None  # no adapter, or it is switched off (evaluate.py's base): sample the base
        uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))  # tied: 2
        if any(not isinstance(m, LoraLinear) or m.lora_variant or m.lora_bias.get(adapter)
               or not m.get_base_layer().weight.dtype.is_floating_point
               or uses[id(m.get_base_layer().weight)] > 1 for m in layers):
            return None
        if any(isinstance(m, AuxiliaryTrainingWrapper) and adapter in m.active_adapters
               for m in model.modules()):
            return None
        # One buffer per (dtype, device) holds every merged weight: freed in one piece after the
        # rollout, it goes back to the system. As ~200 separate tensors they stayed in the CPU heap,
        # fragmented, and PPO's peak memory in the update grew by 0.5-1.1 GiB (SmolLM2, 2 cores).
        # With keep, the run's buffers are refilled instead (the same sizes: the same adapter).
        weights = [m.get_base_layer().weight for m in layers]
        sizes = Counter()
        for w in weights:
            sizes[w.dtype, w.device] += w.numel()
        buffers = KEPT_BUFFERS.get(model, {}) if keep else {}
        if {key: b.numel() for key, b in buffers.items()} != sizes:
            buffers = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}
            if keep:
                KEPT_BUFFERS[model] = buffers
        used, swaps = dict.fromkeys(buffers, 0), []
        for m, w in zip(layers, weights):
            key = w.dtype, w.device
            merged = buffers[key][used[key]:used[key] + w.numel()].view(w.shape)
            used[key] += w.numel()
            merged.copy_(w + m.get_delta_weight(adapter).to(w.dtype))
            swaps.append((m.get_base_layer(), merged))
        return cls(model, swaps)

    def __enter__(self):
        self.own = [layer.weight.data for layer, _ in self.swaps]
        for layer, merged in self.swaps:
            layer.weight.data = merged
        self.off = self.model.disable_adapter()
        self.off.__enter__()

    def __exit__(self, *error):
        self.off.__exit__(*error)
        for (layer, _), own in zip(self.swaps, self.own):
            layer.weight.data = own
        self.own, self.off = [], None


# --static-cache's torch.compile settings for the decode step: None leaves transformers' own
# (inductor with CUDA graphs, on CUDA devices only). A test compiles on the CPU with the eager backend.
DECODE_COMPILE = None


def rows_finished(done):
    """A stopping criterion for generate(): the rows where done (B,) is True count as finished
    from the first step, so generate fills them with padding and stops when the others end."""
    return lambda input_ids, scores, **kwargs: done.to(input_ids.device)


def compiled_graphs():
    """How many graphs torch.compile (dynamo) has built in this process so far, recompilations
    included: a count that grows after a run's first rollout means the decode step was compiled
    again (for a new shape or guard)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


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
                   max_context=4096, greedy=False, reuse_cache=True, merged_sampling=True, static_cache=False,
                   progress=True, desc="dialogues"):
    """Play len(personas) x samples_per_persona dialogues in lockstep: one batched generate for all
    active agents, then one batched simulator step; finished dialogues leave the batch.
    With reuse_cache each dialogue keeps its KV cache between turns, so a turn runs only the tokens
    added since the last one (simulator.cached_batch); without it every turn runs the whole prompt.
    With merged_sampling the agent samples from its adapter merged into a copy of the base weights
    (MergedAdapter), where the model allows it. With static_cache each generate call decodes into
    a KV cache of fixed size, which transformers answers on a GPU by compiling the decode step
    (CUDA graphs: one launch a step instead of one a kernel); a fresh cache each call, so the
    agent's turn caches are off (each turn runs its whole prompt: cheap next to decoding on a GPU).
    So that the step is compiled once per run, its shapes and buffers stay the same: the cache is
    max_context long, a finished dialogue stays in the batch as a one-token padding row that is
    marked done from the first step (its output is never read), and the merged weights keep one
    buffer for the run. stats["decode_compilations"] counts the graphs compiled during the rollout.
    Returns (records, stats): one flat dict per dialogue, and counts and timings."""
    from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

    chat = ChatTokens(tokenizer, system_prompt or (THINK_PROMPT if thinking else PLAIN_PROMPT))
    device = next(policy.parameters()).device
    # An explicit config, so that a model's own defaults (top_k=20, repetition_penalty=1.05 in
    # Qwen2.5's generation_config) cannot change the sampling distribution. top_k must be 0, not
    # None: transformers reads None as "unset" and fills in the model's top_k, or 50. The stored
    # log-probs are log softmax(logits / temperature), the distribution we sample from when
    # top_p = 1; the trainers must compute theirs with the same temperature.
    gen_config = GenerationConfig(
        do_sample=not greedy, temperature=temperature if not greedy else None,
        top_p=top_p if not greedy else None, top_k=0 if not greedy else None, repetition_penalty=1.0,
        max_new_tokens=max_new_tokens, eos_token_id=chat.eos_ids, pad_token_id=tokenizer.pad_token_id,
        **(dict(cache_implementation="static", max_cache_len=max_context, compile_config=DECODE_COMPILE)
           if static_cache else {}))
    reuse_cache = reuse_cache and not static_cache
    dialogues = []
    for g, persona in enumerate(personas):
        for s in range(samples_per_persona):
            ids = chat.prompt(persona.opening)
            dialogues.append(Dialogue(persona=persona, group=g, sample=s, state=simulator.start(persona),
                                      ids=ids, action_mask=[0] * len(ids), logprobs=[0.0] * len(ids)))
    was_training = policy.training
    policy.eval()
    merged = MergedAdapter.of(policy, keep=static_cache) if merged_sampling else None
    stats = Counter()
    graphs_before = compiled_graphs()
    t_policy = 0.0
    sim_seconds_before, sim_tokens_before = simulator.seconds, simulator.backend.generated_tokens
    sim_prompt_before = (getattr(simulator.backend, "prompt_tokens", 0),
                         getattr(simulator.backend, "reused_tokens", 0))
    # dialogues finished (the bar) and agent turns played so far (its postfix), on stderr
    bar = tqdm(total=len(dialogues), desc=desc, disable=not progress, leave=False, file=sys.stderr)
    turns_played = 0
    while True:
        active = [d for d in dialogues if not d.state.done]
        for d in active:  # the next prompt must leave room for a full reply
            if len(d.ids) + max_new_tokens > max_context:
                d.state.end_reason = "context"
                bar.update(1)
        for d in dialogues:
            if d.state.done:
                d.cache.clear()        # free a finished dialogue's KV cache, and its simulator's: the
                d.state.cache.clear()  # simulator frees it only for dialogues that end in its own step
        active = [d for d in active if not d.state.done]
        if not active:
            break
        t0 = time.time()
        # static cache: every dialogue keeps its row (a finished one a single padding token), so
        # that every generate call has the same batch size
        rows = dialogues if static_cache else active
        slots = [d.cache if reuse_cache else {} for d in rows]
        ids, mask, cache = cached_batch([[tokenizer.pad_token_id] if d.state.done else d.ids for d in rows],
                                        slots, tokenizer.pad_token_id, device)
        live = torch.tensor([not d.state.done for d in rows])                            # (B,)
        prompt, reused = prompt_counts(mask[live.to(device)], cache)
        stats["policy_prompt_tokens"] += prompt
        stats["policy_reused_tokens"] += reused
        recorder = SampledLogprobs(1.0 if greedy else temperature)
        # static: generate makes its own cache, and the padding rows are done from the first step
        given = {"stopping_criteria": StoppingCriteriaList([rows_finished(~live)])} if static_cache \
            else {cache_keyword(policy): cache}
        with merged or contextlib.nullcontext():  # the user's turns below run on the base's own weights
            sequences = policy.generate(input_ids=ids, attention_mask=mask, **given,
                                        generation_config=gen_config,
                                        logits_processor=LogitsProcessorList([recorder]))
        keep = live.nonzero()[:, 0].to(sequences.device)  # the active dialogues' rows, in order
        new_logp = recorder.finish(sequences)[keep].cpu()                              # (B_active, N)
        sequences, mask = sequences[keep], mask[keep]
        new = sequences[:, ids.shape[1]:]                                        # (B_active, N)
        lengths = [next((i + 1 for i, t in enumerate(row) if t in chat.eos_ids), len(row))  # keep the EOS
                   for row in new.tolist()]
        # Keep the per-row caches only if a dialogue can go on: on its last allowed turn every one ends
        # (a one-turn rollout never extracts them).
        last_turn = all(d.state.turns + 1 >= simulator.max_turns for d in active)
        if reuse_cache and not last_turn:
            sampled = (torch.arange(new.shape[1], device=device)[None]
                       < torch.tensor(lengths, device=device)[:, None])                      # (B, N)
            keep_cache(slots, cache, sequences, torch.cat([mask, sampled.long()], 1))
        del cache  # the batch's cache: what the dialogues keep is in their slots now
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
        turns_played += len(active)
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
        bar.set_postfix(turns=turns_played)  # and redraw, once per turn
    bar.close()
    del merged
    policy.train(was_training)
    stats["decode_compilations"] = compiled_graphs() - graphs_before
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
    """Batch-level numbers shared by every script's log. With several processes, give it every
    process's records and global_stats(stats): then every figure is the whole job's."""
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
        "simulator_tokens_per_s": (stats.get("simulator_tokens", 0)
                                   / max(1e-9, stats.get("simulator_seconds", 0))),
        "policy_seconds": stats.get("policy_seconds", 0.0),
        "simulator_seconds": stats.get("simulator_seconds", 0.0),
        # the share of prompt tokens read from a dialogue's KV cache instead of being run again
        "policy_cache_hit": (stats.get("policy_reused_tokens", 0)
                             / max(1, stats.get("policy_prompt_tokens", 0))),
        "simulator_cache_hit": (stats.get("simulator_reused_tokens", 0)
                                / max(1, stats.get("simulator_prompt_tokens", 0))),
        "decode_compilations": int(stats.get("decode_compilations", 0)),
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
        return torch.tensor([r[key] + [value] * (width - len(r[key])) for r in records],
                            dtype=dtype, device=device)

    return {
        "input_ids": pad("token_ids", pad_id, torch.long),                                  # (B, T)
        "attention_mask": torch.tensor([[1] * len(r["token_ids"]) + [0] * (width - len(r["token_ids"]))
                                        for r in records], device=device),                  # (B, T)
        "action_mask": pad("action_mask", 0, torch.float32),                                # (B, T)
        "sample_logprobs": pad("logprobs", 0.0, torch.float32),                             # (B, T)
    }


LOGITS_CHUNK_TOKENS = 1024  # rows x positions projected onto the vocabulary at once (token_logprobs)


def one_step_per_batch(passes, minibatch_size, batch_size):
    """True when an iteration takes exactly one optimizer step on its batch (one pass, the whole
    batch as one minibatch). Then the weights that would score the rollout are the ones the
    update's forward pass runs, so the old log-probs are that pass's own, detached, and a separate
    scoring pass would only repeat it (TRL takes them the same way). The tests replace this
    function to force the scoring pass and compare the two paths."""
    return passes == 1 and minibatch_size == batch_size


def length_sorted(attention_mask, micro_batch_size):
    """Micro-batches for passes where the order of dialogues does not matter (scoring): a list of
    (rows, width), the rows sorted by length, longest first, and width their longest row, so that
    a micro-batch of short dialogues is not run at the width of the batch's longest one.
    The batch is right-padded (pad_records), so a row's tokens are its first `length` columns."""
    lengths = attention_mask.sum(1)                                                          # (B,)
    order = torch.argsort(lengths, descending=True, stable=True)
    return [(order[i:i + micro_batch_size], int(lengths[order[i]]))
            for i in range(0, len(order), micro_batch_size)]


def _chunk_logprobs(head, hidden, targets, temperature, with_entropy, entropy_grad):
    """log-probs of `targets` (B, C) and, with with_entropy, the entropy (B, C) of the softmax
    over head(hidden) / temperature, for hidden (B, C, H): one chunk of token_logprobs."""
    logp_all = torch.log_softmax(head(hidden).float() / temperature, -1)                     # (B, C, V)
    picked = logp_all.gather(-1, targets[..., None])[..., 0]                                # (B, C)
    if not with_entropy:
        return picked, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return picked, -(logp_all.exp() * logp_all).sum(-1)                                 # (B, C)


def token_logprobs(model, input_ids, attention_mask, temperature=1.0, with_entropy=False, action_mask=None,
                   chunk_tokens=LOGITS_CHUNK_TOKENS, entropy_grad=True):
    """log p(token t | tokens < t) under `model`, aligned with input_ids (position 0 gets 0),
    computed as log softmax(logits / temperature), the distribution the rollout sampled from.
    With action_mask (B, T), the vocabulary projection and softmax run only at the positions that
    predict an agent token in some row (the rest get 0): the losses read nothing else.
    The (B, K, vocab) logits are the largest tensor of the update (vocab is 49k for SmolLM2, 152k
    for Qwen2.5, K up to 6,144 positions), so they are made in chunks of about chunk_tokens rows x
    positions; with gradients each chunk is recomputed in the backward pass (activation
    checkpointing), so at most one chunk's logits are alive at a time (chunk_tokens=None: one
    chunk). entropy_grad=False computes the entropy without a gradient (an entropy bonus of 0
    needs none, and its backward through the softmax costs as much as the log-probs').
    No KV cache is built: nothing reads it. Returns (logprobs (B, T), entropy (B, T) or None)."""
    from torch.utils.checkpoint import checkpoint

    B, T = input_ids.shape
    if action_mask is None:
        keep = torch.arange(T - 1, device=input_ids.device)                                   # every position
    else:
        keep = action_mask[:, 1:].bool().any(0).nonzero()[:, 0]                         # (K,) predictors
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model             # under peft
    hidden = inner.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False).last_hidden_state[:, keep]                 # (B, K, H)
    head, targets = inner.get_output_embeddings(), input_ids[:, keep + 1]                    # (B, K)
    step = max(1, (chunk_tokens or B * len(keep)) // B)                               # positions a chunk
    parts = []
    for c in range(0, len(keep), step):
        args = (head, hidden[:, c:c + step], targets[:, c:c + step], temperature, with_entropy, entropy_grad)
        if torch.is_grad_enabled() and len(keep) > step:  # only then is there a peak to bound
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args))
    picked = torch.cat([p for p, _ in parts], 1) if parts else hidden.new_zeros(B, 0).float()  # (B, K)
    logp = torch.zeros(B, T, dtype=picked.dtype, device=picked.device)
    logp = logp.index_copy(1, keep + 1, picked)                                               # (B, T)
    entropy = None
    if with_entropy:
        ent = torch.cat([e for _, e in parts], 1) if parts else picked                        # (B, K)
        entropy = torch.zeros_like(logp).index_copy(1, keep + 1, ent)                         # (B, T)
    return logp, entropy


@torch.no_grad()
def batched_logprobs(model, batch, temperature=1.0, micro_batch_size=4, reference=False):
    """token_logprobs over a padded batch (B, T) in micro-batches, without gradients, each
    micro-batch of dialogues of similar length at its own width (length_sorted). reference=True
    runs the base weights with every adapter disabled: the reference policy, no second copy."""
    import contextlib

    ctx = model.disable_adapter() if reference else contextlib.nullcontext()
    was_training = model.training
    model.eval()
    out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32, device=batch["input_ids"].device)
    with ctx:
        for rows, width in length_sorted(batch["attention_mask"], micro_batch_size):
            lp, _ = token_logprobs(model, batch["input_ids"][rows, :width],
                                   batch["attention_mask"][rows, :width], temperature,
                                   action_mask=batch["action_mask"][rows, :width])
            out[rows, :width] = lp
    model.train(was_training)
    return out


def masked_mean(x, mask, dim=None):
    """Mean of x over the positions where mask is 1."""
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# ----------------------------------------------------------------------------------------------
# Settings, run folders and checkpoints, shared by the trainers
# ----------------------------------------------------------------------------------------------
# What each setting may be, by field name; check_settings applies the rules of the fields a
# settings class has. A script adds or replaces rules for its own fields (the choices of
# --loss-agg differ between ppo.py and grpo.py). Renaming a flag means renaming its key here.
TRACKERS = ("tensorboard", "wandb", "trackio")  # each one's pip package has the same name


SETTING_RULES = {
    # the policy and the simulated user
    "model": model_problem, "simulator": simulator_problem, "readout": one_of(*READOUTS),
    "lora_r": at_least(1), "lora_alpha": above(0), "lora_dropout": within(0, 1, high_open=True),
    "split": one_of("train", "test"), "difficulty": one_of("all", *DIFFICULTIES),
    "start_emotion": within(0, 100), "max_change": at_least(1), "max_turns": at_least(1),
    "user_reply_tokens": at_least(1),
    "api_key_env": env_name, "api_timeout": above(0), "api_retries": at_least(0),
    "api_concurrency": at_least(1),
    # rollouts
    "dialogues_per_iteration": at_least(1), "personas_per_iteration": at_least(1), "group_size": at_least(2),
    "dialogues": at_least(0), "samples": at_least(1), "temperature": above(0),
    "top_p": within(0, 1, low_open=True), "max_new_tokens": at_least(1), "max_context": at_least(2),
    # rewards and advantages
    "reward": one_of("final", "turn"), "format_penalty": at_least(0), "kl_coef": at_least(0),
    "kl_loss_coef": at_least(0), "gamma": within(0, 1), "lam": within(0, 1),
    "scale_rewards": one_of("group", "batch", "none"),
    # the update
    "update_epochs": at_least(1), "minibatch_size": at_least(1), "micro_batch_size": at_least(1),
    "clip_low": within(0, 1, low_open=True, high_open=True), "clip_high": above(0),
    "value_clip": above(0), "vf_coef": at_least(0), "ent_coef": at_least(0),
    "critic_lr": at_least(0), "lr": at_least(0), "critic_warmup": at_least(0),
    "warmup_steps": at_least(0), "max_grad_norm": above(0), "max_bad_updates": at_least(1),
    "log_kl_every": at_least(1),
    # the run
    "iterations": at_least(1), "save_every": at_least(1), "time_budget": at_least(0),
    "bootstrap": at_least(1), "math_max_new_tokens": at_least(1), "math_batch_size": at_least(1),
    "keep_checkpoints": at_least(0), "report_to": one_of(*TRACKERS, "all", "none"),
    "dtype": one_of("auto", "float32", "bfloat16"), "judge": one_of("training", "heldout"),
}


def check_settings(args, rules=None):
    """Every setting against its rule (SETTING_RULES, then `rules`), and the pairs that only work
    together, before anything loads. Bad input ends the program: one line naming the flag, the
    value and what is allowed, exit code 2."""
    values = {f.name: getattr(args, f.name) for f in fields(args)}
    check_rules(values, {**SETTING_RULES, **(rules or {})})
    if "simulator" in values and "readout" in values:
        problem = readout_problem(values["readout"], simulator_kind(values["simulator"]))
        if problem:
            fail(f"--readout {values['readout']} with --simulator {redact(values['simulator'])}: {problem}")
    if values.get("load_in_4bit") and four_bit_problem():
        fail(f"--load-in-4bit {four_bit_problem()}")
    context, reply = values.get("max_context"), values.get("max_new_tokens")
    if context is not None and reply is not None and context <= reply:
        fail(f"--max-context {values['max_context']}: must be more than --max-new-tokens "
             f"{values['max_new_tokens']} (a prompt and a whole reply must fit)")


def parse_settings(args_class, presets=None, argv=None, rules=None):
    """Parse a settings dataclass with transformers.HfArgumentParser, then check it (check_settings).
    A preset only changes defaults: any flag given explicitly on the command line wins over it.
    The flags given explicitly are kept in args.given_flags (--resume compares them with the run's)."""
    from transformers import HfArgumentParser

    argv = sys.argv[1:] if argv is None else list(argv)
    # No abbreviated flags: "--max-t 5" would set max_turns without being seen as given below.
    parser = one_line_errors(HfArgumentParser(args_class, allow_abbrev=False))
    rules = {**SETTING_RULES, **(rules or {})}
    if presets is not None:
        rules["preset"] = one_of(*presets)
    for action in parser._actions:  # choices go to argparse too, so that --help lists them
        if hasattr(rules.get(action.dest), "choices") and action.choices is None:
            action.choices = rules[action.dest].choices
    args, extra = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if extra:
        fail(unknown_arguments(parser, extra))
    given = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    given |= {g[3:] for g in given if g.startswith("no_")}  # --no_thinking / --no-thinking set `thinking`
    for key, value in (presets or {}).get(getattr(args, "preset", None), {}).items():
        if key not in given:
            setattr(args, key, value)
    check_settings(args, rules)
    args.given_flags = frozenset(given)
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
    """Settings as a dict for config.json and state.pt: names of environment variables are kept;
    a setting named like a secret is hidden, and so is any value that looks like one (an sk- key,
    a bearer token, the password in a URL), whatever the setting is called."""
    out = {}
    for f in fields(args):
        value = getattr(args, f.name)
        # "api_key" is hidden, "api_key_env" (the variable's name) and "max_new_tokens" are not
        if SECRET_WORDS & set(f.name.lower().split("_")) and not f.name.endswith("_env"):
            value = REDACTED
        out[f.name] = redact(value)
    return out


RUN_FILES = ("config.json", "metrics.jsonl", "rollouts.jsonl", "checkpoints")


def finite_row(row):
    """(row, count): a copy of a JSON row with every NaN or infinite float replaced by None (JSON
    has neither, and strict readers reject the NaN that json.dumps writes), and how many there were."""
    count = 0

    def clean(x):
        nonlocal count
        if isinstance(x, float) and not np.isfinite(x):
            count += 1
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x
    return clean(row), count


def write_atomically(path, text):
    """Replace a file's content so that a kill at any moment leaves the old or the new one whole:
    write a temporary file beside it, fsync, rename over (rename is atomic on POSIX)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    folder = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(folder)  # the rename itself survives a power cut
    finally:
        os.close(folder)


class RunFolder:
    """config.json, metrics.jsonl, rollouts.jsonl and checkpoints/ of one run. Each JSON line is
    written whole and flushed, so a killed run leaves no torn line. resumed: what --resume
    recorded (prepare_run), added to config.json's "resumed_with" list."""

    def __init__(self, path, args, resume=False, enabled=True, resumed=None):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        os.makedirs(os.path.join(path, "checkpoints"), exist_ok=True)
        config = public_config(args)
        config_path = os.path.join(path, "config.json")
        if resume:
            try:
                with open(config_path, encoding="utf-8") as f:
                    config["resumed_with"] = json.load(f).get("resumed_with", [])
            except (OSError, ValueError, AttributeError):
                config["resumed_with"] = []
            config["resumed_with"].append(resumed or {})
        write_atomically(config_path, json.dumps(config, indent=2))
        if not resume:
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                open(os.path.join(path, name), "w").close()

    def append(self, name, rows):
        """Append JSON lines. NaN and infinity are written as null; in metrics.jsonl each row
        says how many of its values were (nonfinite_metrics)."""
        if not self.enabled:
            return
        lines = []
        for row in rows:
            row, count = finite_row(row)
            if name == "metrics.jsonl":
                row["nonfinite_metrics"] = count
            lines.append(json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n")
        with open(os.path.join(self.path, name), "a", encoding="utf-8") as f:
            f.write("".join(lines))
            f.flush()
            os.fsync(f.fileno())

    def truncate(self, name, iterations):
        """On resume: drop lines of iterations after the checkpoint (written after it was saved),
        and a torn last line. The kept lines replace the file atomically (write_atomically): a kill
        during the trim leaves the whole old file, never a cut one."""
        path = os.path.join(self.path, name)
        if not self.enabled or not os.path.exists(path):
            return
        keep = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    if line.strip() and json.loads(line)["iteration"] <= iterations:
                        keep.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut by a kill, or not a row of this run
        write_atomically(path, "".join(keep))


def save_checkpoint(run_dir, iteration, model, adapters, state, name=None):
    """checkpoints/iter_XXXXXX/ (or checkpoints/NAME/): each adapter in peft's format (loadable with
    PeftModel.from_pretrained), and state.pt (optimizer, scheduler, value head, RNG, settings).
    Written to a temporary folder and renamed, so a kill leaves the last complete one intact.
    --resume only picks folders named iter_*; `iteration` is the number of completed iterations."""
    final = os.path.join(run_dir, "checkpoints", name or f"iter_{iteration:06d}")
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


def prune_checkpoints(run_dir, keep):
    """--keep-checkpoints: delete every complete checkpoint but the newest `keep` (0 keeps all).
    Called right after a checkpoint is complete. Each folder is renamed first, to a name ending in
    .tmp, which complete_checkpoints skips, and only then removed: a kill half way through a removal
    leaves a folder that --resume never picks. Leftovers of such a kill go in the next call."""
    folder = os.path.join(run_dir, "checkpoints")
    for path in complete_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        os.rename(path, path + ".deleting.tmp")
    for name in os.listdir(folder):
        if name.endswith(".deleting.tmp"):
            shutil.rmtree(os.path.join(folder, name))


def complete_checkpoints(run_dir):
    """Checkpoint folders, oldest first (a folder still named *.tmp is a save that was cut short)."""
    folder = os.path.join(run_dir, "checkpoints")
    done = sorted(d for d in os.listdir(folder) if d.startswith("iter_") and not d.endswith(".tmp")) \
        if os.path.isdir(folder) else []
    return [os.path.join(folder, d) for d in done]


def latest_checkpoint(run_dir):
    """The newest complete checkpoint folder, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def checkpoint_problem(folder, adapters):
    """(state, None) when a checkpoint loads: state.pt reads and has what a resume needs, and every
    adapter's weights read and have the rank its settings say; else (None, why not)."""
    from safetensors.torch import load_file

    try:
        state = torch.load(os.path.join(folder, "state.pt"), map_location="cpu", weights_only=False)
    except Exception as e:  # a truncated or foreign file fails in many ways
        return None, f"state.pt does not load ({type(e).__name__})"
    missing = [k for k in ("iteration", "optimizer", "scheduler", "args", "rng") if k not in state]
    if missing:
        return None, f"state.pt lacks {', '.join(missing)}"
    rank = state["args"].get("lora_r")
    for name in adapters:
        path = os.path.join(folder, name, "adapter_model.safetensors")
        if not os.path.exists(path):
            return None, f"{name}/adapter_model.safetensors is missing"
        try:
            weights = load_file(path)
        except Exception as e:
            return None, f"{name}/adapter_model.safetensors does not load ({type(e).__name__})"
        ranks = {w.shape[0] for k, w in weights.items() if "lora_A" in k}
        if not ranks or (rank is not None and ranks != {rank}):
            return None, f"{name} adapter has rank {sorted(ranks)}, its settings say --lora-r {rank}"
    return state, None


def pick_checkpoint(run_dir, adapters):
    """(folder, state) of the newest checkpoint that loads, saying on stderr which newer ones it
    skipped and why. None loads: one line, exit code 2."""
    skipped = []
    for folder in reversed(complete_checkpoints(run_dir)):
        state, problem = checkpoint_problem(folder, adapters)
        if state is not None:
            return folder, state, skipped
        print(f"warning: --resume: skipping {folder}: {problem}", file=sys.stderr)
        skipped.append(f"{os.path.basename(folder)}: {problem}")
    fail(f"--resume {run_dir}: no checkpoint in {run_dir}/checkpoints that loads"
         + (f" ({len(skipped)} skipped; newest: {skipped[0]})" if skipped else ""))


# Settings that may differ on --resume: how long and how often, where to log, how the same
# computation is laid out in memory, and how to reach the simulator server. Every other setting
# (the model, the adapter's shape, the optimizer, the method, the data, the seed) is the run's:
# it is taken from the checkpoint, and giving another value on the command line is an error.
MAY_CHANGE_ON_RESUME = {
    "preset", "iterations", "save_every", "time_budget", "out", "resume", "overwrite",
    "gradient_checkpointing", "micro_batch_size", "max_bad_updates", "simulator_device_map",
    "keep_checkpoints", "report_to", "merged_sampling", "static_cache",
    "api_key_env", "api_timeout", "api_retries", "api_concurrency",
}
# Consent is never inherited: a resumed run runs hub code only if this command line allows it.
NOT_FROM_CHECKPOINT = {"trust_remote_code"}


def resume_settings(args, saved, given):
    """args with the run's saved settings put back, checked against the flags given now. Returns
    {field: [saved, now]} of the settings that changed (all in MAY_CHANGE_ON_RESUME); ends the
    program on a flag that would change the model, the adapter, the optimizer or the method."""
    changed = {}
    for f in fields(args):
        if f.name not in saved or f.name in ("resume", "out", "overwrite") or f.name in NOT_FROM_CHECKPOINT:
            continue  # a setting added since the checkpoint keeps its value now
        now, then = getattr(args, f.name), saved[f.name]
        if redact(now) == then:
            continue
        url_moved = f.name == "simulator" and simulator_kind(now) == simulator_kind(then) == "url"
        if f.name in given and (f.name in MAY_CHANGE_ON_RESUME or url_moved):
            changed[f.name] = [then, redact(now)]
        elif f.name in given:
            fail(f"--{f.name.replace('_', '-')} {redact(now)!r}: the run in {args.resume} has {then!r}, and "
                 f"--resume keeps the model, adapter, optimizer and method settings (drop the flag, or start "
                 f"a new run with another --out)")
        elif REDACTED in str(then):
            fail(f"--{f.name.replace('_', '-')}: the run saved it redacted (it held a secret); give it again")
        else:
            setattr(args, f.name, then)
    return changed


def prepare_run(args, adapters, is_main=True):
    """Before any model loads: the run folder and, with --resume, its checkpoint and settings.
    --out on a folder that holds a run stops unless --overwrite (which clears that run's files);
    --resume takes the newest checkpoint that loads (pick_checkpoint) and the settings saved in it
    (resume_settings). Returns (checkpoint folder, state, record for config.json) or Nones."""
    if args.resume:
        if getattr(args, "overwrite", False):
            fail("--overwrite with --resume: continue the run or replace it, not both")
        args.out = args.resume
        folder, state, skipped = pick_checkpoint(args.resume, adapters)
        changed = resume_settings(args, state["args"], getattr(args, "given_flags", set()))
        if is_main:
            print(f"resuming {args.resume} from {os.path.basename(folder)} with its saved settings"
                  + "".join(f"; --{k.replace('_', '-')} {a!r} -> {b!r}" for k, (a, b) in changed.items()),
                  file=sys.stderr)
        return folder, state, {"from": os.path.basename(folder), "changed": changed, "skipped": skipped}
    present = [n for n in RUN_FILES if os.path.exists(os.path.join(args.out, n))
               and (n != "checkpoints" or os.listdir(os.path.join(args.out, n)))]
    if present and not getattr(args, "overwrite", False):
        fail(f"--out {args.out} holds a run ({', '.join(present)}): continue it with --resume {args.out}, "
             f"replace it with --overwrite, or pick another --out")
    if present and is_main:
        for name in present:
            path = os.path.join(args.out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        print(f"--overwrite: cleared the run in {args.out} ({', '.join(present)})", file=sys.stderr)
    return None, None, None


def load_adapter_weights(model, folder, name):
    """Copy a saved adapter's weights into the adapter `name` of a live PeftModel. Weights that do
    not fit (another rank, another model) raise one line, not torch's list of mismatches."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(folder, name, "adapter_model.safetensors"),
                        device=str(next(model.parameters()).device))
    live = get_peft_model_state_dict(model, adapter_name=name)
    wrong = [k for k, w in weights.items() if k in live and live[k].shape != w.shape]
    if wrong or set(weights) != set(live):
        missing, unexpected = len(set(live) - set(weights)), len(set(weights) - set(live))
        why = (f"{wrong[0]} is {tuple(weights[wrong[0]].shape)}, the model's {tuple(live[wrong[0]].shape)}"
               if wrong else f"{missing} missing, {unexpected} unexpected")
        raise RuntimeError(f"{folder}/{name}: adapter weights do not fit this model ({why})")
    set_peft_model_state_dict(model, weights, adapter_name=name)


def load_tokenizer(model_name, trust_remote_code=False):
    """The tokenizer of a model, without its weights (bench.py answers its in-memory model here)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(model_name), trust_remote_code=trust_remote_code)


def check_openings_fit(model_name, personas, system_prompt, max_context, max_new_tokens,
                       trust_remote_code=False):
    """Every persona's first prompt (system prompt and opening) with room for a whole reply must fit
    max_context, or its dialogue would end before the agent speaks (and its metrics would be NaN).
    Needs only the tokenizer, so it runs before the weights load. Bad input: one line, exit 2."""
    chat = ChatTokens(load_tokenizer(model_name, trust_remote_code=trust_remote_code), system_prompt)
    for p in personas:
        if len(p.opening) > 64 * max_context:  # surely too long; spares tokenising megabytes
            n = f"over {max_context}"
        else:
            n = len(chat.prompt(p.opening))
            if n + max_new_tokens <= max_context:
                continue
        fail(f"persona {p.id}: its opening makes a first prompt of {n} tokens, which with --max-new-tokens "
             f"{max_new_tokens} does not fit --max-context {max_context}")


def target_names(target_modules):
    """--target-modules as a list of names: "q_proj, v_proj" -> ["q_proj", "v_proj"]."""
    return [t.strip() for t in target_modules.split(",")]


def check_target_modules(model_name, target_modules, trust_remote_code=False):
    """Every name in --target-modules must name a layer of the model that LoRA adapts (peft takes
    a name for the end of a module's dotted name, and skips without a word a name that matches
    nothing when another one matches). Read off the model's skeleton, built from its config on the
    meta device: no weights load and no random stream moves. Bad input: one line, exit 2."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)
    with random_streams_kept():
        config = AutoConfig.from_pretrained(resolve_model(model_name), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers = [name for name, m in skeleton.named_modules() if isinstance(m, kinds)]
    for target in target_names(target_modules):
        if not any(name == target or name.endswith("." + target) for name in layers):
            ends = sorted({name.rsplit(".", 1)[-1] for name in layers})
            fail(f"--target-modules {target_modules}: {target!r} is no layer of {model_name}; "
                 f"its layers LoRA can adapt end in {', '.join(ends)}")


def begin_run(args_class, presets, argv, rules, adapters, script):
    """Everything before a model loads: the settings, checked (parse_settings); the Accelerator,
    with --report-to's trackers; the run folder, never clobbered, and with --resume the checkpoint
    and the run's own settings (prepare_run). Returns (args, accelerator, checkpoint, state, resumed)."""
    from accelerate import Accelerator

    args = parse_settings(args_class, presets, argv, rules)
    if args.preset == "paper" and not torch.cuda.is_available() and args.model != "smollm2":
        fail(f"the paper's setup needs CUDA; on this machine run `python {script} --preset cpu`")
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              **tracker_settings(args.report_to, args.resume or args.out))
    checkpoint, state, resumed = prepare_run(args, adapters, accelerator.is_main_process)
    return args, accelerator, checkpoint, state, resumed


def training_personas(args):
    """The split's personas at --difficulty, each opening checked to fit --max-context; and, since
    this is the trainers' last check before the weights load, --target-modules against the model."""
    personas = load_personas_or_exit(args.personas, args.split, args.difficulty)
    check_openings_fit(args.model, personas, THINK_PROMPT if args.thinking else PLAIN_PROMPT,
                       args.max_context, args.max_new_tokens, args.trust_remote_code)
    check_target_modules(args.model, args.target_modules, args.trust_remote_code)
    return personas


def policy_settings(args):
    """load_policy's keyword arguments from a trainer's settings."""
    return dict(lora_r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                target_modules=args.target_modules, load_in_4bit=args.load_in_4bit, dtype=args.dtype,
                gradient_checkpointing=args.gradient_checkpointing, trust_remote_code=args.trust_remote_code)


def sampling_settings(args):
    """play_dialogues' keyword arguments from a trainer's settings."""
    return dict(thinking=args.thinking, temperature=args.temperature, top_p=args.top_p,
                max_new_tokens=args.max_new_tokens, max_context=args.max_context, greedy=args.greedy,
                merged_sampling=args.merged_sampling, static_cache=args.static_cache)


def simulator_placement(simulator, device_map, world=1):
    """(device_map, max_memory) for a local simulator model: with one process, several GPUs and
    --simulator-device-map auto, spread over every GPU but the first, which the policy keeps;
    otherwise (None, None), and it goes to the policy's device."""
    local = simulator_kind(simulator) == "local"
    if local and world == 1 and device_map == "auto" and torch.cuda.device_count() > 1:
        return "auto", gpus_after_the_first()
    return None, None


def build_simulator(args, model, tokenizer, device, world=1, judge="training"):
    """The simulated user of --simulator with its settings (a trainer's or evaluate.py's), placed as
    simulator_placement says. Returns (simulator, device_map)."""
    device_map, max_memory = simulator_placement(args.simulator, args.simulator_device_map, world)
    backend = make_backend(args.simulator, policy=model, tokenizer=tokenizer, api_model=args.api_model,
                           api_key_env=args.api_key_env, device=device, device_map=device_map,
                           max_memory=max_memory, trust_remote_code=getattr(args, "trust_remote_code", False),
                           api_timeout=args.api_timeout, api_retries=args.api_retries,
                           api_concurrency=args.api_concurrency)
    simulator = Simulator(backend, readout=args.readout, start_emotion=args.start_emotion,
                          max_change=args.max_change, max_turns=args.max_turns,
                          reply_tokens=args.user_reply_tokens, judge=judge)
    return simulator, device_map


def make_simulator(args, model, tokenizer, accelerator, note=""):
    """A trainer's simulated user (build_simulator); the main process says where it is (and `note`)."""
    device, world = accelerator.device, accelerator.num_processes
    simulator, device_map = build_simulator(args, model, tokenizer, device, world)
    where = {"same": "shares the policy's base", "rules": "rules", "url": "a server"}.get(
        simulator_kind(args.simulator), "spread over GPUs 1.." if device_map else f"on {device}")
    if accelerator.is_main_process:
        print(f"policy {args.model} on {device} x {world} process(es); simulator {redact(args.simulator)} "
              f"({where}), read-out {simulator.readout}{note}")
    return simulator


def start_or_resume(args, accelerator, checkpoint, state, model, adapters, optimizer, scheduler, resumed,
                    modules=None):
    """The run folder, and with --resume the state of the checkpoint prepare_run picked: adapters,
    optimizer, scheduler, `modules` (name in state.pt -> module, e.g. PPO's value head) and every
    process's RNG. Returns (run folder, iteration to start from)."""
    rank, world = accelerator.process_index, accelerator.num_processes
    start = 0
    if args.resume:
        for name in adapters:
            load_adapter_weights(model, checkpoint, name)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        for name, module in (modules or {}).items():
            module.load_state_dict(state[name])
        start = state["iteration"]
        rngs = state["rng"] if isinstance(state["rng"], list) else [state["rng"]]
        if len(rngs) == world:  # the same number of processes: continue exactly where it stopped
            set_rng_state(rngs[rank])
        else:                   # another number of processes: a fresh, still reproducible, stream
            set_seed(args.seed + rank + 7919 * start)
    else:
        set_seed(args.seed + rank)  # each process samples its own dialogues
    run = RunFolder(args.out, args, resume=bool(args.resume), enabled=accelerator.is_main_process,
                    resumed=resumed)
    if args.resume:  # lines logged after the checkpoint belong to iterations that will run again
        run.truncate("metrics.jsonl", start)
        run.truncate("rollouts.jsonl", start)
    start_trackers(args, accelerator, start)
    if torch.cuda.is_available():  # each iteration's peak_memory_gb counts from here (then from its log)
        torch.cuda.reset_peak_memory_stats()
    return run, start


DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d,
            torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout)


def dropout_active(model):
    """True when the model drops anything in train mode: a dropout module with p > 0 (LoRA's
    lora_dropout is one), or a dropout probability above 0 in the model's config (Llama and Qwen2
    apply attention_dropout inside their attention function, where no module shows it). Read from
    the loaded model, once; any *dropout* or *pdrop* setting counts, whether or not this model's
    code reads it, since a needless scoring pass costs time and a missed one costs correctness."""
    if any(isinstance(m, DROPOUTS) and m.p > 0 for m in model.modules()):
        return True
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = inner.config.get_text_config().to_dict()
    return any(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
               and ("dropout" in k or k.endswith("pdrop")) for k, v in config.items())


def passes_to_run(args, iteration, old_first=False, dropout=False):
    """(old log-probs from the update, reference pass): the scoring passes an iteration needs.
    With one optimizer step per batch (one epoch, one minibatch) the old log-probs are the update's
    own forward pass, detached, so a scoring pass would compute the same numbers once more; unless
    something reads them before the update (old_first), or the update's pass drops (dropout: see
    dropout_active): in train mode its log-probs carry dropout noise, not the sampling policy's,
    so the scoring pass, in eval mode as the sampling was, gives them. The reference pass runs when
    a KL term reads it or kl_ref is logged (every --log-kl-every iterations). TRL skips the same
    passes."""
    batch_size = getattr(args, "dialogues_per_iteration", 0) or args.personas_per_iteration * args.group_size
    one_step = one_step_per_batch(args.update_epochs, args.minibatch_size, batch_size)
    old_from_update = one_step and not old_first and not dropout
    kl_term = getattr(args, "kl_coef", 0) > 0 or args.kl_loss_coef > 0
    return old_from_update, kl_term or iteration % args.log_kl_every == 0


def pick_personas(personas, n, seed, iteration):
    """The iteration's n personas, the same on every process (each then plays its own share)."""
    pick = random.Random(seed * 1_000_003 + iteration)
    return pick.sample(personas, n) if len(personas) >= n else [pick.choice(personas) for _ in range(n)]


class StepGuard:
    """--max-bad-updates: a non-finite gradient norm skips its optimizer step; that many in a row
    stop the run. The state at the stop has part of an iteration's steps in it, so it is never
    written over a complete checkpoint: save(name) puts it where --resume does not look."""

    def __init__(self, limit, advice, run_dir, accelerator):
        self.limit, self.advice, self.run_dir, self.in_a_row = limit, advice, run_dir, 0
        self.accelerator = accelerator

    def step_ok(self, norm, iteration, save):
        accelerator = self.accelerator
        if torch.isfinite(norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        print(f"warning: iteration {iteration}: non-finite gradient, update skipped "
              f"({self.in_a_row} in a row)", file=sys.stderr)
        if self.in_a_row >= self.limit:
            path = save(f"partial_iter_{iteration + 1:06d}")
            if accelerator.is_main_process:
                print(f"error: {self.in_a_row} non-finite updates in a row; stopped in iteration "
                      f"{iteration + 1}. --resume continues from the last complete checkpoint "
                      f"({latest_checkpoint(self.run_dir)}); the state at the stop is in {path}. "
                      f"{self.advice}, and resume.", file=sys.stderr)
            accelerator.wait_for_everyone()  # no process may exit (the launcher would stop the main
            sys.exit(1)                      # one) before the main process has written the state
        return False


def log_iteration(run, accelerator, iteration, all_records, rstats, logs, params, method, times):
    """Step 5 of both trainers. The metrics.jsonl line: the method's own figures (`method`, already
    global), the means over processes of what the update logged (`logs`: name -> list), the rollout
    summary, the timings (`times`: name -> this process's seconds), peak memory, and whether every
    process holds the same adapters; then every dialogue to rollouts.jsonl and the trackers.
    A collective call: every process makes it. Returns the metrics."""
    from accelerate.utils import gather_object

    digest = fingerprint(params)  # data parallel: every process must hold bit-identical adapters
    digests = gather_object([digest]) if accelerator.num_processes > 1 else [digest]
    summary = summarize(all_records, global_stats(rstats, accelerator))
    metrics = {"iteration": iteration + 1, **method, **summary,
               **{k: global_mean(v, accelerator) for k, v in logs.items()}, **times,
               "peak_memory_gb": peak_memory_gb(), "processes": accelerator.num_processes,
               "replicas_identical": len(set(digests)) == 1}
    run.append("metrics.jsonl", [metrics])
    run.append("rollouts.jsonl", [transcript_record(r, iteration=iteration + 1) for r in all_records])
    log_to_trackers(accelerator, metrics, all_records, step=iteration + 1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # the next iteration's peak
    return metrics


def checkpoint_due(args, iteration, t_run, accelerator):
    """(save now, stop now) after an iteration: every --save-every iterations, at the last one, and
    when --time-budget is used up (then the run stops, with a line saying so)."""
    out_of_time = time_budget_used(t_run, args.time_budget, accelerator)
    if out_of_time and accelerator.is_main_process:
        print(f"--time-budget {args.time_budget:g} min used up after iteration {iteration + 1}")
    due = (iteration + 1) % args.save_every == 0 or iteration + 1 == args.iterations or out_of_time
    return due, out_of_time


def gather_tensor(x, accelerator):
    """A 1-D tensor of every process's rows, in rank order (itself with one process)."""
    from accelerate.utils import gather_object

    return torch.tensor(gather_object(x.tolist()), dtype=x.dtype) if accelerator.num_processes > 1 else x


def global_masked_mean(x, mask, accelerator):
    """The mean of x over the positions where mask is 1, on every process's positions."""
    total = global_sum((x * mask).sum(), accelerator)
    return (total / global_sum(mask.sum(), accelerator).clamp(min=1)).item()


def stop_on_simulator_error(error, save=None):
    """A simulator that cannot answer ends the run with one line and exit code 2; save() first
    writes a checkpoint of the last complete iteration when one has not been saved."""
    path = save() if save is not None else None
    fail(f"{error}" + (f"; the last complete iteration is saved in {path}" if path else ""))


# ----------------------------------------------------------------------------------------------
# Experiment trackers (--report-to), through accelerate's tracker API; metrics.jsonl stays the record
# ----------------------------------------------------------------------------------------------
TRACKER_DIALOGUES = 3  # dialogues per iteration shown as text in the trackers that take text


def tracker_settings(report_to, run_dir):
    """Accelerator(...) keyword arguments for --report-to none | tensorboard | wandb | trackio | all
    (all: those of the three that are installed). Called before any model loads, so that a tracker
    whose package is missing is a one-line error (exit 2), not a crash after an hour of loading."""
    import importlib.util

    if report_to == "none":
        return {}
    if report_to not in (*TRACKERS, "all"):
        print(f"error: --report-to must be one of none | {' | '.join(TRACKERS)} | all, got '{report_to}'",
              file=sys.stderr)
        sys.exit(2)
    wanted = TRACKERS if report_to == "all" else (report_to,)
    found = [name for name in wanted if importlib.util.find_spec(name) is not None]
    if not found:
        package = "tensorboard" if report_to == "all" else report_to
        print(f"error: --report-to {report_to} needs the {package} package: pip install {package}",
              file=sys.stderr)
        sys.exit(2)
    return {"log_with": found, "project_dir": run_dir}  # TensorBoard writes under project_dir


def start_trackers(args, accelerator, start_iteration=0):
    """Open one tracker run (main process only), with the settings as its config: public_config,
    so no secret, and lists or None written as text, since trackers take scalars and strings.
    TensorBoard writes to <run folder>/rlver/; on --resume it drops the steps a killed run logged
    after the checkpoint (purge_step), as metrics.jsonl does."""
    if not accelerator.log_with:
        return
    config = {k: v if isinstance(v, (bool, int, float, str)) else str(v)
              for k, v in public_config(args).items()}
    name = os.path.basename(os.path.normpath(accelerator.project_dir))
    accelerator.init_trackers("rlver", config=config, init_kwargs={
        "tensorboard": {"purge_step": start_iteration + 1} if start_iteration else {},
        "wandb": {"name": name}, "trackio": {"name": name}})


def dialogue_markdown(record):
    """One dialogue as markdown for a tracker's text panel."""
    lines = [f"**{record['persona_id']}**: final emotion {record['final_emotion']}, "
             f"ended by {record['end_reason']}", ""]
    for t in record["turns"]:
        thought = f" _(thought: {t['thought']})_" if t.get("thought") else ""
        emotion = f" (emotion {t['emotion']})" if "emotion" in t else ""
        lines.append(f"- **{t['role']}**: {t['text']}{thought}{emotion}")
    return "\n".join(lines)


def log_to_trackers(accelerator, metrics, records, step):
    """One iteration to the trackers (main process only): every number of the metrics.jsonl line at
    step = iteration, and the first TRACKER_DIALOGUES dialogues as text where the tracker takes text
    (TensorBoard: markdown; wandb: a table; trackio: none)."""
    if accelerator is None or not accelerator.trackers:  # --report-to none, or not the main process
        return
    numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "iteration"}
    accelerator.log(numbers, step=step)
    shown = records[:TRACKER_DIALOGUES]
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            text = "\n\n---\n\n".join(dialogue_markdown(r) for r in shown)
            tracker.writer.add_text("dialogues", text, global_step=step)
            tracker.writer.flush()
        elif tracker.name == "wandb":
            tracker.log_table("dialogues", columns=["persona", "final_emotion", "end_reason", "dialogue"],
                              data=[[r["persona_id"], r["final_emotion"], r["end_reason"],
                                     dialogue_markdown(r)] for r in shown], step=step)


# ----------------------------------------------------------------------------------------------
# Data parallel and bookkeeping helpers, shared by the trainers
# ----------------------------------------------------------------------------------------------
def adapter_params(model, name):
    """The LoRA parameters of one adapter."""
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]


def global_sum(x, accelerator):
    """Sum of a tensor over every process (itself with one process)."""
    return accelerator.reduce(x, "sum") if accelerator.num_processes > 1 else x


def global_max(x, accelerator):
    """The largest value of a number over every process (itself with one process)."""
    if accelerator.num_processes == 1:
        return float(x)
    return accelerator.gather(torch.tensor([float(x)], device=accelerator.device)).max().item()


def merge_stats(per_process):
    """Rollout stats of every process as one process's: counts add up, and the *_seconds, which the
    processes spend at the same time, are the longest one's, so count / seconds is the whole
    job's rate (what summarize reports) rather than one process's."""
    out = Counter()
    for stats in per_process:
        for key, value in stats.items():
            out[key] = max(out[key], value) if key.endswith("_seconds") else out[key] + value
    return dict(out)


def global_stats(stats, accelerator):
    """merge_stats over every process (a collective call: every process must make it)."""
    from accelerate.utils import gather_object

    return merge_stats(gather_object([stats]) if accelerator.num_processes > 1 else [stats])


def reduce_gradients(params, accelerator, bucket_bytes=256 * 2**20):
    """Sum the gradients of `params` over every process, in one all-reduce per bucket of at most
    bucket_bytes: PPO's two r-32 adapters on Qwen2.5-7B hold 161 M fp32 gradients (646 MB), so
    3 all-reduces a step instead of 786, one per tensor. A gradient that is None stays None:
    during --critic-warmup the actor has none, and zeros in its place would advance AdamW's step
    count (and with it the bias correction of the actor's first real steps), which one process
    does not do. Every process is at the same step, so all have gradients for the same
    parameters; a cheap check (one small gather) says so."""
    if accelerator.num_processes == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    counts = accelerator.gather(torch.tensor([len(grads)], device=accelerator.device))
    if len(set(counts.tolist())) != 1:
        raise RuntimeError(f"processes hold gradients for different parameters: counts {counts.tolist()}")
    buckets, size = [[]], 0  # consecutive gradients of one dtype, up to bucket_bytes each
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if buckets[-1] and (size + nbytes > bucket_bytes or g.dtype != buckets[-1][0].dtype):
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += nbytes
    for bucket in buckets:
        if not bucket:
            continue
        flat = accelerator.reduce(torch.cat([g.reshape(-1) for g in bucket]), "sum")  # (sum of numel,)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket])):
            g.copy_(part.view_as(g))


def time_budget_used(t_run, minutes, accelerator):
    """--time-budget: True on every process once any of them has run `minutes` since t_run (0 = no
    budget), so all stop after the same iteration."""
    if minutes <= 0:
        return False
    late = torch.tensor(float(time.time() - t_run >= 60 * minutes), device=accelerator.device)
    return global_sum(late, accelerator).item() > 0


def global_mean(values, accelerator):
    """The mean of a logged quantity over the processes that logged it (each process's own mean,
    averaged), or None where none did. A collective call that every process makes, with values or
    without: with --drop-zero-spread a process whose dialogues were all dropped logs nothing."""
    local = torch.tensor([float(np.mean(values)) if values else 0.0, float(len(values) > 0)],
                         device=accelerator.device)                                         # (mean, logged)
    mean, logged = (accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local).tolist()
    return mean / logged if logged else None


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
    simulator: str = field(default="same", metadata={
        "help": "same | rules | model id/path | http://host:port/v1"})
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
    merged_sampling: bool = field(default=True, metadata={
        "help": "sample from the adapter merged into a copy of the weights: faster, the update stays "
                "exact (off: less memory; 4-bit bases never merge)"})
    max_context: int = field(default=2048, metadata={
        "help": "tokens per dialogue before it ends with 'context'"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    out: str = field(default="runs/rollout", metadata={"help": "output folder"})


def main(argv=None):
    args = parse_settings(RolloutArgs, None, argv, {"split": one_of("train", "test", "all")})
    set_seed(args.seed)
    personas = load_personas_or_exit(args.personas, None if args.split == "all" else args.split)
    personas = personas[:args.dialogues] if args.dialogues else personas
    check_openings_fit(args.model, personas, THINK_PROMPT if args.thinking else PLAIN_PROMPT,
                       args.max_context, args.max_new_tokens)
    policy, tokenizer = load_policy(args.model, adapter=args.adapter, trainable=False)
    backend = make_backend(args.simulator, policy=policy, tokenizer=tokenizer, device=default_device())
    simulator = Simulator(backend, readout=args.readout, start_emotion=args.start_emotion,
                          max_turns=args.max_turns)
    t0 = time.time()
    try:
        records, stats = play_dialogues(policy, tokenizer, simulator, personas, args.samples,
                                        thinking=args.thinking, temperature=args.temperature,
                                        top_p=args.top_p, max_new_tokens=args.max_new_tokens,
                                        max_context=args.max_context, merged_sampling=args.merged_sampling)
    except SimulatorError as e:
        fail(e)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rollouts.jsonl"), "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(transcript_record(r), ensure_ascii=False) + "\n")
    s = summarize(records, stats)
    print(f"{len(records)} dialogues in {time.time() - t0:.0f} s -> {args.out}/rollouts.jsonl")
    print(f"mean final emotion {s['final_emotion_mean']:.1f}; end reasons "
          + ", ".join(f"{k[4:]} {v}" for k, v in s.items() if k.startswith("end_") and v))
    print(f"policy {s['policy_tokens_per_s']:.1f} tok/s, simulator {s['simulator_tokens_per_s']:.1f} tok/s, "
          f"think-format violations {s['think_violation_rate']:.0%} of turns, "
          f"simulator fallbacks {s['simulator_fallbacks']}")


if __name__ == "__main__":
    main()
