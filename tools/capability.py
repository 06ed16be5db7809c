"""Math and code kept: the base and each adapter on capability tasks, through EleutherAI's lm-eval.

    python tools/capability.py --adapter runs/grpo__0__1700000000 [ADAPTER ...]
    python tools/capability.py --tasks rlver_arithmetic,rlver_code --allow-code-execution \\
        --adapter RUN
    python tools/capability.py --model Qwen/Qwen2.5-7B-Instruct --adapter RUN \\
        --tasks minerva_math500,humaneval_instruct --allow-code-execution      # online, on a GPU

The paper's second claim is that training for empathy leaves math and code as they were (MATH500
and LiveCodeBench stable or slightly better). Every task runs on the base (every adapter off) and
on each --adapter (adapter folders, a trainer's checkpoints or run folders, as evaluate.py takes
them) over one set of weights (evaluate.load_models), through lm-eval's Python API: an HFLM wraps
the loaded PeftModel. Per task and metric: the score with its 95% bootstrap interval over items,
and for an adapter the paired difference adapter - base over the same items with its interval
(stats.with_interval, stats.paired_difference). Decoding is greedy and the items come in a
fixed order, so the same model gives the same numbers. A new folder of its own (--out, or
runs/capability__<time>) gets results.json, results.md and samples.jsonl: every item's prompt, the
model's answer and its score, model by model.

This project's tasks (rlver_arithmetic, rlver_code; tools/capability_tasks/) run offline: the
process sets HF_HUB_OFFLINE and HF_DATASETS_OFFLINE before lm-eval is imported, and their data
are the files beside their YAML. Any other name is one of lm-eval's own tasks (`lm_eval --tasks
list`), whose data come from the Hugging Face Hub. A task that runs the model's code runs only with
--allow-code-execution. lm-eval is optional for the project: without it this is one line naming
`pip install lm-eval==0.4.13`, exit code 2. docs/evaluate.md has the tasks, the times and the
choices.
"""
import contextlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project
from cli import (at_least, command, fail, one_of, parse_settings, public_config,  # noqa: E402
                 release, setting, settings_of_runs, use_cpu_threads,
                 within)
from evaluate import (adapter_folder, check_adapter, load_models, models_under_test,  # noqa: E402
                      run_of, use_model)
from stats import paired_difference, with_interval  # noqa: E402
from policy import four_bit_problem, model_problem  # noqa: E402
from run import append_lines, finite, new_folder, write_atomically  # noqa: E402

TASKS = os.path.join(ROOT, "tools", "capability_tasks")  # this project's tasks, an include path
OURS = ("rlver_arithmetic", "rlver_code")
LM_EVAL = "lm-eval==0.4.13"  # the version tested (.ci/run installs it)


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------
@dataclass
class Settings:
    """What is compared, on which tasks, and how the model loads (as evaluate.py loads it)."""
    title = "tools/capability.py"
    adapter: list[str] = setting(
        [], "LoRA adapters to compare with the base: adapter folders, a trainer's checkpoints "
            "(their policy) or run folders (their newest checkpoint)")
    tasks: str = setting(
        "rlver_arithmetic", "comma-separated tasks: this project's rlver_arithmetic and rlver_code "
                            "(offline), or any of lm-eval's (`lm_eval --tasks list`; online)")
    allow_code_execution: bool = setting(
        False, "let a task run the model's code (rlver_code: a subprocess with CPU-time, memory "
               "and file limits; lm-eval's humaneval, mbpp: theirs)")
    limit: int = setting(0, "the first N items of each task (0 = all)", at_least(0))
    chat_template: bool = setting(
        False, "prompts in the tokenizer's chat template, worked examples as turns (lm-eval's "
               "--apply_chat_template); off: plain text, as lm-eval runs a base model")
    model: str = setting("smollm2", "the base: hub id, path, or smollm2 (embedded); an adapter "
                                    "from a run: the run's", model_problem, path=True)
    dtype: str = setting("auto", "auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16",
                         one_of("auto", "float32", "bfloat16"))
    load_in_4bit: bool = setting(False, "NF4 base weights via bitsandbytes",
                                 lambda on: on and four_bit_problem() or None)
    fp32_head: bool = setting(True, "in bf16: the output layer in float32, as in training")
    trust_remote_code: bool = setting(False, "allow model code from the hub (off unless you "
                                             "trust it)")
    bootstrap: int = setting(2000, "bootstrap resamples for the 95%% intervals", at_least(1))
    seed: int = setting(0, "random seed of the bootstrap", within(0, 2**32 - 1))
    batch_size: int = setting(16, "prompts generated together (the numbers are those of this "
                                  "batch size: padding moves the last bits)", at_least(1),
                              operational=True)
    out: str = setting("", "a new folder for the results, created here (or an empty one); default "
                           "runs/capability__<time>")

    @staticmethod
    def inherit(args, fields):
        """Each --adapter as a policy adapter folder (adapter_folder), and --model from the runs
        the adapters come from, unless given (cli.settings_of_runs)."""
        runs = []
        for i, path in enumerate(args.adapter):
            args.adapter[i] = path = adapter_folder(path)
            if made_by := run_of(path):  # RUN/checkpoints/iter_N/default: RUN's settings
                runs.append((f"{made_by[0]}/config.json", made_by[1]))
        settings_of_runs(args, fields, runs, ["model"])

    @staticmethod
    def check(args):
        """Each adapter against the model (evaluate.check_adapter); the results' folder."""
        for path in args.adapter:
            check_adapter(path, args)
        args.out = args.out or f"runs/capability__{int(time.time())}"


def parse_args(argv=None):
    return parse_settings(Settings, argv, prog="tools/capability.py")


# ----------------------------------------------------------------------------------------------
# lm-eval: imported offline, its tasks loaded and checked before any model loads
# ----------------------------------------------------------------------------------------------
def import_lm_eval(offline):
    """lm-eval's modules, or one line naming how to install it. offline: the hub and datasets
    libraries are told so first (they read it when imported), so that nothing is downloaded."""
    if offline:
        os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        fail(f"tools/capability.py needs lm-eval: pip install {LM_EVAL}")
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on every task and model
    return lm_eval, HFLM, TaskManager


@contextlib.contextmanager
def hugging_face_evaluate():
    """Inside, `import evaluate` gives Hugging Face's package of that name, which lm-eval's code
    tasks (humaneval, mbpp) and its metric look-up import; outside, it gives this project's
    evaluate.py again, the module this file's functions come from. Without the swap, lm-eval
    would find this project's module under the name."""
    ours = sys.modules["evaluate"]
    theirs = sys.modules.get("hugging_face_evaluate")
    try:
        if theirs is None:  # imported once, from anywhere on the path but this project
            others = [p for p in sys.path
                      if os.path.realpath(p or os.curdir) != os.path.realpath(ROOT)]
            spec = importlib.machinery.PathFinder.find_spec("evaluate", others)
            theirs = importlib.util.module_from_spec(spec)
            sys.modules["evaluate"] = theirs  # its own modules import it by that name
            spec.loader.exec_module(theirs)
            sys.modules["hugging_face_evaluate"] = theirs
        sys.modules["evaluate"] = theirs
        yield
    finally:
        sys.modules["evaluate"] = ours


def load_tasks(names, manager, allow_code_execution):
    """Every task name known and its data loaded (lm-eval's TaskManager.load), each failure one
    line: an unknown name, a data file missing or unreadable, data that cannot be fetched offline,
    a task that runs code without --allow-code-execution."""
    for name in names:
        if name not in manager.all_tasks:
            fail(f"--tasks {name}: no such task; this project's are {', '.join(OURS)}"
                 + ("" if name.startswith("rlver_") else
                    ", lm-eval's are listed by `lm_eval --tasks list`"))
    try:
        with hugging_face_evaluate():
            tasks = manager.load(names)["tasks"]  # {name: Task}, groups opened
    except Exception as e:  # a missing file, the hub offline, a data set's own error: one line
        fail(f"--tasks {','.join(names)}: lm-eval could not load a task's data "
             f"({type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else '-'})")
    for task in tasks.values():
        if task.config.unsafe_code and not allow_code_execution:
            fail(f"--tasks {task.config.task} runs the model's code: add --allow-code-execution "
                 "(rlver_code runs it in a subprocess with CPU-time, memory and file limits)")


# ----------------------------------------------------------------------------------------------
# One model's items, and the statistics over them
# ----------------------------------------------------------------------------------------------
def item_rows(label, samples):
    """samples.jsonl's lines of one model from lm-eval's logged samples ({task: [sample]}): each
    item's prompt, the model's answer, what was scored of it, the target and the scores."""
    rows = []
    for task, logged in samples.items():
        for s in sorted(logged, key=lambda s: (s["doc_id"], s["filter"])):
            rows.append({"model": label, "task": task, "item": s["doc_id"],
                         "id": s["doc"].get("id"), "prompt": s["arguments"][0][0],
                         "answer": s["resps"][0][0], "scored": s["filtered_resps"][0],
                         "target": s["target"],
                         "scores": {f"{m},{s['filter']}": float(s[m]) for m in s["metrics"]}})
    return rows


def scores_by_metric(rows):
    """{(task, "metric,filter"): array of the items' scores, in item order}."""
    scores = {}
    for row in rows:
        for metric, value in row["scores"].items():
            scores.setdefault((row["task"], metric), []).append(value)
    return {key: np.array(values) for key, values in scores.items()}


def model_scores(scores, base, n_boot, seed):
    """Per task and metric: the score and its interval over items; with base (the base's scores,
    the same items), the paired difference and its interval."""
    table = {}
    for (task, metric), values in scores.items():
        row = {"n": len(values), **with_interval(values[:, None], np.mean, n_boot, seed)}
        if base is not None:
            row["vs_base"] = paired_difference(values, base[(task, metric)], n_boot, seed)
        table.setdefault(task, {})[metric] = row
    return table


def verdict(difference):
    """What a paired difference says: its whole interval below 0 or above, or neither."""
    if difference["high"] < 0:
        return "dropped"
    if difference["low"] > 0:
        return "rose"
    return "no change shown"


def results_table(results):
    """results.md: a line saying what was measured, then a row a task, metric and model."""
    s = results["settings"]
    lines = [
        f"Tasks {s['tasks']} through lm-eval {results['lm_eval']}, greedy, items in a fixed "
        f"order{', prompts in the chat template' if s['chat_template'] else ''}; base "
        f"`{s['model']}`. Score: the mean over items [95% bootstrap interval over items, "
        f"{s['bootstrap']} resamples]; adapter - base: the mean paired difference over the same "
        "items and its interval; `dropped` / `rose`: the interval lies below / above 0.",
        "", "| task | metric | items | model | score | adapter - base | |",
        "|---|---|---|---|---|---|---|"]
    for m in results["models"]:
        for task, metrics in m["scores"].items():
            for metric, x in metrics.items():
                difference = x.get("vs_base")
                lines.append(
                    f"| {task} | {metric} | {x['n']} | {m['label']} "
                    f"| {x['value']:.3f} [{x['low']:.3f}, {x['high']:.3f}] "
                    + (f"| {difference['value']:+.3f} [{difference['low']:+.3f}, "
                       f"{difference['high']:+.3f}] | {verdict(difference)} |" if difference
                       else "| - | |"))
    return "\n".join(lines) + "\n"


def write_results(out, results):
    write_atomically(f"{out}/results.json", json.dumps(finite(results), indent=1,
                                                       ensure_ascii=False, allow_nan=False))
    write_atomically(f"{out}/results.md", results_table(results))


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    names = [name.strip() for name in args.tasks.split(",") if name.strip()]
    if not names:
        fail("--tasks: name at least one task")
    ours = all(name.startswith("rlver_") for name in names)  # this project's names
    if args.allow_code_execution:  # Hugging Face's code_eval (lm-eval's humaneval, mbpp) asks it
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"
    lm_eval, HFLM, TaskManager = import_lm_eval(offline=ours)
    # lm-eval's own 14,000 task configs are indexed only when a task is theirs (half a minute)
    manager = TaskManager(include_path=TASKS, include_defaults=not ours)
    load_tasks(names, manager, args.allow_code_execution)
    new_folder(args.out)  # before any model loads
    models = models_under_test(args.adapter)  # the base, then each adapter labelled by its run
    policy, tokenizer = load_models(args, models)
    lm = HFLM(pretrained=policy, tokenizer=tokenizer, batch_size=args.batch_size)
    print(f"{len(models)} models x tasks {','.join(names)}; CPU threads: "
          f"{torch.get_num_threads()}", file=sys.stderr)
    results = {"complete": False, "settings": public_config(args, "tools/capability.py"),
               "lm_eval": lm_eval.__version__, "models": []}
    base = None
    for done, (label, adapter_name, path, _) in enumerate(models, 1):
        t0 = time.time()
        with use_model(policy, adapter_name), hugging_face_evaluate():
            output = lm_eval.simple_evaluate(
                model=lm, tasks=names, task_manager=manager, limit=args.limit or None,
                log_samples=True, bootstrap_iters=0, apply_chat_template=args.chat_template,
                confirm_run_unsafe_code=args.allow_code_execution)
        rows = item_rows(label, output["samples"])
        append_lines(f"{args.out}/samples.jsonl", rows)
        scores = scores_by_metric(rows)
        base = base or scores  # the first model is the base
        results["models"].append({
            "label": label, "adapter": path, "seconds": time.time() - t0,
            "scores": model_scores(scores, None if adapter_name is None else base,
                                   args.bootstrap, args.seed)})
        results["complete"] = done == len(models)
        write_results(args.out, results)
    release()
    print(results_table(results))
    print(f"-> {args.out}/results.json, results.md, samples.jsonl")
    return results


if __name__ == "__main__":
    use_cpu_threads()  # on a CPU: half the usable cores, unless OMP_NUM_THREADS is set
    command(main)()
