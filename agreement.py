"""The agreement check: is a simulated user SAGE's judge? Its changes against SAGE's recorded ones.

SAGE's protocol in numbers (its start, the replies it judges, its exits), which evaluate.py's
benchmark follows too; SAGE's recorded dialogues read as strictly as a persona file; for every
recorded reply that SAGE's judge appraised, the simulated user's appraisal in the recorded state,
and the two compared reply by reply, by final emotion and by the ranking of the evaluated models
(stats.py's statistics, each with its interval). results.json and results.md are written whole by
write_results, the benchmark's too. Run through evaluate.py, whose settings it takes:

    python evaluate.py --agreement SAGE/dataset/<judge>_based_simulator/*_result.jsonl \\
        --personas SAGE/profile/simulator_profile_withfirsttalk.jsonl --simulator URL
"""
import json
import os
import re
import sys
from itertools import groupby

import numpy as np
import torch
from tqdm import tqdm

from cli import exit_on_signals, fail, public_config, read_json_lines, release
from personas import load_personas
from rollout import build_simulator, reach_simulator
from run import append_lines, finite, new_folder, write_atomically, write_failure
from simulator import SimulatorError, UserState, apply_change
from stats import (STATISTICS, kendall_with_interval, mean_with_interval, paired_difference,
                   shown, with_interval)


# ----------------------------------------------------------------------------------------------
# SAGE's protocol, and the results' two files (the benchmark's too)
# ----------------------------------------------------------------------------------------------
# SAGE (github.com/Tencent/digitalhuman, SAGE/test_npc.py and simulator_response.py): a dialogue
# starts at 40 with the profile's first_talk; the agent writes at most 10 replies, all but the last
# judged (9 count); it stops at a goodbye, at 100 (a success) or below 10 (a failure). The score is
# the mean final emotion; docs/evaluate.md lists where this project differs, and why.
SAGE_START, SAGE_JUDGED_REPLIES, SAGE_SUCCESS, SAGE_LEAVE_BELOW = 40, 9, 100, 10


def write_results(out, results, table):
    """results.json and results.md, each replaced whole (run.write_atomically). results.json is
    strict JSON: a statistic that is undefined (NaN) is written as null."""
    write_atomically(f"{out}/results.json",
                     json.dumps(finite(results), indent=1, ensure_ascii=False, allow_nan=False))
    write_atomically(f"{out}/results.md", table)


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
    reach_simulator(args.simulator, args)  # a URL user answers a first short request, or one line
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
