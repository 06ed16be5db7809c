"""The run: everything a training script needs that is not the method.

ppo.py and grpo.py call this module by name, and in their loops every plumbing call reads
run.something(...): a reader who skips those lines still sees the whole method, the optimizer step
included. It imports no other file of the project; every other file may import it.

  bad input   fail() raises Stop, which command() turns into one line on stderr and exit code 2;
              the checks a setting declares (one_of, ...)
  settings    setting() declares a flag with its default, its --help line and its check side by
              side; parse_settings() builds one argparse parser from a script's settings classes
  secrets     redact(): anything that looks like a key never reaches a log or a saved file
  streams     seeds, the random streams' state, and random_streams_kept() for code that must not
              move them (a model's initialisation)
  files       atomic writes and JSON lines
  Run         one training run: a folder it creates itself (or --resume's), held by a lock;
              checkpoints; the sums over data-parallel processes; the log; trackers; signals
"""
import argparse
import contextlib
import dataclasses
import fcntl
import functools
import importlib.util
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

# What this process holds for its run folder: lock descriptors, and signal handlers to restore
HELD = []
# The settings this command took from a file instead of its command line, until they are checked
# and a run begins: what a line says of one (its flag, or a path's value) -> the file and field it
# came from. A Stop about one names them.
TAKEN = {}


def release():
    """Let go of the run folder's lock and put back the signal handlers (a finished or failed run;
    tests run several in one process)."""
    while HELD:
        item = HELD.pop()
        if isinstance(item, int):
            os.close(item)
        else:
            signal.signal(*item)


# ----------------------------------------------------------------------------------------------
# Bad input: one line, exit code 2, never a traceback
# ----------------------------------------------------------------------------------------------
class Stop(Exception):
    """What ends a command with one line: bad input (code 2) or a run that cannot go on (code 1)."""

    def __init__(self, message, code=2):
        # a line about a value the command did not get on its command line says where it came from
        for said, where in TAKEN.items():
            if said in message and where not in message:
                message = f"{where}: {message}"
        super().__init__(message)
        self.code = code


def fail(message, code=2):
    """Raise Stop: library code never exits; the command line (command) turns it into one line."""
    raise Stop(message, code)


class Redacted:
    """A text stream that writes everything through redact(): what any command prints, argparse's
    own errors and a traceback included, never shows a key."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.stream.write(redact(text))

    def __getattr__(self, name):  # flush, isatty, fileno, ... of the stream itself
        return getattr(self.stream, name)


def command(main):
    """A script's main() as its command line: stdout and stderr redacted, Ctrl-C and SIGTERM one
    line from its first statement on (model loading included), and a Stop one line (below the
    progress bars, last_line) and its exit code."""
    @functools.wraps(main)
    def run_command(argv=None):
        # each stream wrapped once, though one process may run several commands (the tests do)
        for name in ("stdout", "stderr"):
            if not isinstance(getattr(sys, name), Redacted):
                setattr(sys, name, Redacted(getattr(sys, name)))
        quiet_libraries()
        exit_on_signals(lambda: "")
        try:
            return main(argv)
        except Stop as stop:
            if str(stop):  # empty on a process other than the main one
                last_line(f"error: {stop}")
            sys.exit(stop.code)
        finally:
            release()
    return run_command


def use_cpu_threads():
    """On a machine without CUDA, torch's threads for this command: half the cores this process may
    run on, at least one, unless OMP_NUM_THREADS is set (torch has taken it). PyTorch's default is
    a thread a physical core, and its OpenMP threads wait for each other at every operation: with
    every core taken, anything else the machine runs (a second run, the tests, a server) stalls
    each operation, an iteration twelve times slower, while half the cores cost an idle 2-core
    machine 1.7x (docs/run.md); with two hardware threads a core, half is torch's own choice. The
    scripts call it from their command line only, so that a caller of their main() keeps its own
    torch.set_num_threads."""
    if torch.cuda.is_available() or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, cores // 2))


def last_line(line):
    """A command's last line, on stderr, below its progress bars: each is closed first (one that
    stays shows its last state above the line), so that none is drawn again under it."""
    for bar in list(getattr(tqdm, "_instances", [])):
        bar.close()
    print(line, file=sys.stderr, flush=True)


def quiet_libraries():
    """Keep off the command line what the libraries print that never applies to a run here:
    bitsandbytes' advice, at its import, to fetch a kernel package from a hub (nothing is fetched:
    its own CPU kernels serve), transformers' progress bars while it loads or saves weights, and
    its deprecation of an attribute peft reads. The project's own lines and bar are what is left."""
    from transformers.utils import logging as transformers_logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    transformers_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)


def exit_on_signals(say):
    """Ctrl-C and SIGTERM end the command at once (a request in flight may take a minute to time
    out) with one line, "stopped by SIGINT" and what say() returns (None: no line, for a process
    other than the main one), and exit code 130 / 143, as a shell reports a killed command. Files
    are written whole (renamed into place, or one whole JSON line), so nothing is left half written.
    release() puts the old handlers back."""
    def stopped(number, frame):
        told = say()
        if told is not None:
            last_line(f"stopped by {signal.Signals(number).name}{told}")
        os._exit(128 + number)
    for number in (signal.SIGINT, signal.SIGTERM):
        HELD.append((number, signal.signal(number, stopped)))


# A check takes a value and returns None when it is allowed, else what is allowed.
def one_of(*choices):
    def check(value):
        if value not in choices:
            return f"must be one of {' | '.join(map(str, choices))}"
    check.choices = choices  # argparse gets them, so --help lists them and refuses any other value
    return check


def at_least(low):
    """Finite and at least low: a coefficient of inf would make every update non-finite."""
    def check(value):
        if not low <= value < math.inf:  # nan is never in range
            return f"must be a finite number, at least {low}"
    return check


def above(low):
    """Finite and greater than low: a learning rate of inf or nan would make every weight NaN."""
    def check(value):
        if not low < value < math.inf:
            return f"must be a finite number above {low}"
    return check


def within(low, high, low_open=False, high_open=False):
    """From low to high, both included; low_open or high_open leaves that end out."""
    def check(value):
        above_low = value > low if low_open else value >= low
        below_high = value < high if high_open else value <= high
        if not (above_low and below_high):
            return f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    return check


# Values that look like secrets, whatever the setting is called: an OpenAI-style or Hugging Face
# key, a bearer token, the password of a URL (user:password@host), a key in a URL's query.
SECRETS = (re.compile(r"\bsk-[A-Za-z0-9_-]{6,}"),
           re.compile(r"\bhf_[A-Za-z0-9]{10,}"),
           re.compile(r"\bBearer\s+\S+", re.IGNORECASE),
           re.compile(r"(?<=://)[^/@\s]+(?=@)"),
           re.compile(r"(?<=[?&])((?:api[_-]?)?key|token|access_token|password)=[^&\s]*",
                      re.IGNORECASE))
REDACTED = "<redacted>"


def redact(value):
    """value with anything that looks like a secret replaced by <redacted> (lists element-wise)."""
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        for pattern in SECRETS:
            value = pattern.sub(REDACTED, value)
    return value


def env_name(value):
    """--api-key-env takes the name of a variable; a key typed there instead is refused, unshown."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return None
    return "must be the name of an environment variable that holds the key, such as OPENAI_API_KEY"


env_name.secret = True


# ----------------------------------------------------------------------------------------------
# Settings: each declared once, next to the code that reads it, with its check beside its default
# ----------------------------------------------------------------------------------------------
def setting(default, help, check=None, operational=False, path=False):
    """A field of a settings dataclass: its default, its --help line and its check (a function of
    the value: None when it is allowed, else what is allowed). operational: a rarely changed setting
    of how the run is carried out, not what it computes; --help lists those last, and --resume lets
    them change. path: a file or folder the run saves, made absolute where it exists, so that it
    means the same from any working folder."""
    metadata = {"help": help, "check": check, "operational": operational, "path": path}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def to_bool(text):
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError("must be true or false")
    return text.lower() == "true"


# How argparse reads a flag, by its default's type: a boolean as `--x` or `--x true|false`, a list
# as any number of values; anything else as one value of the default's type.
KINDS = {bool: dict(type=to_bool, nargs="?", const=True, metavar="true|false"),
         list: dict(nargs="*")}

# What --resume lets a command line change: how long and how often, and where to log; besides these,
# every operational setting. Anything else (the model, the adapters, the method, the data, the seed)
# is the run's own, taken from its config.json.
RESUMABLE = ("iterations", "save_every", "keep_checkpoints", "max_bad_updates", "report_to")


class DefaultsShown(argparse.HelpFormatter):
    """--help with each flag's default (the script's own, without a preset) after its help; none
    for an empty one."""

    def _split_lines(self, text, width):  # never inside a flag's name (--micro-batch-size)
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action):
        if not action.option_strings or action.default in ("", [], None, argparse.SUPPRESS):
            return action.help
        return f"{action.help} (default: %(default)s)"


def parse_settings(classes, argv=None, presets=None, defaults=None, prog=None):
    """One argparse parser over the fields of `classes` (one --help group per class's `group`, the
    operational settings in a last group), then every value against its field's check and each
    class's check(args) for settings that only work together. Flags are spelled with -, as --help
    shows them; booleans read `--x` or `--x true|false`. defaults: the script's own;
    presets: {name: defaults} picked with --preset; a flag given on the command line wins. With
    --resume DIR the run's saved settings come back (resume_settings), and a class's
    inherit(args, fields) takes settings from the files it names (evaluate.py: its adapters' runs),
    both before every check. Bad input ends the program with one line, exit code 2."""
    if argv is None:
        argv = sys.argv[1:]
    TAKEN.clear()  # a new command's settings
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False, formatter_class=DefaultsShown)
    parser.error = fail
    groups = {cls.title: parser.add_argument_group(cls.title) for cls in classes}
    operational = parser.add_argument_group("operational (rarely changed)")
    fields, actions = [], {}
    for cls in classes:
        declared = cls()  # every field at its declared default
        for f in dataclasses.fields(cls):
            fields.append(f)
            default = getattr(declared, f.name)
            group = groups[cls.title]
            if f.metadata["operational"]:
                group = operational
            kind = KINDS.get(type(default), dict(type=type(default)))
            actions[f.name] = group.add_argument(
                f"--{f.name.replace('_', '-')}", default=default, help=f.metadata["help"],
                choices=getattr(f.metadata["check"], "choices", None), **kind)
    for name, preset in (presets or {}).items():  # --help says what each preset changes
        changes = " ".join(f"--{k.replace('_', '-')} {str(v).lower() if isinstance(v, bool) else v}"
                           for k, v in preset.items())
        actions["preset"].help += f". {name}: {changes or 'the defaults'}".replace("%", "%%")
    # set_defaults replaces the fields' defaults: the script's own, then the preset's (read by a
    # first pass; its flag's choices refuse an unknown one), so that every flag given wins over both
    parser.set_defaults(**(defaults or {}))
    if presets:
        parser.set_defaults(**presets[parser.parse_args(argv).preset])
    args = parser.parse_args(argv)
    args.given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    if getattr(args, "resume", ""):
        resume_settings(args, fields, prog)
    for cls in classes:  # settings a class takes from files it names (evaluate.py: its adapters'
        if hasattr(cls, "inherit"):  # runs), each checked there as its flag is
            cls.inherit(args, fields)
    for f in fields:
        value = getattr(args, f.name)
        check_setting(f, value)
        if f.metadata["path"] and os.path.exists(value):
            setattr(args, f.name, os.path.abspath(value))
    for cls in classes:
        if hasattr(cls, "check"):
            cls.check(args)
    return args


def check_setting(f, value, where=None):
    """One line (exit 2) unless value is one the setting f allows: of its default's type (a value
    from a file is checked as a flag is, its type first; a bool is no int), then its check. where:
    the file and field the value came from, named first."""
    declared = f.default_factory() if f.default is dataclasses.MISSING else f.default
    kinds = (int, float) if type(declared) is float else (type(declared),)
    check = f.metadata["check"]
    problem = f"must be {type(declared).__name__}"
    if type(value) in kinds:
        problem = check and check(value)
    if problem:
        shown = REDACTED if getattr(check, "secret", False) else repr(redact(value))
        fail(f"{where + ': ' if where else ''}--{f.name.replace('_', '-')} {shown}: {problem}")


def settings_of_runs(args, fields, runs, names):
    """The settings `names` of other runs (runs: [(a config.json's path, its settings)]) where the
    command line did not give them: each value of every run checked as its flag is (check_setting,
    one line naming the file and the field), then taken, when the runs agree (else one line), and
    TAKEN, so that a later line about it names the file too."""
    fields = {f.name: f for f in fields}
    for name in names:
        flag = f"--{name.replace('_', '-')}"
        had = [(f"{where}: field '{name}'", run[name]) for where, run in runs if name in run]
        for where, value in had:
            check_setting(fields[name], value, where)
        values = {value for _, value in had}
        if values and name not in args.given:
            if len(values) > 1:
                fail(f"the runs were trained with different {flag} ({sorted(values)}): "
                     f"give {flag} to use them alike")
            setattr(args, name, values.pop())
            TAKEN[flag] = had[0][0]


def read_run(folder):
    """The saved settings of a run folder (its config.json, the run's mark), or None."""
    try:
        saved = json.loads(Path(f"{folder}/config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(saved, dict) and "script" in saved:
        return saved
    return None


def resume_settings(args, fields, prog=None):
    """--resume DIR: the run's saved settings replace the defaults, each one TAKEN from config.json;
    a flag given now may change only what RESUMABLE and the operational settings allow. Every check
    runs after this, on what is kept."""
    saved = read_run(args.resume)
    if saved is None:
        fail(f"--resume {args.resume}: not a run folder (no config.json written by a trainer)")
    if saved["script"] != prog:  # the other trainer's checkpoints hold other parts
        advice = "it is not a training run"
        if saved["script"] in ("ppo.py", "grpo.py"):
            advice = f"resume it with `python {saved['script']} --resume {args.resume}`"
        fail(f"--resume {args.resume}: the run was made by {saved['script']}; {advice}")
    if "out" in args.given and os.path.abspath(args.out) != os.path.abspath(args.resume):
        fail(f"--out {args.out} with --resume {args.resume}: "
             "a resume continues in the run's own folder")
    for f in fields:
        # a setting added since keeps today's default; consent to hub code is never inherited; the
        # folder is the one resumed (a run folder may have been moved or copied since it was made)
        if f.name not in saved or f.name in ("resume", "out", "trust_remote_code"):
            continue
        now = getattr(args, f.name)
        then = saved[f.name]
        if f.name not in args.given:
            setattr(args, f.name, then)
            # a line about its flag, or about a path's value, names where it came from (Stop)
            where = f"{args.resume}/config.json: field '{f.name}'"
            TAKEN[f"--{f.name.replace('_', '-')}"] = where
            if f.metadata["path"]:
                TAKEN[str(then)] = where
        elif redact(now) != then and f.name not in RESUMABLE and not f.metadata["operational"]:
            fail(f"--{f.name.replace('_', '-')} {redact(now)!r}: the run in {args.resume} has "
                 f"{then!r}, and --resume keeps it (it may change only {', '.join(RESUMABLE)} "
                 "and the operational settings)")
    args.out = os.path.abspath(args.resume)


def public_config(args, script):
    """The settings as config.json holds them: the script that made the run, and every value with
    anything that looks like a secret hidden (redact; a secret comes only from the environment)."""
    # given (which flags were typed) is parse_settings' note, not a setting
    return {"script": script,
            **{name: redact(value) for name, value in vars(args).items() if name != "given"}}


@dataclasses.dataclass
class RunSettings:
    """A training run's length, folder, checkpoints and resume."""
    title = "the run"
    preset: str = setting("paper", "paper (Qwen2.5-7B on CUDA) | cpu (the embedded model, a few "
                                   "iterations) | cpu-learn (the embedded model, 20 iterations of "
                                   "one-turn dialogues, 14-27 min: the reward rises); explicit "
                                   "flags win",
                          one_of("paper", "cpu", "cpu-learn"))
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


def summary(rows):
    """A run in one line, from its metrics.jsonl rows: the iterations and the minutes they took
    (their time_iteration: no loading, no checkpoints), and the mean reward and final emotion over
    its first and its last iterations (3 each, fewer in a short run; never the same ones, but in a
    run of one iteration)."""
    k = max(1, min(3, len(rows) // 2))

    def mean(key, part, digits):
        values = [row[key] for row in part if row.get(key) is not None]
        return f"{sum(values) / len(values):.{digits}f}" if values else "-"
    minutes = sum(row.get("time_iteration") or 0 for row in rows) / 60
    return (f"{len(rows)} iterations in {minutes:.1f} min; reward_mean "
            f"{mean('reward_mean', rows[:k], 3)} -> {mean('reward_mean', rows[-k:], 3)}, "
            f"final_emotion_mean {mean('final_emotion_mean', rows[:k], 1)} -> "
            f"{mean('final_emotion_mean', rows[-k:], 1)} (first -> last "
            f"{'iteration' if k == 1 else f'{k} iterations'})")


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
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
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
    """Run a block without moving torch's, numpy's or python's random streams (the CUDA devices'
    included). Loading and converting a model must not draw from them, or a run that converts the
    embedded model would train differently from every later one."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


# ----------------------------------------------------------------------------------------------
# Files: atomic writes and JSON lines
# ----------------------------------------------------------------------------------------------
def write_atomically(path, text):
    """Replace a file so that a kill at any moment leaves the old or the new one whole: a temporary
    file beside it, synced, renamed over (atomic on POSIX); it is removed if the write fails."""
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


def finite(row):
    """A copy of a JSON-able value with every NaN or infinite float as None: JSON has neither, and
    strict readers reject the NaN that json.dumps writes."""
    if isinstance(row, float) and not math.isfinite(row):
        return None
    if isinstance(row, dict):
        return {k: finite(v) for k, v in row.items()}
    if isinstance(row, (list, tuple)):
        return [finite(v) for v in row]
    return row


def append_lines(path, rows):
    """Append rows to a JSON-lines file as whole lines, flushed and synced: a crash afterwards
    leaves them on disk, a kill during the write at most one torn last line, which every reader
    here skips."""
    lines = [json.dumps(finite(row), ensure_ascii=False, allow_nan=False) + "\n" for row in rows]
    with open(path, "a", encoding="utf-8") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())


def read_text(path, error=ValueError):
    """A text file named on the command line; `error` (one line naming the file, and the line of a
    byte that is not UTF-8) when it cannot be read. Only a regular file is read: a named pipe would
    wait for a writer forever."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise error(f"{path}: not a regular file")
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{path}: cannot read: {e.strerror}")
    except UnicodeDecodeError as e:
        raise error(f"{path}: line {e.object[:e.start].count(10) + 1}: not UTF-8 text")


def parse_json(text, where, error=ValueError):
    """A JSON value; `error` (one line naming `where`) when the text is not JSON, nests too deep
    for Python to read, or holds a lone surrogate (an escape such as \\ud800: no tokenizer takes
    it)."""
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return value
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON: {e.msg}")
    except RecursionError:
        raise error(f"{where}: nested too deep to read")
    except UnicodeEncodeError:
        raise error(f"{where}: holds a lone surrogate (an escape such as \\ud800), "
                    "which is not text")


def read_json_lines(path, error=ValueError):
    """[(line index, object)] for each non-empty line of a JSON-lines file; `error` (one line naming
    the file and the line) when it cannot be read or a line is not JSON (parse_json)."""
    lines = read_text(path, error).splitlines()
    return [(i, parse_json(line, f"{path}: line {i + 1}", error))
            for i, line in enumerate(lines) if line.strip()]


def write_failure(error, path):
    """Why a write to path failed, in words: "the disk is full" when less than 1 MiB is left there
    (torch.save says only "unexpected pos" on a full disk), else the error's first line."""
    path = os.path.abspath(path)
    while not os.path.exists(path):  # up to a folder that is still there ("/" at the latest)
        path = os.path.dirname(path)
    if shutil.disk_usage(path).free < 2**20:
        return "the disk is full"
    first_line = str(error).partition("\n")[0]
    return f"{type(error).__name__}: {first_line[:160]}"


def new_folder(out, flag="--out"):
    """A folder for this command only, held by a lock for the process's life: created here (its
    parents too), or taken while empty; never a folder that holds anything, and never one inside a
    run folder (whose checkpoints could take its name). Bad: one line, exit 2."""
    for parent in Path(os.path.realpath(out)).parents:  # links resolved
        if read_run(parent):
            fail(f"{flag} {out} is inside the run folder {parent}: pick a folder outside it")
    try:
        os.makedirs(out)
    except FileExistsError:
        if not os.path.isdir(out) or os.listdir(out):
            fail(f"{flag} {out} exists and is not an empty folder: "
                 f"a command writes only into a folder it creates; pick a new {flag}"
                 f"{' (or continue a run with --resume)' if read_run(out) else ''}")
    except OSError as e:
        fail(f"{flag} {out} cannot be made ({e.strerror})")
    lock(out, flag)


def lock(folder, flag):
    """An flock on the folder itself, which the kernel drops when this process ends, however it
    ends: a second command writing there stops with one line."""
    fd = os.open(folder, os.O_RDONLY)
    HELD.append(fd)  # closed by release(), which fail() calls too
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fail(f"{flag} {folder} is being written by another process; wait for it to end")


def checkpoints(run_dir):
    """The run's checkpoints, oldest first: the folders of RUN/checkpoints named iter_NNNNNN (six
    digits: sorted as names, they are sorted by iteration). save() writes each one into
    iter_NNNNNN.tmp and renames it into place, so the name is the mark of a complete one, whatever
    a kill interrupted; no list beside them can disagree with the folders. A checkpoint is what
    save() writes, a real folder in a real folder: a link or a file in the place of either (a link
    to another run's checkpoint, or to itself) is one line naming it (exit 2), so that it is never
    taken for one, nor in the way of a save's rename."""
    folder = f"{run_dir}/checkpoints"
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    found = [f"{folder}/{n}" for n in names if re.fullmatch(r"iter_[0-9]{6}", n)]
    for path in [folder] * os.path.lexists(folder) + found:  # the folder, if any, first
        if os.path.islink(path) or not os.path.isdir(path):
            fail(f"{path} is a link or a file where a run saves a folder: move it out of {run_dir}")
    return found


def state_problem(state, parts, iteration):
    """What keeps a checkpoint's state.pt from being what save() writes, or None: a dict with each
    part's state dict, a list with each process's random streams (a dict of their python, numpy
    and torch states), the size of each log (an int) and its 'iteration', the one its folder is
    named with (a copy under another name is another iteration's)."""
    if not isinstance(state, dict):
        return f"holds a value of type {type(state).__name__}, not a dict"
    if state.get("iteration") != iteration:
        return f"is the state of iteration {state.get('iteration')!r}, not {iteration}"
    layout = {**dict.fromkeys(parts, dict), "rng": list, "log_sizes": dict}
    for key, kind in layout.items():
        if not isinstance(state.get(key), kind):
            return f"its '{key}' is not a {kind.__name__}"
    if not all(isinstance(r, dict) and {"python", "numpy", "torch"} <= r.keys()
               for r in state["rng"]):
        return "its 'rng' is not one dict of python, numpy and torch states a process"
    if not all(isinstance(state["log_sizes"].get(log), int) for log in LOGS):
        return f"its 'log_sizes' has no int for each of {', '.join(LOGS)}"


# ----------------------------------------------------------------------------------------------
# The Run: one training run, called by name from the trainer's loop
# ----------------------------------------------------------------------------------------------
LOGS = ("metrics.jsonl", "rollouts.jsonl")  # a run's logs, one JSON line an iteration / a dialogue


class Run:
    """One training run. The trainer makes it once its settings and data are checked and before any
    model loads; hands it what a checkpoint holds once the models exist (begin); then calls it by
    name in its loop: share() for this process's dialogues, lap() at the end of a step (its
    seconds), sum() and gather() for global figures (accelerate's reduce and gather_object; sum()
    also makes the loss's denominators global counts), add_sums() for what the update logs,
    sum_gradients() before the clip, skip_or_stop() for a non-finite step, log() and save_if_due()
    after each iteration, stop() when the simulator cannot answer, finish() at the end. It holds
    no loop; it counts the iterations done (log).

    The folder: a new run creates it (new_folder); --resume takes the run's own (its settings came
    back in parse_settings). Either way it holds a lock, and config.json (the settings, the run's
    mark) is written at once. The processes: one per GPU under `accelerate launch`; the settings in
    per_process must split evenly over them; every process is seeded alike, so the adapters start
    equal. The tracker (--report-to, through accelerate) gets every number of a metrics line;
    metrics.jsonl stays the record."""

    def __init__(self, args, script, adapters, per_process=()):
        from accelerate import Accelerator
        from accelerate.utils import gather_object

        # without --out, a new folder named as CleanRL's
        new_run_folder = f"runs/{script[:-3]}__{args.seed}__{int(time.time())}"  # as CleanRL's
        args.out = os.path.abspath(args.out or new_run_folder)
        self.args = args
        self.script = script
        self.adapters = adapters
        trackers = None  # accelerate's log_with
        if args.report_to != "none":
            trackers = [args.report_to]
            # asked before any model loads: a missing tracker package is one line, not a crash after
            # an hour of loading (each tracker's pip package has its name)
            if importlib.util.find_spec(args.report_to) is None:
                fail(f"--report-to {args.report_to} needs the {args.report_to} package: "
                     f"pip install {args.report_to}")
        # project_dir: where TensorBoard writes (<run folder>/rlver/)
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available(), project_dir=args.out,
                                       log_with=trackers)
        self.device = self.accelerator.device
        self.is_main = self.accelerator.is_main_process
        self.rank = self.accelerator.process_index
        self.world = self.accelerator.num_processes
        # collective calls: sum(tensor) over every process (with one: a copy), and gather(list),
        # every process's items in rank order (with one: the list itself); the reduction is named,
        # not left to accelerate's default, since the loss denominators depend on it
        self.sum = functools.partial(self.accelerator.reduce, reduction="sum")
        self.gather = gather_object
        for name in per_process:  # counts that every process takes an equal share of
            if getattr(args, name) % self.world:
                fail(f"--{name.replace('_', '-')} {getattr(args, name)} must divide by the "
                     f"{self.world} processes")
        # before any model loads: what is under checkpoints/ is checkpoints (a run never gets past
        # its --iterations, so a later one is not this run's)
        for folder in checkpoints(args.out) if args.resume else []:
            if int(folder[-6:]) > args.iterations:
                fail(f"{folder} is past this run's --iterations {args.iterations}: give "
                     f"--iterations {int(folder[-6:])} or more, or move it out of "
                     f"{args.out}/checkpoints")
        if self.is_main:
            if args.resume:
                lock(args.out, "--resume")
            else:
                new_folder(args.out)
            try:
                write_atomically(f"{args.out}/config.json",
                                 json.dumps(public_config(args, script), indent=1))
            except OSError as e:
                fail(f"--out {args.out} cannot be written ({write_failure(e, args.out)})")
        self.show_progress = self.is_main and sys.stderr.isatty()  # the rollout's own bar
        set_seed(args.seed)

    # --- start and resume ------------------------------------------------------------------------
    def begin(self, model, optimizer, scheduler, modules=None):
        """The models exist: with a checkpoint to resume from (restore), load it; else seed each
        process apart (each samples its own dialogues). Then drop the log lines written after the
        checkpoint, open the trackers and catch Ctrl-C and SIGTERM. Returns the first iteration."""
        args = self.args
        # what state.pt holds besides the adapters, each under its name
        self.model = model
        self.parts = {"optimizer": optimizer, "scheduler": scheduler, **(modules or {})}
        self.trained = [p for group in optimizer.param_groups for p in group["params"]]
        TAKEN.clear()  # the settings are checked: a line from here on is about the run
        folder, start, log_sizes = self.restore()
        if self.is_main:
            # the logs as long as they were when the checkpoint was written (empty without one: the
            # run starts again from its beginning): what came after belongs to iterations that run
            # again, a torn last line included; a log cut shorter than that is never appended to
            for name in LOGS:
                size = log_sizes[name]
                with open(f"{args.out}/{name}", "a", encoding="utf-8") as f:
                    if f.tell() < size:
                        fail(f"{args.out}/{name} is shorter than {folder} recorded ({f.tell()} of "
                             f"{size} bytes): it was cut; put the whole file back, "
                             "or start a new run")
                    f.truncate(size)
            message = f"{'resuming' if args.resume else 'run'} {args.out}"
            if folder:
                message += f" from {folder}"
            print(message, file=sys.stderr)
        # no config for the tracker: the run's config.json holds the settings. TensorBoard drops the
        # steps a killed run logged after the checkpoint (purge_step; nothing in a new run), as
        # metrics.jsonl does. Without a tracker this does nothing.
        options = {"tensorboard": {"purge_step": start + 1}, "wandb": {"name": Path(args.out).name}}
        self.accelerator.init_trackers("rlver", init_kwargs=options)
        exit_on_signals(self.stopped_at)
        self.done = start  # iterations done
        self.saved_at = start  # the last iteration saved
        self.saving = None  # the iteration whose checkpoint is being written
        self.bad_in_a_row = 0
        self.bar = tqdm(total=args.iterations, initial=start, desc=self.script[:-3],
                        disable=not self.is_main)
        self.times = {}  # the laps of the iteration
        self.t_iteration = time.time()  # the first iteration's clock
        return start

    def restore(self):
        """(checkpoint folder, its iteration, the logs' sizes it recorded) of the newest checkpoint
        that loads, loaded into the adapters, the optimizer, the schedule, the modules and (with as
        many processes as it was saved by) each process's random streams; (None, 0, empty logs)
        where there is none, each process seeded apart. Everything of it is read here: one that
        does not load (a truncated file, another trainer's state, a state.pt of another layout) is
        named in a warning, moved aside to NAME.broken, and the one before it is tried; where none
        loads, or one cannot be moved aside, one line."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        found = checkpoints(self.args.out)
        for folder in reversed(found):
            try:
                start = int(folder[-6:])  # iter_NNNNNN: the next save is never this folder
                state = torch.load(f"{folder}/state.pt", map_location="cpu", weights_only=False)
                problem = state_problem(state, self.parts, start)
                if problem:
                    raise ValueError(f"{folder}/state.pt: {problem}")
                weights = {name: load_file(f"{folder}/{name}/adapter_model.safetensors")
                           for name in self.adapters}
                for name, part in self.parts.items():
                    part.load_state_dict(state[name])
                for name, adapter in weights.items():
                    # copied onto the device
                    set_peft_model_state_dict(self.model, adapter, adapter_name=name)
                # as many processes as before: each one's stream continues; else each is seeded
                # apart
                if len(state["rng"]) == self.world:
                    set_rng_state(state["rng"][self.rank])
                else:
                    set_seed(self.args.seed + self.rank + 7919 * start)
                return folder, start, state["log_sizes"]
            # whatever a file that is not this run's checkpoint makes torch, safetensors or peft
            # raise (the layout is checked first, so a bug of this code shows in the message)
            except Exception as e:
                why = f"{type(e).__name__}: {str(e).partition(chr(10))[0][:160]}"
                if self.is_main:  # kept, out of the way of the iteration's new checkpoint
                    try:
                        os.rename(folder, f"{folder}.broken")
                    except OSError as moved:
                        fail(f"the checkpoint {folder} does not load ({why}) and cannot be moved "
                             f"to {folder}.broken ({moved.strerror}): move it out of "
                             f"{self.args.out}/checkpoints, then run "
                             f"`python {self.script} --resume {self.args.out}` again")
                tqdm.write(f"warning: the checkpoint {folder} does not load ({why}); "
                           f"moved to {folder}.broken", file=sys.stderr)
        if found:
            fail(f"--resume {self.args.out}: none of its {len(found)} checkpoints loads; "
                 f"move the broken ones out of {self.args.out}/checkpoints, or start a new run")
        set_seed(self.args.seed + self.rank)
        return None, 0, dict.fromkeys(LOGS, 0)

    def lap(self, step):
        """The seconds since the last lap (or since the iteration began), logged as time_<step>."""
        seconds = time.time() - self.t_iteration - sum(self.times.values())
        self.times[f"time_{step}"] = seconds
        return seconds

    def resume_advice(self):
        """What holds now and the command that continues (every one tested)."""
        found = checkpoints(self.args.out)
        how = f"python {self.script} --resume {self.args.out}"
        if read_run(self.args.out) is None:  # deleted: --resume would find no run folder there
            return (f"{self.args.out} holds no run any more (no config.json): start a new run, "
                    f"`python {self.script}` with the flags it was started with")
        if found:
            return f"the newest complete checkpoint is {found[-1]}; `{how}` continues from it"
        return f"there is no checkpoint yet; `{how}` starts the run again from its beginning"

    def stopped_at(self):
        """What the line of a Ctrl-C or SIGTERM says (the main process's): where the run stopped and
        how to go on. Checkpoints are renamed into place whole, and a log line cut short is dropped
        on resume, so nothing a resume needs is lost."""
        if not self.is_main:
            return None
        where = f"in iteration {self.done + 1}"
        if self.saving:
            where = f"while the checkpoint of iteration {self.saving} was written"
        return f" {where} of {self.args.out}; {self.resume_advice()}"

    def halt(self, message):
        """The trained weights or their gradients are not finite and the run cannot go on: one line
        (main process) with what to do, exit code 1, once every process is here."""
        self.accelerator.wait_for_everyone()
        advice = "Lower the learning rate or use --dtype float32 first."
        line = f"{message}; {self.resume_advice()}. {advice}"
        if not self.is_main:
            line = ""  # the main process says it
        fail(line, code=1)

    # --- the processes ---------------------------------------------------------------------------
    def share(self, items):
        """This process's part of a list every process drew alike: an equal slice, in rank order."""
        n = len(items) // self.world
        return items[self.rank * n:(self.rank + 1) * n]

    def sum_gradients(self, params):
        """Sum the gradients of `params` over every process (each loss was already divided by the
        global count), one all-reduce a tensor, in the order of params, the same on every process.
        PPO's adapters on Qwen2.5-7B are 786 tensors: 786 calls of tens of microseconds each beside
        a step of seconds, and no flat copy of every gradient (0.6 GB). Every process runs the same
        losses on dialogues that each hold an agent token, so a parameter has a gradient on all of
        them or on none (the critic's LoRA on lm_head, which its value head never reads): one that
        is None stays None, and AdamW passes over it."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is not None:
                p.grad.copy_(self.sum(p.grad))

    def skip_or_stop(self, grad_norm):
        """True, with a warning, when the clipped gradients' norm is not finite: the trainer drops
        them and takes no step; the --max-bad-updates-th in a row stops the run with one line."""
        if torch.isfinite(grad_norm):
            self.bad_in_a_row = 0
            return False
        self.bad_in_a_row += 1
        tqdm.write(f"warning: iteration {self.done + 1}: non-finite gradient, update skipped "
                   f"({self.bad_in_a_row} in a row)", file=sys.stderr)
        if self.bad_in_a_row >= self.args.max_bad_updates:
            self.halt(f"{self.bad_in_a_row} non-finite updates in a row; stopped in iteration "
                      f"{self.done + 1}")
        return True

    @torch.no_grad()
    def add_sums(self, logs, terms, mask):
        """Add each of the update's per-token terms (b, T), summed over the agent tokens of mask,
        and the count of those tokens, to logs[name] ([sum, count]; a term that is None is left
        out). log() sums both over the processes before it divides, so a figure is its mean over
        every token the iteration trained on, however they were split into micro-batches and
        processes (a mean of means would weigh a micro-batch of one token as one of a thousand). A
        figure of one value a step (a gradient norm) comes with a mask of 1."""
        for key, x in terms.items():
            if x is not None:
                logs[key][0] += torch.where(mask > 0, x, 0.0).sum().item()
                logs[key][1] += mask.sum().item()

    # --- after an iteration ----------------------------------------------------------------------
    def log(self, figures, update_logs, dialogues):
        """Step 5 of both trainers (a collective call): one metrics.jsonl line of the iteration's
        figures (already global), the global means of what the update logged (add_sums: every
        process's sums over every process's counts; None where nothing was counted), the laps'
        timings and peak memory (a number that is not finite is written as null); the dialogues
        (JSON objects) to rollouts.jsonl, each with its iteration; every number to the tracker."""
        iteration = self.done + 1
        sums = self.sum(torch.tensor(list(update_logs.values()), dtype=torch.float64,
                                     device=self.device))                                   # (K, 2)
        metrics = {"iteration": iteration, **figures,
                   **{k: (total / n).item() if n else None
                      for k, (total, n) in zip(update_logs, sums)},
                   **self.times, "time_iteration": time.time() - self.t_iteration,
                   "peak_memory_gb": peak_memory_gb(), "processes": self.world}
        if self.is_main:
            dialogues = [{"iteration": iteration, **d} for d in dialogues]
            for name, rows in zip(LOGS, ([metrics], dialogues)):
                try:
                    append_lines(f"{self.args.out}/{name}", rows)
                except OSError as e:
                    fail(f"cannot append to {name} in {self.args.out} "
                         f"({write_failure(e, self.args.out)}); {self.resume_advice()}", code=1)
        # the numbers only (a figure not measured this iteration is None, which accelerate's
        # trackers are not documented to take); main process only, and nothing without a tracker
        self.accelerator.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                             step=iteration)
        self.done = iteration
        self.bar.update(1)
        self.bar.set_postfix(reward=metrics["reward_mean"], emotion=metrics["final_emotion_mean"])

    def save_if_due(self, now=False):
        """(A collective call) after an iteration: a checkpoint every --save-every iterations, at
        the last one, and `now` (a run that stops); then the next iteration's clock and peak
        memory start."""
        if now or self.done % self.args.save_every == 0 or self.done == self.args.iterations:
            self.save(self.done)
        self.accelerator.wait_for_everyone()
        self.times = {}
        self.t_iteration = time.time()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def save(self, iteration):
        """(A collective call: every process hands in its RNG state.) The main process writes
        checkpoints/iter_N: each adapter in peft's format (PeftModel.from_pretrained loads it) with
        its role beside it, and state.pt (optimizer, schedule, modules, every process's RNG, the
        iteration, the logs' sizes), into iter_N.tmp renamed into place: the rename makes it a
        checkpoint (checkpoints), so a kill at any moment leaves the ones before whole. Then the
        oldest beyond --keep-checkpoints go. Weights that are not all finite are never a
        checkpoint; a write that fails (a full disk) leaves nothing half-written; either ends the
        run with one line on stderr."""
        rngs = self.gather([rng_state()])
        if not all(torch.isfinite(p).all() for p in self.trained):
            self.halt(f"iteration {iteration}: the trained weights hold NaN or infinity, "
                      "so they are no checkpoint")
        self.saving = self.saved_at = iteration
        out = self.args.out
        if self.is_main:
            final = f"{out}/checkpoints/iter_{iteration:06d}"
            tmp = f"{final}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left: none of it is kept
            try:
                for adapter in self.adapters:
                    # peft writes 'default' into the folder given and any other adapter into a
                    # subfolder of its name: either way each lands in tmp/<adapter>/, with its role
                    # (evaluate.py scores only a policy, wherever its folder was copied)
                    self.model.save_pretrained(f"{tmp}/default" if adapter == "default" else tmp,
                                               selected_adapters=[adapter])
                    Path(f"{tmp}/{adapter}/role").write_text(adapter, encoding="utf-8")
                state = {**{part: value.state_dict() for part, value in self.parts.items()},
                         "rng": rngs, "iteration": iteration,
                         "log_sizes": {log: os.path.getsize(f"{out}/{log}") for log in LOGS}}
                torch.save(state, f"{tmp}/state.pt")
                os.rename(tmp, final)  # the one step that makes it a checkpoint
            # an OSError, or what torch (RuntimeError) and safetensors say of a full disk
            except Exception as e:
                why = write_failure(e, final)  # before the removal gives the space back
                shutil.rmtree(tmp, ignore_errors=True)
                fail(f"iteration {iteration}: the checkpoint {final} could not be written ({why}); "
                     f"what was written of it is removed; {self.resume_advice()}", code=1)
            # the oldest go (--keep-checkpoints 0: none); a folder without state.pt is no
            # checkpoint anything saved (someone's notes, named like one) and is never deleted
            for old in checkpoints(out)[:-self.args.keep_checkpoints]:
                if os.path.isfile(f"{old}/state.pt"):
                    shutil.rmtree(old, ignore_errors=True)
        self.saving = None

    def stop(self, error):
        """A simulator that cannot answer ends the run with one line and exit code 2; a finished
        iteration not yet saved is saved first (with one process: a save is collective)."""
        if self.done > self.saved_at and self.world == 1:
            self.save_if_due(now=True)
        fail(f"{error}; {self.resume_advice()}")

    def finish(self):
        """Close the trackers and the progress bar, say what the run did (summary) and where the
        adapter is, release the folder."""
        self.bar.close()
        self.accelerator.end_training()
        if self.is_main:
            rows = [row for _, row in read_json_lines(f"{self.args.out}/metrics.jsonl")]
            print(f"done: {self.args.out}: {summary(rows)}; "
                  f"adapter: {checkpoints(self.args.out)[-1]}/default")
        release()
