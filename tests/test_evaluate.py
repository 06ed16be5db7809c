"""Tests for evaluate.py: the statistics against hand computation, answer extraction, adapter
switching, the output folder on a tiny model, training curves, and the command end to end on the
embedded model (base vs a perturbed LoRA adapter).

    OMP_NUM_THREADS=1 python -m pytest tests/test_evaluate.py -q
"""
import copy
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import evaluate
import simulator
from evaluate import (CURVE_METRICS, answers_match, bootstrap_interval, extract_answer,
                      mean_trajectory, model_summary, paired_difference, persona_means, results_table,
                      run_evaluation, unique_labels, use_model)
from simulator import RulesBackend, Simulator, load_personas

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")
PNG_HEADER = b"\x89PNG\r\n\x1a\n"



def eval_args(**values):
    """evaluate.py's settings at its defaults, then `values` set as given (unchecked)."""
    args = evaluate.parse_args([])
    for name, value in values.items():
        assert hasattr(args, name), name
        setattr(args, name, value)
    return args

def assert_png(path):
    assert os.path.getsize(path) > 1000, path
    with open(path, "rb") as f:
        assert f.read(8) == PNG_HEADER, path


def fake_record(persona_id, final, end_reason="max_turns", turns=2, tokens=20, violations=0, fallbacks=0,
                sample=0, cut=0):
    return {"persona_id": persona_id, "sample": sample, "final_emotion": final, "end_reason": end_reason,
            "turn_ends": list(range(turns)), "emotions": [final] * turns, "policy_tokens": tokens,
            "violations": violations, "fallbacks": fallbacks, "cut_replies": cut}


# ----------------------------------------------------------------------------------------------
# Score, bootstrap interval, paired difference
# ----------------------------------------------------------------------------------------------
def test_constant_scores_give_a_zero_width_interval():
    assert bootstrap_interval([55.0] * 7, n_boot=500, seed=3) == (55.0, 55.0)


def test_bootstrap_interval_against_hand_computation():
    # [0, 100]: resampled means are 0, 50, 100 with probabilities 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% quantiles are the extremes.
    assert bootstrap_interval([0, 100], n_boot=2000, seed=0) == (0.0, 100.0)
    # [0, 0, 0, 100]: P(mean = 0) = (3/4)^4 = 0.32 > 0.025; P(mean >= 75) = 0.051 > 0.025 but
    # P(mean = 100) = 0.004 < 0.025, so the upper end is 75.
    assert bootstrap_interval([0, 0, 0, 100], n_boot=2000, seed=0) == (0.0, 75.0)


def test_bootstrap_interval_is_about_the_normal_one_and_seeded():
    values = np.arange(1, 41, dtype=float)  # mean 20.5
    low, high = bootstrap_interval(values, n_boot=4000, seed=1)
    half = 1.96 * values.std() / np.sqrt(len(values))  # 3.58
    assert low < 20.5 < high
    assert abs((high - low) / 2 - half) < 0.15 * half
    assert bootstrap_interval(values, n_boot=500, seed=7) == bootstrap_interval(values, n_boot=500, seed=7)
    assert bootstrap_interval(values, n_boot=500, seed=7) != bootstrap_interval(values, n_boot=500, seed=8)


def test_paired_difference_cancels_persona_difficulty():
    base = [10, 50, 90, 30]
    treated = [b + 5 for b in base]
    p = paired_difference(treated, base, n_boot=1000)
    # every persona moved by exactly +5: a paired interval has no width, while two separate
    # intervals of the spread-out scores would overlap widely
    assert p == {"mean": 5.0, "low": 5.0, "high": 5.0, "n": 4}
    worse = paired_difference([b - d for b, d in zip(base, [1, 2, 3, 4])], base, n_boot=1000)
    assert worse["mean"] == -2.5 and worse["low"] < -2.5 < worse["high"] <= -1.0
    with pytest.raises(ValueError, match="same personas"):
        paired_difference([1, 2], [1, 2, 3])


def test_score_averages_samples_per_persona_first():
    records = [fake_record("p1", 40, sample=0), fake_record("p1", 60, sample=1),
               fake_record("p2", 10, end_reason="left", turns=1, tokens=5)]
    assert persona_means(records, ["p1", "p2"]).tolist() == [50.0, 10.0]
    s = model_summary(records, ["p1", "p2"], n_boot=200)
    assert s["score"] == 30.0  # (50 + 10) / 2, not the dialogue mean 36.7
    assert s["ci_low"] == 10.0 and s["ci_high"] == 50.0
    assert (s["successes"], s["failures"], s["dialogues"], s["personas"]) == (0, 1, 3, 2)
    assert s["turns_mean"] == 5 / 3
    assert s["reply_tokens_mean"] == 45 / 5
    with pytest.raises(ValueError, match="p3"):
        persona_means(records, ["p1", "p3"])


def test_summary_counts_successes_violations_and_fallbacks():
    records = [fake_record("a", 100, end_reason="success", violations=1, fallbacks=2),
               fake_record("b", 5, end_reason="left", violations=2),
               fake_record("c", 60, fallbacks=1)]
    s = model_summary(records, ["a", "b", "c"], n_boot=100)
    assert s["score"] == 55.0
    assert (s["successes"], s["failures"], s["think_violations"], s["simulator_fallbacks"]) == (1, 1, 3, 3)
    assert s["think_violation_rate"] == 3 / 6
    assert s["end_reasons"] == {"success": 1, "left": 1, "max_turns": 1}


def test_mean_trajectory_carries_final_emotion_forward():
    assert mean_trajectory([[40, 45], [40, 50, 60]]) == [40.0, 47.5, 52.5]
    records = [{"emotions": [45]}, {"emotions": [50, 60]}]
    assert mean_trajectory([evaluate.trajectory(r, 40) for r in records]) == [40.0, 47.5, 52.5]


def test_results_table(tmp_path):
    ids = ["p1", "p2"]
    base = model_summary([fake_record("p1", 40), fake_record("p2", 60)], ids, n_boot=100)
    ppo = model_summary([fake_record("p1", 45, tokens=40, cut=1), fake_record("p2", 100, "success")], ids,
                        n_boot=100)
    base["label"], ppo["label"] = "base", "ppo"
    args = eval_args(personas="/x/personas.json", out=str(tmp_path), bootstrap=100)
    results = {"settings": args.values(), "readout": "likelihood", "personas_played": 2,
               "models": [base, ppo],
               "paired": [{"model": "ppo", "vs": "base", **paired_difference([45, 100], [40, 60], 100)}],
               "math": None}
    table = results_table(results)
    lines = table.splitlines()
    assert "2 personas from `personas.json` (split test)" in lines[0] and "start emotion 40" in lines[0]
    assert lines[2].startswith("| model | score | cut replies | vs base | successes | failures |")
    assert lines[4] == "| base | 50.0 [40.0, 60.0] | 0 (0%) | - | 0/2 | 0/2 | 2.0 | 10 | 0 (0%) | 0 |"
    assert lines[5].startswith("| ppo | 72.5 [45.0, 100.0] | 1 (25%) | +22.5 [+5.0, +40.0] | 1/2 | 0/2 | 2.0 "
                               "| 15 |")
    results["math"] = {"models": {"base": {"accuracy": 0.5}, "ppo": {"accuracy": 0.25}},
                       "paired": [{"model": "ppo", "mean": -0.25, "low": -0.5, "high": 0.0}]}
    table = results_table(results).splitlines()
    assert table[2].endswith("| math acc. | math vs base |")
    assert table[4].endswith("| 50.0% | - |") and table[5].endswith("| 25.0% | -25.0 pts [-50.0, +0.0] |")


# ----------------------------------------------------------------------------------------------
# Answer extraction
# ----------------------------------------------------------------------------------------------
EXTRACT = [
    ("The workshop builds 1,200 chairs.", "1200"),
    ("Answer: 1,234,567", "1234567"),
    ("She sells 3/4 of them, so 12 are left.", "12"),
    ("So the share is 3/4", "3/4"),
    (r"The result is $\boxed{\frac{3}{4}}$.", "3/4"),
    (r"\boxed{-\dfrac{1}{2}}", "-1/2"),
    (r"First \boxed{5}, corrected: \boxed{6}", "6"),
    (r"\boxed{12 \text{ apples}}", "12"),
    (r"\boxed{2\sqrt{3}}", r"2\sqrt{3}"),
    ("48 - 36 = 12\nAnswer: 12 apples", "12"),
    ("It costs $3.50 in total", "3.50"),
    ("Answer: $3.50", "3.50"),
    ("The temperature drops to -7 degrees.", "-7"),
    ("Answer: \u22127", "-7"),
    ("The answer is 7.", "7"),
    ("The answer is: 0.50.", "0.50"),
    ("**Answer:** 72 km/h", "72"),
    ("Answer: x = 8", "8"),
    ("Answer:\n42", "42"),
    ("Answer: 15%", "15"),
    ("I will answer carefully: 5 + 7 = 12", "12"),  # 'answer carefully' is not a marker
    ("Answer: 2, but 3 also works: the answer is 4", "4"),
    ("no numbers at all", ""),
]


@pytest.mark.parametrize("text,expected", EXTRACT, ids=[t for t, _ in EXTRACT])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


MATCH = [("0.50", "0.5", True), ("0.5", "1/2", True), ("3/4", r"\frac{3}{4}", True), ("1200", "1,200", True),
         ("7", "7.0", True), ("-7", "7", False), ("11/12", "11/12", True), ("22/3", "7.33", False),
         (r"2\sqrt{3}", r"2 \sqrt{3}", True), ("", "0", False), ("12", "13", False)]


@pytest.mark.parametrize("predicted,reference,same", MATCH)
def test_answers_match(predicted, reference, same):
    assert answers_match(predicted, reference) is same


def test_shipped_math_answers_are_read_back():
    problems = evaluate.load_math_or_exit(os.path.join(DATA, "math_problems.jsonl"))
    assert len(problems) == 30
    for p in problems:
        assert answers_match(extract_answer(f"Some steps.\nAnswer: {p['answer']}"), p["answer"]), p
        assert answers_match(extract_answer(f"so it is \\boxed{{{p['answer']}}}."), p["answer"]), p
        assert not answers_match(extract_answer(f"Answer: {p['answer']}1"), p["answer"]), p


# ----------------------------------------------------------------------------------------------
# Models under test: labels and adapter switching
# ----------------------------------------------------------------------------------------------
def test_unique_labels():
    assert unique_labels(["runs/ppo/adapter", "runs/grpo/adapter", "runs/x/sft/"]) == \
        ["ppo/adapter", "grpo/adapter", "sft"]
    assert unique_labels(["ckpt/base"]) == ["ckpt/base"]  # 'base' is the base model's label
    assert unique_labels(["a/b", "a/b"]) == ["a/b", "a/b#2"]


@pytest.fixture(scope="module")
def tiny_peft(tiny_model):
    """The tiny Llama with two different random LoRA adapters, 'default' and 'adapter_1'."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny_model
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    peft = get_peft_model(copy.deepcopy(model), config)
    peft.add_adapter("adapter_1", config)
    peft.requires_grad_(False)
    peft.eval()
    return peft, tokenizer, model


def test_base_context_nests_with_the_same_simulator(tiny_peft):
    peft, tokenizer, plain = tiny_peft
    ids = torch.tensor([tokenizer("hello there, how are you")["input_ids"]])
    reference = plain(ids).logits
    with use_model(peft, "default"):
        first = peft(ids).logits
    with use_model(peft, "adapter_1"):
        second = peft(ids).logits
    assert not torch.allclose(first, reference, atol=1e-4) and not torch.allclose(first, second, atol=1e-4)
    with use_model(peft, None):
        torch.testing.assert_close(peft(ids).logits, reference)
        with peft.disable_adapter():  # what LocalBackend(use_base=True) does inside a base run
            torch.testing.assert_close(peft(ids).logits, reference)
        torch.testing.assert_close(peft(ids).logits, reference)  # still the base after the inner exit
    with use_model(peft, "adapter_1"):  # and the adapter is back after the outer one
        torch.testing.assert_close(peft(ids).logits, second)


# ----------------------------------------------------------------------------------------------
# The evaluation loop on the tiny model with the rules user (seconds)
# ----------------------------------------------------------------------------------------------
MODELS = [{"label": "base", "adapter_name": None, "adapter_path": None},
          {"label": "one", "adapter_name": "default", "adapter_path": "x/one"},
          {"label": "two", "adapter_name": "adapter_1", "adapter_path": "x/two"}]


def tiny_run(tiny_peft, tmp_path, personas_file, split="test", n=2, problems=None, models=MODELS):
    peft, tokenizer, _ = tiny_peft
    args = eval_args(personas=personas_file, split=split, out=str(tmp_path / "eval"), simulator="rules",
                    max_turns=2, max_new_tokens=6, bootstrap=200, math_max_new_tokens=5, math_batch_size=2)
    personas = load_personas(personas_file, split)[:n]
    sim = Simulator(RulesBackend(), start_emotion=args.start_emotion, max_turns=args.max_turns)
    return args, run_evaluation(args, peft, tokenizer, sim, personas, models, problems)


def check_output_folder(out, labels, personas_played):
    results = json.load(open(os.path.join(out, "results.json")))
    assert results["complete"] and [m["label"] for m in results["models"]] == labels
    assert [p["model"] for p in results["paired"]] == labels[1:]
    lines = [json.loads(x) for x in open(os.path.join(out, "transcripts.jsonl"))]
    assert [x["model"] for x in lines] == [lab for lab in labels for _ in range(personas_played)]
    for m in results["models"]:
        assert len(m["per_persona"]) == personas_played and len(m["dialogue_results"]) == personas_played
        # the numbers follow from the dialogues written out: each persona's final emotion (one
        # dialogue each), the score their mean, inside its interval
        finals = {x["persona_id"]: x["final_emotion"] for x in lines if x["model"] == m["label"]}
        assert m["per_persona"] == pytest.approx(finals)
        assert m["score"] == pytest.approx(np.mean(list(finals.values())))
        assert 0 <= m["ci_low"] <= m["score"] <= m["ci_high"] <= 100
    base = results["models"][0]["per_persona"]
    for p, m in zip(results["paired"], results["models"][1:]):  # the mean of the per-persona differences
        assert p["mean"] == pytest.approx(np.mean([m["per_persona"][k] - base[k] for k in base]))
        assert p["low"] <= p["mean"] <= p["high"] and p["n"] == personas_played
    assert all("token_ids" not in x and x["turns"][0]["role"] == "user" for x in lines)
    table = open(os.path.join(out, "results.md")).read()
    assert all(f"| {lab} |" in table for lab in labels)
    for name in ("scores.png", "trajectories.png"):
        assert_png(os.path.join(out, name))
    return results


def test_sage_file_evaluates(tiny_peft, tmp_path):
    args, results = tiny_run(tiny_peft, tmp_path, os.path.join(DATA, "sage_sample.jsonl"), n=3)
    check_output_folder(args.out, ["base", "one", "two"], 3)
    assert results["persona_ids"] == ["sage-001", "sage-002", "sage-003"]


def test_project_file_evaluates_with_math(tiny_peft, tmp_path):
    problems = evaluate.load_math_or_exit(os.path.join(DATA, "math_problems.jsonl"))[:3]
    args, results = tiny_run(tiny_peft, tmp_path, os.path.join(ROOT, "personas.json"), problems=problems)
    check_output_folder(args.out, ["base", "one", "two"], 2)
    math = results["math"]
    assert (set(math["models"]) == {"base", "one", "two"}
            and [p["model"] for p in math["paired"]] == ["one", "two"])
    for m in math["models"].values():  # accuracy = correct / questions, each answer graded again here
        assert len(m["answers"]) == 3
        assert all(a["correct"] == answers_match(a["extracted"], a["answer"]) for a in m["answers"])
        assert m["correct"] == sum(a["correct"] for a in m["answers"]) and m["accuracy"] == m["correct"] / 3
    for p in math["paired"]:
        diffs = [a["correct"] - b["correct"] for a, b in zip(math["models"][p["model"]]["answers"],
                                                               math["models"]["base"]["answers"])]
        assert p["mean"] == pytest.approx(np.mean(diffs))
    assert "math acc." in open(os.path.join(args.out, "results.md")).read()


def test_failure_half_way_leaves_finished_transcripts(tiny_peft, tmp_path, monkeypatch):
    real = evaluate.play_dialogues
    calls = []

    def fail_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return real(*a, **k)

    monkeypatch.setattr(evaluate, "play_dialogues", fail_second)
    with pytest.raises(RuntimeError, match="out of memory"):
        tiny_run(tiny_peft, tmp_path, os.path.join(DATA, "sage_sample.jsonl"))
    out = tmp_path / "eval"
    assert [json.loads(x)["model"] for x in open(out / "transcripts.jsonl")] == ["base", "base"]
    partial = json.load(open(out / "results.json"))
    assert not partial["complete"] and [m["label"] for m in partial["models"]] == ["base"]


def test_settings_are_checked(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        evaluate.parse_args(["--samples", "3"])
    assert stop.value.code == 2 and "--sample" in capsys.readouterr().err
    (tmp_path / "ckpt" / "policy").mkdir(parents=True)
    (tmp_path / "ckpt" / "policy" / "adapter_config.json").write_text("{}")
    with pytest.raises(SystemExit) as stop:
        evaluate.parse_args(["--adapter", str(tmp_path / "ckpt")])
    assert stop.value.code == 2 and re.search("did you mean .*ckpt/policy", capsys.readouterr().err)
    args = evaluate.parse_args(["--adapter", str(tmp_path / "ckpt" / "policy"), "--no-thinking",
                                "--max-turns", "3"])
    assert (args.thinking, args.max_turns, args.start_emotion, args.sample) == (False, 3, 40, False)


def test_load_in_4bit_is_checked_then_passed_to_the_policy(tiny_model_dir, monkeypatch, capsys):
    if not torch.cuda.is_available():  # one line, exit 2, before any model loads
        with pytest.raises(SystemExit) as stop:
            evaluate.parse_args(["--load-in-4bit"])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and "--load-in-4bit needs CUDA" in err and err.strip().count("\n") == 0
    seen, real = [], evaluate.load_policy

    def record(*a, **k):
        seen.append(k["load_in_4bit"])
        return real(*a, **{**k, "load_in_4bit": False})  # bitsandbytes needs CUDA; the route is what counts
    monkeypatch.setattr(evaluate, "load_policy", record)
    for flag in (True, False):
        evaluate.load_models(eval_args(model=tiny_model_dir, load_in_4bit=flag))
    assert seen == [True, False]


def test_a_local_simulator_goes_to_the_gpus_after_the_first(monkeypatch):
    from simulator import simulator_placement

    if torch.cuda.device_count() < 2:
        assert simulator_placement("Qwen/Qwen2.5-7B-Instruct", "auto") == (None, None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(simulator, "gpus_after_the_first", lambda: {0: 0, 1: 9, 2: 9})
    assert simulator_placement("Qwen/Qwen2.5-7B-Instruct", "auto") == ("auto", {0: 0, 1: 9, 2: 9})
    for user, device_map in (("same", "auto"), ("rules", "auto"), ("http://127.0.0.1:8000/v1", "auto"),
                             ("Qwen/Qwen2.5-7B-Instruct", "none")):
        assert simulator_placement(user, device_map) == (None, None), user


def test_judge_flag_is_checked(capsys):
    assert evaluate.parse_args([]).judge == "training"
    for argv, words in [(["--judge", "outside"], ["--judge", "'outside'"]),
                        (["--judge", "heldout"], ["--judge heldout", "reasoned", "'likelihood'"]),
                        (["--judge", "heldout", "--simulator", "rules"], ["'rules'"])]:
        with pytest.raises(SystemExit) as info:
            evaluate.parse_args(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.startswith("error:") and all(w in err for w in words), err
    args = evaluate.parse_args(["--judge", "heldout", "--simulator", "http://127.0.0.1:9/v1"])
    assert args.judge == "heldout"


def test_heldout_judge_runs_and_is_recorded(tiny_model_dir, tmp_path):
    """evaluate.py --judge heldout against an OpenAI-compatible server on 127.0.0.1: the server sees
    the outside observer's prompt, never the persona's own, and results.json says which judged."""
    import http.server
    import threading

    asked = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append(body["messages"])
            last = body["messages"][-1]["content"]
            text = "Their reaction: wary.\nChange: \u22122" if "Change: N" in last else "Okay."
            data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        out = tmp_path / "eval"
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        evaluate.main(["--model", tiny_model_dir, "--simulator", url,
                       "--judge", "heldout", "--dialogues", "2", "--max-turns", "2", "--max-new-tokens", "6",
                       "--bootstrap", "50", "--out", str(out)])
    finally:
        server.shutdown()
        server.server_close()
    results = json.load(open(out / "results.json"))
    assert results["judge"] == "heldout" and results["settings"]["judge"] == "heldout"
    assert results["readout"] == "reasoned"
    assert "judge heldout" in open(out / "results.md").read()
    appraisals = [m for m in asked if "Change: N" in m[-1]["content"]]
    assert len(appraisals) == 4 and all("outside observer" in m[-1]["content"] for m in appraisals)
    assert not any("You are playing" in m[0]["content"] for m in appraisals)
    assert results["models"][0]["score"] == 40 - 4  # two turns of -2 from the start at 40


# ----------------------------------------------------------------------------------------------
# Training curves
# ----------------------------------------------------------------------------------------------
def write_run(folder, rows):
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def test_curves_from_two_runs(tmp_path):
    ppo = write_run(tmp_path / "ppo", [{"iteration": i, "reward_mean": 0.3 + 0.05 * i, "kl_ref": 0.01 * i,
                                        "value_loss": 1.0 / (i + 1), "entropy": 2.0, "clip_frac": 0.1,
                                        "seconds": 3.0} for i in range(1, 6)])
    grpo = write_run(tmp_path / "grpo", [{"iteration": i, "reward_mean": 0.3 + 0.04 * i, "kl_ref": 0.02 * i,
                                          "entropy": 2.1} for i in range(1, 4)])
    out = tmp_path / "curves"
    evaluate.main(["--curves", ppo, grpo, "--out", str(out)])
    written = sorted(os.listdir(out))
    assert written == sorted(f"curves_{k}.png"
                             for k in ("reward_mean", "kl_ref", "value_loss", "entropy", "clip_frac"))
    assert "seconds" not in CURVE_METRICS
    for name in written:
        assert_png(out / name)


def test_curves_errors(tmp_path, capsys):
    odd = write_run(tmp_path / "odd", [{"iteration": 1, "something_else": 1.0}])
    with pytest.raises(SystemExit) as info:
        evaluate.main(["--curves", odd, "--out", str(tmp_path / "c")])
    assert info.value.code == 2 and "something_else" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        evaluate.main(["--curves", str(tmp_path / "missing"), "--out", str(tmp_path / "c")])
    assert info.value.code == 2 and "metrics.jsonl: cannot read" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# An adapter from a training run is evaluated with the run's settings (issue 30 item 2)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter folder (rank 4) for the tiny model, saved by peft."""
    from rollout import load_policy

    policy, _ = load_policy(tiny_model_dir, lora_r=4, device="cpu")
    folder = tmp_path_factory.mktemp("adapter") / "default"
    policy.save_pretrained(str(folder))
    return folder


def run_folder(folder, adapter, **settings):
    """A trainer's run folder as run.RunFolder and Run.save leave it, made by hand: config.json with
    the run's settings, and checkpoints/iter_000001 with state.pt and the policy adapter default/."""
    checkpoint = folder / "checkpoints" / "iter_000001"
    shutil.copytree(adapter, checkpoint / "default")
    config = {"model": "smollm2", "thinking": True, "max_new_tokens": 512, "max_context": 6144, "lora_r": 4,
              **settings}
    torch.save({"args": config, "iteration": 1}, checkpoint / "state.pt")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_an_adapter_from_a_run_is_evaluated_with_its_settings_and_cut_replies_are_counted(
        tiny_model_dir, tiny_adapter, personas_file, tmp_path, capsys):
    # the run trained a think-then-say agent on the tiny model with 24 tokens a reply; evaluate.py's
    # own defaults (the embedded model, 128 tokens, 4096 of context) would not even load its adapter
    run = run_folder(tmp_path / "run", tiny_adapter, model=tiny_model_dir, max_new_tokens=24, max_context=900)
    out = tmp_path / "eval"
    evaluate.main(["--adapter", str(run), "--personas", personas_file, "--split", "test", "--simulator",
                   "rules", "--dialogues", "2", "--max-turns", "2", "--bootstrap", "20", "--out", str(out)])
    err = capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    s = results["settings"]
    assert (s["model"], s["thinking"], s["max_new_tokens"], s["max_context"]) == (tiny_model_dir, True, 24,
                                                                                   900)
    # the random model never ends a reply (no end-of-turn token): every one is cut at the run's 24 tokens
    transcripts = [json.loads(line) for line in (out / "transcripts.jsonl").read_text().splitlines()]
    for m in results["models"]:
        turns = [t for x in transcripts if x["model"] == m["label"]
                 for t in x["turns"] if t["role"] == "agent"]
        assert turns and all(t["tokens"] == 24 and t["cut"] for t in turns)
        assert m["cut_replies"] == len(turns) == sum(r["cut_replies"] for r in m["dialogue_results"])
        assert f"{len(turns)} cut replies" in err
    assert f"| {len(turns)} (100%) |" in (out / "results.md").read_text()


def test_the_runs_settings_unless_given_and_runs_that_disagree(tiny_model_dir, tiny_adapter, tmp_path,
                                                               capsys):
    run = run_folder(tmp_path / "a", tiny_adapter, model=tiny_model_dir, thinking=False, max_new_tokens=24)
    args = evaluate.parse_args(["--adapter", str(run)])
    assert (args.model, args.thinking, args.max_new_tokens, args.max_context) == (tiny_model_dir, False, 24,
                                                                                    6144)
    assert capsys.readouterr().err == ""
    # a flag given wins; fewer tokens a reply than the run trained with: one warning line, not an error
    args = evaluate.parse_args(["--adapter", str(run), "--max-new-tokens", "8", "--thinking", "true"])
    assert (args.max_new_tokens, args.thinking, args.max_context) == (8, True, 6144)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --max-new-tokens 8") and "24" in err[0], err
    # an adapter folder outside a run keeps evaluate.py's own defaults
    args = evaluate.parse_args(["--adapter", str(tiny_adapter)])
    assert (args.model, args.thinking, args.max_new_tokens, args.max_context) == ("smollm2", True, 128, 4096)
    # two runs trained with different budgets: which one to evaluate with is not guessed
    other = run_folder(tmp_path / "b", tiny_adapter, model=tiny_model_dir, thinking=False, max_new_tokens=32)
    with pytest.raises(SystemExit) as stop:
        evaluate.parse_args(["--adapter", str(run), str(other)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "--max-new-tokens" in err, err
    both = evaluate.parse_args(["--adapter", str(run), str(other), "--max-new-tokens", "32"])
    assert both.max_new_tokens == 32


# ----------------------------------------------------------------------------------------------
# The command end to end on the embedded model
# ----------------------------------------------------------------------------------------------
def run_cli(*args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_cli_bad_personas_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": "x"}]')
    result = run_cli("--personas", str(bad), "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "error:" in result.stderr and "missing" in result.stderr


@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    """A LoRA adapter on smollm2 whose B matrices were perturbed, so it is not the base."""
    from rollout import load_policy

    policy, _ = load_policy("smollm2", device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # strong enough to change greedy replies
    folder = tmp_path_factory.mktemp("adapters") / "trained"
    policy.save_pretrained(str(folder))
    del policy
    return str(folder)


@pytest.mark.smollm2
def test_cli_base_vs_adapter_end_to_end(trained_adapter, tmp_path):
    math_file = tmp_path / "math.jsonl"
    math_file.write_text("".join(open(os.path.join(DATA, "math_problems.jsonl")).readlines()[:2]))
    out = tmp_path / "eval"
    result = run_cli("--model", "smollm2", "--adapter", trained_adapter, "--personas", "personas.json",
                     "--split", "test", "--dialogues", "2", "--max-turns", "2", "--max-new-tokens", "12",
                     "--user-reply-tokens", "16", "--simulator", "same", "--math", str(math_file),
                     "--math-max-new-tokens", "8", "--bootstrap", "200", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    results = check_output_folder(str(out), ["base", "trained"], 2)
    assert results["readout"] == "likelihood" and results["paired"][0]["vs"] == "base"
    assert results["math"]["paired"][0]["model"] == "trained"
    math = results["math"]["models"]
    assert all(m["accuracy"] == sum(a["correct"] for a in m["answers"]) / 2 for m in math.values())
    lines = [json.loads(x) for x in open(out / "transcripts.jsonl")]
    base_first = [x["turns"][1]["raw"] for x in lines if x["model"] == "base"]
    trained_first = [x["turns"][1]["raw"] for x in lines if x["model"] == "trained"]
    assert base_first != trained_first  # the adapter really was switched on
    assert "| base |" in result.stdout and "| trained |" in result.stdout
