"""Evaluation: the base and trained adapters against the same users; a user against SAGE's judge.

A Sentient-style benchmark (SAGE, arXiv 2505.02847): every persona of a set talks with each model
under test (the base, every adapter disabled, and each --adapter on top of it; the weights load
once) under SAGE's protocol by default; the score is the mean final emotion (0-100) with a 95%
bootstrap interval, each adapter compared with the base on the same personas. --agreement checks a
simulated user's changes against SAGE's recorded ones; --write-openings writes the first messages
RLVER's profiles lack. Each run writes into a folder of its own: docs/evaluate.md.

    python evaluate.py --model smollm2 --personas personas.json --split test
    python evaluate.py --adapter runs/ppo__0__1700000000 [another adapter ...] --out runs/eval_ppo
    python evaluate.py --agreement SAGE/dataset/<judge>_based_simulator/*_result.jsonl \\
        --personas SAGE/profile/simulator_profile_withfirsttalk.jsonl --simulator URL
"""
import contextlib
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass
from itertools import groupby

import numpy as np
import torch
from tqdm import tqdm

from cli import (TAKEN, at_least, command, exit_on_signals, fail, parse_json, parse_settings,
                 public_config, read_json_lines, read_run, read_text, release, setting,
                 settings_of_runs, use_cpu_threads, within)
from personas import PersonaError, load_personas
from policy import check_model, default_device, load_policy
from rl import DialogueSettings
from rollout import (TOKEN_ARRAYS, ChatTokens, build_simulator, check_openings_fit, make_backend,
                     play_dialogues)
from run import append_lines, checkpoints, finite, new_folder, write_atomically, write_failure
from simulator import (PROMPTS, RulesBackend, SimulatorError, UserState, apply_change,
                       clean_user_text, user_turn_messages)
from stats import (STATISTICS, kendall_with_interval, mean_with_interval, paired_difference,
                   with_interval)


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
    dialogues: int = setting(
        0, "the first N personas of the split; with --agreement the first N dialogues of each file "
           "(0 = all)", at_least(0))
    bootstrap: int = setting(2000, "bootstrap resamples for the 95%% intervals", at_least(1))
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
        trained: the model, thinking, reply and context sizes and the user come from its run's
        config.json unless given here (cli.settings_of_runs, docs/evaluate.md). Fewer tokens a
        reply than in training: a warning."""
        runs = []  # (config.json's path, its settings)
        for i, path in enumerate(args.adapter):
            path = os.path.normpath((checkpoints(path) or [path])[-1])
            if os.path.isdir(f"{path}/default"):
                path = f"{path}/default"
            # a saved role other than the policy's (PPO's critic), or no adapter at all
            role = "default"
            if os.path.isfile(f"{path}/role"):
                role = read_text(f"{path}/role", fail).strip()
            if role != "default":
                fail(f"--adapter {path}: not a policy adapter (its role is {role!r}: PPO's critic "
                     "is a value model)")
            args.adapter[i] = path
            if made_by := run_of(path):  # the saved settings of the run it comes from
                runs.append((f"{made_by[0]}/config.json", made_by[1]))
        # what an adapter from a run is evaluated with, unless given here
        taken = "model thinking max_new_tokens max_context simulator api_model api_key_env"
        settings_of_runs(args, fields, runs, taken.split())
        trained = max([run["max_new_tokens"] for _, run in runs if "max_new_tokens" in run],
                      default=0)
        if args.max_new_tokens < trained:
            print(f"warning: --max-new-tokens {args.max_new_tokens} is less than the {trained} "
                  "tokens a reply the adapter trained with: cut replies are counted in "
                  "results.md", file=sys.stderr)

    @staticmethod
    def check(args):
        """Each adapter against the model taken (check_adapter); the results' folder."""
        for path in args.adapter:
            check_adapter(path, args)
        args.out = args.out or f"runs/eval__{int(time.time())}"


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


# SAGE (github.com/Tencent/digitalhuman, SAGE/test_npc.py and simulator_response.py): a dialogue
# starts at 40 with the profile's first_talk; the agent writes at most 10 replies, all but the last
# judged (9 count); it stops at a goodbye, at 100 (a success) or below 10 (a failure). The score is
# the mean final emotion; docs/evaluate.md lists where this project differs, and why.
SAGE_START, SAGE_JUDGED_REPLIES, SAGE_SUCCESS, SAGE_LEAVE_BELOW = 40, 9, 100, 10
# Sizes for a reply, not a long thought (an adapter from a run takes the run's own).
DEFAULTS = dict(model="smollm2", max_new_tokens=128, max_context=4096, split="test",
                start_emotion=SAGE_START, max_turns=SAGE_JUDGED_REPLIES, user_reply_tokens=64)


def parse_args(argv=None):
    """The settings, each checked before any model loads (cli.parse_settings)."""
    return parse_settings(Settings, argv, defaults=DEFAULTS, prog="evaluate.py")


# ----------------------------------------------------------------------------------------------
# The benchmark's numbers (the statistics themselves, one bootstrap for every interval: stats.py)
# ----------------------------------------------------------------------------------------------
def model_summary(records, n_boot=2000, seed=0):
    """The benchmark's numbers for one model, from its one dialogue per persona: the score (the mean
    final emotion) and its interval over personas, SAGE's successes (100) and failures (the user
    left), and the counts that explain a score: turns, replies cut at --max-new-tokens, reply
    length, think-format violations, dialogues ended unread."""
    per_persona = {r["persona_id"]: float(r["final_emotion"]) for r in records}
    score = mean_with_interval([*per_persona.values()], n_boot, seed)
    # at least one a dialogue (check_openings_fit)
    turns = sum(len(r["turn_ends"]) for r in records)
    total = {k: sum(r[k] for r in records)
             for k in ("cut_replies", "policy_tokens", "violations")}
    reasons = Counter(r["end_reason"] for r in records)
    return {"score": score["value"], "ci_low": score["low"], "ci_high": score["high"],
            "dialogues": len(records), "successes": reasons["success"], "failures": reasons["left"],
            "unread": reasons["unread"], "turns_mean": turns / len(records), **total,
            "reply_tokens_mean": total["policy_tokens"] / turns, "per_persona": per_persona}


# ----------------------------------------------------------------------------------------------
# Models under test: the base and each adapter, one set of weights
# ----------------------------------------------------------------------------------------------
def load_models(args):
    """One PeftModel: the first adapter as 'default' (or a fresh LoRA, the identity since B = 0),
    further adapters by name. Returns (policy, tokenizer, models): (label, adapter name, adapter
    folder) each, labelled by its folder, models[0] the base (None, None). An adapter whose weights
    do not all load into the base is one line naming both, never scored half-loaded."""
    path = (args.adapter or [None])[0]
    models = [("base", None, None)]
    try:
        policy, tokenizer = load_policy(args.model, adapter=path, trainable=False,
                                        device=default_device(), load_in_4bit=args.load_in_4bit,
                                        dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                                        fp32_head=args.fp32_head)
        for i, path in enumerate(args.adapter):
            name = "default" if i == 0 else f"adapter_{i}"
            # loaded (the first again) for peft's missing and unexpected keys,
            # which it only warns of
            result = policy.load_adapter(path, adapter_name=name, is_trainable=False)
            missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
            if missing or result.unexpected_keys:
                raise RuntimeError(f"{len(missing)} of its weights missing "
                                   f"(e.g. {(missing or ['-'])[0]}), "
                                   f"{len(result.unexpected_keys)} unexpected")
            # a checkpoint's policy: the checkpoint
            models.append((os.path.basename(path.removesuffix("/default")), name, path))
    except RuntimeError as e:
        # torch's size mismatches (another hidden size): the first says why, in shapes
        why = re.findall(r"size mismatch.*", str(e)) + str(e).splitlines()
        fail(f"--adapter {path} does not fit --model {args.model}: {why[0][:300]}")
    return policy, tokenizer, models


def use_model(policy, adapter_name):
    """The base (every adapter disabled) for adapter_name None, else that adapter on. The `same`
    user's nested disable_adapter leaves the base base: peft re-enables only what it disabled."""
    if adapter_name is None:
        return policy.disable_adapter()
    policy.set_adapter(adapter_name)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# The evaluation loop
# ----------------------------------------------------------------------------------------------
def shown(x, digits=2, sign=""):
    """A statistic and its interval in results.md (the benchmark's and the agreement check's)."""
    if x is None:
        return "- (needs 2 files or more that share scenarios)"
    if not np.isfinite(x["value"]):
        return "undefined (one side never varies)"
    spec = f"{sign}.{digits}f"
    return f"{x['value']:{spec}} [{x['low']:{spec}}, {x['high']:{spec}}]"


def results_table(results):
    """The markdown table of results.json, with a line saying what was measured."""
    s = results["settings"]
    lines = [
        f"{len(results['persona_ids'])} personas from `{os.path.basename(s['personas'])}` "
        f"(split {s['split']}), 1 greedy dialogue each; simulator `{s['simulator']}` (read-out "
        f"{results['readout']}), start emotion {s['start_emotion']}, up to "
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
    for m in results["models"]:
        n, p = m["dialogues"], m.get("vs_base")
        lines.append(f"| {m['label']} | {m['score']:.1f} [{m['ci_low']:.1f}, {m['ci_high']:.1f}] "
                     f"| {m['cut_replies']} ({m['cut_replies'] / (m['turns_mean'] * n):.0%}) "
                     f"| {shown(p, 1, '+') if p else '-'} "
                     f"| {m['successes']}/{n} | {m['failures']}/{n} | {m['turns_mean']:.1f} "
                     f"| {m['reply_tokens_mean']:.0f} | {m['violations']} "
                     f"({m['violations'] / (m['turns_mean'] * n):.0%}) | {m['unread']} |")
    return "\n".join(lines) + "\n"


def write_results(out, results, table):
    """results.json and results.md, each replaced whole (run.write_atomically). results.json is
    strict JSON: a statistic that is undefined (NaN) is written as null."""
    write_atomically(f"{out}/results.json",
                     json.dumps(finite(results), indent=1, ensure_ascii=False, allow_nan=False))
    write_atomically(f"{out}/results.md", table)


def run_evaluation(args, policy, tokenizer, simulator, personas, models):
    """Every model plays every persona; writes into args.out and returns the results dict.
    results.json and results.md are rewritten after each model (complete after the last), so a
    failure half way leaves the finished models' numbers and transcripts on disk."""
    results = {"complete": False, "settings": public_config(args, "evaluate.py"),
               "readout": simulator.readout, "persona_ids": [p.id for p in personas], "models": []}
    for done, (label, adapter_name, path) in enumerate(models, 1):
        t0 = time.time()
        with use_model(policy, adapter_name):
            # a Decoder of its own a model (play_dialogues makes one): on CUDA, its adapter's graphs
            records, _ = play_dialogues(
                policy, simulator, personas, chat=ChatTokens(tokenizer, args.thinking),
                temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                max_context=args.max_context, greedy=True, desc=f"{label}: dialogues")
        # each dialogue tagged with its model, its token arrays left out
        append_lines(f"{args.out}/transcripts.jsonl",
                     [{"model": label, **{k: r[k] for k in r if k not in TOKEN_ARRAYS}}
                      for r in records])
        summary = {"label": label, "adapter": path,
                   **model_summary(records, args.bootstrap, args.seed), "seconds": time.time() - t0}
        if adapter_name:
            base = list(results["models"][0]["per_persona"].values())
            summary["vs_base"] = paired_difference(list(summary["per_persona"].values()), base,
                                                   args.bootstrap, args.seed)
        results["models"].append(summary)
        results["complete"] = done == len(models)
        write_results(args.out, results, results_table(results))
    return results


# ----------------------------------------------------------------------------------------------
# A simulated user measured against SAGE's recorded judgments (--agreement)
# ----------------------------------------------------------------------------------------------
def is_emotion(value):
    """A recorded emotion: a JSON number in [0, 100] (true and false are of type bool, not int; NaN
    and infinity fail the comparison)."""
    return type(value) in (int, float) and 0 <= value <= 100


def read_sage_dialogues(path, personas):
    """SAGE's recorded dialogues, one JSON object a line: id, emo_point (the final emotion) and
    history, {role: user|assistant, content} each, a user message with the judge's `emotion-point`.
    Returns [{file, line, id, final, history: [{role: user|agent, text}], points: {message index:
    emotion}}]. Bad input, as strict as a persona file: one line naming file, line and field."""
    dialogues, lines = [], {}
    for i, record in read_json_lines(path, fail):
        where = f"{path}: line {i + 1}"
        name = str(record.get("id")) if isinstance(record, dict) else None
        if name not in personas:
            fail(f"{where}: must be an object whose field 'id' names a persona "
                 "of the --personas file")
        where += f" (id {name})"
        if name in lines:  # a second "model" or a repeated line would count its replies twice
            fail(f"{where}: field 'id' is on line {lines[name]} too: one dialogue per scenario")
        lines[name] = i + 1
        if not is_emotion(record.get("emo_point")):
            fail(f"{where}: field 'emo_point' must be a number from 0 to 100 (the final emotion), "
                 f"not {record.get('emo_point')!r}")
        history = record.get("history")
        if not isinstance(history, list) or len(history) < 3:
            fail(f"{where}: field 'history' must be a list of messages with a judged reply "
                 "(user, agent, user)")
        messages, points = [], {}
        for k, m in enumerate(history):
            role = "assistant" if k % 2 else "user"
            in_turn = isinstance(m, dict) and m.get("role") == role
            if not in_turn or not isinstance(m.get("content"), str):
                fail(f"{where}: field 'history[{k}]' must be {{role: {role}, content: text}} "
                     "(messages alternate, the user's first)")
            messages.append({"role": "agent" if k % 2 else "user", "text": m["content"]})
            if role == "user":
                points[k] = m.get("emotion-point")
                if not is_emotion(points[k]):
                    fail(f"{where}: field 'history[{k}].emotion-point' must be a number "
                         f"from 0 to 100, not {points[k]!r}")
        dialogues.append({"file": path, "line": i + 1, "id": name, "final": record["emo_point"],
                          "history": messages, "points": points})
    return dialogues or fail(f"{path}: no dialogues")


def judged_replies(dialogue):
    """[(index of the agent message, emotion before it, emotion after it)] for every agent reply
    that a user message with an emotion-point follows (SAGE's unjudged last reply is left out)."""
    points = dialogue["points"]
    return [(k, points[k - 1], points[k + 1]) for k in range(1, len(dialogue["history"]) - 1, 2)]


def recorded_state(persona, dialogue, k):
    """The simulated user as it was when agent message k arrived: the recorded conversation before
    it, the recorded emotion, and one appraisal per earlier reply whose move is the recorded change,
    so that the appraisal sees the recorded moods. It is appraised once (the check's `same` user
    keeps no KV cache)."""
    moods = [dialogue["points"][j] for j in range(0, k, 2)]  # e_0 .. e_m
    appraisals = [{"change": after - before, "emotion": after, "appraisal": ""}
                  for before, after in zip(moods, moods[1:])]
    return UserState(persona, moods[-1], dialogue["history"][:k], turns=len(appraisals),
                     appraisals=appraisals)


def simulated_final(start, changes, max_change=10):
    """The final emotion from adding the simulator's changes along a recorded dialogue, each clamped
    as the simulator clamps it (apply_change): to +-max_change, the mood to [0, 100]; it stops where
    SAGE and Simulator.step stop, at 100 (a success) or below 10 (a failure), and where an appraisal
    could not be read (None: a dialogue in training would end there)."""
    emotion = start
    for change in changes:
        if change is None:
            break
        if SAGE_LEAVE_BELOW <= emotion < SAGE_SUCCESS:
            emotion, _ = apply_change(emotion, change, max_change)
    return emotion


def agreement_rows(dialogue, changes, max_change=10):
    """(replies, 2) array of (recorded change, simulated move) for one dialogue's read appraisals:
    the simulator's move starts from the recorded emotion before each reply, so the two are compared
    reply by reply. A reply whose appraisal could not be read (None) is left out."""
    return np.array([(after - before, apply_change(before, change, max_change)[1])
                     for (_, before, after), change in zip(judged_replies(dialogue), changes)
                     if change is not None], dtype=float).reshape(-1, 2)


def agreement_report(dialogues, changes, max_change=10, n_boot=2000, seed=0):
    """Every number of the agreement check. dialogues: read_sage_dialogues rows; changes: the
    simulator's change per judged reply (None where unread), per dialogue, in the same order. Per
    reply, per dialogue's final emotion (rebuilt with SAGE's exits), per file (one file is one
    evaluated model) and the ranking of the files."""
    groups = [agreement_rows(d, c, max_change) for d, c in zip(dialogues, changes)]
    recorded, simulated = np.concatenate(groups).T                         # (replies,) each
    finals = np.array([(d["final"], simulated_final(d["points"][0], c, max_change))
                       for d, c in zip(dialogues, changes)], dtype=float)  # (dialogues, 2)
    by_file = {}  # file -> {id: (recorded, simulated) final}; ids are unique within a file
    for d, final in zip(dialogues, finals):
        by_file.setdefault(d["file"], {})[d["id"]] = final
    files = [{"label": re.sub(r"(_result)?\.jsonl?$", "", os.path.basename(path)), "file": path,
              "dialogues": len(mine),
              **{side: {**mean_with_interval(column, n_boot, seed),
                        "successes": int((column >= SAGE_SUCCESS).sum()),
                        "failures": int((column < SAGE_LEAVE_BELOW).sum())}
                 for side, column in zip(("recorded", "simulated"), np.array([*mine.values()]).T)}}
             for path, mine in by_file.items()]
    # the models are ranked on the scenarios every file holds
    first, *others = by_file.values()
    shared = [i for i in first if all(i in mine for mine in others)]
    # (files, shared, 2); (files, 0) when they share none
    shared_finals = np.array([[mine[i] for i in shared] for mine in by_file.values()])
    return {
        "replies": {"n": len(recorded), "dialogues": len(dialogues),
                    "unread": sum(change is None for mine in changes for change in mine),
                    **{name: with_interval(groups, statistic, n_boot, seed)
                       for name, statistic in STATISTICS.items()},
                    # what a simulator that knows nothing gets: the commonest recorded
                    # direction; never moving
                    "direction_baseline": max(np.mean(np.sign(recorded) == d) for d in (-1, 0, 1)),
                    "mae_of_no_change": np.abs(recorded).mean(),
                    "recorded_mean_change": recorded.mean(),
                    "simulated_mean_change": simulated.mean()},
        "final": {"simulated_minus_recorded": paired_difference(finals[:, 1], finals[:, 0],
                                                                n_boot, seed),
                  **{name: with_interval(finals[:, None], STATISTICS[name], n_boot, seed)
                     for name in ("mae", "spearman", "pearson")}},
        "files": files,
        "models": {"scenarios": len(shared),
                   "kendall_tau_b": kendall_with_interval(shared_finals, n_boot, seed)},
    }


def ranking(files, side):
    """'a > b = c': the files in order of their recorded or simulated score, ties shown as ties."""
    ordered = sorted(files, key=lambda m: -m[side]["value"])  # stable: ties keep the files' order
    return " > ".join(" = ".join(m["label"] for m in tied)
                      for _, tied in groupby(ordered, lambda m: m[side]["value"]))


def agreement_table(report):
    """results.md of an agreement run (its results.json: the report and the settings)."""
    r, f, settings = report["replies"], report["final"], report["settings"]
    model = ""
    if settings["simulator"] == "same":
        model = f" (model `{settings['model']}`)"
    lines = [
        f"Simulator `{settings['simulator']}`{model}, read-out {settings['readout']}, against "
        f"{r['dialogues']} recorded SAGE dialogues ({r['n']} judged replies) of "
        f"{len(report['files'])} file(s). [95% bootstrap interval over dialogues, "
        f"{settings['bootstrap']} resamples.] "
        "Changes: the recorded one is the next user message's emotion-point minus the one before; "
        "the simulator's is its move from the recorded emotion.",
        "", "| per reply | value |", "|---|---|",
        f"| Spearman of the changes | {shown(r['spearman'])} |",
        f"| Pearson of the changes | {shown(r['pearson'])} |",
        f"| direction agreement (up / flat / down) | {shown(r['direction_agreement'])} "
        f"(always the commonest recorded direction: {r['direction_baseline']:.2f}) |",
        f"| mean absolute error | {shown(r['mae'])} (never moving: {r['mae_of_no_change']:.2f}) |",
        f"| mean change: recorded / simulated | {r['recorded_mean_change']:+.2f} / "
        f"{r['simulated_mean_change']:+.2f} |",
        f"| appraisals not read (left out) | {r['unread']} |",
        "", "| final emotion per dialogue | value |", "|---|---|",
        f"| mean absolute error | {shown(f['mae'], 1)} |",
        f"| simulated - recorded | {shown(f['simulated_minus_recorded'], 1, '+')} |",
        f"| Spearman | {shown(f['spearman'])} |",
        "",
        "| file (model) | dialogues | recorded score | simulated score | recorded successes "
        "/ failures | simulated successes / failures |", "|---|---|---|---|---|---|"]
    for m in report["files"]:
        rec, sim = m["recorded"], m["simulated"]
        lines += [f"| {m['label']} | {m['dialogues']} | {shown(rec, 1)} | {shown(sim, 1)} "
                  f"| {rec['successes']} / {rec['failures']} "
                  f"| {sim['successes']} / {sim['failures']} |"]
    lines += ["", "Rank order of the models, Kendall's tau-b over the "
              f"{report['models']['scenarios']} scenarios every file holds: "
              f"{shown(report['models']['kendall_tau_b'])}; "
              f"recorded {ranking(report['files'], 'recorded')}, "
              f"simulated {ranking(report['files'], 'simulated')}."]
    return "\n".join(lines) + "\n"


BATCH_DIALOGUES = 4  # dialogues whose replies go to the simulator in one call


def agreement_main(args):
    """python evaluate.py --agreement FILE... --personas PROFILES [--simulator ...] [--dialogues N],
    everything checked before any model loads. A stopped check is run again whole; its appraisals
    stay in appraisals.jsonl, line by line, and no result file is half written."""
    personas = {p.id: p for p in load_personas(args.personas, difficulty=args.difficulty)}
    dialogues, seen = [], {}
    for path in args.agreement:
        dialogues += read_sage_dialogues(path, personas)[:args.dialogues or None]
        # the same file under another name or a hard link would count as a second model that agrees
        first = seen.setdefault((os.stat(path).st_dev, os.stat(path).st_ino), path)
        if first != path:
            fail(f"--agreement {path}: the file {first} again; give each once")
    new_folder(args.out)
    store = f"{args.out}/appraisals.jsonl"
    exit_on_signals(lambda: f"; the appraisals made so far are in {store}")
    # `same`: the base model alone (no policy, no adapters)
    simulator = build_simulator(args, None, None)
    print(f"{len(dialogues)} recorded dialogues from {len(args.agreement)} file(s); simulator "
          f"{args.simulator} (read-out {simulator.readout}), CPU threads: "
          f"{torch.get_num_threads()}; every appraisal goes to {store}", file=sys.stderr)
    try:
        # The simulator's (change, appraisal) for every judged reply: each batch of BATCH_DIALOGUES
        # dialogues is one call to simulator.appraise (all their replies at once), and each finished
        # dialogue is appended to the store at once, the record of every appraisal. The progress bar
        # counts replies.
        answers = []  # per dialogue, in order
        bar = tqdm(total=sum(len(judged_replies(d)) for d in dialogues), desc="agreement: replies")
        for start in range(0, len(dialogues), BATCH_DIALOGUES):
            part = dialogues[start:start + BATCH_DIALOGUES]
            jobs = [(d, k) for d in part for k, _, _ in judged_replies(d)]
            states = [recorded_state(personas[d["id"]], d, k) for d, k in jobs]
            told = iter(simulator.appraise(states, [d["history"][k]["text"] for d, k in jobs]))
            rows = [{"id": d["id"], "appraisals": [next(told)[:2] for _ in judged_replies(d)]}
                    for d in part]
            append_lines(store, rows)
            answers += [row["appraisals"] for row in rows]
            bar.update(len(jobs))
        bar.close()
        changes = [[change for change, _ in mine] for mine in answers]
        if all(change is None for mine in changes for change in mine):
            raise SimulatorError("not one of its appraisals could be read: check the simulator's "
                                 f"answers in {store}")
        report = agreement_report(dialogues, changes, args.max_change, args.bootstrap, args.seed)
        settings = {**public_config(args, "evaluate.py"), "readout": simulator.readout}
        results = {"settings": settings, **report}
        table = agreement_table(results)
        write_results(args.out, results, table)
    except OSError as e:
        # a full disk: the appraisal lines written whole stay, no result is half written
        fail(f"cannot write in {args.out} ({write_failure(e, args.out)}); "
             f"the appraisals made so far are in {store}")
    release()
    print(table)
    print(f"-> {args.out}/results.json, results.md, appraisals.jsonl")
    return results


# ----------------------------------------------------------------------------------------------
# Openings for profiles without them: RLVER's training profiles have no first_talk
# ----------------------------------------------------------------------------------------------
# RLVER writes each opening with its simulator when it loads a profile; here they are written once,
# into a new file, so that every run trains from the same first messages. The prompt is the user's
# own (persona card, the reply rules, a mood note), asking for a first message instead of a reply.
RULES_OPENING = {"en": "There is something on my mind that I would like to talk through.",
                 "zh": "我心里有件事，想找人聊聊。"}
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
    backend = make_backend(args.simulator, args=args) if todo else RulesBackend()
    try:
        if backend.name == "rules":
            texts = [RULES_OPENING[p.language] for p in todo]
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
    check_openings_fit(personas, args.model, args.thinking, args.max_new_tokens, args.max_context,
                       args.trust_remote_code)
    new_folder(args.out)  # before any model loads
    policy, tokenizer, models = load_models(args)
    simulator = build_simulator(args, policy, tokenizer, goodbye="sage")
    print(f"{len(models)} models x {len(personas)} personas, one greedy dialogue each; simulator "
          f"{args.simulator} (read-out {simulator.readout}); CPU threads: "
          f"{torch.get_num_threads()}", file=sys.stderr)
    # a simulator that stops answering ends it in one line; finished models are in transcripts.jsonl
    results = run_evaluation(args, policy, tokenizer, simulator, personas, models)
    print(results_table(results))
    print(f"-> {args.out}/results.json, results.md, transcripts.jsonl")
    return results


if __name__ == "__main__":
    use_cpu_threads()  # on a CPU: half the usable cores, unless OMP_NUM_THREADS is set
    command(main)()  # the command line: a Stop is one line and its exit code
