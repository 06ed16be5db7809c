"""Evaluation: the base model and trained adapters against the same simulated users, with plots.

A Sentient-style benchmark (SAGE, arXiv 2505.02847): every persona of a set talks with each model
under test, SAGE settings by default (start emotion 40, up to 10 turns, greedy agent decoding).
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
"""
import contextlib
import json
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch
from tqdm import tqdm

from rollout import (PLAIN_PROMPT, THINK_PROMPT, build_simulator, check_openings_fit, default_device, eos_ids,
                     load_policy, log_to_trackers, parse_settings, play_dialogues, public_config, set_seed,
                     start_trackers, summarize, tracker_settings, transcript_record)
from simulator import (SimulatorError, auto_readout, fail, load_personas_or_exit, one_of, redact,
                       simulator_kind)


# ----------------------------------------------------------------------------------------------
# Settings
# ----------------------------------------------------------------------------------------------
@dataclass
class EvalArgs:
    model: str = field(default="smollm2", metadata={
        "help": "base model: smollm2 (embedded), a hub id or a path"})
    load_in_4bit: bool = field(default=False, metadata={
        "help": "NF4 base weights via bitsandbytes (CUDA only): QLoRA adapters on the base they trained on"})
    adapter: list[str] = field(default_factory=list, metadata={
        "help": "LoRA adapter folders to compare with the base (each holds adapter_config.json)"})
    personas: str = field(default="personas.json", metadata={"help": "personas.json or a SAGE profile file"})
    split: str = field(default="test", metadata={"help": "train | test | all"})
    dialogues: int = field(default=0, metadata={
        "help": "personas to play, the first N of the split (0 = all)"})
    simulator: str = field(default="same", metadata={
        "help": "same | rules | model id/path | http://host:port/v1"})
    simulator_device_map: str = field(default="auto", metadata={
        "help": "where a local simulator model goes: auto spreads it over the GPUs after the first"})
    readout: str = field(default="auto", metadata={"help": "auto | reasoned | likelihood | rules"})
    judge: str = field(default="training", metadata={
        "help": "training | heldout: the appraisal prompt that scores (heldout: an outside observer the "
                "agent never trained against; needs the reasoned read-out)"})
    api_model: str = field(default="default", metadata={"help": "model name sent to a URL simulator"})
    api_key_env: str = field(default="OPENAI_API_KEY", metadata={
        "help": "environment variable holding its key"})
    api_timeout: float = field(default=60.0, metadata={
        "help": "seconds a request to a URL simulator may take in all; a call, x (retries + 1)"})
    api_retries: int = field(default=4, metadata={"help": "tries after a failed request to a URL simulator"})
    api_concurrency: int = field(default=8, metadata={"help": "requests in flight at once to a URL server"})
    start_emotion: int = field(default=40, metadata={"help": "the user's starting emotion (SAGE: 40)"})
    max_change: int = field(default=10, metadata={"help": "largest emotion change per turn (SAGE: 10)"})
    max_turns: int = field(default=10, metadata={"help": "agent turns per dialogue (SAGE: 10)"})
    user_reply_tokens: int = field(default=64, metadata={"help": "tokens per simulated user message"})
    thinking: bool = field(default=True, metadata={
        "help": "think-then-say scaffold (--no-thinking to drop it)"})
    system_prompt_file: str = field(default=None, metadata={
        "help": "a file whose text replaces the agent's system prompt"})
    sample: bool = field(default=False, metadata={
        "help": "sample the agent's replies instead of greedy decoding"})
    samples: int = field(default=1, metadata={"help": "dialogues per persona (needs --sample when > 1)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature with --sample"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling with --sample"})
    max_new_tokens: int = field(default=128, metadata={"help": "tokens per agent turn, thought included"})
    merged_sampling: bool = field(default=True, metadata={
        "help": "sample from the adapter merged into a copy of the weights: faster, the update stays "
                "exact (off: less memory; 4-bit bases never merge)"})
    static_cache: bool = field(default=False, metadata={
        "help": "decode into a fixed-size KV cache, which transformers compiles on a GPU (CUDA graphs); "
                "turn caches off. Not yet measured on a GPU"})
    max_context: int = field(default=4096, metadata={
        "help": "tokens per dialogue before it ends with 'context'"})
    bootstrap: int = field(default=2000, metadata={"help": "bootstrap resamples for the 95%% intervals"})
    seed: int = field(default=0, metadata={"help": "random seed (sampling, bootstrap)"})
    math: str = field(default=None, metadata={"help": "JSON lines {id, question, answer}: capability check"})
    math_max_new_tokens: int = field(default=256, metadata={"help": "tokens per math answer"})
    math_batch_size: int = field(default=8, metadata={"help": "math questions per generate call"})
    curves: list[str] = field(default_factory=list, metadata={
        "help": "run folders with metrics.jsonl: plot their training curves instead of evaluating"})
    out: str = field(default="runs/eval", metadata={"help": "output folder"})
    report_to: str = field(default="none", metadata={"help": "none | tensorboard | wandb | trackio | all"})


def parse_args(argv=None):
    """The settings, each checked (rollout.check_settings) before any model loads."""
    args = parse_settings(EvalArgs, None, argv, {"split": one_of("train", "test", "all")})
    if args.samples > 1 and not args.sample:
        fail("--samples: greedy decoding plays the same dialogue every time; add --sample for --samples > 1")
    readout = args.readout if args.readout != "auto" else auto_readout(simulator_kind(args.simulator))
    if args.judge == "heldout" and readout != "reasoned":
        fail(f"--judge heldout is an appraisal prompt: it needs --readout reasoned, and --simulator "
             f"{redact(args.simulator)} reads out '{readout}'")
    for path in args.adapter:
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            inside = sorted(d for d in os.listdir(path)
                            if os.path.isfile(os.path.join(path, d, "adapter_config.json"))) \
                if os.path.isdir(path) else []
            hint = f"; did you mean {os.path.join(path, inside[0])}?" if inside else ""
            fail(f"--adapter {path}: no adapter_config.json there{hint}")
    return args


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
    bad line prints one error line naming the file and the line, and exits with code 2."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        print(f"error: {path}: cannot read: {e.strerror}", file=sys.stderr)
        sys.exit(2)
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            print(f"error: {path}: line {i + 1}: not valid JSON: {e.msg}", file=sys.stderr)
            sys.exit(2)
    return out


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
                                        load_in_4bit=args.load_in_4bit)
    except RuntimeError as e:  # torch's size mismatch: another hidden size
        fail(f"--adapter {first} does not fit --model {args.model}: {str(e).splitlines()[0][:200]}")
    policy.requires_grad_(False)
    models = [{"label": "base", "adapter_name": None, "adapter_path": None}]
    for i, (path, label) in enumerate(zip(args.adapter, unique_labels(args.adapter))):
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
        return str(e).splitlines()[0][:200]
    missing = [k for k in result.missing_keys if "lora_" in k and f".{name}." in k]
    if missing or result.unexpected_keys:
        return (f"{len(missing)} of its weights missing (e.g. {(missing or ['-'])[0]}), "
                f"{len(result.unexpected_keys)} unexpected (e.g. {(result.unexpected_keys or ['-'])[0]})")
    return None


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
        "reply tokens = policy tokens per agent turn, "
        "thought included.",
        "",
        "| model | score | vs base | successes | failures | turns | reply tokens | think violations "
        "| sim. fallbacks |"
        + (" math acc. | math vs base |" if has_math else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if has_math else ""),
    ]
    for m in results["models"]:
        n = m["dialogues"]
        p = paired.get(m["label"])
        vs = f"{_signed(p['mean'])} [{_signed(p['low'])}, {_signed(p['high'])}]" if p else "-"
        row = (f"| {m['label']} | {m['score']:.1f} [{m['ci_low']:.1f}, {m['ci_high']:.1f}] | {vs} "
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
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
        fig.tight_layout()
        path = os.path.join(out, f"curves_{key}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
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
def _append_lines(path, rows):
    """Whole lines, flushed and synced: a crash in the next model leaves these on disk."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def _write_results(out, results):
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1, ensure_ascii=False)
    with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
        f.write(results_table(results))


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
        _append_lines(transcripts, [transcript_record(r, model=m["label"]) for r in records])
        summary = model_summary(records, persona_ids, args.bootstrap, args.seed)
        speed = summarize(records, stats)
        summary.update(label=m["label"], adapter=m["adapter_path"], seconds=time.time() - t0,
                       policy_tokens_per_s=speed["policy_tokens_per_s"],
                       simulator_tokens_per_s=speed["simulator_tokens_per_s"],
                       dialogue_results=[{k: r[k] for k in ("persona_id", "sample", "final_emotion",
                                                            "end_reason", "emotions", "violations",
                                                            "fallbacks", "policy_tokens")}
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
        _write_results(args.out, results)
        numbers = dict(summary)
        if answers is not None:
            numbers["math_accuracy"] = results["math"]["models"][m["label"]]["accuracy"]
        log_to_trackers(accelerator, numbers, records, step=len(results["models"]) - 1)
        line = (f"{m['label']}: score {summary['score']:.1f} "
                f"[{summary['ci_low']:.1f}, {summary['ci_high']:.1f}], "
                f"{summary['successes']} successes, {summary['failures']} failures, "
                f"{summary['seconds']:.0f} s")
        if answers is not None:
            line += f", math {results['math']['models'][m['label']]['accuracy']:.1%}"
        print(line, file=sys.stderr)
    results["complete"] = True
    _write_results(args.out, results)
    plot_scores(results["models"], os.path.join(args.out, "scores.png"))
    plot_trajectories(played, simulator.start_emotion, simulator.leave_below,
                      os.path.join(args.out, "trajectories.png"))
    return results


def main(argv=None):
    args = parse_args(argv)
    if args.curves:
        for path in plot_curves(args.curves, args.out):
            print(path)
        return
    personas = load_personas_or_exit(args.personas, None if args.split == "all" else args.split)
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
    set_seed(args.seed)
    accelerator = None
    if args.report_to != "none":  # trackers only; evaluate.py places its models itself
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                                  **tracker_settings(args.report_to, args.out))
        start_trackers(args, accelerator)
    policy, tokenizer, models = load_models(args)
    try:
        simulator, device_map = build_simulator(args, policy, tokenizer, default_device(), judge=args.judge)
    except ValueError as e:
        fail(e)
    print(f"{len(models)} models x {len(personas)} personas x {args.samples} "
          f"{'sampled' if args.sample else 'greedy'} dialogue(s); simulator {redact(args.simulator)} "
          f"(read-out {simulator.readout}, judge {simulator.judge}"
          f"{', spread over GPUs 1..' if device_map else ''})"
          + (f"; {len(problems)} math questions" if problems else ""),
          file=sys.stderr)
    try:
        results = run_evaluation(args, policy, tokenizer, simulator, personas, models, problems, accelerator)
    except SimulatorError as e:  # the models finished before it are in transcripts.jsonl
        fail(e)
    if accelerator is not None:
        accelerator.end_training()
    print(results_table(results))
    print(f"-> {args.out}/results.json, results.md, transcripts.jsonl, scores.png, trajectories.png")


if __name__ == "__main__":
    main()
