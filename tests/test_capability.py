"""tools/capability.py and its offline tasks (tools/capability_tasks/): the data files are the
generator's output at seed 0, every reference function passes its asserts and the sandbox bounds a
candidate's time, memory, files and environment; through lm-eval (skipped without it; .ci/run
installs it): bad input is one line before any model loads, the base and an adapter end to end on a
tiny model with every item kept, the same model twice gives the same numbers and nothing touches
the network, and an adapter damaged on purpose (every LoRA B x 50) is reported as a drop on the
embedded model.

    OMP_NUM_THREADS=1 python -m pytest tests/test_capability.py -q -p no:xdist
"""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import capability
from cli import command
from conftest import ROOT

TASKS = os.path.join(ROOT, "tools", "capability_tasks")
spec = importlib.util.spec_from_file_location("rlver_tasks", os.path.join(TASKS, "rlver_tasks.py"))
rlver_tasks = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rlver_tasks)


def items(task):
    return [json.loads(line) for line in open(rlver_tasks.FILES[task], encoding="utf-8")]


# ----------------------------------------------------------------------------------------------
# The tasks: generated from a seed, answers exact, code run in a bounded subprocess
# ----------------------------------------------------------------------------------------------
def test_the_data_files_are_the_generators_output_at_seed_0(tmp_path):
    for seed in (0, 1):
        os.makedirs(tmp_path / str(seed))
        rlver_tasks.write(str(tmp_path / str(seed)), seed)
    for task, path in rlver_tasks.FILES.items():
        name = os.path.basename(path)
        committed = open(path, "rb").read()
        assert (tmp_path / "0" / name).read_bytes() == committed, f"{name}: run rlver_tasks.py"
        assert (tmp_path / "1" / name).read_bytes() != committed  # the seed decides the items
        tests = [item for item in items(task) if item["split"] == "test"]
        assert len(tests) == rlver_tasks.TEST_ITEMS[task]
        assert len({item["id"] for item in items(task)}) == len(items(task))
    # every worked calculation is right and ends in the item's exact answer
    for item in items("arithmetic"):
        left, right = item["solution"].split(" = ")
        assert eval(left.replace(" x ", " * ")) == int(right) == int(item["answer"])


def test_each_reference_function_passes_and_a_wrong_one_fails():
    tests = [item for item in items("code") if item["split"] == "test"]
    # all reference bodies in one program: each item's asserts against its own function
    program = "\n\n".join(rlver_tasks.code_program(item, item["solution"]) for item in tests)
    assert rlver_tasks.run_sandboxed(program) == (True, "passed")
    item = tests[0]  # add_k: x + k
    assert rlver_tasks.score_code(item, [item["solution"]]) == {"pass@1": 1.0}
    assert rlver_tasks.score_code(item, ["\n    return x\n"]) == {"pass@1": 0.0}
    assert rlver_tasks.run_sandboxed(rlver_tasks.code_program(item, "\n    return x\n")) == (
        False, "AssertionError")


@pytest.mark.parametrize("body, why", [
    ("while True:\n    pass", "CPU-time limit"),
    ("import time\ntime.sleep(60)", "wall-clock limit"),
    ("x = bytearray(2 << 30)", "MemoryError"),
    ("open('f', 'w').write('x' * (2 << 20))", "File too large"),
    ("import os\nassert os.environ.get('SECRET') is None, 'leaked'\nraise SystemExit(3)",
     "exit code 3"),
])
def test_the_sandbox_bounds_a_candidate(body, why, monkeypatch):
    monkeypatch.setenv("SECRET", "sk-not-for-the-candidate")
    passed, said = rlver_tasks.run_sandboxed(body, cpu_seconds=1)
    assert not passed and why in said, said


# ----------------------------------------------------------------------------------------------
# The command: bad input in one line, before any model loads
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def offline_env(monkeypatch):
    """The command sets HF_HUB_OFFLINE, HF_DATASETS_OFFLINE (and with --allow-code-execution
    HF_ALLOW_CODE_EVAL); put them back after the test."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ALLOW_CODE_EVAL"):
        monkeypatch.delenv(name, raising=False)


def one_line(argv, capsys, *words):
    """capability.main(argv) ends with one line holding every word, exit code 2."""
    with pytest.raises(SystemExit) as stop:
        command(capability.main)(argv)
    err = capsys.readouterr().err
    lines = [line for line in re.split(r"[\r\n]", err) if line.startswith("error:")]
    assert stop.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert all(word in lines[0] for word in words), (words, lines[0])


def test_without_lm_eval_one_line_names_the_install(tmp_path, capsys, monkeypatch, offline_env):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    one_line(["--out", str(tmp_path / "out")], capsys, "needs lm-eval: pip install lm-eval==0.4.13")
    assert not (tmp_path / "out").exists()


def test_bad_tasks_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch, offline_env):
    pytest.importorskip("lm_eval")

    def loaded(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(capability, "load_models", loaded)
    out = str(tmp_path / "out")
    one_line(["--tasks", "rlver_nothing", "--out", out], capsys, "--tasks rlver_nothing: no such task")
    one_line(["--tasks", " , ", "--out", out], capsys, "--tasks: name at least one task")
    one_line(["--tasks", "rlver_arithmetic,rlver_code", "--out", out], capsys,
             "--tasks rlver_code runs the model's code: add --allow-code-execution")
    # the task folder without its data file
    shutil.copytree(TASKS, tmp_path / "tasks", ignore=shutil.ignore_patterns("arithmetic.jsonl"))
    monkeypatch.setattr(capability, "TASKS", str(tmp_path / "tasks"))
    one_line(["--out", out], capsys, "could not load a task's data", "FileNotFoundError",
             "arithmetic.jsonl")
    assert not os.path.exists(out)


def test_lm_eval_imports_hugging_faces_evaluate_and_this_project_keeps_its_own():
    """lm-eval's humaneval and mbpp `import evaluate` (Hugging Face's package); so does this
    project's evaluate.py by its name. Inside capability.hugging_face_evaluate it is theirs."""
    pytest.importorskip("lm_eval")
    import evaluate as ours
    with capability.hugging_face_evaluate():
        import evaluate as theirs
        assert hasattr(theirs, "load") and theirs.__file__ != ours.__file__
    import evaluate
    assert evaluate is ours and evaluate.load_models is capability.load_models


# ----------------------------------------------------------------------------------------------
# End to end: the base and an adapter, every item kept, twice the same, no network
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_adapter(tiny_model_dir, tmp_path_factory):
    """A LoRA adapter for the tiny model whose B is not 0, so that it changes the model."""
    from policy import load_policy

    policy, _ = load_policy(tiny_model_dir, lora_r=4, device="cpu")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
    folder = tmp_path_factory.mktemp("adapter") / "default"
    policy.save_pretrained(str(folder))
    return str(folder)


# sitecustomize.py for a child process: every attempt to reach a host is written down and refused
NETWORK_OFF = """
import socket

def refused(*args, **kwargs):
    with open({log!r}, "a") as f:
        f.write(repr(args[:2]) + "\\n")
    raise OSError("the network is off in this test")

connect = socket.socket.connect
def connect_local(self, address, *args):
    if self.family in (socket.AF_INET, socket.AF_INET6):
        return refused(address)
    return connect(self, address, *args)

socket.socket.connect = connect_local
socket.getaddrinfo = socket.create_connection = refused
"""


def read_samples(out):
    return [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"), encoding="utf-8")]


def test_base_and_adapter_end_to_end_the_same_twice_and_offline(tiny_model_dir, tiny_adapter, tmp_path,
                                                                capsys, offline_env):
    pytest.importorskip("lm_eval")
    argv = ["--model", tiny_model_dir, "--adapter", tiny_adapter, "--tasks",
            "rlver_arithmetic,rlver_code", "--allow-code-execution", "--limit", "3", "--batch-size",
            "4", "--bootstrap", "50"]
    out = str(tmp_path / "first")
    results = capability.main([*argv, "--out", out])
    label = os.path.basename(os.path.dirname(tiny_adapter))  # its folder's name: RUN/.../default
    assert results["complete"] and [m["label"] for m in results["models"]] == ["base", label]
    base, adapter = (m["scores"] for m in results["models"])
    assert set(base) == {"rlver_arithmetic", "rlver_code"}
    for task, metric in (("rlver_arithmetic", "exact_match,last-number"), ("rlver_code", "pass@1,none")):
        assert base[task][metric]["n"] == 3 and "vs_base" not in base[task][metric]
        difference = adapter[task][metric]["vs_base"]
        assert difference["n"] == 3
        change = adapter[task][metric]["value"] - base[task][metric]["value"]
        assert difference["value"] == pytest.approx(change)
    table = open(os.path.join(out, "results.md"), encoding="utf-8").read()
    assert table == capsys.readouterr().out.split("-> ")[0].rstrip("\n") + "\n"
    assert f"| rlver_code | pass@1,none | 3 | {label} |" in table
    # every item kept: its prompt (the worked examples, then the item), the answer, what was scored
    samples = read_samples(out)
    assert [(s["model"], s["task"]) for s in samples] == [
        (model, task) for model in ("base", label) for task in ("rlver_arithmetic", "rlver_code")
        for _ in range(3)]
    assert samples[0]["id"] == "arithmetic-000" and samples[0]["prompt"].startswith("Question: ")
    assert samples[0]["prompt"].count("Question: ") == 5  # four worked examples and the item
    assert samples[0]["answer"] != samples[6]["answer"]  # the adapter changed the model
    for s in samples:
        if s["task"] == "rlver_arithmetic":  # the answer's last number, exact match
            numbers = re.findall(r"-?[0-9]+", s["answer"])
            assert s["scored"] == (numbers[-1] if numbers else "[invalid]")
            assert s["scores"] == {"exact_match,last-number": float(s["scored"] == s["target"])}
        else:  # the program a reader can run again: prompt + answer + the asserts (the target)
            doc = {"prompt": s["prompt"].split("\n\n\n")[-1], "tests": s["target"]}
            passed, _ = rlver_tasks.run_sandboxed(rlver_tasks.code_program(doc, s["answer"]))
            assert s["scores"] == {"pass@1,none": float(passed)}
    # the same command again, in a process whose network is off: the same answers and numbers
    (tmp_path / "site").mkdir()
    log = tmp_path / "network.log"
    (tmp_path / "site" / "sitecustomize.py").write_text(NETWORK_OFF.format(log=str(log)))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "tools/capability.py", *argv, "--out", str(tmp_path / "again")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not log.exists(), log.read_text()
    assert read_samples(tmp_path / "again") == samples
    again = json.loads((tmp_path / "again" / "results.json").read_text())
    assert [m["scores"] for m in again["models"]] == [m["scores"] for m in json.loads(
        open(os.path.join(out, "results.json")).read())["models"]]
    assert open(tmp_path / "again" / "results.md").read() == table


# ----------------------------------------------------------------------------------------------
# The check can fail: an adapter damaged on purpose is a drop (the embedded model, which answers)
# ----------------------------------------------------------------------------------------------
@pytest.mark.smollm2
def test_a_damaged_adapter_is_reported_as_a_drop(tmp_path, offline_env):
    """The first 8 items of each task: the base passes most code items, and the damaged adapter
    none, a drop whose interval lies below 0; on 8 arithmetic items (the base answers 2) only the
    direction is asserted. The whole sets, a trained adapter x 50: docs/results.md."""
    pytest.importorskip("lm_eval")
    from policy import load_policy

    # a small change, as some training leaves, then every LoRA B x 50
    policy, _ = load_policy("smollm2", lora_r=8, device="cpu")
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 2e-3, generator=torch.Generator().manual_seed(0)).mul_(50)
    policy.save_pretrained(str(tmp_path / "damaged"))
    results = capability.main(["--adapter", str(tmp_path / "damaged"), "--tasks",
                               "rlver_arithmetic,rlver_code", "--allow-code-execution", "--limit",
                               "8", "--bootstrap", "500", "--out", str(tmp_path / "out")])
    base, damaged = (m["scores"] for m in results["models"])
    code, arithmetic = base["rlver_code"]["pass@1,none"], base["rlver_arithmetic"]["exact_match,last-number"]
    assert code["value"] >= 0.5 and arithmetic["value"] > 0, base  # the base answers some
    assert capability.verdict(damaged["rlver_code"]["pass@1,none"]["vs_base"]) == "dropped", damaged
    assert damaged["rlver_arithmetic"]["exact_match,last-number"]["vs_base"]["value"] < 0, damaged
