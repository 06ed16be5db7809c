"""The run: a training run's folder, its lock, its checkpoints, its logs and its trackers.

ppo.py and grpo.py make one Run once their settings are checked, and in their loops every plumbing
call reads run.something(...): a reader who skips those lines still sees the whole method, the
optimizer step included.

  streams     seeds, the random streams' state, and random_streams_kept() for code that must not
              move them (a model's initialisation)
  files       atomic writes and JSON lines that a kill leaves whole
  folders     new_folder(): a command writes only into a folder it creates, held by a lock
  Run         one training run: its folder (new, or --resume's), checkpoints written whole and
              restored exactly, the sums over data-parallel processes, the log, the trackers
"""
import contextlib
import fcntl
import importlib.util
import json
import math
import os
import random
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from cli import (HELD, TAKEN, destination_flags, exit_on_signals, fail, public_config, read_run,
                 redact, release)


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
    taken for one, nor in the way of a save's rename; so is a link anywhere inside one (an adapter
    linked in from another run would load as this run's): every path of a checkpoint is its own."""
    folder = f"{run_dir}/checkpoints"
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    found = [f"{folder}/{n}" for n in names if re.fullmatch(r"iter_[0-9]{6}", n)]
    for path in [folder] * os.path.lexists(folder) + found:  # the folder, if any, first
        if os.path.islink(path) or not os.path.isdir(path):
            fail(f"{path} is a link or a file where a run saves a folder: move it out of {run_dir}")
    for checkpoint in found:
        for root, dirs, files in os.walk(checkpoint):  # links are listed, never followed
            for name in dirs + files:
                if os.path.islink(f"{root}/{name}"):
                    fail(f"{root}/{name} is a link inside a checkpoint, whose every file is what "
                         f"save() wrote there: move {checkpoint} out of {run_dir}/checkpoints")
    return found


def state_problem(state, parts, iteration):
    """What keeps a checkpoint's state.pt from being what save() writes, or None: a dict with each
    part's state dict, a list with each process's random streams (a dict of their python, numpy
    and torch states), the size of each log (an int, at least 0), the schedule's and the
    optimizer's step counts (at least 0) and its 'iteration', the one its folder is named with (a
    copy under another name is another iteration's)."""
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
    if not all(type(state["log_sizes"].get(log)) is int and state["log_sizes"][log] >= 0
               for log in LOGS):
        return f"its 'log_sizes' has no size (an int, at least 0) for each of {', '.join(LOGS)}"
    # the steps the schedule and AdamW go on from (a negative one turns the warm-up's rate negative)
    steps = [state["scheduler"].get("last_epoch")] + [
        s.get("step") for s in state["optimizer"].get("state", {}).values() if isinstance(s, dict)]
    if not all((type(n) is int or isinstance(n, torch.Tensor) and n.numel() == 1)
               and 0 <= float(n) < math.inf for n in steps):
        return "its scheduler's or optimizer's step count is not a finite number, at least 0"


# ----------------------------------------------------------------------------------------------
# The Run: one training run, called by name from the trainer's loop
# ----------------------------------------------------------------------------------------------
LOGS = ("metrics.jsonl", "rollouts.jsonl")  # a run's logs, one JSON line an iteration / a dialogue
# The figures of its last iteration a saved adapter's card gives (docs/metrics.md)
CARD_FIGURES = ("reward_mean", "reward_std", "final_emotion_mean", "unread_dialogues", "kl_ref",
                "clip_frac", "cut_reply_rate")


class Run:
    """One training run. The trainer makes it once its settings and data are checked and before any
    model loads; hands it what a checkpoint holds once the models exist (begin); then calls it by
    name in its loop: share() for this process's dialogues, lap() at the end of a step (its
    seconds), sum() and gather() for global figures (accelerate's reduce and gather_object; sum()
    also makes the loss's denominators global counts), add_sums() for what the update logs,
    sum_gradients() before the clip, skip_or_stop() for a non-finite step, log() (it writes the
    iteration's metrics and returns them; the trainer prints its line) and save_if_due() after each
    iteration, stop() when the simulator cannot answer, finish() at the end. It holds
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
        # a collective call: gather(list), every process's items in rank order (with one: the list
        # itself); sum(tensor) is the other (a method below)
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
        if found:  # each one moved aside above: the next --resume finds none
            moved = ", ".join(f"{os.path.basename(folder)}.broken" for folder in found)
            fail(f"--resume {self.args.out}: none of its {len(found)} checkpoints loads; each was "
                 f"moved aside in {self.args.out}/checkpoints ({moved}). The same command now "
                 f"starts the run again from iteration 1 and empties {' and '.join(LOGS)} (copy "
                 "them first to keep them); or start a new run")
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
        # a URL user's address and key variable are typed again on resume (confirm_destination)
        how = " ".join(filter(None, [f"python {self.script} --resume {self.args.out}",
                                     destination_flags(self.args)]))
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
        told = f" {where} of {self.args.out}; {self.resume_advice()}"
        self.keep(f"stopped by Ctrl-C or SIGTERM{told}")
        return told

    def halt(self, message):
        """The trained weights or their gradients are not finite and the run cannot go on: one line
        (main process) with what to do, exit code 1, once every process is here."""
        self.accelerator.wait_for_everyone()
        advice = "Lower the learning rate or use --dtype float32 first."
        line = f"{message}; {self.resume_advice()}. {advice}"
        if not self.is_main:
            line = ""  # the main process says it
        self.end(line, code=1)

    # --- the processes ---------------------------------------------------------------------------
    def sum(self, tensor):
        """(A collective call) the tensor summed over every process (with one: a copy). The
        reduction is named, not left to accelerate's default, since the loss denominators and the
        whitening's moments depend on it."""
        return self.accelerator.reduce(tensor, reduction="sum")

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
        (JSON objects) to rollouts.jsonl, each with its iteration; every number to the tracker.
        It prints nothing: it returns the metrics line, from which the trainer prints its own."""
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
                    self.end(f"cannot append to {name} in {self.args.out} "
                             f"({write_failure(e, self.args.out)}); {self.resume_advice()}", code=1)
        # the numbers only (a figure not measured this iteration is None, which accelerate's
        # trackers are not documented to take); main process only, and nothing without a tracker
        self.accelerator.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))},
                             step=iteration)
        self.done = iteration
        return metrics

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
            rows = self.metrics()  # for each adapter's card
            final = f"{out}/checkpoints/iter_{iteration:06d}"
            tmp = f"{final}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left: none of it is kept
            try:
                for adapter in self.adapters:
                    # peft writes 'default' into the folder given and any other adapter into a
                    # subfolder of its name: either way each lands in tmp/<adapter>/, with its role
                    # (evaluate.py scores only a policy, wherever its folder was copied). No
                    # embedding layer: none is trained here (no new token, LoRA on linear layers),
                    # and peft's "auto" would look the base's public name up on the hub each save
                    self.model.save_pretrained(f"{tmp}/default" if adapter == "default" else tmp,
                                               selected_adapters=[adapter],
                                               save_embedding_layers=False)
                    Path(f"{tmp}/{adapter}/role").write_text(adapter, encoding="utf-8")
                    # the project's card in the place of peft's blank one
                    Path(f"{tmp}/{adapter}/README.md").write_text(
                        self.model_card(adapter, iteration, rows), encoding="utf-8")
                state = {**{part: value.state_dict() for part, value in self.parts.items()},
                         "rng": rngs, "iteration": iteration,
                         "log_sizes": {log: os.path.getsize(f"{out}/{log}") for log in LOGS}}
                torch.save(state, f"{tmp}/state.pt")
                os.rename(tmp, final)  # the one step that makes it a checkpoint
            # an OSError, or what torch (RuntimeError) and safetensors say of a full disk
            except Exception as e:
                why = write_failure(e, final)  # before the removal gives the space back
                shutil.rmtree(tmp, ignore_errors=True)
                self.end(f"iteration {iteration}: the checkpoint {final} could not be written "
                         f"({why}); what was written of it is removed; {self.resume_advice()}",
                         code=1)
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
        self.end(f"{error}; {self.resume_advice()}")

    def finish(self):
        """Close the trackers, say what the run did (summary) and where the adapter is, release the
        folder."""
        self.accelerator.end_training()
        if self.is_main:
            line = (f"done: {self.args.out}: {summary(self.metrics())}; "
                    f"adapter: {checkpoints(self.args.out)[-1]}/default")
            print(line)
            self.keep(line)
        release()

    def metrics(self):
        """The rows of metrics.jsonl (the main process's): whole lines only, since begin() cut the
        log at its checkpoint and each line since was appended whole."""
        with open(f"{self.args.out}/metrics.jsonl", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    # --- what the run folder says of itself -------------------------------------------------------
    def end(self, line, code=2):
        """End the run with one line (fail: stderr, exit code `code`), kept in summary.txt too."""
        self.keep(f"error: {line}")
        fail(line, code)

    def keep(self, line):
        """Append a line that ends the run's process (finish's `done:`, or a stop with the resume
        advice) to the run folder's summary.txt, with the time: the terminal's last line scrolls
        away; the folder keeps every end, the newest last (a stop, then its resume's `done:`). On a
        disk that is full (which may be the stop) the line is on the terminal only."""
        if not self.is_main:
            return
        try:
            with open(f"{self.args.out}/summary.txt", "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        except OSError:
            pass

    def model_card(self, adapter, iteration, rows):
        """The README.md of a saved adapter (peft writes a blank one, and the base's path on this
        machine): what it is and how it was made, its last figures, how to load it with peft alone.
        No path of this machine: the run by its folder's name, the base by its public name
        (policy.public_name), each setting's path by its last part (cli.preset_changes)."""
        args = self.args
        base = self.model.peft_config[adapter].base_model_name_or_path
        hub = "/" in base  # org/name; a local folder is named by its last part
        name = redact(Path(args.out).name)
        where = f"{name}/checkpoints/iter_{iteration:06d}/{adapter}"
        changes = ", ".join(f"`--{k.replace('_', '-')} {redact(v)}`"
                            for k, v in getattr(args, "off_preset", {}).items()) or "none"
        role = ("the policy (the agent)" if adapter == "default" else
                f"PPO's {adapter} (its LoRA only: the value head is `value_head` in "
                "../state.pt, which peft does not load)")
        last = rows[-1] if rows else {}
        figures = ", ".join(f"{key} {last[key]:.4g}" for key in CARD_FIGURES
                            if isinstance(last.get(key), (int, float)))
        lines = ["---", *([f"base_model: {base}"] if hub else []), "library_name: peft",
                 "pipeline_tag: text-generation", "tags:",
                 *([f"- base_model:adapter:{base}"] if hub else []), "- lora", "- rlver",
                 f"- {self.script[:-3]}", "---",
                 f"# {name}: {role}, iteration {iteration}", "",
                 f"A LoRA adapter on `{base}`{'' if hub else ' (a local folder)'}, trained by "
                 f"`{self.script}` of RLVER, small and readable (reinforcement learning with "
                 "verifiable emotion rewards, arXiv 2507.03112): the agent talks with a simulated "
                 "user whose final emotion / 100 is the reward.", ""]
        # the embedded model (policy.PUBLIC_NAMES): a name that is neither base nor a folder's path
        if args.model != base and not os.path.isabs(args.model):
            lines += [f"Trained on `--model {args.model}`, the project's embedded copy of `{base}` "
                      "(a quantized GGUF file, dequantized: docs/rollouts.md); on the hub's "
                      "weights the adapter behaves close to, not exactly as, in training.", ""]
        lines += [f"- trainer: `{self.script}`, adapter `{adapter}`",
                  f"- settings: `--preset {args.preset}`, seed {args.seed}; different from the "
                  f"preset: {changes}",
                  f"- the simulated user: `--simulator {redact(args.simulator)}`; the agent's "
                  f"system prompt: rollout.py's for `--thinking {str(args.thinking).lower()}`",
                  f"- iteration {iteration} of {args.iterations}",
                  f"- its last figures (iteration {last.get('iteration', '-')}, metrics.jsonl; "
                  f"docs/metrics.md): {figures or 'none logged'}",
                  f"- the run: {summary(rows) if rows else 'no iteration logged'}", "",
                  "## Load it with peft", "", "```python",
                  "from peft import PeftModel",
                  "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                  f'base = AutoModelForCausalLM.from_pretrained("{base}")'
                  f'{"" if hub else "  # the local folder the run loaded"}',
                  f'tokenizer = AutoTokenizer.from_pretrained("{base}")',
                  f'model = PeftModel.from_pretrained(base, "{where}")', "```", "",
                  "Against the base on the benchmark: `python evaluate.py --adapter "
                  f"{where}` (docs/evaluate.md).", ""]
        return "\n".join(lines)

