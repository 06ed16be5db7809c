"""The judge matrix (evaluate.py --judges, issue 62 item 3): every model under several users in one
command, the weights loaded once; per judge each model's score and each adapter's paired gain with
their intervals, labelled training or held out by the adapter's run; results.md's matrix and
matrix.png; bad judges, a --simulator beside them, a missing or repeated adapter refused in one line
before any model loads. Adapters labelled by their run (issue 66 item 4).

    OMP_NUM_THREADS=1 python -m pytest tests/test_judges.py -q
"""
import json
import os
import sys

import numpy as np
import pytest

import evaluate
from evaluate import models_under_test
from test_evaluate import no_model_loads, one_line, run_folder, transcripts


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory):
    """A fresh LoRA adapter folder (rank 4) for the tiny model, saved by peft."""
    from policy import load_policy

    policy, _ = load_policy(tiny_model_dir, lora_r=4, device="cpu")
    folder = tmp_path_factory.mktemp("adapter") / "fresh"
    policy.save_pretrained(str(folder))
    return str(folder)


def matrix_argv(model, personas, out, *extra):
    """Two personas, two turns of four tokens: seconds on the tiny model."""
    return ["--model", model, "--personas", personas, "--split", "test", "--dialogues", "2",
            "--max-turns", "2", "--max-new-tokens", "4", "--bootstrap", "200", "--out", str(out),
            *extra]


def test_two_judges_and_two_adapters_in_one_command(tiny_model_dir, adapter, personas_file,
                                                    fake_user, tmp_path, capsys):
    """Run a trained against the rules user, run b against the URL user: under each judge every
    model plays the same personas, each adapter is `training` under its own judge and `held out`
    under the other; the matrix in results.md holds every judge's numbers, and matrix.png is drawn."""
    pytest.importorskip("matplotlib")
    a = run_folder(tmp_path / "run_a", adapter, model=tiny_model_dir, simulator="rules",
                   max_new_tokens=4, max_context=1024)
    b = run_folder(tmp_path / "run_b", adapter, model=tiny_model_dir, simulator=fake_user.url,
                   api_model="default", max_new_tokens=4, max_context=1024)
    out = tmp_path / "eval"
    evaluate.main(matrix_argv(tiny_model_dir, personas_file, out, "--adapter", str(a), str(b),
                              "--judges", "rules", fake_user.url))
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["complete"] and results["settings"]["judges"] == ["rules", fake_user.url]
    judged = results["judges"]
    assert [(j["judge"], j["readout"]) for j in judged] == [("rules", "rules"),
                                                             (fake_user.url, "reasoned")]
    roles = {(j["judge"], m["label"]): m.get("held_out") for j in judged for m in j["models"]}
    assert roles == {("rules", "base"): None, ("rules", "run_a"): False, ("rules", "run_b"): True,
                     (fake_user.url, "base"): None, (fake_user.url, "run_a"): True,
                     (fake_user.url, "run_b"): False}
    # every judge played every model on the same personas, and the numbers are its own dialogues'
    lines = transcripts(out)
    assert [(x["judge"], x["model"]) for x in lines] == [
        (j, m) for j in ("rules", fake_user.url) for m in ("base", "run_a", "run_b") for _ in "12"]
    for j in judged:
        base = j["models"][0]["per_persona"]["final_emotion"]
        for m in j["models"]:
            finals = {x["persona_id"]: x["final_emotion"] for x in lines
                      if (x["judge"], x["model"]) == (j["judge"], m["label"])}
            assert m["per_persona"]["final_emotion"] == finals and len(finals) == 2
            assert m["measures"]["final_emotion"]["value"] == np.mean([*finals.values()])
            if m["label"] != "base":
                gain = m["vs_base"]["final_emotion"]["value"]
                assert gain == np.mean([finals[i] - base[i] for i in base])
    # results.md: the matrix first, one row a judge and model, each its judge's numbers as shown
    table = (out / "results.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith(("| rules |", "| http"))]
    assert table.startswith("Every model under every judge") and len(rows) == 6
    for row, (j, m) in zip(rows, [(j, m) for j in judged for m in j["models"]]):
        gain = m.get("vs_base", {}).get("final_emotion")
        cut = m["cut_replies"] / sum(t["role"] == "agent" for x in lines for t in x["turns"]
                                     if (x["judge"], x["model"]) == (j["judge"], m["label"]))
        assert row == (f"| {j['judge']} | {m['label']} | {evaluate.ROLES[m.get('held_out')]} "
                       f"| {evaluate.shown(m['measures']['final_emotion'], 1)} "
                       f"| {evaluate.shown(gain, 1, '+') if gain else '-'} | {cut:.0%} "
                       f"| {m['unread']}/2 |")
    assert table.count("| model | score | cut replies |") == 2  # each judge's own table below
    assert printed.startswith(table) and "matrix.png" in printed
    assert (out / "matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_matrix_is_a_table_and_says_so(tiny_model_dir, personas_file,
                                                              tmp_path, capsys, monkeypatch):
    # import matplotlib (and any of its modules an earlier test imported): ImportError
    for name in ["matplotlib", *[n for n in sys.modules if n.startswith("matplotlib.")]]:
        monkeypatch.setitem(sys.modules, name, None)
    out = tmp_path / "eval"
    evaluate.main(matrix_argv(tiny_model_dir, personas_file, out, "--judges", "rules", "same",
                              "--dialogues", "1", "--max-turns", "1"))
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warned) == 1 and "pip install matplotlib" in warned[0], err[-2000:]
    assert sorted(os.listdir(out)) == ["results.json", "results.md", "transcripts.jsonl"]
    assert (out / "results.md").read_text().startswith("Every model under every judge")


@pytest.mark.parametrize("flags, words", [
    (["--judges", "rules", "smollm2"], ["--judges smollm2", "same | rules"]),  # a model of its own
    (["--judges", "rules", "http://"], ["--judges http://", "host"]),
    (["--judges", "rules", "rules"], ["--judges rules", "twice"]),
    (["--judges", "rules", "same", "--simulator", "rules"], ["--simulator rules", "--judges"]),
    (["--judges", "rules", "same", "--model", "smollm3"], ["--model", "smollm3"]),  # same: no model
    (["--judges", "rules", "same", "--adapter", "/no/such/adapter"], ["/no/such/adapter"]),
    (["--judges", "rules", "--agreement", "x.jsonl"], ["--judges", "--agreement"]),
])
def test_bad_judges_are_one_line_before_any_model_loads(flags, words, personas_file, tmp_path,
                                                        capsys, monkeypatch):
    no_model_loads(monkeypatch)
    one_line(["--personas", personas_file, "--out", str(tmp_path / "eval"), *flags], capsys, *words)
    assert not (tmp_path / "eval").exists()


def test_an_adapter_given_twice_is_one_line(tiny_model_dir, adapter, personas_file, tmp_path,
                                            capsys, monkeypatch):
    run = run_folder(tmp_path / "run", adapter, iterations=2, model=tiny_model_dir)
    newest = run / "checkpoints" / "iter_000002"
    no_model_loads(monkeypatch)
    one_line(matrix_argv(tiny_model_dir, personas_file, tmp_path / "eval", "--adapter", str(run),
                         str(newest)), capsys, "--adapter", "iter_000002", "twice")


def test_adapters_are_labelled_by_their_run(adapter, tmp_path):
    """Issue 66 item 4: a checkpoint reads as its run, and as run/iter_N beside another checkpoint of
    the same run; two runs of one name in different folders read as their paths; an adapter folder
    outside a run as its own name."""
    def checkpoint(run, n):
        return os.path.join(str(run), "checkpoints", f"iter_{n:06d}", "default")

    e0, e1 = (run_folder(tmp_path / name, adapter, iterations=2) for name in ("e0", "e1"))
    other = run_folder(tmp_path / "elsewhere" / "e0", adapter)
    labels = [m[0] for m in models_under_test([checkpoint(e0, 2), checkpoint(e1, 1), adapter])]
    assert labels == ["base", "e0", "e1", "fresh"]
    labels = [m[0] for m in models_under_test([checkpoint(e0, 1), checkpoint(e0, 2), checkpoint(e1, 2)])]
    assert labels == ["base", "e0/iter_000001", "e0/iter_000002", "e1"]
    labels = [m[0] for m in models_under_test([checkpoint(e0, 2), checkpoint(other, 1)])]
    assert labels == ["base", checkpoint(e0, 2), checkpoint(other, 1)]
    # each carries its run's saved settings, which say what it trained against
    assert models_under_test([checkpoint(e0, 2)])[1][3]["script"] == "ppo.py"
    assert models_under_test([adapter])[1][3] is None
