"""The command line: what every script does before and around its work, none of it the method.

  bad input   fail() raises Stop, which command() turns into one line on stderr and exit code 2;
              the checks a setting declares (one_of, at_least, above, within)
  settings    setting() declares a field of a script's settings dataclass with its default, its
              --help line and its check side by side; parse_settings() builds one argparse parser
              from that dataclass, a preset and --resume's saved settings, and checks every value
  secrets     redact(): anything that looks like a key never reaches the screen, a log or a file
  files       the text and JSON files a command line names, read with one line for what is wrong
  signals     Ctrl-C and SIGTERM end a command with one line; release() lets go of what it held

It imports no other file of the project; every other file may import it.
"""
import argparse
import dataclasses
import difflib
import functools
import json
import logging
import math
import os
import re
import signal
import sys
import textwrap
import warnings
from pathlib import Path

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
    tests run several in one process), and forget where this command's settings came from, so
    that the next command's lines name no file of this one's."""
    TAKEN.clear()
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


KEY_VARIABLE = "OPENAI_API_KEY"  # --api-key-env's default: the variable OpenAI's clients read


def env_name(value):
    """--api-key-env takes the name of a variable; a key typed there instead is refused, unshown."""
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return None
    return f"must be the name of an environment variable that holds the key, such as {KEY_VARIABLE}"


env_name.secret = True


# ----------------------------------------------------------------------------------------------
# Settings: each field of a script's Settings with its default, its help and its check
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


def parse_settings(settings, argv=None, presets=None, defaults=None, prog=None):
    """The command line of a script whose settings are the dataclass `settings`: one argparse
    parser over its fields (a --help group for its own and one for each class it builds on, the
    operational settings in a last group), then every value against its field's check, and each
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
    # the script's own class first, then each it builds on (rl.TrainerSettings, ...)
    classes = [cls for cls in settings.__mro__ if dataclasses.is_dataclass(cls)]
    groups = {cls: parser.add_argument_group(cls.title) for cls in classes}
    operational = parser.add_argument_group("operational (rarely changed)")
    declared = settings()  # every field at its declared default
    by_name = {f.name: f for f in dataclasses.fields(settings)}
    fields, actions = [], {}  # in --help's order: the script's own first
    for cls in classes:
        for name in vars(cls).get("__annotations__", {}):  # the fields this class declares
            f = by_name[name]
            fields.append(f)
            default = getattr(declared, name)
            group = operational if f.metadata["operational"] else groups[cls]
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
        parser.set_defaults(**presets[parser.parse_known_args(argv)[0].preset])
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        fail(unknown_arguments(unknown, [a.option_strings[0] for a in actions.values()]))
    args.given = {a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    if getattr(args, "resume", ""):
        resume_settings(args, fields, prog)
    for cls in classes:  # settings a class takes from files it names (evaluate.py: its adapters'
        if "inherit" in vars(cls):  # runs), each checked there as its flag is
            cls.inherit(args, fields)
    for f in fields:
        value = getattr(args, f.name)
        check_setting(f, value)
        if f.metadata["path"] and os.path.exists(value):
            setattr(args, f.name, os.path.abspath(value))
    confirm_destination(args)
    for cls in classes:
        if "check" in vars(cls):
            cls.check(args)
    # what the run's model card names besides its preset (run.Run.save)
    args.off_preset = preset_changes(settings, presets, vars(args))
    return args


# What a run folder's config.json may never choose unseen: where the URL user's requests go, and
# which environment variable's key they carry (KEY_VARIABLE unless --api-key-env says another)
DESTINATION = ("simulator", "api_key_env")


def destination_flags(args):
    """The flags that state a URL user's address and key variable (where not KEY_VARIABLE), as args
    holds them ("" for a user that sends nothing: same, rules): what a command that sends them
    there types."""
    if not str(getattr(args, "simulator", "")).startswith(("http://", "https://")):
        return ""
    flags = f"--simulator {args.simulator}"
    if args.api_key_env != KEY_VARIABLE:
        flags += f" --api-key-env {args.api_key_env}"
    return flags


def confirm_destination(args):
    """A URL user's address, or a key variable other than KEY_VARIABLE, that came from a run's
    config.json (TAKEN: --resume's run, evaluate.py's adapters' runs) is used only when typed on
    the command line too: else one line (exit 2), before any request, naming the file and what to
    type. A folder copied from elsewhere (a shared machine, a download) would otherwise send the key
    of any variable to any host."""
    flags = destination_flags(args)
    where = [TAKEN[flag] for name in DESTINATION
             if (flag := f"--{name.replace('_', '-')}") in TAKEN and name not in args.given
             and flag in flags]
    if where:
        fail(f"{' and '.join(where)}: the user's requests would go to {args.simulator} with the "
             f"key in ${args.api_key_env}, and a run's folder never chooses that unseen: type "
             f"{flags} to send them there, or give another --simulator")


def unknown_arguments(unknown, flags):
    """argparse's line for the arguments no flag takes, and for each unknown flag the nearest of
    `flags`: the same words in another order (--lr-critic: --critic-lr), else the closest spelling
    (difflib, as argparse itself does for a choice from Python 3.14 on)."""
    line = f"unrecognized arguments: {' '.join(unknown)}"
    for word in unknown:
        if word == "--":  # argparse's separator: what follows is no flag
            break
        typed = word.partition("=")[0]  # --flag=value: the flag
        if not typed.startswith("--"):
            continue
        words = sorted(typed[2:].replace("_", "-").split("-"))
        near = [flag for flag in flags if sorted(flag[2:].split("-")) == words]
        near = near or difflib.get_close_matches(typed, flags, n=1, cutoff=0.6)
        if near:
            line += f"; {typed}: did you mean {near[0]}?"
    return line


# Not compared with a run's preset: where it writes (out, resume), what a resume may change
# (RESUMABLE) or how it is carried out (operational), and the seed (named apart)
NOT_THE_METHOD = ("preset", "out", "resume", "seed")


def preset_changes(settings, presets, values):
    """{name: value} of the settings in `values` (parse_settings' args, or a run's config.json)
    that differ from its preset's (presets[values['preset']] over the dataclass `settings`'
    defaults): empty for a run of the preset as it stands. An absolute path (a run saves each path
    that exists so) counts by its last part, and is given so, never as a path of this machine."""
    declared = settings()
    preset = (presets or {}).get(values.get("preset"), {})
    changes = {}
    for f in dataclasses.fields(settings):
        left_out = f.name in NOT_THE_METHOD or f.name in RESUMABLE or f.metadata["operational"]
        if left_out or f.name not in values:  # a setting added since the run was made
            continue
        value = values[f.name]
        if f.metadata["path"] and isinstance(value, str) and os.path.isabs(value):
            value = os.path.basename(os.path.normpath(value))
        if value != preset.get(f.name, getattr(declared, f.name)):
            changes[f.name] = value
    return changes


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
    a flag given now may change only what RESUMABLE and the operational settings allow (a path
    typed again is the same setting where it names the same file: same_path). Every check runs
    after this, on what is kept."""
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
        elif (redact(now) != then
              and not (f.metadata["path"] and isinstance(then, str) and same_path(now, then))
              and f.name not in RESUMABLE and not f.metadata["operational"]):
            fail(f"--{f.name.replace('_', '-')} {redact(now)!r}: the run in {args.resume} has "
                 f"{then!r}, and --resume keeps it (it may change only {', '.join(RESUMABLE)} "
                 "and the operational settings)")
    args.out = os.path.abspath(args.resume)


def same_path(typed, saved):
    """Whether a path typed now (relative to this working folder) names what a saved one names: the
    same absolute path, or the same file or folder by another path."""
    if os.path.abspath(typed) == os.path.abspath(saved):
        return True
    return os.path.exists(typed) and os.path.exists(saved) and os.path.samefile(typed, saved)


def public_config(args, script):
    """The settings as config.json holds them: the script that made the run, and every value with
    anything that looks like a secret hidden (redact; a secret comes only from the environment)."""
    # given (which flags were typed) and off_preset are parse_settings' notes, not settings
    return {"script": script,
            **{name: redact(value) for name, value in vars(args).items()
               if name not in ("given", "off_preset")}}


# ----------------------------------------------------------------------------------------------
# Files a command line names: read whole, or one line that says what is wrong
# ----------------------------------------------------------------------------------------------
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
    the file and the line) when it cannot be read or a line is not JSON (parse_json). Lines end at
    "\n" only: JSON leaves U+2028, U+0085 and the like unescaped inside strings (SAGE's recorded
    files hold them), where str.splitlines would cut a line in two."""
    lines = read_text(path, error).split("\n")
    return [(i, parse_json(line, f"{path}: line {i + 1}", error))
            for i, line in enumerate(lines) if line.strip()]

