"""Evaluation: the base and trained adapters against the same users, under one judge or several.

A Sentient-style benchmark (SAGE, arXiv 2505.02847): every persona of a set talks with each model
under test (the base, every adapter disabled, and each --adapter on top of it; the weights load
once) under SAGE's protocol by default; the score is the mean final emotion (0-100) with a 95%
bootstrap interval, each adapter compared with the base on the same personas. --judges plays it all
under several users (the judge matrix): a gain the adapter's training judge sees and a held-out one
does not is the judge's blind spot, not empathy. The measures and their intervals: MEASURES here
(the score, the collapse rate, hidden intentions named), the state tracking (--state-probe) and the
table by persona type in measures.py, the statistics in stats.py. --agreement (agreement.py)
checks a simulated user's changes against SAGE's recorded ones; --write-openings writes the first
messages RLVER's profiles lack. Each run writes into a folder of its own: docs/evaluate.md.

    python evaluate.py --model smollm2 --personas personas.json --split test
    python evaluate.py --adapter runs/ppo__0__1700000000 [another adapter ...] --out runs/eval_ppo
    python evaluate.py --adapter RUN_A RUN_B --judges rules http://localhost:8000/v1
    python evaluate.py --agreement SAGE/dataset/<judge>_based_simulator/*_result.jsonl \\
        --personas SAGE/profile/simulator_profile_withfirsttalk.jsonl --simulator URL
"""
import contextlib
import copy
import importlib.util
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from agreement import SAGE_JUDGED_REPLIES, SAGE_START, agreement_main, write_results
from cli import (TAKEN, at_least, command, exit_on_signals, fail, parse_json, parse_settings,
                 public_config, read_json_lines, read_run, read_text, redact, setting,
                 settings_of_runs, use_cpu_threads, within)
from measures import by_type_table, collapsed, hidden_named, probe_states, tracking, tracking_gain
from personas import PersonaError, load_personas
from policy import check_model, default_device, load_policy
from rl import DialogueSettings
from rollout import (TOKEN_ARRAYS, ChatTokens, build_simulator, check_openings_fit, make_backend,
                     play_dialogues, reach_simulator)
from run import append_lines, checkpoints, new_folder, write_atomically, write_failure
from simulator import (PROMPTS, SimulatorError, UserState, clean_user_text,
                       simulator_problem, user_turn_messages)
from stats import mean_with_interval, paired_difference, shown
from users import OPENING_LINES, ScriptedUser


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------
@dataclass
class Settings(DialogueSettings):
    """What evaluate.py compares, and how, on top of what plays a dialogue (rl.DialogueSettings, to
    which DEFAULTS below gives SAGE's sizes)."""
    title = "evaluate.py"
    adapter: list[str] = setting(
        [], "LoRA adapters to compare with the base: adapter folders, a trainer's checkpoints "
            "(their policy) or run folders (their newest checkpoint)")
    judges: list[str] = setting(
        [], "the users that score every model, each a --simulator value (rules | same | URL ...): "
            "every model under every judge, each adapter's gain over the base, a table and "
            "matrix.png (docs/evaluate.md); none: --simulator alone")
    dialogues: int = setting(
        0, "the first N personas of the split; with --agreement the first N dialogues of each file "
           "(0 = all)", at_least(0))
    bootstrap: int = setting(2000, "bootstrap resamples for the 95%% intervals", at_least(1))
    state_probe: bool = setting(
        True, "after each agent turn, ask the policy apart from the dialogue (greedy) how the "
              "user feels, 0-100: the state tracking's Spearman and MAE against the simulator's "
              "emotion (docs/evaluate.md)")
    seed: int = setting(0, "random seed of the bootstrap", within(0, 2**32 - 1))
    agreement: list[str] = setting(
        [], "SAGE result files (JSON lines: id, emo_point, history), one per evaluated model: "
            "check the simulator against their judge instead of evaluating (docs/evaluate.md)")
    out: str = setting("", "a new folder for the results, created here (or an empty one); default "
                           "runs/eval__<time>")
    write_openings: str = setting(
        "", "a new file: the JSON-lines profiles of --personas with the first_talk they lack, "
            "written by the simulated user, instead of evaluating")

    @staticmethod
    def inherit(args, fields):
        """Before every check (cli.parse_settings): --adapter as policy adapter folders (a run
        folder: its newest checkpoint's policy; PPO's critic refused), each evaluated as it was
        trained: the model, thinking, reply and context sizes and the user (unless --judges names
        the users) come from its run's config.json unless given here (cli.settings_of_runs,
        docs/evaluate.md). Fewer tokens a reply than in training: a warning."""
        runs = []  # (config.json's path, its settings)
        for i, path in enumerate(args.adapter):
            path = args.adapter[i] = adapter_folder(path)
            if made_by := run_of(path):  # the saved settings of the run it comes from
                runs.append((f"{made_by[0]}/config.json", made_by[1]))
        # what an adapter from a run is evaluated with, unless given here
        taken = "model thinking max_new_tokens max_context simulator api_model api_key_env".split()
        if args.judges:  # the users are --judges': runs that trained against different ones meet
            taken.remove("simulator")
        settings_of_runs(args, fields, runs, taken)
        trained = max([run["max_new_tokens"] for _, run in runs if "max_new_tokens" in run],
                      default=0)
        if args.max_new_tokens < trained:
            print(f"warning: --max-new-tokens {args.max_new_tokens} is less than the {trained} "
                  "tokens a reply the adapter trained with: cut replies are counted in "
                  "results.md", file=sys.stderr)

    @staticmethod
    def check(args):
        """Each adapter against the model taken (check_adapter), and given once; the judges, each a
        user --simulator takes, given once; the results' folder."""
        for k, path in enumerate(args.adapter):
            check_adapter(path, args)
            if path in args.adapter[:k]:  # a run folder and its newest checkpoint are one adapter
                fail(f"--adapter {path}: given twice")
        if args.judges and (args.agreement or args.write_openings):
            fail("--judges: the benchmark's; --agreement and --write-openings take one --simulator")
        if "state_probe" in args.given and (args.agreement or args.write_openings):
            fail("--state-probe: the benchmark's; --agreement and --write-openings play no "
                 "dialogue")
        if args.judges and "simulator" in args.given:
            fail(f"--simulator {args.simulator} with --judges: name every judge in --judges")
        for k, judge in enumerate(args.judges):
            if problem := simulator_problem(judge):
                fail(f"--judges {judge}: {problem}")
            if judge in args.judges[:k]:
                fail(f"--judges {judge}: given twice")
        args.judges = args.judges or [args.simulator]
        if len(args.judges) > 1 and importlib.util.find_spec("matplotlib") is None:
            print("warning: matplotlib is not installed: the judge matrix goes to results.md, "
                  "without its picture matrix.png (pip install matplotlib)", file=sys.stderr)
        args.out = args.out or f"runs/eval__{int(time.time())}"


def adapter_folder(path):
    """The policy adapter an --adapter names: a run folder's newest checkpoint (run.checkpoints), a
    checkpoint's `default` adapter, or an adapter folder as it is; a saved role other than the
    policy's (PPO's critic, a value model) is one line."""
    path = os.path.normpath((checkpoints(path) or [path])[-1])
    if os.path.isdir(f"{path}/default"):
        path = f"{path}/default"
    role = "default"
    if os.path.isfile(f"{path}/role"):
        role = read_text(f"{path}/role", fail).strip()
    if role != "default":
        fail(f"--adapter {path}: not a policy adapter (its role is {role!r}: PPO's critic is a "
             "value model)")
    return path


def run_of(path):
    """(the run folder, its saved settings) of an adapter a trainer saved
    (RUN/checkpoints/iter_N/default, RUN/config.json), else None."""
    folder = os.path.normpath(f"{path}/../../..")
    if path.split(os.sep)[-3:-2] == ["checkpoints"] and (run := read_run(folder)):
        return folder, run
    return None


def check_adapter(path, args):
    """An adapter folder checked before any model loads: adapter_config.json a LoRA adapter's whose
    target modules are layers of --model (policy.check_model reads its skeleton, no weights), and
    adapter_model.safetensors a safetensors file (safe_open reads the header). Bad: one line."""
    from safetensors import safe_open

    file = f"{path}/adapter_config.json"
    config = parse_json(read_text(file, fail), file, fail)
    lora = isinstance(config, dict) and config.get("peft_type") == "LORA"
    targets = lora and config.get("target_modules")
    if not isinstance(targets, list):
        fail(f"{file}: not the config of a LoRA adapter (a JSON object with peft_type LORA and "
             "target_modules a list of layer names)")
    TAKEN["--target-modules"] = f"{file}: field 'target_modules'"  # named in check_model's line
    check_model(args.model, ",".join(map(str, targets)), args.trust_remote_code)
    weights = f"{path}/adapter_model.safetensors"
    if not os.path.isfile(weights):  # a named pipe would make safe_open wait for a writer
        fail(f"{weights}: missing or not a regular file: the adapter's weights")
    try:
        safe_open(weights, "pt")
    except Exception as e:  # SafetensorError, or an OSError
        fail(f"{weights}: not a safetensors file ({e})")


# Sizes for a reply, not a long thought (an adapter from a run takes the run's own).
DEFAULTS = dict(model="smollm2", max_new_tokens=128, max_context=4096, split="test",
                start_emotion=SAGE_START, max_turns=SAGE_JUDGED_REPLIES, user_reply_tokens=64)


def parse_args(argv=None):
    """The settings, each checked before any model loads (cli.parse_settings)."""
    return parse_settings(Settings, argv, defaults=DEFAULTS, prog="evaluate.py")


# ----------------------------------------------------------------------------------------------
# The benchmark's numbers (the statistics themselves, one bootstrap for every interval: stats.py)
# ----------------------------------------------------------------------------------------------
# What is measured of a model, one number a dialogue (a persona's): the model's value is their
# mean over personas and an adapter's gain their mean paired difference from the base's, each with
# its 95% interval from stats.py's one bootstrap. A new measure is one entry here; every interval
# written is held by tests/test_forks.py (docs/forks.md).
# collapse and hidden_named read what measures.py adds to an evaluation's records (run_evaluation).
MEASURES = {"final_emotion": lambda record: float(record["final_emotion"]),  # the score
            "collapse": lambda record: float(collapsed(record)),
            "hidden_named": lambda record: float(any(record["hidden_named"]))}


def model_summary(records, n_boot=2000, seed=0):
    """The benchmark's numbers for one model, from its one dialogue per persona: each of MEASURES
    per persona and as a mean with its interval over personas (final_emotion's is SAGE's score),
    SAGE's successes (100) and failures (the user left), and the counts that explain a score:
    turns, replies cut at --max-new-tokens, reply length, think-format violations, dialogues ended
    unread."""
    per_persona = {name: {r["persona_id"]: measure(r) for r in records}
                   for name, measure in MEASURES.items()}
    # at least one a dialogue (check_openings_fit)
    turns = sum(len(r["turn_ends"]) for r in records)
    total = {k: sum(r[k] for r in records)
             for k in ("cut_replies", "policy_tokens", "violations")}
    reasons = Counter(r["end_reason"] for r in records)
    return {"measures": {name: mean_with_interval([*values.values()], n_boot, seed)
                         for name, values in per_persona.items()},
            "dialogues": len(records), "successes": reasons["success"], "failures": reasons["left"],
            "unread": reasons["unread"], "turns_mean": turns / len(records), **total,
            "reply_tokens_mean": total["policy_tokens"] / turns, "per_persona": per_persona}


def gain_over_base(summary, base, n_boot=2000, seed=0):
    """Each of an adapter's MEASURES less the base's on the same personas (model_summary's both),
    paired (stats.paired_difference)."""
    return {name: paired_difference([*values.values()],
                                    [base["per_persona"][name][i] for i in values], n_boot, seed)
            for name, values in summary["per_persona"].items()}


def model_results(records, base_records, probed, n_boot=2000, seed=0):
    """A model's figures: model_summary, the state tracking where probed (measures.tracking), and
    for an adapter (base_records: the base's dialogues with the same personas; None for the base)
    each gain over the base; then the same for each persona type's dialogues (by_type)."""
    def figures(mine, base):
        summary = model_summary(mine, n_boot, seed)
        if probed:
            summary["tracking"] = tracking(mine, n_boot, seed)
        if base is not None:
            summary["vs_base"] = gain_over_base(summary, model_summary(base, n_boot, seed),
                                                n_boot, seed)
            if probed:
                summary["tracking_vs_base"] = tracking_gain(mine, base, n_boot, seed)
        return summary

    def of_type(rows, kind):
        return rows and [r for r in rows if r["type"] == kind]

    kinds = list(dict.fromkeys(r["type"] for r in records))  # in the personas' order
    by_type = {kind: figures(of_type(records, kind), of_type(base_records, kind))
               for kind in kinds}
    return {**figures(records, base_records), "by_type": by_type}


def held_out(judge, run, args):
    """Whether a judge is held out for an adapter of this run (its saved settings, config.json):
    False where the run trained against this user (at a URL, with the same --api-model), True where
    against another; None for an adapter without its run."""
    if run is None:
        return None
    if run.get("simulator") != redact(judge):  # a URL's password is saved redacted
        return True
    return judge.startswith(("http://", "https://")) and run.get("api_model") != args.api_model


# ----------------------------------------------------------------------------------------------
# Models under test: the base and each adapter, one set of weights
# ----------------------------------------------------------------------------------------------
def models_under_test(paths):
    """[(label, adapter name, adapter folder, its run's saved settings or None)], the base first
    (None each). An adapter is labelled by its run: RUN/checkpoints/iter_N/default by RUN's folder
    name, and by RUN/iter_N where another adapter of RUN is compared too; an adapter outside a run
    by its folder's name; two that would still read alike by their paths."""
    runs = [run_of(path) for path in paths]  # (folder, saved settings) or None each
    compared = Counter(made_by[0] for made_by in runs if made_by)  # adapters of each run
    names = []
    for path, made_by in zip(paths, runs):
        if made_by is None:
            names.append(os.path.basename(path.removesuffix("/default")))
        elif compared[made_by[0]] == 1:
            names.append(os.path.basename(made_by[0]))
        else:  # RUN/iter_N
            names.append(f"{os.path.basename(made_by[0])}/{path.split(os.sep)[-2]}")
    labels = [path if names.count(name) > 1 else name for name, path in zip(names, paths)]
    return [("base", None, None, None)] + [
        (label, "default" if k == 0 else f"adapter_{k}", path, made_by and made_by[1])
        for k, (label, path, made_by) in enumerate(zip(labels, paths, runs))]


def load_models(args, models):
    """One PeftModel: the first adapter as 'default' (or a fresh LoRA, the identity since B = 0),
    further adapters by name (models: models_under_test's). Returns (policy, tokenizer). An adapter
    whose weights do not all load into the base is one line naming both, never scored
    half-loaded."""
    path = (args.adapter or [None])[0]
    try:
        policy, tokenizer = load_policy(args.model, adapter=path, trainable=False,
                                        device=default_device(), load_in_4bit=args.load_in_4bit,
                                        dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                                        fp32_head=args.fp32_head)
        for _, name, path, _ in models[1:]:
            # loaded (the first again) for peft's missing and unexpected keys,
            # which it only warns of
            result = policy.load_adapter(path, adapter_name=name, is_trainable=False)
            missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
            if missing or result.unexpected_keys:
                raise RuntimeError(f"{len(missing)} of its weights missing "
                                   f"(e.g. {(missing or ['-'])[0]}), "
                                   f"{len(result.unexpected_keys)} unexpected")
    except RuntimeError as e:
        # torch's size mismatches (another hidden size): the first says why, in shapes
        why = re.findall(r"size mismatch.*", str(e)) + str(e).splitlines()
        fail(f"--adapter {path} does not fit --model {args.model}: {why[0][:300]}")
    return policy, tokenizer


def use_model(policy, adapter_name):
    """The base (every adapter disabled) for adapter_name None, else that adapter on. The `same`
    user's nested disable_adapter leaves the base base: peft re-enables only what it disabled."""
    if adapter_name is None:
        return policy.disable_adapter()
    policy.set_adapter(adapter_name)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# The results: a table a judge; with several judges, the judge matrix and its picture
# ----------------------------------------------------------------------------------------------
def judge_table(results, judged):
    """The markdown table of one judge's models (results.json's judges[k]), with a line saying what
    was measured."""
    s = results["settings"]
    lines = [
        f"{len(results['persona_ids'])} personas from `{os.path.basename(s['personas'])}` "
        f"(split {s['split']}), 1 greedy dialogue each; simulator `{judged['judge']}` (read-out "
        f"{judged['readout']}), start emotion {s['start_emotion']}, up to "
        f"{s['max_turns']} turns, thinking {'on' if s['thinking'] else 'off'}. "
        "Score = mean final emotion (0-100); [95% bootstrap interval over personas, "
        f"{s['bootstrap']} resamples]; vs base = mean paired difference over the same personas; "
        f"cut replies = agent turns that reached --max-new-tokens {s['max_new_tokens']} "
        "unfinished; reply tokens = policy tokens per agent turn, thought included.",
        "",
        "| model | score | cut replies | vs base | successes | failures | turns | reply tokens "
        "| think violations | unread |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in judged["models"]:
        n, p = m["dialogues"], m.get("vs_base", {}).get("final_emotion")
        lines.append(f"| {m['label']} | {shown(m['measures']['final_emotion'], 1)} "
                     f"| {m['cut_replies']} ({m['cut_replies'] / (m['turns_mean'] * n):.0%}) "
                     f"| {shown(p, 1, '+') if p else '-'} "
                     f"| {m['successes']}/{n} | {m['failures']}/{n} | {m['turns_mean']:.1f} "
                     f"| {m['reply_tokens_mean']:.0f} | {m['violations']} "
                     f"({m['violations'] / (m['turns_mean'] * n):.0%}) | {m['unread']} |")
    return "\n".join(lines) + "\n"


ROLES = {True: "held out", False: "training", None: "-"}  # held_out's words in the matrix


def matrix_table(results):
    """The judge matrix: every model's score under every judge, each adapter's gain over the base,
    and whether the judge is the one the adapter's run trained against or held out."""
    lines = ["Every model under every judge, on the same personas, greedy. score = mean final "
             "emotion [95% bootstrap interval over personas]; vs base = mean paired difference "
             "from the base under the same judge [95%]; judge is = `training` where the adapter's "
             "run trained against this user, `held out` where it never met it, `-` for the base "
             "or an adapter without its run; cut = share of agent turns cut at --max-new-tokens; "
             "unread = dialogues ended on an appraisal the judge's answer did not state (many: "
             "the judge read nothing, whatever its score).", "",
             "| judge | model | judge is | score | vs base | cut | unread |",
             "|---|---|---|---|---|---|---|"]
    for judged in results["judges"]:
        for m in judged["models"]:
            p = m.get("vs_base", {}).get("final_emotion")
            lines.append(f"| {judged['judge']} | {m['label']} | {ROLES[m.get('held_out')]} "
                         f"| {shown(m['measures']['final_emotion'], 1)} "
                         f"| {shown(p, 1, '+') if p else '-'} "
                         f"| {m['cut_replies'] / (m['turns_mean'] * m['dialogues']):.0%} "
                         f"| {m['unread']}/{m['dialogues']} |")
    return "\n".join(lines) + "\n"


def results_table(results):
    """results.md: each judge's table, under the judge matrix where there are several judges."""
    tables = [judge_table(results, judged) + "\n" + by_type_table(results, judged)
              for judged in results["judges"]]
    if len(results["settings"]["judges"]) > 1:
        tables.insert(0, matrix_table(results))
    return "\n".join(tables)


def draw_matrix(results, path):
    """matrix.png: under each judge, every model's score and each adapter's gain over the base with
    their 95% intervals, a hollow marker where the judge is the adapter's training judge. False
    without matplotlib (optional: Settings.check said so before any model loaded)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no window, no global state
    except ImportError:
        return False
    judges = [judged["judge"] for judged in results["judges"]]
    labels = [m["label"] for m in results["judges"][0]["models"]]
    figure = Figure(figsize=(4 + 2.2 * len(judges), 4), layout="constrained")
    score_ax, gain_ax = figure.subplots(1, 2)
    for i, label in enumerate(labels):
        cells = [judged["models"][i] for judged in results["judges"]]  # the model under each judge
        x = np.arange(len(judges)) + 0.6 * (i - (len(labels) - 1) / 2) / len(labels)
        training = [m.get("held_out") is False for m in cells]
        for ax, figures in ((score_ax, [m["measures"]["final_emotion"] for m in cells]),
                            (gain_ax, [m.get("vs_base", {}).get("final_emotion") for m in cells])):
            if figures[0] is None:  # the base: no gain over itself
                continue
            # (3, judges): value, low, high; an undefined one (NaN) is left out of the picture
            value, low, high = np.array([[f[k] for f in figures] for k in ("value", "low", "high")],
                                        dtype=float)
            ax.errorbar(x, value, yerr=[value - low, high - value], fmt="none", ecolor=f"C{i}",
                        capsize=3)
            ax.scatter(x, value, edgecolors=f"C{i}", zorder=3,
                       facecolors=["none" if t else f"C{i}" for t in training])
        score_ax.plot([], [], "o", color=f"C{i}", label=label)  # the legend's filled marker
    gain_ax.axhline(0, color="grey", linewidth=0.8)
    for ax, title in ((score_ax, "score: mean final emotion"), (gain_ax, "adapter - base")):
        ax.set_title(f"{title} [95%]")
        ax.set_xticks(range(len(judges)), judges, rotation=10)
        ax.set_xlabel("judge")
    score_ax.legend(fontsize="small")
    figure.suptitle(f"{len(results['persona_ids'])} personas ({results['settings']['split']}); "
                    "hollow: the adapter's training judge", fontsize="medium")
    tmp = f"{path}.tmp{os.getpid()}"  # written whole or not at all, as every result file
    try:
        figure.savefig(tmp, format="png", dpi=120)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return True


# ----------------------------------------------------------------------------------------------
# The evaluation loop
# ----------------------------------------------------------------------------------------------
def judge_simulator(judge, args, policy, tokenizer):
    """The simulated user of one judge: --simulator's user with args' settings, judge in its place
    (`same`: the policy's frozen base)."""
    judged = copy.copy(args)
    judged.simulator = judge
    return build_simulator(judged, policy, tokenizer, goodbye="sage")


def run_evaluation(args, policy, tokenizer, judges, personas, models):
    """Under each judge ((name, Simulator) pairs), every model plays every persona; writes into
    args.out and returns the results dict. results.json and results.md are rewritten after each
    model (complete after the last), so a failure half way leaves the finished models' numbers and
    transcripts on disk."""
    results = {"complete": False, "settings": public_config(args, "evaluate.py"),
               "persona_ids": [p.id for p in personas], "judges": []}
    for judge, simulator in judges:
        judged = {"judge": redact(judge), "readout": simulator.readout, "models": []}
        results["judges"].append(judged)
        base_records = None  # the first model's: the base's
        for label, adapter_name, path, run in models:
            t0 = time.time()
            with use_model(policy, adapter_name):
                # a Decoder of its own a model (play_dialogues makes one): on CUDA, its
                # adapter's graphs
                records, _ = play_dialogues(
                    policy, simulator, personas, chat=ChatTokens(tokenizer, args.thinking),
                    temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                    max_context=args.max_context, greedy=True, desc=f"{label}: dialogues")
                # what measures.py reads: the type, the replies that name the hidden intention,
                # and the policy's estimates of the user's emotion, asked after the dialogues
                for r, p in zip(records, personas):
                    r["type"], r["hidden_named"] = p.type, hidden_named(r, p, simulator.scripted)
                t_probe = time.time()
                if args.state_probe:
                    estimates = probe_states(policy, tokenizer, records,
                                             [p.language for p in personas], args.max_context)
                    for r, mine in zip(records, estimates):
                        r["state_estimates"] = mine
                probe_seconds = time.time() - t_probe
            # each dialogue tagged with its judge and model, its token arrays left out
            append_lines(f"{args.out}/transcripts.jsonl",
                         [{"judge": judged["judge"], "model": label,
                           **{k: r[k] for k in r if k not in TOKEN_ARRAYS}} for r in records])
            summary = {"label": label, "adapter": path,
                       **model_results(records, base_records, args.state_probe, args.bootstrap,
                                       args.seed),
                       "seconds": time.time() - t0, "probe_seconds": probe_seconds}
            if adapter_name:
                summary["held_out"] = held_out(judge, run, args)
            base_records = base_records or records
            judged["models"].append(summary)
            results["complete"] = (len(results["judges"]), len(judged["models"])) == (
                len(judges), len(models))
            write_results(args.out, results, results_table(results))
    return results


# ----------------------------------------------------------------------------------------------
# Openings for profiles without them: RLVER's training profiles have no first_talk
# ----------------------------------------------------------------------------------------------
# RLVER writes each opening with its simulator when it loads a profile; here they are written once,
# into a new file, so that every run trains from the same first messages. The prompt is the user's
# own (persona card, the reply rules, a mood note), asking for a first message instead of a reply.
OPENING_TOKENS = 64


def write_openings(args):
    """python evaluate.py --write-openings OUT --personas FILE [--model MODEL | --simulator URL]:
    FILE's lines with first_talk filled where it is missing, written by the user at the trainers'
    --start-emotion (first_talk_emotion records it), into OUT once, whole (renamed into place), or
    not at all; a failure (bad input, the simulator, the disk, a signal) is one line, and a failed
    write is simply run again (docs/evaluate.md)."""
    source, out = args.personas, args.write_openings
    if "start_emotion" not in args.given:
        # the mood a trainer's dialogues start at, not the benchmark's
        args.start_emotion = DialogueSettings.start_emotion
    if os.path.exists(out):
        fail(f"--write-openings {out}: the file exists; give a new file "
             "(nothing is ever overwritten)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out))):
        fail(f"--write-openings {out}: its folder does not exist")
    try:
        personas = load_personas(source, need_opening=False)
        lines = read_json_lines(source, PersonaError)
    except PersonaError as e:
        fail(f"{e} (--write-openings takes JSON-lines profiles: SAGE's, RLVER's)")
    todo = [p for p in personas if not p.opening.strip()]
    print(f"{len(personas)} profiles in {source}: {len(todo)} to write with {args.simulator} "
          f"at mood {args.start_emotion}", file=sys.stderr)
    exit_on_signals(lambda: f"; {out} not written")
    # no model when none is missing
    backend = make_backend(args.simulator if todo else "rules", args=args)
    try:
        if isinstance(backend, ScriptedUser):  # a scripted user's one fixed line
            texts = [OPENING_LINES[p.language] for p in todo]
        else:
            # the user's own chat, in the persona's language, with the request where an agent's
            # first message would be
            asked = [user_turn_messages(UserState(p, args.start_emotion, [
                {"role": "agent", "text": PROMPTS[p.language]["opening"]}])) for p in todo]
            texts = [clean_user_text(t) for t in backend.chat(asked, OPENING_TOKENS)]
        if "..." in texts:  # nothing usable was left after cleaning
            raise SimulatorError("the simulator wrote nothing usable for id "
                                 f"{todo[texts.index('...')].id}")
        texts = iter(texts)
        for p, (_, entry) in zip(personas, lines):
            if not p.opening.strip():
                entry.update(first_talk=next(texts), first_talk_emotion=args.start_emotion)
        write_atomically(out, "".join(json.dumps(e, ensure_ascii=False) + "\n" for _, e in lines))
    except SimulatorError as e:
        fail(f"--write-openings {out}: {e}; nothing written")
    except OSError as e:
        fail(f"--write-openings {out}: {write_failure(e, out)}; nothing written")
    print(f"-> {out}: {len(personas)} profiles, every one with an opening", file=sys.stderr)


def main(argv=None):
    args = parse_args(argv)
    if args.agreement:  # the simulator checked against SAGE's recorded judgments
        return agreement_main(args)
    if args.write_openings:  # the first messages RLVER's training profiles lack
        return write_openings(args)
    personas = load_personas(args.personas, args.split, args.difficulty)[:args.dialogues or None]
    for judge in args.judges:  # a URL user answers a first short request, or one line
        reach_simulator(judge, args)
    check_openings_fit(personas, args.model, args.thinking, args.max_new_tokens, args.max_context,
                       args.trust_remote_code)
    models = models_under_test(args.adapter)
    new_folder(args.out)  # before any model loads
    policy, tokenizer = load_models(args, models)
    judges = [(judge, judge_simulator(judge, args, policy, tokenizer)) for judge in args.judges]
    print(f"{len(models)} models x {len(personas)} personas, one greedy dialogue each; "
          f"{'judges' if len(judges) > 1 else 'simulator'} "
          + ", ".join(f"{redact(judge)} (read-out {s.readout})" for judge, s in judges)
          + f"; CPU threads: {torch.get_num_threads()}", file=sys.stderr)
    # a simulator that stops answering ends it in one line; finished models are in transcripts.jsonl
    results = run_evaluation(args, policy, tokenizer, judges, personas, models)
    print(results_table(results))
    drawn = len(judges) > 1 and draw_matrix(results, f"{args.out}/matrix.png")
    print(f"-> {args.out}/results.json, results.md, transcripts.jsonl" + ", matrix.png" * drawn)
    return results


if __name__ == "__main__":
    use_cpu_threads()  # on a CPU: half the usable cores, unless OMP_NUM_THREADS is set
    command(main)()  # the command line: a Stop is one line and its exit code
