"""The researcher's tools around a run: --report-to (a tracker beside the files, numbers only), the
metrics line's non-finite numbers, and sum_gradients (one all-reduce a tensor) with two real processes."""
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import cli  # noqa: E402
import run  # noqa: E402
import rl  # noqa: E402
import grpo
import ppo
from conftest import ROOT, read_metrics


def tiny_args(model_dir, personas, out, *extra):
    return ["--preset", "cpu", "--model", model_dir, "--simulator", "rules", "--personas", personas,
            "--split", "test", "--minibatch-size", "2", "--micro-batch-size", "1", "--max-turns", "2",
            "--max-new-tokens", "6", "--max-context", "512", "--lora-r", "4", "--lora-alpha", "8",
            "--out", str(out), *extra]


def events_matching_metrics(out):
    """The run's TensorBoard events, checked to hold reward_mean at steps 1 and 2 with the values
    of metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "rlver"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("reward_mean")]
    expected = [(m["iteration"], m["reward_mean"]) for m in read_metrics(out)]
    assert [s for s, _ in logged] == [1, 2]
    assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-6)
    return events


SIZE = {ppo: ["--dialogues-per-iteration", "2"], grpo: ["--personas-per-iteration", "1", "--group-size", "2"]}


# ----------------------------------------------------------------------------------------------
# --report-to
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_tensorboard_gets_every_iteration(script, tiny_model_dir, personas_file, tmp_path):
    """2 iterations, a checkpoint after each, one kept, and a TensorBoard event file with reward_mean
    (as in metrics.jsonl) at steps 1 and 2: numbers only."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    script.main(tiny_args(tiny_model_dir, personas_file, out, *SIZE[script], "--iterations", "2",
                          "--save-every", "1", "--keep-checkpoints", "1", "--report-to", "tensorboard"))
    assert os.listdir(out / "checkpoints") == ["iter_000002"]
    events = events_matching_metrics(out)
    assert "kl_ref" in events.Tags()["scalars"]


def test_resume_replaces_what_a_killed_run_logged_after_its_checkpoint(tiny_model_dir, personas_file,
                                                                       tmp_path, monkeypatch):
    """A run logged iteration 2 and was killed before its checkpoint: --resume plays iteration 2
    again, and TensorBoard holds it once (purge_step; without it, step 2 would be there twice), as
    metrics.jsonl does."""
    pytest.importorskip("tensorboard")
    from accelerate import Accelerator

    out = tmp_path / "run"
    args = tiny_args(tiny_model_dir, personas_file, out, *SIZE[ppo], "--iterations", "2", "--save-every", "1",
                     "--report-to", "tensorboard")
    ppo.main(args)
    shutil.rmtree(out / "checkpoints" / "iter_000002")  # the kill
    started = []
    real = Accelerator.init_trackers
    monkeypatch.setattr(Accelerator, "init_trackers",
                        lambda self, *a, **k: started.append(k) or real(self, *a, **k))
    ppo.main([*args, "--resume", str(out)])
    events_matching_metrics(out)
    assert [m["iteration"] for m in read_metrics(out)] == [1, 2]
    (kwargs,) = started
    assert kwargs["init_kwargs"]["tensorboard"] == {"purge_step": 2}


@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_report_to_a_missing_tracker_is_one_line_before_any_model_loads(script, tiny_model_dir, personas_file,
                                                                         tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")
    monkeypatch.setattr("policy.load_model", no_loading)
    args = ["--preset", "cpu", "--model", tiny_model_dir, "--simulator", "rules", "--personas", personas_file,
            "--split", "test"]
    for value, message in (("wandb", "error: --report-to wandb needs the wandb package: pip install wandb"),
                           ("mlflow", "error: argument --report-to: invalid choice: 'mlflow' "
                                      "(choose from 'none', 'tensorboard', 'wandb')")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            cli.command(script.main)([*args, "--out", str(tmp_path / value), "--report-to", value])
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [message]


def test_report_to_wandb_without_wandb_from_the_command_line(tmp_path):
    """As a user runs it: exit 2, one line on stderr, nothing else."""
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    proc = subprocess.run([sys.executable, "ppo.py", "--preset", "cpu", "--simulator", "rules",
                           "--report-to", "wandb", "--out", str(tmp_path / "run")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --report-to wandb needs the wandb package: pip install wandb"]
    assert proc.stdout == ""


# ----------------------------------------------------------------------------------------------
# The metrics line: strict JSON, a non-finite number as null
# ----------------------------------------------------------------------------------------------
def test_non_finite_metrics_are_written_as_null(tmp_path):
    args = cli.parse_settings(rl.TrainerSettings, argv=["--out", str(tmp_path / "run"), "--iterations", "1"])
    layer = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    the_run = run.Run(args, "ppo.py", adapters=[])
    try:
        assert the_run.begin(layer, optimizer, scheduler) == 0
        dialogue = {"end_reason": "success", "final_emotion": 100}
        # the update's figures as run.add_sums keeps them: [sum, count]
        the_run.log({"reward_mean": math.inf, "c": 2.5, "final_emotion_mean": 100.0},
                    {"a": [math.nan, 1.0], "b": [3.0, 2.0], "d": [0.0, 0.0]}, [dialogue])
    finally:
        the_run.accelerator.end_training()
        cli.release()
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    row = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
    assert (row["a"], row["b"], row["c"], row["reward_mean"], row["d"]) == (None, 1.5, 2.5, None, None)
    assert row["iteration"] == 1
    (dialogue,) = [json.loads(line) for line in (tmp_path / "run" / "rollouts.jsonl").open()]
    assert dialogue == {"iteration": 1, "end_reason": "success", "final_emotion": 100}


# ----------------------------------------------------------------------------------------------
# sum_gradients with two real processes (gloo on the CPU)
# ----------------------------------------------------------------------------------------------
SUM_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    import cli
    import rl
    import run

    args = cli.parse_settings(rl.TrainerSettings, argv=["--out", {folder!r}])
    the_run = run.Run(args, "ppo.py", adapters=[])
    rank = the_run.rank
    seen = []  # each process writes its own file: printed lines of two processes interleave
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(5)),
              torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64))]
    for i, p in enumerate(params):
        if i != 1:  # parameter 1 has no gradient on either process (e.g. the critic's LoRA on lm_head)
            p.grad = torch.arange(p.numel(), dtype=p.dtype).view_as(p) + 100 * i + 10 * rank
    calls = []
    real = the_run.sum  # the process group's all-reduce (accelerate's reduce)
    the_run.sum = lambda t: calls.append(t.numel()) or real(t)
    the_run.sum_gradients(params)
    seen.append(f"NONE {{params[1].grad is None}}")
    seen.append(f"CALLS {{calls}}")
    for i in (0, 2, 3):
        expected = 2 * (torch.arange(params[i].numel(), dtype=params[i].dtype) + 100 * i) + 10
        seen.append(f"EQUAL {{i}} {{torch.equal(params[i].grad.reshape(-1), expected)}}")
    with open(f"{out}/rank{{rank}}.txt", "w") as f:
        f.write("\\n".join(seen))
    the_run.accelerator.end_training()  # leaves the process group cleanly
""")


def test_sum_gradients_sums_every_gradient_and_leaves_none_alone(tmp_path):
    script = tmp_path / "sum.py"
    script.write_text(SUM_SCRIPT.format(root=ROOT, out=str(tmp_path), folder=str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                           "--dynamo_backend", "no",
                           "--main_process_port", str(29600 + os.getpid() % 1000), str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.txt").read_text().splitlines()
        assert lines == ["NONE True",
                         # one call a tensor that has a gradient, in the order of params
                         "CALLS [6, 4, 4]",
                         "EQUAL 0 True", "EQUAL 2 True", "EQUAL 3 True"], rank


def test_sum_gradients_with_one_process_changes_nothing(tmp_path):
    args = cli.parse_settings(rl.TrainerSettings, argv=["--out", str(tmp_path / "run")])
    the_run = run.Run(args, "ppo.py", adapters=[])
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    the_run.sum_gradients([p, q])
    cli.release()
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0])) and q.grad is None
