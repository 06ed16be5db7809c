"""Evaluation: the base model and trained adapters against the same simulated users, with plots.

A Sentient-style benchmark (SAGE, arXiv 2505.02847): every persona of a set talks with each model
under test, SAGE's protocol by default (start emotion 40, the opening first, up to 9 judged agent replies,
the user leaves on a goodbye, at 100 or below 10; greedy agent decoding; see docs/evaluate.md).
The score is the mean final emotion (0-100) over the personas, with a 95% bootstrap interval; each
adapter is compared with the base on the same personas (mean paired difference, paired bootstrap).
The models under test are the base (every adapter disabled) and each --adapter on top of it; the
weights are loaded once. With --simulator same the simulated user is the frozen base for all of them.

    python evaluate.py --model smollm2 --personas personas.json --split test --out runs/eval
    python evaluate.py --model smollm2 --adapter path/to/adapter [path/to/another ...] \\
        --personas personas.json --math tests/data/math_problems.jsonl --out runs/eval_ppo

Each run writes results.json (every number, per persona), results.md (the table for a README),
transcripts.jsonl (one dialogue a line, tagged with its model; appended as each model finishes),
scores.png and trajectories.png. Training curves of finished or running runs, one line per run:

    python evaluate.py --curves runs/ppo runs/grpo --out runs/curves

Capability retention (RLVER reports that math and code stay intact): --math FILE asks every model
every question of a JSON-lines file {id, question, answer} and reports exact-match accuracy.

Does a simulated user agree with the judge behind SAGE's numbers? Its changes on SAGE's recorded
dialogues against the recorded ones (its own settings: python evaluate.py --agreement --help):

    python evaluate.py --agreement SAGE/dataset/<judge>_based_simulator/*_result.jsonl \\
        --personas SAGE/profile/simulator_profile_withfirsttalk.jsonl --simulator URL --out runs/agreement
"""
import contextlib
import dataclasses
import hashlib
import inspect
import json
import os
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from tqdm import tqdm

from rollout import (PLAIN_PROMPT, THINK_PROMPT, PolicySettings, SamplingSettings, check_openings_fit,
                     eos_ids, load_policy, play_dialogues)
from run import (OutputSettings, TrackerSettings, append_lines, at_least, claim_folder, default_device, fail,
                 finite_row, latest_checkpoint, load_tokenizer, log_to_trackers, one_of, parse_settings,
                 public_config, read_json_lines, read_text, redact, release_run, resolve_model, rows_with,
                 set_seed, setting, start_trackers, start_writing, summarize, tracker_settings,
                 transcript_record, write_atomically, write_failure)
from simulator import (NEGATIVE_REACTIONS, POSITIVE_REACTIONS, Simulator, SimulatorError, SimulatorSettings,
                       UserState, appraisal_messages, apply_change, auto_readout, build_simulator,
                       load_personas_or_exit, persona_language, retry_messages, simulator_kind,
                       user_model, user_turn_messages)


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------
@dataclass
class EvalSettings:
    """What evaluate.py compares, and how (the policy's, the user's and the output's settings are
    declared where they are read; evaluate.py gives them SAGE's defaults)."""
    group = "evaluate.py"
    adapter: list[str] = setting([], "LoRA adapter folders to compare with the base (each holds "
                                     "adapter_config.json)")
    judge: str = setting("training", "training | heldout: the appraisal prompt that scores (heldout: an "
                                     "outside observer the agent never trained against; needs the reasoned "
                                     "read-out)", one_of("training", "heldout"))
    dialogues: int = setting(0, "personas to play, the first N of the split (0 = all)", at_least(0))
    system_prompt_file: str = setting("", "a file whose text replaces the agent's system prompt")
    sample: bool = setting(False, "sample the agent's replies instead of greedy decoding")
    samples: int = setting(1, "dialogues per persona (needs --sample when > 1)", at_least(1))
    bootstrap: int = setting(2000, "bootstrap resamples for the 95%% intervals", at_least(1))
    math: str = setting("", "JSON lines {id, question, answer}: capability check")
    math_max_new_tokens: int = setting(256, "tokens per math answer", at_least(1))
    math_batch_size: int = setting(8, "math questions per generate call", at_least(1))
    curves: list[str] = setting([], "run folders with metrics.jsonl: plot their training curves instead of "
                                    "evaluating")
    agreement: list[str] = setting([], "SAGE result files (JSON lines: id, emo_point, history), one per "
                                       "evaluated model: check the simulator against their judge instead of "
                                       "evaluating (docs/evaluate.md)")
    limit: int = setting(0, "--agreement: the first N dialogues of each file (0 = all)", at_least(0))
    batch_dialogues: int = setting(4, "--agreement: dialogues whose replies go to the simulator in one call",
                                   at_least(1))

    @staticmethod
    def check(args):
        if args.samples > 1 and not args.sample:
            fail("--samples: greedy decoding plays the same dialogue every time; add --sample for "
                 "--samples > 1")
        readout = args.readout if args.readout != "auto" else auto_readout(user_model(args))[0]
        if args.judge == "heldout" and readout != "reasoned":
            fail(f"--judge heldout is an appraisal prompt: it needs --readout reasoned, and --simulator "
                 f"{redact(args.simulator)} reads out '{readout}'")
        args.adapter = [policy_adapter(path) for path in args.adapter]
        take_run_settings(args)


def take_run_settings(args):
    """An adapter of a trainer's run (RUN/checkpoints/iter_N/default) is evaluated as it was trained:
    the base model, thinking (and with it the system prompt), tokens a reply and context come from
    the run's config.json unless given here. With evaluate.py's own defaults a think-then-say agent
    trained with 512 tokens would be cut at 128, mid-thought, and the user would hear silence. Runs
    that disagree: one line (which to take is not guessed); fewer tokens a reply than in training: a
    warning. An adapter folder outside a run keeps the defaults."""
    runs = {}
    for path in args.adapter:
        checkpoints = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        config = os.path.join(os.path.dirname(checkpoints), "config.json")
        if os.path.basename(checkpoints) == "checkpoints" and os.path.isfile(config):
            try:
                runs[path] = json.loads(read_text(config))
            except ValueError as e:
                fail(f"--adapter {path}: its run's settings do not read ({e})")
    for name in ("model", "thinking", "max_new_tokens", "max_context"):
        saved = {path: run[name] for path, run in runs.items() if run.get(name) is not None}
        if len(set(saved.values())) > 1 and name not in args.given_flags:
            flag = f"--{name.replace('_', '-')}"
            fail(f"--adapter: the runs were trained with different {flag} ("
                 + ", ".join(f"{v} in {p}" for p, v in saved.items()) + f"): give {flag} to evaluate "
                 "them alike")
        if saved and name not in args.given_flags:
            setattr(args, name, next(iter(saved.values())))
    trained = max((run.get("max_new_tokens") or 0 for run in runs.values()), default=0)
    if args.max_new_tokens < trained:
        print(f"warning: --max-new-tokens {args.max_new_tokens} is less than the {trained} tokens a reply "
              f"the adapter trained with: cut replies are counted in results.md", file=sys.stderr)
    SamplingSettings.check(args)  # the context taken must still hold a whole reply


def policy_adapter(path):
    """--adapter PATH as the folder of a policy adapter: a trainer's checkpoint gives its policy
    (default/), a run folder its newest complete checkpoint's; PPO's critic is a value model and is
    refused, as is a folder without adapter_config.json (one line each, before any model loads)."""
    if os.path.isdir(os.path.join(path, "checkpoints")):  # a run folder
        newest = latest_checkpoint(path)
        if newest is None:
            fail(f"--adapter {path}: a run folder without a complete checkpoint")
        path = newest
    if os.path.isfile(os.path.join(path, "state.pt")) and os.path.isdir(os.path.join(path, "default")):
        path = os.path.join(path, "default")  # a checkpoint: its policy
    checkpoint = os.path.dirname(os.path.normpath(path))
    if os.path.basename(os.path.normpath(path)) == "critic" and os.path.isfile(os.path.join(checkpoint,
                                                                                          "state.pt")):
        fail(f"--adapter {path} is PPO's critic (a value model), not a policy: give the checkpoint "
             f"{checkpoint} (its policy, default/) instead")
    if not os.path.isfile(os.path.join(path, "adapter_config.json")):
        inside = sorted(d for d in os.listdir(path) if d != "critic"
                        and os.path.isfile(os.path.join(path, d, "adapter_config.json"))) \
            if os.path.isdir(path) else []
        hint = f"; did you mean {os.path.join(path, inside[0])}?" if inside else ""
        fail(f"--adapter {path}: no adapter_config.json there{hint}")
    return path


SETTINGS = (PolicySettings, SamplingSettings, SimulatorSettings, EvalSettings, OutputSettings,
            TrackerSettings)
# SAGE's benchmark settings: start emotion 40; its loop writes 10 agent replies and judges the first
# 9 (the 10th is never appraised), so 9 judged replies give SAGE's score (docs/evaluate.md). Sizes for
# a reply, not a long thought.
DEFAULTS = dict(model="smollm2", max_new_tokens=128, max_context=4096, split="test", start_emotion=40,
                max_turns=9, user_reply_tokens=64, out="runs/eval")


def parse_args(argv=None):
    """The settings, each checked before any model loads (run.parse_settings)."""
    return parse_settings(SETTINGS, None, argv, defaults=DEFAULTS, prog="evaluate.py")


# ----------------------------------------------------------------------------------------------
# The statistics: score, bootstrap intervals, paired differences (pure, tested by hand)
# ----------------------------------------------------------------------------------------------
def persona_means(records, persona_ids):
    """Final emotion per persona, averaged over its samples, in the order of persona_ids. The
    persona is the unit of the benchmark: with K samples each, this keeps the interval from
    pretending to have K times as many independent scenarios."""
    by_persona = {}
    for r in records:
        by_persona.setdefault(r["persona_id"], []).append(r["final_emotion"])
    missing = [p for p in persona_ids if p not in by_persona]
    if missing:
        raise ValueError(f"no dialogues for personas {missing}")
    return np.array([np.mean(by_persona[p]) for p in persona_ids], dtype=float)


def bootstrap_interval(values, n_boot=2000, seed=0, level=0.95):
    """Percentile bootstrap interval of the mean: resample the values with replacement n_boot
    times and take the (1-level)/2 and (1+level)/2 quantiles of the resampled means."""
    values = np.asarray(values, dtype=float)
    if values.ndim != 1 or len(values) == 0:
        raise ValueError("bootstrap needs a non-empty 1-d list of values")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(values), size=(n_boot, len(values)))  # (n_boot, n)
    means = values[idx].mean(1)                                      # (n_boot,)
    low, high = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def paired_difference(treated, base, n_boot=2000, seed=0, level=0.95):
    """Mean of treated - base over the same personas, with a bootstrap interval that resamples
    personas (pairs), not the two lists separately: persona difficulty, which moves both scores
    alike, then cancels out, and the interval is much tighter than from two independent ones."""
    treated, base = np.asarray(treated, dtype=float), np.asarray(base, dtype=float)
    if treated.shape != base.shape:
        raise ValueError(f"paired difference needs the same personas: {treated.shape} vs {base.shape}")
    diff = treated - base
    low, high = bootstrap_interval(diff, n_boot, seed, level)
    return {"mean": float(diff.mean()), "low": low, "high": high, "n": int(len(diff))}


def model_summary(records, persona_ids, n_boot=2000, seed=0):
    """The benchmark's numbers for one model: score and interval over personas, SAGE's successes
    (emotion reached 100) and failures (the user left below the threshold), and the behaviour
    counts that explain a score: turns, reply length, think-format violations, simulator fallbacks."""
    per_persona = persona_means(records, persona_ids)
    low, high = bootstrap_interval(per_persona, n_boot, seed)
    agent_turns = sum(len(r["turn_ends"]) for r in records)
    violations = sum(r["violations"] for r in records)
    return {
        "score": float(per_persona.mean()), "ci_low": low, "ci_high": high,
        "dialogues": len(records), "personas": len(persona_ids),
        "successes": sum(r["end_reason"] == "success" for r in records),
        "failures": sum(r["end_reason"] == "left" for r in records),
        "end_reasons": dict(Counter(r["end_reason"] for r in records)),
        "turns_mean": agent_turns / len(records),
        # replies that ran into --max-new-tokens unfinished: a cut thought reaches the user as "..."
        "cut_replies": sum(r["cut_replies"] for r in records),
        "reply_tokens_mean": sum(r["policy_tokens"] for r in records) / max(1, agent_turns),
        "think_violations": violations,
        "think_violation_rate": violations / max(1, agent_turns),
        "simulator_fallbacks": sum(r["fallbacks"] for r in records),
        "per_persona": {p: float(v) for p, v in zip(persona_ids, per_persona)},
    }


def trajectory(record, start_emotion):
    """Emotion before the first reply and after each agent reply."""
    return [start_emotion] + list(record["emotions"])


def mean_trajectory(trajectories):
    """Mean emotion per turn. A dialogue that has ended keeps its final emotion, so the curve
    ends at the score (the mean final emotion) instead of at the mean of the longest talks."""
    width = max(len(t) for t in trajectories)
    padded = np.array([t + [t[-1]] * (width - len(t)) for t in trajectories], dtype=float)  # (D, T)
    return padded.mean(0).tolist()


# ----------------------------------------------------------------------------------------------
# Math answers: extraction and comparison (pure, tested on tricky cases)
# ----------------------------------------------------------------------------------------------
MATH_PROMPT = ("Solve the problem step by step, briefly. End with a last line of the form "
               "'Answer: <number>' holding only the final number.")
NUMBER = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)(?:/-?(?:\d+(?:\.\d+)?|\.\d+))?")  # 12, -3.5, .5, 3/4
ANSWER_MARKER = re.compile(r"answer\s*(?:is\b|:)", re.IGNORECASE)
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _last_boxed(text):
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed (cut off by the token limit): not an answer


def _clean(text):
    """LaTeX and typography to plain text: \\frac{a}{b} -> a/b, no $ or \\text, no thousands commas."""
    text = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", text)
    text = re.sub(r"\((-?[\d.]+)\)/\((-?[\d.]+)\)", r"\1/\2", text)  # drop the brackets around plain numbers
    text = re.sub(r"\\(?:text|mathrm|textbf|mathbf)\s*\{([^{}]*)\}", r"\1", text)
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "%").replace("\\!", "").replace("\\,", "")
    text = text.replace("\u2212", "-").replace("\\left", "").replace("\\right", "").replace("*", "")
    text = re.sub(r"(?<=\d)\s*/\s*(?=-?\d)", "/", text)  # "3 / 4" -> "3/4"
    return THOUSANDS.sub("", text)


ANSWER_PREFIX = re.compile(r"^[A-Za-z\s:,]*$")          # words before the number: "approximately"
ANSWER_SUFFIX = re.compile(r"^[A-Za-z\s%./(),'\u2019]*$")  # units or words after it: " km/h.", " apples"


def _number_or_text(segment):
    """The answer in a segment of text. After its last '=' (so 'x = 8' gives 8), a number with
    only words around it is that number: 'about 12 apples.' -> '12', '15%' -> '15'. Anything else
    ('2\\sqrt{3}', '(1, 2)', 'x^2+1') is kept whole as text, without a final full stop."""
    segment = segment.split("=")[-1].strip()
    found = NUMBER.search(segment)
    if found and ANSWER_PREFIX.match(segment[:found.start()]) and ANSWER_SUFFIX.match(segment[found.end():]):
        return found.group(0)
    return segment.rstrip(".").strip()


def extract_answer(text):
    """The final answer of a model's solution, by the first rule that applies:
      1. the content of the last \\boxed{...};
      2. else the text after the last answer marker ('Answer:', 'the answer is'), up to the end
         of that line;
      3. else the last number anywhere in the text.
    Before that the text is cleaned: LaTeX fractions become a/b, $ signs, ** and thousands
    separators go ('$1,200' -> '1200'). From the answer of rules 1 and 2 a number with only words
    around it is kept without them ('12 apples.' -> '12'); other answers stay whole as text
    ('2\\sqrt{3}'). Returns '' when there is nothing to extract. answers_match() compares."""
    text = _clean(text)
    boxed = _last_boxed(text)
    if boxed is not None:
        return _number_or_text(boxed)
    markers = list(ANSWER_MARKER.finditer(text))
    if markers:
        segment = text[markers[-1].end():].strip().split("\n")[0]
        if segment.strip():
            return _number_or_text(segment)
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else ""


def as_fraction(text):
    """'0.50', '1/2', '-3/4', '2.5/5' -> an exact Fraction; None if the text is not a number."""
    text = text.replace(" ", "").rstrip("%")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted, reference):
    """Exact match: as numbers when both are numbers ('0.5' == '1/2' == '0.50' == '\\frac{1}{2}'),
    else as text with case, spaces and a final full stop ignored (after the same LaTeX cleaning)."""
    if not predicted.strip():
        return False
    squash = lambda s: re.sub(r"\s+", "", _clean(s)).rstrip(".").lower()  # noqa: E731
    p, r = as_fraction(squash(predicted)), as_fraction(squash(reference))
    if p is not None and r is not None:
        return p == r
    return squash(predicted) == squash(reference)


def read_jsonl_or_exit(path):
    """(line index, object) for each non-empty line of a JSON-lines file; an unreadable file or a
    bad line ends the program with one line naming the file and the line, exit code 2."""
    try:
        return read_json_lines(path)
    except ValueError as e:
        fail(e)


def load_math_or_exit(path):
    """A JSON-lines file of {id, question, answer}; a bad line prints one error line, exit 2."""
    problems = []
    for i, entry in read_jsonl_or_exit(path):
        missing = [k for k in ("id", "question", "answer") if not isinstance(entry, dict) or k not in entry]
        if missing:
            print(f"error: {path}: line {i + 1}: field '{missing[0]}' is missing", file=sys.stderr)
            sys.exit(2)
        problems.append({"id": str(entry["id"]), "question": str(entry["question"]),
                         "answer": str(entry["answer"])})
    if not problems:
        print(f"error: {path}: no questions", file=sys.stderr)
        sys.exit(2)
    return problems


# ----------------------------------------------------------------------------------------------
# Models under test: the base and each adapter, one set of weights
# ----------------------------------------------------------------------------------------------
def unique_labels(paths, reserved=("base",)):
    """Short names for adapter folders: the folder name, with parent folders added only where two
    names (or 'base') would clash: ['runs/a/policy', 'runs/b/policy'] -> ['a/policy', 'b/policy']."""
    parts = [[p for p in os.path.normpath(path).split(os.sep) if p] or [path] for path in paths]
    depth = [1] * len(paths)
    while True:
        labels = ["/".join(pp[-d:]) for pp, d in zip(parts, depth)]
        clash = [i for i, lab in enumerate(labels) if labels.count(lab) > 1 or lab in reserved]
        grow = [i for i in clash if depth[i] < len(parts[i])]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    seen = Counter()
    for i, lab in enumerate(labels):  # the same folder twice, or a folder named 'base'
        seen[lab] += 1
        if seen[lab] > 1 or lab in reserved:
            labels[i] = f"{lab}#{seen[lab]}"
    return labels


def load_models(args):
    """One PeftModel: the first adapter as 'default' (or a fresh LoRA, the identity since B = 0),
    further adapters by name. Returns (policy, tokenizer, models); models[0] is the base.
    An adapter whose weights do not all load into the base (made for another model) ends the
    program with one line naming both, instead of being scored half-loaded."""
    first = args.adapter[0] if args.adapter else None
    try:
        policy, tokenizer = load_policy(args.model, adapter=first, trainable=False, device=default_device(),
                                        load_in_4bit=args.load_in_4bit, dtype=args.dtype,
                                        trust_remote_code=args.trust_remote_code)
    except RuntimeError as e:  # torch's size mismatch: another hidden size
        fail(f"--adapter {first} does not fit --model {args.model}: {load_error(e)}")
    policy.requires_grad_(False)
    models = [{"label": "base", "adapter_name": None, "adapter_path": None}]
    # a checkpoint's policy is a folder named default: its label names the checkpoint
    for i, (path, label) in enumerate(zip(args.adapter, unique_labels(args.adapter, ("base", "default")))):
        name = "default" if i == 0 else f"adapter_{i}"
        problem = adapter_fit_problem(policy, path, name, load=i > 0)
        if problem:
            fail(f"--adapter {path} does not fit --model {args.model}: {problem}")
        models.append({"label": label, "adapter_name": name, "adapter_path": path})
    return policy, tokenizer, models


def adapter_fit_problem(policy, path, name, load=True):
    """None when every weight of the adapter at `path` loads into the adapter `name` of policy and
    every LoRA weight of that adapter comes from the file; else peft's missing or unexpected keys.
    load=False: the adapter is already in (from_pretrained); its weights are loaded again to see."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    try:
        if load:
            policy.load_adapter(path, adapter_name=name, is_trainable=False)
        result = set_peft_model_state_dict(policy, load_peft_weights(path, device="cpu"), adapter_name=name)
    except RuntimeError as e:  # size mismatches
        return load_error(e)
    missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
    if missing or result.unexpected_keys:
        return (f"{len(missing)} of its weights missing (e.g. {(missing or ['-'])[0]}), "
                f"{len(result.unexpected_keys)} unexpected (e.g. {(result.unexpected_keys or ['-'])[0]})")
    return None


def load_error(error):
    """Why weights do not load, in one line: torch puts the reasons (size mismatches) after a
    header line ("Error(s) in loading state_dict for ..."); the first one, shapes side by side."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    why = next((line for line in lines if "size mismatch" in line), lines[0])
    m = re.search(r"size mismatch for (\S+): copying a param with shape torch\.Size\(\[(.*?)\]\) from "
                  r"checkpoint, the shape in current model is torch\.Size\(\[(.*?)\]\)", why)
    return f"{m[1]} is ({m[2]}) in the adapter, ({m[3]}) in the model" if m else why[:300]


@contextlib.contextmanager
def use_model(policy, adapter_name):
    """The base (every adapter disabled) for adapter_name None, else that adapter switched on.
    The 'same' simulator disables adapters again inside: peft's LoRA context only re-enables on
    exit what was enabled on entry, so the nested context leaves the base base (tested)."""
    if adapter_name is None:
        with policy.disable_adapter():
            yield
    else:
        policy.set_adapter(adapter_name)
        yield


@torch.no_grad()
def answer_questions(policy, tokenizer, problems, max_new_tokens=256, batch_size=8, desc="math"):
    """Greedy answers to each question, with a plain system prompt (no thinking scaffold), batched
    with left padding so every row's answer starts at the same column."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, temperature=None, top_p=None, top_k=None,
                              repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_ids(tokenizer), pad_token_id=tokenizer.pad_token_id)
    device = next(policy.parameters()).device
    was_training = policy.training
    policy.eval()
    outputs = []
    for i in tqdm(range(0, len(problems), batch_size), desc=desc, leave=False):
        # enable_thinking=False switches off Qwen3-style templates' own thinking; others ignore it.
        texts = [tokenizer.apply_chat_template([{"role": "system", "content": MATH_PROMPT},
                                                {"role": "user", "content": p["question"]}],
                                               tokenize=False, add_generation_prompt=True,
                                               enable_thinking=False)
                 for p in problems[i:i + batch_size]]
        enc = tokenizer(texts, add_special_tokens=False, padding=True, padding_side="left",
                        return_tensors="pt").to(device)
        out = policy.generate(**enc, generation_config=config)
        outputs += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    policy.train(was_training)
    return [o.strip() for o in outputs]


# ----------------------------------------------------------------------------------------------
# Outputs: results.md, plots
# ----------------------------------------------------------------------------------------------
def _signed(x):
    return f"{x:+.1f}"


def results_table(results):
    """The markdown table of results.json, with a line saying what was measured."""
    s = results["settings"]
    decoding = f"{s['samples']} sampled (T={s['temperature']})" if s["sample"] else "1 greedy"
    paired = {p["model"]: p for p in results["paired"]}
    has_math = results.get("math") is not None
    lines = [
        f"{results['personas_played']} personas from `{os.path.basename(s['personas'])}` "
        f"(split {s['split']}), "
        f"{decoding} dialogue(s) each; simulator `{s['simulator']}` (read-out {results['readout']}, "
        f"judge {results.get('judge', 'training')}), "
        f"start emotion {s['start_emotion']}, up to {s['max_turns']} turns, "
        f"thinking {'on' if s['thinking'] else 'off'}. "
        f"Score = mean final emotion (0-100); "
        f"[95% bootstrap interval over personas, {s['bootstrap']} resamples]; "
        "vs base = mean paired difference over the same personas; "
        f"cut replies = agent turns that reached --max-new-tokens {s['max_new_tokens']} unfinished; "
        "reply tokens = policy tokens per agent turn, "
        "thought included.",
        "",
        "| model | score | cut replies | vs base | successes | failures | turns | reply tokens "
        "| think violations | sim. fallbacks |"
        + (" math acc. | math vs base |" if has_math else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if has_math else ""),
    ]
    for m in results["models"]:
        n = m["dialogues"]
        p = paired.get(m["label"])
        vs = f"{_signed(p['mean'])} [{_signed(p['low'])}, {_signed(p['high'])}]" if p else "-"
        row = (f"| {m['label']} | {m['score']:.1f} [{m['ci_low']:.1f}, {m['ci_high']:.1f}] "
               f"| {m['cut_replies']} ({m['cut_replies'] / max(1, m['turns_mean'] * n):.0%}) | {vs} "
               f"| {m['successes']}/{n} | {m['failures']}/{n} | {m['turns_mean']:.1f} "
               f"| {m['reply_tokens_mean']:.0f} "
               f"| {m['think_violations']} ({m['think_violation_rate']:.0%}) | {m['simulator_fallbacks']} |")
        if has_math:
            acc = results["math"]["models"].get(m["label"])
            mp = {q["model"]: q for q in results["math"]["paired"]}.get(m["label"])
            row += f" {acc['accuracy']:.1%} |" if acc else " |"
            row += (f" {100 * mp['mean']:+.1f} pts [{100 * mp['low']:+.1f}, {100 * mp['high']:+.1f}] |"
                    if mp else " - |")
        lines.append(row)
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path):
    """Lay out, save and close a figure, written whole or not at all (as run.write_atomically: a
    temporary file renamed over), so that a full disk or a kill never leaves half a PNG. Returns it."""
    import matplotlib.pyplot as plt

    tmp = f"{path}.tmp{os.getpid()}"
    fig.tight_layout()
    try:
        fig.savefig(tmp, dpi=120, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return fig


def plot_scores(models, path):
    """One bar per model: the score with its 95% interval."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.5, 1.6 + 1.3 * len(models)), 4))
    x = np.arange(len(models))
    scores = np.array([m["score"] for m in models])
    yerr = np.array([[m["score"] - m["ci_low"] for m in models], [m["ci_high"] - m["score"] for m in models]])
    ax.bar(x, scores, color=[f"C{i}" for i in range(len(models))], alpha=0.8)
    ax.errorbar(x, scores, yerr=yerr, fmt="none", ecolor="black", capsize=6, lw=1.5)
    for xi, m in zip(x, models):
        ax.text(xi, min(m["ci_high"] + 2, 97), f"{m['score']:.1f}", ha="center", va="bottom")
    ax.set_xticks(x, [m["label"] for m in models], rotation=15 if len(models) > 3 else 0)
    ax.set_ylim(0, 100)
    ax.set_ylabel("score: mean final emotion")
    ax.set_title("Score per model\n(bars: 95% bootstrap interval)", fontsize=10)
    save_figure(fig, path)
    return path


def plot_trajectories(runs, start_emotion, leave_below, path):
    """Emotion per turn: a thin line per dialogue, a thick mean line per model. runs: a list of
    (label, records)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 1
    for i, (label, records) in enumerate(runs):
        paths = [trajectory(r, start_emotion) for r in records]
        width = max(width, max(len(p) for p in paths))
        for p in paths:
            ax.plot(range(len(p)), p, color=f"C{i}", lw=0.9, alpha=0.45)
        mean = mean_trajectory(paths)
        ax.plot(range(len(mean)), mean, color=f"C{i}", lw=3, label=f"{label} (mean)")
    ax.axhline(100, color="grey", ls="--", lw=0.8)
    ax.axhline(leave_below, color="grey", ls=":", lw=0.8)
    ax.text(0.05, 97, "success", color="grey", fontsize=8, va="top")
    ax.text(0.05, leave_below + 1, "the user leaves below this", color="grey", fontsize=8, va="bottom")
    ax.set_xlim(0, max(1, width - 1))
    ax.set_ylim(-2, 102)
    ax.set_xticks(range(width))
    ax.set_xlabel("agent turn (0 = the opening)")
    ax.set_ylabel("user emotion")
    ax.set_title("Emotion per turn: thin lines one dialogue each, thick the mean per model\n"
                 "(a dialogue that ended early keeps its final emotion in the mean)", fontsize=9)
    ax.legend(loc="best", fontsize=8)
    save_figure(fig, path)
    return path


# Training-curve keys the trainers write to metrics.jsonl (see docs/metrics.md); those present
# are plotted against 'iteration', one figure each. Different KL names cover both estimators.
CURVE_METRICS = ("reward_mean", "final_emotion_mean", "kl_ref", "kl", "kl_mean", "approx_kl", "entropy",
                 "value_loss", "policy_loss", "clip_frac", "success_rate", "think_violation_rate")


def load_metrics(run_dir):
    """The rows of run_dir/metrics.jsonl; a missing file or a bad line exits with one error line."""
    path = os.path.join(run_dir, "metrics.jsonl")
    rows = []
    for i, row in read_jsonl_or_exit(path):
        if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
            print(f"error: {path}: line {i + 1}: needs an integer 'iteration'", file=sys.stderr)
            sys.exit(2)
        rows.append(row)
    return rows


def plot_curves(run_dirs, out):
    """One PNG per known metric (curves_<metric>.png), one line per run; returns the paths."""
    labels = unique_labels(run_dirs, reserved=())
    runs = [(label, load_metrics(d)) for label, d in zip(labels, run_dirs)]
    os.makedirs(out, exist_ok=True)
    plt = _pyplot()
    written = []
    for key in CURVE_METRICS:
        series = []
        for label, rows in runs:
            points = [(r["iteration"], float(r[key])) for r in rows
                      if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
            if points:
                series.append((label, sorted(points)))
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        few = max(len(points) for _, points in series) < 30  # dots only where they stay readable
        for label, points in series:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=label, marker="o" if few else None, ms=3)
        ax.set_xlabel("iteration")
        ax.set_ylabel(key)
        ax.set_title(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = os.path.join(out, f"curves_{key}.png")
        save_figure(fig, path)
        written.append(path)
    if not written:
        found = sorted({k for _, rows in runs for r in rows for k in r} - {"iteration"})
        print(f"error: none of the known metrics {list(CURVE_METRICS)} is in these runs; found {found}",
              file=sys.stderr)
        sys.exit(2)
    return written


# ----------------------------------------------------------------------------------------------
# The evaluation loop
# ----------------------------------------------------------------------------------------------
def write_results(out, results, table):
    """results.json and results.md, each replaced whole (run.write_atomically). results.json is strict
    JSON: a statistic that is undefined (NaN) is written as null."""
    write_atomically(os.path.join(out, "results.json"),
                     json.dumps(finite_row(results)[0], indent=1, ensure_ascii=False, allow_nan=False))
    write_atomically(os.path.join(out, "results.md"), table)


def run_evaluation(args, policy, tokenizer, simulator, personas, models, problems=None, accelerator=None):
    """Every model plays every persona (and answers the math questions); writes args.out and
    returns the results dict. results.json and results.md are rewritten after each model, so a
    failure half way leaves the finished models' numbers and transcripts on disk. With an
    accelerator holding trackers (--report-to), each model's numbers and a few of its dialogues
    go to them too, at step = the model's place in the table (0 = base)."""
    os.makedirs(args.out, exist_ok=True)
    transcripts = os.path.join(args.out, "transcripts.jsonl")
    open(transcripts, "w").close()
    system_prompt = None
    if args.system_prompt_file:
        with open(args.system_prompt_file, encoding="utf-8") as f:
            system_prompt = f.read().strip()
    persona_ids = [p.id for p in personas]
    results = {"complete": False, "settings": public_config(args), "readout": simulator.readout,
               "judge": simulator.judge,
               "personas_played": len(personas), "persona_ids": persona_ids, "models": [], "paired": [],
               "math": None if problems is None else {"questions": len(problems), "models": {}, "paired": []}}
    played = []
    base_correct = None
    for m in models:
        set_seed(args.seed)  # the same random stream for every model when sampling
        t0 = time.time()
        with use_model(policy, m["adapter_name"]):
            records, stats = play_dialogues(
                policy, tokenizer, simulator, personas, args.samples, thinking=args.thinking,
                system_prompt=system_prompt, temperature=args.temperature, top_p=args.top_p,
                max_new_tokens=args.max_new_tokens, max_context=args.max_context, greedy=not args.sample,
                merged_sampling=args.merged_sampling,
                static_cache=args.static_cache, desc=f"{m['label']}: dialogues")
            answers = None
            if problems is not None:
                answers = answer_questions(policy, tokenizer, problems, args.math_max_new_tokens,
                                           args.math_batch_size, desc=f"{m['label']}: math")
        append_lines(transcripts, [transcript_record(r, model=m["label"]) for r in records])
        summary = model_summary(records, persona_ids, args.bootstrap, args.seed)
        speed = summarize(records, stats)
        summary.update(label=m["label"], adapter=m["adapter_path"], seconds=time.time() - t0,
                       policy_tokens_per_s=speed["policy_tokens_per_s"],
                       simulator_tokens_per_s=speed["simulator_tokens_per_s"],
                       dialogue_results=[{k: r[k] for k in ("persona_id", "sample", "final_emotion",
                                                            "end_reason", "emotions", "violations",
                                                            "fallbacks", "policy_tokens", "cut_replies")}
                                         | {"turns": len(r["turn_ends"])} for r in records])
        results["models"].append(summary)
        if m["adapter_name"] is not None:
            base = results["models"][0]
            results["paired"].append({"model": m["label"], "vs": base["label"], **paired_difference(
                [summary["per_persona"][p] for p in persona_ids],
                [base["per_persona"][p] for p in persona_ids], args.bootstrap, args.seed)})
        if answers is not None:
            graded = [{"id": q["id"], "answer": q["answer"], "extracted": extract_answer(a),
                       "output": a} for q, a in zip(problems, answers)]
            for g in graded:
                g["correct"] = answers_match(g["extracted"], g["answer"])
            correct = [float(g["correct"]) for g in graded]
            results["math"]["models"][m["label"]] = {"accuracy": float(np.mean(correct)),
                                                     "correct": int(sum(correct)), "answers": graded}
            if m["adapter_name"] is None:
                base_correct = correct
            elif base_correct is not None:
                results["math"]["paired"].append({"model": m["label"], "vs": "base", **paired_difference(
                    correct, base_correct, args.bootstrap, args.seed)})
        played.append((m["label"], records))
        write_results(args.out, results, results_table(results))
        numbers = dict(summary)
        if answers is not None:
            numbers["math_accuracy"] = results["math"]["models"][m["label"]]["accuracy"]
        log_to_trackers(accelerator, numbers, records, step=len(results["models"]) - 1)
        line = (f"{m['label']}: score {summary['score']:.1f} "
                f"[{summary['ci_low']:.1f}, {summary['ci_high']:.1f}], "
                f"{summary['successes']} successes, {summary['failures']} failures, "
                f"{summary['cut_replies']} cut replies, "
                f"{summary['seconds']:.0f} s")
        if answers is not None:
            line += f", math {results['math']['models'][m['label']]['accuracy']:.1%}"
        print(line, file=sys.stderr)
    results["complete"] = True
    write_results(args.out, results, results_table(results))
    plot_scores(results["models"], os.path.join(args.out, "scores.png"))
    plot_trajectories(played, simulator.start_emotion, simulator.leave_below,
                      os.path.join(args.out, "trajectories.png"))
    return results


# ----------------------------------------------------------------------------------------------
# SAGE's protocol, and a simulated user measured against SAGE's recorded judgments (--agreement)
# ----------------------------------------------------------------------------------------------
# SAGE (github.com/Tencent/digitalhuman, SAGE/test_npc.py and simulator_response.py) starts every
# dialogue at 40 with the profile's first_talk, lets the agent write at most 10 replies and judges
# all but the last (the 10th is written, never appraised: 9 count), and stops when the user says
# goodbye or the emotion reaches 100 (a success) or falls below 10 (a failure). The score is the
# mean final emotion. docs/evaluate.md lists where this project differs, and why.
SAGE_START, SAGE_JUDGED_REPLIES, SAGE_SUCCESS, SAGE_LEAVE_BELOW = 40, 9, 100, 10


def sage_outcome(final_emotion):
    """'success' (reached 100), 'failure' (ended below 10) or None, from the final emotion alone,
    as a recorded SAGE file allows (its records keep no end reason)."""
    if final_emotion >= SAGE_SUCCESS:
        return "success"
    return "failure" if final_emotion < SAGE_LEAVE_BELOW else None


def sage_counts(finals):
    """(successes, failures) of a list of final emotions."""
    outcomes = [sage_outcome(f) for f in finals]
    return outcomes.count("success"), outcomes.count("failure")


# The statistics, in numpy (no scipy), each tested against a hand computation.
def average_ranks(x):
    """1-based ranks, ties sharing the mean of the ranks they span: [10, 20, 20, 30] -> [1, 2.5, 2.5, 4]."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x))
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and x[order[j + 1]] == x[order[i]]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(x, y):
    """Pearson correlation; NaN when either side is constant (no correlation is defined)."""
    dx = np.asarray(x, dtype=float) - np.mean(x)
    dy = np.asarray(y, dtype=float) - np.mean(y)
    denominator = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / denominator) if denominator > 0 else float("nan")


def spearman(x, y):
    """Spearman's rho: the Pearson correlation of the average ranks (ties handled)."""
    return pearson(average_ranks(x), average_ranks(y))


def kendall_tau_b(x, y):
    """Kendall's tau-b: (concordant - discordant) / sqrt((n0 - ties in x) (n0 - ties in y)) over the
    n0 = n(n-1)/2 pairs; NaN when either side is constant."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    i, j = np.triu_indices(len(x), 1)
    sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])  # (n0,) each
    n0 = len(i)
    denominator = np.sqrt((n0 - (sx == 0).sum()) * (n0 - (sy == 0).sum()))
    return float((sx * sy).sum() / denominator) if denominator > 0 else float("nan")


def direction_agreement(recorded, simulated):
    """The share of replies whose change goes the same way (up, flat or down) in both."""
    return float(np.mean(np.sign(recorded) == np.sign(simulated)))


def mean_absolute_error(recorded, simulated):
    return float(np.mean(np.abs(np.asarray(recorded, dtype=float) - np.asarray(simulated, dtype=float))))


def dialogue_bootstrap(groups, statistic, n_boot=2000, seed=0, level=0.95):
    """Percentile interval of statistic(rows) when whole dialogues are resampled: groups is one
    (replies, 2) array of (recorded, simulated) changes per dialogue. Replies of one dialogue share
    its persona and history, so resampling replies would pretend they are independent and make the
    interval too narrow; this resamples dialogues (the same draws as bootstrap_interval) and keeps
    each one's replies together. Resamples where the statistic is undefined (NaN) are dropped."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(groups), size=(n_boot, len(groups)))  # (n_boot, dialogues)
    values = np.array([statistic(np.concatenate([groups[k] for k in row])) for row in idx])
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    low, high = np.percentile(values, [50 * (1 - level), 50 * (1 + level)])
    return float(low), float(high)


def with_interval(groups, statistic, n_boot, seed):
    """{value, low, high} of a statistic of the (recorded, simulated) rows of all dialogues."""
    value = statistic(np.concatenate(groups))
    low, high = dialogue_bootstrap(groups, statistic, n_boot, seed)
    return {"value": value, "low": low, "high": high}


def kendall_with_interval(finals, n_boot=2000, seed=0):
    """Kendall's tau-b between the files' (models') mean recorded and mean simulated final emotions
    over the same scenarios, with an interval from resampling scenarios: one draw for every file, so
    the comparison stays paired (SAGE's models all played the same 100 scenarios, and a scenario's
    difficulty moves every model alike). finals: (files, scenarios, 2) of (recorded, simulated).
    None for fewer than 2 files or no scenario."""
    if len(finals) < 2 or finals.shape[1] == 0:
        return None
    tau = lambda rows: kendall_tau_b(*rows.mean(0).T)  # noqa: E731  rows (draws, files, 2) -> files' means
    return with_interval(list(finals.transpose(1, 0, 2)[:, None]), tau, n_boot, seed)


# Reading SAGE's recorded dialogues: one JSON object per line with id, emo_point (the final
# emotion) and history, a list of {role: user|assistant, content}; each user message carries the
# judge's `emotion-point` when it was written (the first: 40).
def is_emotion(value):
    """A recorded emotion: a number in [0, 100] (NaN and infinity fail the comparison)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 100


def read_sage_dialogues(path):
    """[{file, line, id, final, history: [{role: user|agent, text}], points: {message index:
    emotion}, key}] for each line. Bad input (as strict as a persona file: an emotion outside 0-100
    or not finite, an id twice): one line naming the file, the line and the field, exit 2."""
    dialogues, lines = [], {}
    for i, record in read_jsonl_or_exit(path):
        where = f"{path}: line {i + 1}"
        if not isinstance(record, dict):
            fail(f"{where}: must be a JSON object")
        if not isinstance(record.get("id"), (str, int)) or isinstance(record.get("id"), bool):
            fail(f"{where}: field 'id' is {'missing' if 'id' not in record else 'not a string'}")
        where += f" (id {record['id']})"
        if str(record["id"]) in lines:  # a second "model" or a repeated line would count its replies twice
            fail(f"{where}: field 'id' is on line {lines[str(record['id'])]} too: one dialogue per scenario")
        lines[str(record["id"])] = i + 1
        final = record.get("emo_point")
        if not is_emotion(final):
            fail(f"{where}: field 'emo_point' must be a number from 0 to 100 (the final emotion), "
                 f"not {final!r}")
        history = record.get("history")
        if not isinstance(history, list) or not history:
            fail(f"{where}: field 'history' must be a non-empty list of messages")
        messages, points = [], {}
        for k, m in enumerate(history):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ("user", "assistant"):
                fail(f"{where}: field 'history[{k}].role' must be user or assistant")
            if role == ("assistant" if k % 2 == 0 else "user"):
                fail(f"{where}: field 'history[{k}].role': messages must alternate, the user's first")
            if not isinstance(m.get("content"), str):
                fail(f"{where}: field 'history[{k}].content' must be a string")
            if role == "user":
                point = m.get("emotion-point")
                if "emotion-point" not in m:
                    fail(f"{where}: field 'history[{k}].emotion-point' is missing")
                if not is_emotion(point):
                    fail(f"{where}: field 'history[{k}].emotion-point' must be a number from 0 to 100, "
                         f"not {point!r}")
                points[k] = point
            messages.append({"role": "user" if role == "user" else "agent", "text": m["content"]})
        text = json.dumps(record, sort_keys=True, ensure_ascii=False)
        dialogues.append({"file": path, "line": i + 1, "id": str(record["id"]), "final": final,
                          "history": messages, "points": points, "text": text})
    if not dialogues:
        fail(f"{path}: no dialogues")
    return dialogues


def judged_replies(dialogue):
    """[(index of the agent message, emotion before it, emotion after it)] for every agent reply
    that a user message with an emotion-point follows (SAGE's unjudged last reply is left out)."""
    out, before = [], None
    for k, m in enumerate(dialogue["history"]):
        if m["role"] == "user":
            before = dialogue["points"][k]
        elif k + 1 < len(dialogue["history"]):
            out.append((k, before, dialogue["points"][k + 1]))
    return out


def recorded_state(persona, dialogue, k):
    """The simulated user as it was when agent message k arrived: the recorded conversation before
    it, the recorded emotion, and one appraisal per earlier reply whose move is the recorded change,
    so that the mood notes (user_turn_messages) and the likelihood read-out see the recorded moods.
    It is appraised once, so it keeps no KV cache (cache None: a local simulator stores none)."""
    history = [dict(m) for m in dialogue["history"][:k]]
    moods = [dialogue["points"][j] for j in range(k) if history[j]["role"] == "user"]  # e_0 .. e_m
    appraisals = [{"change": after - before, "emotion": after, "appraisal": "", "parsed": True}
                  for before, after in zip(moods, moods[1:])]
    return UserState(persona=persona, emotion=moods[-1], history=history, turns=len(appraisals),
                     appraisals=appraisals, cache=None)


def simulated_final(start, changes, max_change=10):
    """The final emotion from adding the simulator's changes along a recorded dialogue, each
    clamped as the simulator clamps it (apply_change): to +-max_change, the mood to [0, 100]; it
    stops where SAGE and Simulator.step stop, at 100 (a success) or below 10 (a failure)."""
    emotion = start
    for change in changes:
        if sage_outcome(emotion):
            break
        emotion, _ = apply_change(emotion, change, max_change)
    return emotion


def agreement_rows(dialogue, changes, max_change=10):
    """(replies, 2) array of (recorded change, simulated move) for one dialogue: the simulator's
    move starts from the recorded emotion before each reply, so the two are compared reply by reply."""
    rows = [(after - before, apply_change(before, change, max_change)[1])
            for (_, before, after), change in zip(judged_replies(dialogue), changes)]
    return np.array(rows, dtype=float).reshape(-1, 2)


def agreement_report(dialogues, changes, fallbacks, max_change=10, n_boot=2000, seed=0):
    """Every number of the agreement check. dialogues: read_sage_dialogues rows (tagged with their
    file's label); changes / fallbacks: the simulator's change per judged reply and its count of
    unread appraisals, per dialogue, in the same order."""
    groups = [agreement_rows(d, c, max_change) for d, c in zip(dialogues, changes)]
    groups = [g for g in groups if len(g)]  # at least one judged reply (agreement_main checks)
    rows = np.concatenate(groups)
    recorded, simulated = rows[:, 0], rows[:, 1]
    names = {1: "up", 0: "flat", -1: "down"}
    confusion = {f"{names[a]}->{names[b]}": int(((np.sign(recorded) == a) & (np.sign(simulated) == b)).sum())
                 for a in names for b in names}  # recorded direction -> simulated direction
    finals = np.array([(d["final"], simulated_final(d["points"][0], c, max_change))
                       for d, c in zip(dialogues, changes)], dtype=float)  # (dialogues, 2)
    final_groups = [f[None] for f in finals]
    low, high = bootstrap_interval(np.abs(finals[:, 1] - finals[:, 0]), n_boot, seed)
    files = []
    for label in dict.fromkeys(d["label"] for d in dialogues):
        mine = [k for k, d in enumerate(dialogues) if d["label"] == label]
        rec, sim = finals[mine, 0], finals[mine, 1]
        files.append({
            "label": label, "file": dialogues[mine[0]]["file"], "dialogues": len(mine),
            "replies": int(sum(len(judged_replies(dialogues[k])) for k in mine)),
            "recorded_score": float(rec.mean()), "recorded_ci": bootstrap_interval(rec, n_boot, seed),
            "simulated_score": float(sim.mean()), "simulated_ci": bootstrap_interval(sim, n_boot, seed),
            "recorded_successes_failures": sage_counts(rec), "simulated_successes_failures": sage_counts(sim),
            "fallbacks": int(sum(fallbacks[k] for k in mine))})
    # the models are ranked on the scenarios every file holds (ids are unique within a file)
    by_file = [{d["id"]: f for d, f in zip(dialogues, finals) if d["label"] == m["label"]} for m in files]
    shared = [i for i in by_file[0] if all(i in f for f in by_file)]
    shared_finals = np.array([[f[i] for i in shared] for f in by_file]).reshape(len(files), -1, 2)
    tau = kendall_with_interval(shared_finals, n_boot, seed)
    return {
        "replies": {
            "n": int(len(rows)), "dialogues": len(dialogues),
            "spearman": with_interval(groups, lambda r: spearman(r[:, 0], r[:, 1]), n_boot, seed),
            "pearson": with_interval(groups, lambda r: pearson(r[:, 0], r[:, 1]), n_boot, seed),
            "direction_agreement": with_interval(
                groups, lambda r: direction_agreement(r[:, 0], r[:, 1]), n_boot, seed),
            "mae": with_interval(groups, lambda r: mean_absolute_error(r[:, 0], r[:, 1]), n_boot, seed),
            # what a simulator that knows nothing gets: always the commonest recorded direction; never moving
            "direction_baseline": max(float(np.mean(np.sign(recorded) == d)) for d in (-1, 0, 1)),
            "mae_of_no_change": float(np.abs(recorded).mean()),
            "recorded_mean_change": float(recorded.mean()), "simulated_mean_change": float(simulated.mean()),
            "directions": confusion, "fallbacks": int(sum(fallbacks)),
        },
        "final": {
            "mae": {"value": float(np.abs(finals[:, 1] - finals[:, 0]).mean()), "low": low, "high": high},
            "simulated_minus_recorded": paired_difference(finals[:, 1], finals[:, 0], n_boot, seed),
            "spearman": with_interval(final_groups, lambda r: spearman(r[:, 0], r[:, 1]), n_boot, seed),
            "pearson": with_interval(final_groups, lambda r: pearson(r[:, 0], r[:, 1]), n_boot, seed),
        },
        "files": files,
        "models": {"kendall_tau_b": tau, "scenarios": len(shared),
                   "recorded_order": [m["label"] for m in sorted(files, key=lambda m: -m["recorded_score"])],
                   "simulated_order": [m["label"]
                                       for m in sorted(files, key=lambda m: -m["simulated_score"])]},
    }


def _interval(x, digits=2):
    if x is None:
        return "- (needs 2 files or more that share scenarios)"
    if not np.isfinite(x["value"]):
        return "undefined (one side never varies)"
    return f"{x['value']:.{digits}f} [{x['low']:.{digits}f}, {x['high']:.{digits}f}]"


def _ranking(files, key):
    """'a > b = c': the files in order of a score, ties shown as ties."""
    ordered = sorted(files, key=lambda m: -m[key])
    text = ordered[0]["label"]
    for before, m in zip(ordered, ordered[1:]):
        text += (" = " if m[key] == before[key] else " > ") + m["label"]
    return text


def agreement_table(report, settings):
    """results.md of an agreement run."""
    r, f = report["replies"], report["final"]
    model = f" (model `{settings['model']}`)" if settings["simulator"] == "same" else ""
    lines = [
        f"Simulator `{settings['simulator']}`{model}, read-out {settings['readout']}, judge "
        f"{settings['judge']}, against {r['dialogues']} recorded SAGE dialogues ({r['n']} judged replies) of "
        f"{len(report['files'])} file(s). [95% bootstrap interval over dialogues, {settings['bootstrap']} "
        "resamples.] Changes: the recorded one is the next user message's emotion-point minus the one "
        "before; the simulator's is its move from the recorded emotion.",
        "",
        "| per reply | value |", "|---|---|",
        f"| Spearman of the changes | {_interval(r['spearman'])} |",
        f"| Pearson of the changes | {_interval(r['pearson'])} |",
        f"| direction agreement (up / flat / down) | {_interval(r['direction_agreement'])} "
        f"(always the commonest recorded direction: {r['direction_baseline']:.2f}) |",
        f"| mean absolute error | {_interval(r['mae'])} (never moving: {r['mae_of_no_change']:.2f}) |",
        f"| mean change: recorded / simulated | {r['recorded_mean_change']:+.2f} / "
        f"{r['simulated_mean_change']:+.2f} |",
        f"| appraisals not read (fallback 0) | {r['fallbacks']} |",
        "", "| final emotion per dialogue | value |", "|---|---|",
        f"| mean absolute error | {_interval(f['mae'], 1)} |",
        f"| simulated - recorded | {f['simulated_minus_recorded']['mean']:+.1f} "
        f"[{f['simulated_minus_recorded']['low']:+.1f}, {f['simulated_minus_recorded']['high']:+.1f}] |",
        f"| Spearman | {_interval(f['spearman'])} |",
        "", "| file (model) | dialogues | recorded score | simulated score | recorded successes / failures "
        "| simulated successes / failures |", "|---|---|---|---|---|---|"]
    for m in report["files"]:
        (rs, rf), (ss, sf) = m["recorded_successes_failures"], m["simulated_successes_failures"]
        lines.append(f"| {m['label']} | {m['dialogues']} | {m['recorded_score']:.1f} "
                     f"[{m['recorded_ci'][0]:.1f}, {m['recorded_ci'][1]:.1f}] | {m['simulated_score']:.1f} "
                     f"[{m['simulated_ci'][0]:.1f}, {m['simulated_ci'][1]:.1f}] | {rs} / {rf} "
                     f"| {ss} / {sf} |")
    tau = _interval(report["models"]["kendall_tau_b"])
    lines += ["", f"Rank order of the models, Kendall's tau-b over the {report['models']['scenarios']} "
              f"scenarios every file holds: {tau}; "
              f"recorded {_ranking(report['files'], 'recorded_score')}, simulated "
              f"{_ranking(report['files'], 'simulated_score')}."]
    return "\n".join(lines) + "\n"


def plot_agreement(rows, path, title="", max_change=10):
    """Recorded against simulated change per reply as a heat map: one cell per pair of whole changes,
    coloured by how many replies fall there (log scale; empty cells blank). It reads the same at 20
    replies and at 20,000, where dots sized by their count cover the plot. Returns the figure."""
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    rho = spearman(rows[:, 0], rows[:, 1])
    rows = np.rint(rows).astype(int)                         # (replies, 2): recorded, simulated
    m = max(max_change, int(np.abs(rows).max(initial=0)))   # cells -m..m on both axes
    counts = np.zeros((2 * m + 1, 2 * m + 1))                 # (simulated, recorded)
    np.add.at(counts, (rows[:, 1] + m, rows[:, 0] + m), 1)
    fig, ax = plt.subplots(figsize=(6, 5))
    image = ax.imshow(np.ma.masked_equal(counts, 0), origin="lower", extent=(-m - 0.5, m + 0.5) * 2,
                      norm=LogNorm(vmin=1, vmax=max(2, counts.max())), cmap="viridis")
    fig.colorbar(image, ax=ax, label="replies")
    ax.plot([-m, m], [-m, m], color="red", ls="--", lw=0.8)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(integer=True))  # the cells are whole changes
    ax.set_xlabel("recorded change (SAGE's judge)")
    ax.set_ylabel("simulated change (this simulator)")
    ax.set_title(f"{title}\nSpearman {rho:.2f}; dashed: perfect agreement",
                 fontsize=9)
    return save_figure(fig, path)


def _key(value):
    """A short fingerprint of a JSON-able value: which settings, which dialogue and persona."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def finished_appraisals(path, settings_key):
    """{dialogue key: row} of appraisals.jsonl rows made with these settings (run.rows_with: other
    settings' rows are never mixed in, a line cut short by a crash is skipped)."""
    return {row["dialogue"]: row for row in rows_with(path, settings_key)}


def appraise_dialogues(simulator, dialogues, personas, store, settings_key, batch_dialogues=4, progress=True):
    """The simulator's change for every judged reply of every dialogue: {dialogue key: row}. Each
    batch of dialogues is one call to simulator.appraise (all their replies at once); each finished
    dialogue is appended to `store` at once, so an interrupted run keeps it and a rerun skips it."""
    done = finished_appraisals(store, settings_key)
    todo = [d for d in dialogues if d["key"] not in done]
    replies = [len(judged_replies(d)) for d in dialogues]  # the bar counts replies: one can take minutes
    bar = tqdm(total=sum(replies), initial=sum(replies) - sum(len(judged_replies(d)) for d in todo),
               desc="agreement: replies", disable=not progress)
    for start in range(0, len(todo), batch_dialogues):
        part = todo[start:start + batch_dialogues]
        jobs = [(d, k) for d in part for k, _, _ in judged_replies(d)]
        results = simulator.appraise([recorded_state(personas[d["id"]], d, k) for d, k in jobs],
                                     [d["history"][k]["text"] for d, k in jobs])
        rows = []
        for d in part:
            mine = [r for (owner, _), r in zip(jobs, results) if owner is d]
            rows.append({"settings": settings_key, "dialogue": d["key"], "file": d["file"], "line": d["line"],
                         "id": d["id"], "changes": [c for c, _, _ in mine], "parsed": [p for _, _, p in mine],
                         "appraisals": [t for _, t, _ in mine]})
        append_lines(store, rows)
        done.update((row["dialogue"], row) for row in rows)
        bar.update(len(jobs))
    bar.close()
    return done


@contextlib.contextmanager
def one_line_on_signals(kept):
    """Ctrl-C and SIGTERM end the command at once with one line saying what is kept, and exit code
    130 / 143 (as a shell reports a killed command; the run's Run.interrupted does the same); the
    handlers from before are back afterwards. Every appraisal line is written whole (a torn last line
    is skipped on reading) and every result file is renamed into place, so nothing is half written."""
    def stop(number, frame):
        tqdm.write(f"stopped by {signal.Signals(number).name}; {kept}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(128 + number)
    before = {number: signal.signal(number, stop) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


def check_appraisals_fit(args, dialogues, personas, readout):
    """A local simulator (same, or a model for transformers) must hold every appraisal in
    min(--max-context, its window: max_position_embeddings), or its answers past the window are
    noise. Checked before any model loads, with the tokenizer only, on each dialogue's longest
    appraisal: the prompt for its last judged reply and what the read-out adds to it (reasoned: the
    answer, and the re-asking in case it is unread; likelihood: the longest reaction scored). One that
    does not fit: one line naming it. Nothing is cut to fit: a cut history is another dialogue."""
    from transformers import AutoConfig

    name = args.model if args.simulator == "same" else args.simulator
    tokenizer = load_tokenizer(name, args.trust_remote_code)
    window = AutoConfig.from_pretrained(resolve_model(name), trust_remote_code=args.trust_remote_code)
    window = getattr(window, "max_position_embeddings", None) or args.max_context
    limit = min(args.max_context, window)
    asked = inspect.signature(Simulator).parameters  # the appraisal's tokens, as build_simulator leaves them
    for d, (k, _, _) in [(d, judged_replies(d)[-1]) for d in dialogues if judged_replies(d)]:
        state, reply = recorded_state(personas[d["id"]], d, k), d["history"][k]["text"]
        if readout == "reasoned":
            messages = retry_messages(appraisal_messages(state, reply, args.judge, args.max_change), "",
                                      persona_language(state.persona), args.max_change)
            added = asked["appraisal_tokens"].default + asked["retry_tokens"].default
        else:
            messages = user_turn_messages(dataclasses.replace(state, history=state.history + [
                {"role": "agent", "text": reply}]))
            added = max(len(tokenizer(t, add_special_tokens=False)["input_ids"])
                        for t in POSITIVE_REACTIONS + NEGATIVE_REACTIONS)
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        needed = len(tokenizer(text, add_special_tokens=False)["input_ids"]) + added
        if needed > limit:
            why = f"the window of {name}" if limit < args.max_context else f"--max-context {limit}"
            fail(f"{d['file']}: line {d['line']} (id {d['id']}): its longest appraisal needs {needed} tokens "
                 f"and {limit} fit ({why}): raise --max-context (up to the model's window, {window}), or use "
                 f"a simulator with a longer window, such as a URL")


def agreement_main(args):
    """python evaluate.py --agreement FILE... --personas PROFILES [--simulator ...] [--limit N]."""
    from run import load_model

    # everything is read and checked before any model loads
    personas = {p.id: p for p in load_personas_or_exit(args.personas)}
    real = [os.path.realpath(path) for path in args.agreement]
    for k, path in enumerate(args.agreement):
        if real[k] in real[:k]:  # it would count as a second model that agrees with the first
            fail(f"--agreement {path}: the file {args.agreement[real.index(real[k])]} again; give each once")
    labels = [re.sub(r"(_result)?\.jsonl?$", "", name) for name in unique_labels(args.agreement, reserved=())]
    dialogues = []
    for path, label in zip(args.agreement, labels):
        mine = read_sage_dialogues(path)
        for d in mine:
            if d["id"] not in personas:
                fail(f"{path}: line {d['line']}: field 'id' {d['id']!r} has no persona in {args.personas}")
        mine = mine[:args.limit] if args.limit else mine
        for d in mine:
            d["label"] = label
            d["key"] = _key([d["text"], dataclasses.asdict(personas[d["id"]])])
        dialogues += mine
    if not any(judged_replies(d) for d in dialogues):
        fail(f"--agreement: no agent reply in {', '.join(args.agreement)} is followed by a judged user "
             f"message (one with an emotion-point)")
    readout = args.readout if args.readout != "auto" else auto_readout(user_model(args))[0]
    if simulator_kind(args.simulator) in ("same", "local"):
        check_appraisals_fit(args, dialogues, personas, readout)
    settings = {"simulator": redact(args.simulator), "readout": readout, "judge": args.judge,
                "model": args.model if args.simulator == "same" else None, "max_change": args.max_change,
                "api_model": args.api_model if simulator_kind(args.simulator) == "url" else None}
    claim_folder(args.out, "evaluate.py", args.overwrite, reuse="agreement")  # its appraisals go on
    model = tokenizer = None
    if args.simulator == "same":  # the base model alone: no policy, no adapters
        model, tokenizer = load_model(args.model, device=default_device(), dtype=None,
                                      trust_remote_code=args.trust_remote_code)
        model.requires_grad_(False)
    try:
        simulator, _ = build_simulator(args, model, tokenizer, default_device(), judge=args.judge)
    except ValueError as e:
        fail(e)
    start_writing(args.out, "evaluate.py", args.overwrite, kind="agreement")
    store = os.path.join(args.out, "appraisals.jsonl")
    print(f"{len(dialogues)} recorded dialogues from {len(args.agreement)} file(s); simulator "
          f"{redact(args.simulator)} (read-out {simulator.readout}, {simulator.readout_why}; judge "
          f"{simulator.judge}); appraisals "
          f"kept in {store}", file=sys.stderr)
    kept = f"the dialogues finished so far are kept in {store}: the same command continues from them"
    with one_line_on_signals(kept):
        try:
            done = appraise_dialogues(simulator, dialogues, personas, store, _key(settings),
                                      args.batch_dialogues)
            rows = [done[d["key"]] for d in dialogues]
            report = agreement_report(dialogues, [r["changes"] for r in rows],
                                      [len(r["parsed"]) - sum(r["parsed"]) for r in rows], args.max_change,
                                      args.bootstrap, args.seed)
            results = {"complete": True, "settings": {**public_config(args), "readout": simulator.readout},
                       **report}
            table = agreement_table(report, results["settings"])
            write_results(args.out, results, table)
            pairs = np.concatenate([agreement_rows(d, r["changes"], args.max_change)
                                    for d, r in zip(dialogues, rows)])
            plot_agreement(pairs, os.path.join(args.out, "agreement.png"),
                           f"{redact(args.simulator)} ({simulator.readout}) vs SAGE's judge: "
                           f"{len(pairs)} replies", args.max_change)
        except SimulatorError as e:
            fail(f"{e}; {kept}")
        except OSError as e:  # a full disk: the appraisal lines written whole stay, no result is half written
            fail(f"cannot write in {args.out} ({write_failure(e, args.out)}); {kept}")
    print(table)
    print(f"-> {args.out}/results.json, results.md, agreement.png, appraisals.jsonl")
    release_run()
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.agreement:  # the simulator checked against SAGE's recorded judgments
        return agreement_main(args)
    if args.curves:
        for path in plot_curves(args.curves, args.out):
            print(path)
        return
    personas = load_personas_or_exit(args.personas, args.split)
    personas = personas[:args.dialogues] if args.dialogues else personas
    problems = load_math_or_exit(args.math) if args.math else None
    system_prompt = None
    if args.system_prompt_file:
        try:
            with open(args.system_prompt_file, encoding="utf-8") as f:
                system_prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"--system-prompt-file {args.system_prompt_file}: cannot read it ({e})")
    system_prompt = system_prompt or (THINK_PROMPT if args.thinking else PLAIN_PROMPT)
    check_openings_fit(args.model, personas, system_prompt, args.max_context, args.max_new_tokens)
    claim_folder(args.out, "evaluate.py", args.overwrite)  # before any model loads; cleared only below
    set_seed(args.seed)
    accelerator = None
    if args.report_to != "none":  # trackers only; evaluate.py places its models itself
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                                  **tracker_settings(args.report_to, args.out))
    policy, tokenizer, models = load_models(args)
    try:
        simulator, device_map = build_simulator(args, policy, tokenizer, default_device(), judge=args.judge,
                                                goodbye="sage")
    except ValueError as e:
        fail(e)
    start_writing(args.out, "evaluate.py", args.overwrite)  # every check passed: --overwrite clears now
    if accelerator is not None:
        start_trackers(args, accelerator)
    print(f"{len(models)} models x {len(personas)} personas x {args.samples} "
          f"{'sampled' if args.sample else 'greedy'} dialogue(s); simulator {redact(args.simulator)} "
          f"(read-out {simulator.readout}, {simulator.readout_why}; judge {simulator.judge}"
          f"{', spread over GPUs 1..' if device_map else ''})"
          + (f"; {len(problems)} math questions" if problems else ""),
          file=sys.stderr)
    try:
        results = run_evaluation(args, policy, tokenizer, simulator, personas, models, problems, accelerator)
    except SimulatorError as e:  # the models finished before it are in transcripts.jsonl
        fail(e)
    if accelerator is not None:
        accelerator.end_training()
    release_run()
    print(results_table(results))
    print(f"-> {args.out}/results.json, results.md, transcripts.jsonl, scores.png, trajectories.png")


if __name__ == "__main__":
    main()
