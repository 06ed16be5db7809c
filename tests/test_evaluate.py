"""Tests for evaluate.py: a model's numbers against hand computation, adapter switching, the output
folder on a tiny model, the settings an adapter from a run brings, bad input
(one line, exit code 2, before any model loads), the folder it writes into, and the command end to
end on the embedded model (base vs a perturbed LoRA adapter). The agreement check's numbers are in
tests/test_paper_data.py; its full disk and signals are here.

    OMP_NUM_THREADS=1 python -m pytest tests/test_evaluate.py -q
"""
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from personas import load_personas
import evaluate
import cli
import simulator
from conftest import ROOT, reply
from cli import command
from evaluate import model_summary, results_table, run_evaluation, use_model
from simulator import Simulator
from stats import paired_difference
from users import RulesBackend

DATA = os.path.join(ROOT, "tests", "data")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def eval_args(**values):
    """evaluate.py's settings at its defaults, then `values` set as given (unchecked)."""
    args = evaluate.parse_args([])
    for name, value in values.items():
        assert hasattr(args, name), name
        setattr(args, name, value)
    return args


def shell(*argv, timeout=300):
    """evaluate.py (or another script) as a user runs it: (returncode, stdout, stderr)."""
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=ENV)
    return done.returncode, done.stdout, done.stderr


def error_lines(stderr):
    """The lines that start with error: (a progress bar may share the terminal line, after a \\r)."""
    return [line for line in re.split(r"[\r\n]", stderr) if line.startswith("error:")]


def assert_one_line(code, stderr, *words):
    """Exit code 2, exactly one error line holding every word, no traceback."""
    assert code == 2 and "Traceback" not in stderr, stderr[-2000:]
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-2000:]
    assert all(word in lines[0] for word in words), (words, lines[0])


def one_line(argv, capsys, *words):
    """evaluate.main(argv) in this process ends with one line holding every word, exit code 2."""
    with pytest.raises(SystemExit) as stop:
        cli.command(evaluate.main)(argv)
    assert_one_line(stop.value.code, capsys.readouterr().err, *words)


def fake_record(persona_id, final, end_reason="max_turns", turns=2, tokens=20, violations=0, cut=0):
    return {"persona_id": persona_id, "final_emotion": final, "end_reason": end_reason,
            "turn_ends": list(range(turns)), "policy_tokens": tokens, "violations": violations,
            "cut_replies": cut, "type": "cooperative", "hidden_named": [False] * turns}


def no_model_loads(monkeypatch):
    """Loading any model fails the test: what is checked must be checked before."""
    def loaded(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("policy.load_model", loaded)
    monkeypatch.setattr(evaluate, "load_policy", loaded)


def ev(model, personas, out, *extra):
    """The smallest evaluation: one persona, one turn of four tokens, the rules user."""
    return ["--model", model, "--personas", personas, "--split", "test", "--simulator", "rules",
            "--dialogues", "1", "--max-turns", "1", "--max-new-tokens", "4", "--bootstrap", "20",
            "--out", str(out), *extra]


def snapshot(folder):
    """Every file under folder: relative path -> its bytes."""
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(folder) for name in names}


# ----------------------------------------------------------------------------------------------
# A model's numbers (the statistics themselves: tests/test_stats.py)
# ----------------------------------------------------------------------------------------------
def test_score_is_the_mean_over_personas():
    records = [fake_record("p1", 40), fake_record("p2", 10, end_reason="left", turns=1, tokens=5)]
    s = model_summary(records, n_boot=200)
    assert s["per_persona"] == {"final_emotion": {"p1": 40.0, "p2": 10.0}, "collapse": {"p1": 0.0, "p2": 1.0},
                                "hidden_named": {"p1": 0.0, "p2": 0.0}}
    # two personas: the resampled means are 10, 25 and 40, the two ends each with probability 1/4
    assert s["measures"]["final_emotion"] == {"value": 25.0, "low": 10.0, "high": 40.0}
    assert (s["successes"], s["failures"], s["dialogues"]) == (0, 1, 2)
    assert s["turns_mean"] == 3 / 2
    assert s["reply_tokens_mean"] == 25 / 3


def test_summary_counts_successes_violations_and_unread_dialogues():
    records = [fake_record("a", 100, end_reason="success", violations=1, cut=1),
               fake_record("b", 5, end_reason="left", violations=2),
               fake_record("c", 60, end_reason="unread")]
    s = model_summary(records, n_boot=100)
    assert s["measures"]["final_emotion"]["value"] == 55.0  # an unread one scores where it ended
    counts = (s["successes"], s["failures"], s["violations"], s["unread"], s["cut_replies"])
    assert counts == (1, 1, 3, 1, 1) and s["turns_mean"] == 6 / 3


def test_results_table(tmp_path):
    ids = ["p1", "p2"]
    base_records = [fake_record("p1", 40), fake_record("p2", 60)]
    base = {"label": "base", **evaluate.model_results(base_records, None, False, n_boot=100)}
    played = [fake_record("p1", 45, tokens=40, cut=1), fake_record("p2", 100, "success")]
    ppo = {"label": "ppo", **evaluate.model_results(played, base_records, False, n_boot=100)}
    assert ppo["vs_base"]["final_emotion"] == paired_difference([45, 100], [40, 60], 100)
    args = eval_args(personas="/x/personas.json", out=str(tmp_path), bootstrap=100, state_probe=False)
    results = {"settings": vars(args), "persona_ids": ids,
               "judges": [{"judge": "rules", "readout": "reasoned", "models": [base, ppo]}]}
    lines = results_table(results).splitlines()
    assert "2 personas from `personas.json` (split test)" in lines[0] and "start emotion 40" in lines[0]
    assert lines[2].startswith("| model | score | cut replies | vs base | successes | failures |")
    assert lines[4] == "| base | 50.0 [40.0, 60.0] | 0 (0%) | - | 0/2 | 0/2 | 2.0 | 10 | 0 (0%) | 0 |"
    assert lines[5].startswith("| ppo | 72.5 [45.0, 100.0] | 1 (25%) | +22.5 [+5.0, +40.0] | 1/2 | 0/2 | 2.0 "
                               "| 15 |")
    # the table by persona type (measures.by_type_table): one type, so no `all` row
    rows = lines[lines.index(next(line for line in lines if line.startswith("| type | model |"))) + 2:]
    assert rows == [
        "| cooperative | base | 2 | 50.0 [40.0, 60.0] | - | 0.00 [0.00, 0.00] | - | 0.00 [0.00, 0.00] | - "
        "| - | - | - | - | - |",
        "| cooperative | ppo | 2 | 72.5 [45.0, 100.0] | +22.5 [+5.0, +40.0] | 0.00 [0.00, 0.00] "
        "| +0.00 [+0.00, +0.00] | 0.00 [0.00, 0.00] | +0.00 [+0.00, +0.00] | - | - | - | - | - |"]
    assert "not probed (--state-probe false)" in results_table(results)


# ----------------------------------------------------------------------------------------------
# Models under test: adapter switching
# ----------------------------------------------------------------------------------------------
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
MODELS = [("base", None, None, None), ("one", "default", "x/one", None), ("two", "adapter_1", "x/two", None)]


def tiny_run(tiny_peft, tmp_path, personas_file, n=2):
    peft, tokenizer, _ = tiny_peft
    args = eval_args(personas=personas_file, out=str(tmp_path / "eval"), simulator="rules", max_turns=2,
                     max_new_tokens=6, bootstrap=200)
    os.makedirs(args.out)
    personas = load_personas(personas_file, "test")[:n]
    sim = Simulator(RulesBackend(), start_emotion=args.start_emotion, max_turns=args.max_turns)
    return args, run_evaluation(args, peft, tokenizer, [("rules", sim)], personas, MODELS)


def transcripts(out):
    return [json.loads(x) for x in open(os.path.join(out, "transcripts.jsonl"))]


def check_output_folder(out, labels, personas_played):
    results = json.load(open(os.path.join(out, "results.json")))
    (judged,) = results["judges"]
    assert results["complete"] and [m["label"] for m in judged["models"]] == labels
    lines = transcripts(out)
    assert [x["model"] for x in lines] == [lab for lab in labels for _ in range(personas_played)]
    assert {x["judge"] for x in lines} == {judged["judge"]} == {results["settings"]["simulator"]}
    base = judged["models"][0]["per_persona"]["final_emotion"]
    for m in judged["models"]:
        mine, score = m["per_persona"]["final_emotion"], m["measures"]["final_emotion"]
        assert len(mine) == personas_played
        # the numbers follow from the dialogues written out: each persona's final emotion (one
        # dialogue each), the score their mean, inside its interval
        finals = {x["persona_id"]: x["final_emotion"] for x in lines if x["model"] == m["label"]}
        assert mine == pytest.approx(finals)
        assert score["value"] == pytest.approx(np.mean(list(finals.values())))
        assert 0 <= score["low"] <= score["value"] <= score["high"] <= 100
        if m["label"] != "base":  # the mean of the per-persona differences
            p = m["vs_base"]["final_emotion"]
            assert p["value"] == pytest.approx(np.mean([mine[k] - base[k] for k in base]))
            assert p["low"] <= p["value"] <= p["high"] and p["n"] == personas_played
    assert "vs_base" not in judged["models"][0]
    assert all("token_ids" not in x and x["turns"][0]["role"] == "user" for x in lines)
    table = open(os.path.join(out, "results.md")).read()
    assert all(f"| {lab} |" in table for lab in labels)
    return results


def test_sage_file_evaluates(tiny_peft, tmp_path):
    args, results = tiny_run(tiny_peft, tmp_path, os.path.join(DATA, "sage_sample.jsonl"), n=3)
    check_output_folder(args.out, ["base", "one", "two"], 3)
    assert results["persona_ids"] == ["sage-001", "sage-002", "sage-003"]


def test_project_file_evaluates(tiny_peft, tmp_path):
    args, _ = tiny_run(tiny_peft, tmp_path, os.path.join(ROOT, "personas.json"))
    check_output_folder(args.out, ["base", "one", "two"], 2)


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
    assert [x["model"] for x in transcripts(out)] == ["base", "base"]
    partial = json.load(open(out / "results.json"))
    assert not partial["complete"] and [m["label"] for m in partial["judges"][0]["models"]] == ["base"]


# ----------------------------------------------------------------------------------------------
# Settings: checked before any model loads, one line each
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, words", [
    (["--split", "dev"], ["--split", "dev"]),
    (["--max-turns", "0"], ["--max-turns", "0"]),
    (["--bootstap", "5"], ["--bootstap"]),
    (["--model", "smollm3"], ["--model", "smollm3", "hub id"]),
    (["--simulator", "smollm2"], ["--simulator", "smollm2", "same | rules"]),  # a model of its own: a URL
])
def test_bad_settings_are_one_line(flags, words, capsys, monkeypatch):
    no_model_loads(monkeypatch)
    one_line(flags, capsys, *words)


def test_bad_settings_through_the_real_command_line():
    t0 = time.time()
    assert_one_line(*shell("evaluate.py", "--split", "dev")[::2], "--split", "dev")
    assert time.time() - t0 < 40  # no hub retries


def test_the_defaults_are_sages_protocol():
    args = evaluate.parse_args(["--thinking", "false", "--max-turns", "3"])
    assert (args.thinking, args.max_turns, args.start_emotion) == (False, 3, 40)
    assert re.fullmatch(r"runs/eval__\d+", args.out)  # a new folder of its own


def test_bad_personas_exit_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"id": "x"}]')
    done = shell("evaluate.py", "--personas", str(bad), "--out", str(tmp_path / "o"))
    assert_one_line(*done[::2], "missing")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------------------------
# The output folder: created by the command, never one that holds anything
# ----------------------------------------------------------------------------------------------
def test_an_existing_out_is_refused_before_any_model_loads(tiny_model_dir, personas_file, tmp_path,
                                                           monkeypatch, capsys):
    out = tmp_path / "eval"
    evaluate.main(ev(tiny_model_dir, personas_file, out))  # an earlier evaluation
    before = snapshot(out)
    no_model_loads(monkeypatch)
    one_line(ev(tiny_model_dir, personas_file, out), capsys, str(out), "exists")
    assert snapshot(out) == before
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    one_line(ev(tiny_model_dir, personas_file, mine), capsys, str(mine), "exists")
    assert snapshot(mine) == {"notes.txt": b"mine"}
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.undo()
    evaluate.main(ev(tiny_model_dir, personas_file, empty))  # an empty folder is taken
    assert (empty / "results.json").exists()


# ----------------------------------------------------------------------------------------------
# Adapters: a checkpoint's policy, a run's newest checkpoint, evaluated with the run's settings
# (issue 30 item 2); one that does not fit the model is one line
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter folder (rank 4) for the tiny model, saved by peft."""
    from policy import load_policy

    policy, _ = load_policy(tiny_model_dir, lora_r=4, device="cpu")
    folder = tmp_path_factory.mktemp("adapter") / "default"
    policy.save_pretrained(str(folder), save_embedding_layers=False)  # as run.Run.save
    return folder


def run_folder(folder, adapter, iterations=1, **settings):
    """A trainer's run folder as run.Run leaves it, made by hand: config.json with the run's settings,
    and checkpoints/iter_N with state.pt, the policy adapter default/ and PPO's critic/."""
    for n in range(1, iterations + 1):
        checkpoint = folder / "checkpoints" / f"iter_{n:06d}"
        for name in ("default", "critic"):
            shutil.copytree(adapter, checkpoint / name)
        torch.save({"iteration": n}, checkpoint / "state.pt")
        (checkpoint / "critic" / "role").write_text("critic")
    config = {"script": "ppo.py", "model": "smollm2", "thinking": True, "max_new_tokens": 512,
              "max_context": 2048, "lora_r": 4, **settings}
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
    shown = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    s = results["settings"]
    assert (s["model"], s["thinking"], s["max_new_tokens"], s["max_context"]) == (tiny_model_dir, True, 24,
                                                                                   900)
    # the random model never ends a reply (no end-of-turn token): every one is cut at the run's 24 tokens
    for m in results["judges"][0]["models"]:
        turns = [t for x in transcripts(out) if x["model"] == m["label"]
                 for t in x["turns"] if t["role"] == "agent"]
        assert turns and all(t["tokens"] == 24 and t["cut"] for t in turns)
        assert m["cut_replies"] == len(turns)
    assert f"| {len(turns)} (100%) |" in (out / "results.md").read_text()
    assert f"| {len(turns)} (100%) |" in shown  # the table, printed


def test_the_runs_settings_unless_given_and_runs_that_disagree(tiny_model_dir, tiny_adapter, tmp_path,
                                                               capsys):
    run = run_folder(tmp_path / "a", tiny_adapter, model=tiny_model_dir, thinking=False, max_new_tokens=24)
    args = evaluate.parse_args(["--adapter", str(run)])
    assert (args.model, args.thinking, args.max_new_tokens, args.max_context) == (tiny_model_dir, False, 24,
                                                                                    2048)
    assert capsys.readouterr().err == ""
    # a flag given wins; fewer tokens a reply than the run trained with: one warning line, not an error
    args = evaluate.parse_args(["--adapter", str(run), "--max-new-tokens", "8", "--thinking", "true"])
    assert (args.max_new_tokens, args.thinking, args.max_context) == (8, True, 2048)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --max-new-tokens 8") and "24" in err[0], err
    # an adapter folder outside a run keeps evaluate.py's own defaults
    args = evaluate.parse_args(["--adapter", str(tiny_adapter)])
    assert (args.model, args.thinking, args.max_new_tokens, args.max_context) == ("smollm2", True, 128, 4096)
    # two runs trained with different budgets: which one to evaluate with is not guessed
    other = run_folder(tmp_path / "b", tiny_adapter, model=tiny_model_dir, thinking=False, max_new_tokens=32)
    with pytest.raises(SystemExit) as stop:
        command(evaluate.parse_args)(["--adapter", str(run), str(other)])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "--max-new-tokens" in err, err
    both = evaluate.parse_args(["--adapter", str(run), str(other), "--max-new-tokens", "32"])
    assert both.max_new_tokens == 32


def test_evaluate_picks_the_policy_adapter_of_a_checkpoint_or_a_run(tiny_model_dir, tiny_adapter,
                                                                     personas_file, tmp_path, monkeypatch,
                                                                     capsys):
    """Cases 9 and 29 of issue 26: --adapter RUN/checkpoints/iter_000001/critic is PPO's critic (a value
    model) and a folder without adapter_config.json no adapter: one line each, before any model
    loads. --adapter RUN/checkpoints/iter_000001 evaluates its policy adapter (default), --adapter RUN
    the newest complete checkpoint's; two of one run are labelled by the run and the checkpoint (issue
    66 item 4), and the adapter field is the folder loaded."""
    run = run_folder(tmp_path / "run", tiny_adapter, iterations=2, model=tiny_model_dir)
    checkpoint = run / "checkpoints" / "iter_000001"
    no_model_loads(monkeypatch)
    one_line(ev(tiny_model_dir, personas_file, tmp_path / "critic", "--adapter", str(checkpoint / "critic")),
             capsys, "critic", "policy")
    one_line(ev(tiny_model_dir, personas_file, tmp_path / "none", "--adapter", str(tmp_path)), capsys,
             "adapter_config.json")
    monkeypatch.undo()
    out = tmp_path / "eval"
    evaluate.main(ev(tiny_model_dir, personas_file, out, "--adapter", str(checkpoint), str(run)))
    base, first, newest = json.loads((out / "results.json").read_text())["judges"][0]["models"]
    for m, picked in ((first, "iter_000001"), (newest, "iter_000002")):
        assert m["label"] == f"run/{picked}"
        assert m["adapter"] == os.path.join(str(run), "checkpoints", picked, "default")


def test_an_adapter_for_another_base_is_one_line(tiny_model_dir, tmp_path, personas_file):
    """Case 5 of issue 16: an adapter made for the 2-layer tiny model on the same model with a third
    layer loads without an error in peft (one layer's weights missing): one line naming both."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    adapter = tmp_path / "adapter"
    get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter)
    bigger = tmp_path / "three_layers"
    config = base.config
    config.num_hidden_layers = 3
    AutoModelForCausalLM.from_config(config).save_pretrained(bigger)
    for name in os.listdir(tiny_model_dir):  # the tokenizer's files
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(tiny_model_dir, name), bigger)
    code, _, err = shell("evaluate.py", *ev(str(bigger), personas_file, tmp_path / "eval", "--adapter",
                                          str(adapter)))
    assert_one_line(code, err, str(adapter), str(bigger), "missing")
    assert not (tmp_path / "eval" / "results.json").exists()


def test_an_adapter_for_another_model_width_says_why(tiny_model_dir, personas_file, tmp_path, capsys):
    """Case 26 of issue 26: an adapter made for a 48-wide model on the 64-wide tiny model: the line says
    why (a weight's shape against the model's), not just "Error(s) in loading state_dict"."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LlamaConfig.from_pretrained(tiny_model_dir).to_dict(), "hidden_size": 48,
                            "intermediate_size": 96, "head_dim": 12})
    adapter = tmp_path / "adapter"
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    get_peft_model(LlamaForCausalLM(config), lora).save_pretrained(adapter)
    argv = ev(tiny_model_dir, personas_file, tmp_path / "eval", "--adapter", str(adapter))
    with pytest.raises(SystemExit) as stop:
        cli.command(evaluate.main)(argv)
    err = capsys.readouterr().err
    assert_one_line(stop.value.code, err, str(adapter))
    why = error_lines(err)[0].replace(str(adapter), "").replace(tiny_model_dir, "")
    assert re.search(r"\b48\b", why) and re.search(r"\b64\b", why), why


# ----------------------------------------------------------------------------------------------
# The simulated user: SAGE's farewell rule, a server that fails
# ----------------------------------------------------------------------------------------------
def chat(text):
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


def test_evaluate_ends_a_dialogue_on_a_farewell_word_anywhere_as_sage_does(tiny_model_dir, persona_entry,
                                                                         write_personas, tmp_path):
    # issue 30, item 1: training goes on after this line (tests/test_simulator.py); SAGE's rule ends it
    about = "He just said bye and left me there."
    path = write_personas([persona_entry(id="t1", band_lines={b: about for b in "ABCF"})])
    out = tmp_path / "eval"
    evaluate.main(["--model", tiny_model_dir, "--simulator", "rules", "--personas", path, "--max-turns", "3",
                   "--max-new-tokens", "4", "--bootstrap", "20", "--out", str(out)])
    played = transcripts(out)[0]
    assert played["end_reason"] == "goodbye"
    assert [t["role"] for t in played["turns"]] == ["user", "agent", "user"]  # one agent turn
    assert not simulator.says_goodbye(about) and simulator.says_goodbye(about, "sage")


def test_evaluate_ends_on_a_simulator_error_with_one_line(server, tiny_model_dir, personas_file, tmp_path):
    s = server(lambda h, n, body: reply(h, 200, b'[{"not": "a completion"}]'))
    code, _, err = shell("evaluate.py", *ev(tiny_model_dir, personas_file, tmp_path / "eval", "--simulator",
                                          s.url, "--api-retries", "1"))
    assert_one_line(code, err, s.url, "malformed response", "2 tries")


# ----------------------------------------------------------------------------------------------
# Issue 30 item 12: the agreement check on a full disk, on Ctrl-C and on SIGTERM
# ----------------------------------------------------------------------------------------------
RECORDED = [os.path.join(DATA, "sage_results", f"{name}_result.jsonl") for name in ("warm", "cold", "mixed")]
RESULT_FILES = ("results.json", "results.md")


def agreement_argv(out, *extra):
    return ["evaluate.py", "--agreement", *RECORDED, "--personas", os.path.join(DATA, "sage_sample.jsonl"),
            "--bootstrap", "20", "--out", str(out), *extra]


def test_agreement_on_a_full_disk_keeps_its_appraisals_and_half_writes_nothing(tmp_path):
    """The disk fills once the appraisals (the rules user's) are in appraisals.jsonl, as the results
    are written: one line, exit code 2; appraisals.jsonl whole, no result file at all (not a 0-byte
    results.md)."""
    reference = tmp_path / "reference"
    code, _, err = shell(*agreement_argv(reference, "--simulator", "rules"))
    assert code == 0, err[-2000:]
    out = tmp_path / "full"
    out.mkdir()
    room = (reference / "appraisals.jsonl").stat().st_size + 64
    code, _, err = shell(os.path.join("tests", "faults.py"), "--disk-full", str(out), "--free", str(room),
                         "--", *agreement_argv(out, "--simulator", "rules"))
    assert_one_line(code, err, "the disk is full", "appraisals.jsonl")
    kept = (out / "appraisals.jsonl").read_bytes()
    assert kept == (reference / "appraisals.jsonl").read_bytes()
    assert not [n for n in os.listdir(out) if n in RESULT_FILES or ".tmp" in n], os.listdir(out)


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_agreement_stopped_by_a_signal_keeps_its_appraisals(server, tmp_path, name):
    """Ctrl-C (SIGINT) or SIGTERM while the simulator server appraises the second dialogue ends the
    check at once with one line naming appraisals.jsonl, exit code 130 / 143; the first dialogue's
    appraisals are there and no result file is written."""
    gate = threading.Event()

    def handle(handler, n, body):
        # the first short request (rollout.reach_simulator) and the first dialogue's two judged replies
        # are answered; the next wait for the signal
        if n > 3:
            gate.wait(300)
        reply(handler, 200, chat("Change: +2"))
    srv = server(handle)
    out, log = tmp_path / "out", tmp_path / "stderr.txt"
    store = out / "appraisals.jsonl"
    with open(log, "w") as err:
        # one dialogue a call to the server, so that the first is stored before the second waits
        one_a_call = ("import sys, agreement, evaluate; agreement.BATCH_DIALOGUES = 1; "
                      "evaluate.main(sys.argv[1:])")
        argv = agreement_argv(out, "--simulator", srv.url)[1:]
        proc = subprocess.Popen([sys.executable, "-c", one_a_call, *argv], cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        t0 = time.time()
        while not (store.exists() and store.read_text().count("\n") == 1):
            assert proc.poll() is None and time.time() - t0 < 240, log.read_text()[-2000:]
            time.sleep(0.05)
        proc.send_signal(getattr(signal, name))
        code = proc.wait(20)  # at once: the request in flight is left unanswered
    finally:
        gate.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    err = log.read_text()
    said = [line for line in re.split(r"[\r\n]", err) if name in line]
    assert code == 128 + getattr(signal, name) and "Traceback" not in err, (code, err[-2000:])
    assert said == [f"stopped by {name}; the appraisals made so far are in {store}"], err[-2000:]
    assert [json.loads(line)["id"] for line in store.read_text().splitlines()] == ["sage-001"]
    assert not [n for n in os.listdir(out) if n in RESULT_FILES], os.listdir(out)


# ----------------------------------------------------------------------------------------------
# The command end to end on the embedded model
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_adapter(tmp_path_factory):
    """A LoRA adapter on smollm2 whose B matrices were perturbed, so it is not the base."""
    from policy import load_policy

    policy, _ = load_policy("smollm2", device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # strong enough to change greedy replies
    folder = tmp_path_factory.mktemp("adapters") / "trained"
    policy.save_pretrained(str(folder), save_embedding_layers=False)  # as run.Run.save
    del policy
    return str(folder)


@pytest.mark.smollm2
def test_cli_base_vs_adapter_end_to_end(trained_adapter, tmp_path):
    out = tmp_path / "eval"
    code, stdout, err = shell("evaluate.py", "--model", "smollm2", "--adapter", trained_adapter, "--personas",
                            "personas.json", "--split", "test", "--dialogues", "2", "--max-turns", "2",
                            "--max-new-tokens", "12", "--user-reply-tokens", "16", "--simulator", "rules",
                            "--bootstrap", "200", "--out", str(out))
    assert code == 0, err[-3000:]
    results = check_output_folder(str(out), ["base", "trained"], 2)
    # (the `same` user's 300-token appraisals cost minutes on 2 cores)
    assert results["judges"][0]["readout"] == "rules"
    lines = transcripts(out)
    base_first = [x["turns"][1]["raw"] for x in lines if x["model"] == "base"]
    trained_first = [x["turns"][1]["raw"] for x in lines if x["model"] == "trained"]
    assert base_first != trained_first  # the adapter really was switched on
    assert "| base |" in stdout and "| trained |" in stdout
