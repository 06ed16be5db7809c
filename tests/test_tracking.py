"""The researcher's tools around a run: --report-to (experiment trackers), --keep-checkpoints, and
reduce_gradients (one all-reduce per bucket of gradients) with two real processes."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import run  # noqa: E402
import grpo
import ppo
import rollout
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
def test_tensorboard_gets_every_iteration_and_old_checkpoints_go(script, tiny_model_dir, personas_file,
                                                                 tmp_path):
    """The Done-when run of issue 18 on the tiny model: 2 iterations, a checkpoint after each, one kept,
    and a TensorBoard event file with reward_mean (as in metrics.jsonl) at steps 1 and 2."""
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    script.main(tiny_args(tiny_model_dir, personas_file, out, *SIZE[script], "--iterations", "2",
                          "--save-every", "1", "--keep-checkpoints", "1", "--report-to", "tensorboard"))
    assert os.listdir(out / "checkpoints") == ["iter_000002"]
    assert run.latest_checkpoint(str(out)).endswith("iter_000002")
    events = events_matching_metrics(out)
    assert "kl_ref" in events.Tags()["scalars"]
    texts = events.Tensors("dialogues/text_summary")  # a few dialogues per iteration, as markdown
    assert [t.step for t in texts] == [1, 2]
    first = texts[0].tensor_proto.string_val[0].decode()
    assert "**agent**" in first and "**user**" in first and "final emotion" in first


def test_resume_replaces_what_a_killed_run_logged_after_its_checkpoint(tiny_model_dir, personas_file,
                                                                       tmp_path):
    """A run logged iteration 2 and was killed before its checkpoint: --resume plays iteration 2
    again, and TensorBoard holds it once (purge_step; without it, step 2 would be there twice), as
    metrics.jsonl does."""
    pytest.importorskip("tensorboard")
    import shutil

    out = tmp_path / "run"
    args = tiny_args(tiny_model_dir, personas_file, out, *SIZE[ppo], "--iterations", "2", "--save-every", "1",
                     "--report-to", "tensorboard")
    ppo.main(args)
    shutil.rmtree(out / "checkpoints" / "iter_000002")  # the kill
    ppo.main([*args, "--resume", str(out)])
    events_matching_metrics(out)


@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_report_to_a_missing_tracker_is_one_line_before_any_model_loads(script, tiny_model_dir, personas_file,
                                                                         tmp_path, monkeypatch, capsys):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the settings were checked")
    monkeypatch.setattr(rollout, "load_model", no_loading)
    args = ["--model", tiny_model_dir, "--simulator", "rules", "--personas", personas_file,
            "--out", str(tmp_path)]
    args = ["--preset", "cpu", *args]
    for value, message in (("wandb", "error: --report-to wandb needs the wandb package: pip install wandb"),
                           ("mlflow", "error: argument --report_to/--report-to: invalid choice: 'mlflow' "
                                      "(choose from 'tensorboard', 'wandb', 'trackio', 'all', 'none')")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            script.main([*args, "--report-to", value])
        assert stop.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [message]


def test_report_to_wandb_without_wandb_from_the_command_line(tmp_path):
    """The Done-when line of issue 18, as a user runs it: exit 2, one line on stderr, nothing else."""
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    proc = subprocess.run([sys.executable, "ppo.py", "--preset", "cpu", "--simulator", "rules",
                           "--report-to", "wandb", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["error: --report-to wandb needs the wandb package: pip install wandb"]
    assert proc.stdout == ""


def test_tracker_config_is_public_and_plain():
    """What start_trackers hands the trackers: public_config (no secret values), scalars and strings only."""
    from dataclasses import field, make_dataclass

    class Accelerated:  # records what accelerate's init_trackers would receive
        log_with, project_dir, calls = ["tensorboard"], "/runs/ppo-7", []

        def init_trackers(self, project, config, init_kwargs):
            self.calls.append((project, config, init_kwargs))

    # a settings class that holds a secret value, as a careless fork might
    WithSecret = make_dataclass("WithSecret", [("api_key", str, field(default="sk-123"))])
    tracked = Accelerated()
    run.start_trackers(run.parse_settings(ppo.SETTINGS + (WithSecret,), argv=[]), tracked, start_iteration=4)
    (project, config, init_kwargs), = tracked.calls
    assert config["api_key"] == "<redacted>" and config["api_key_env"] == "OPENAI_API_KEY"
    assert "sk-123" not in json.dumps(config)
    assert all(isinstance(v, (bool, int, float, str)) for v in config.values())
    assert init_kwargs["tensorboard"] == {"purge_step": 5}  # a resumed run drops the steps logged after it
    assert init_kwargs["wandb"] == {"name": "ppo-7"}


# ----------------------------------------------------------------------------------------------
# --keep-checkpoints
# ----------------------------------------------------------------------------------------------
def fake_checkpoints(run_dir, iterations):
    for i in iterations:
        folder = os.path.join(run_dir, "checkpoints", f"iter_{i:06d}")
        os.makedirs(os.path.join(folder, "default"))
        for name in ("state.pt", os.path.join("default", "adapter_model.safetensors")):
            with open(os.path.join(folder, name), "w") as f:
                f.write("x")


def test_prune_keeps_the_newest(tmp_path):
    fake_checkpoints(tmp_path, [1, 2, 3, 4])
    os.makedirs(tmp_path / "checkpoints" / "iter_000005.tmp")  # a save in progress is not counted or touched
    run.prune_checkpoints(str(tmp_path), 2)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["iter_000003", "iter_000004", "iter_000005.tmp"]
    run.prune_checkpoints(str(tmp_path), 0)  # 0 keeps all
    assert len(os.listdir(tmp_path / "checkpoints")) == 3
    run.prune_checkpoints(str(tmp_path), 1)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["iter_000004", "iter_000005.tmp"]


def test_a_kill_during_deletion_leaves_a_loadable_newest_checkpoint(tiny_model, tmp_path, monkeypatch):
    """Real checkpoints of a tiny two-adapter model; the removal of the older one is killed after its
    first file. Every folder that looks complete still is, and --resume's pick loads."""
    import copy
    import shutil

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny_model[0]), LoraConfig(r=2, target_modules=["q_proj"]))
    for iteration in (1, 2):
        run.save_checkpoint(str(tmp_path), iteration, model, ["default"], {"marker": iteration})

    def killed_rmtree(path, *args, **kwargs):
        for root, _, files in os.walk(path):
            os.remove(os.path.join(root, files[0]))
            raise KeyboardInterrupt  # the kill, half way through the removal
    monkeypatch.setattr(shutil, "rmtree", killed_rmtree)
    with pytest.raises(KeyboardInterrupt):
        run.prune_checkpoints(str(tmp_path), 1)
    monkeypatch.undo()
    folder = tmp_path / "checkpoints"
    for name in os.listdir(folder):  # whatever is named like a complete checkpoint is complete
        if not name.endswith(".tmp"):
            assert os.path.isfile(folder / name / "state.pt") and os.path.isfile(
                folder / name / "default" / "adapter_model.safetensors"), name
    newest = run.latest_checkpoint(str(tmp_path))
    assert newest.endswith("iter_000002")
    assert torch.load(os.path.join(newest, "state.pt"), weights_only=False)["marker"] == 2
    run.load_adapter_weights(model, newest, "default")
    run.prune_checkpoints(str(tmp_path), 1)  # the next call clears what the kill left
    assert os.listdir(folder) == ["iter_000002"]


# ----------------------------------------------------------------------------------------------
# reduce_gradients with two real processes (gloo on the CPU)
# ----------------------------------------------------------------------------------------------
REDUCE_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r})
    from accelerate import Accelerator
    from run import reduce_gradients

    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    seen = []  # each process writes its own file: printed lines of two processes interleave
    params = [torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(5)),
              torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2, 2))]
    for i, p in enumerate(params):
        if i != 1:  # parameter 1 has no gradient on either process (e.g. the actor during critic warm-up)
            p.grad = torch.arange(p.numel(), dtype=torch.float32).view_as(p) + 100 * i + 10 * rank
    calls = []
    real = accelerator.reduce
    accelerator.reduce = lambda t, op: calls.append(t.numel()) or real(t, op)
    # buckets of at most 48 bytes (12 floats): [6 + 4 floats], [4 floats]
    reduce_gradients(params, accelerator, bucket_bytes=48)
    seen.append(f"NONE {{params[1].grad is None}}")
    seen.append(f"CALLS {{calls}}")
    for i in (0, 2, 3):
        expected = 2 * (torch.arange(params[i].numel(), dtype=torch.float32) + 100 * i) + 10
        seen.append(f"EQUAL {{i}} {{torch.equal(params[i].grad.reshape(-1), expected)}}")
    # a gradient one process lacks (it ran no backward pass) counts as zeros there
    params[0].grad = None if rank == 1 else torch.ones(3, 2)
    reduce_gradients(params, accelerator)
    seen.append(f"FILLED {{torch.equal(params[0].grad, torch.ones(3, 2))}}")
    with open(f"{out}/rank{{rank}}.txt", "w") as f:
        f.write("\\n".join(seen))
    accelerator.end_training()  # leaves the process group cleanly
""")


def test_reduce_gradients_sums_in_buckets_and_leaves_none_alone(tmp_path):
    script = tmp_path / "reduce.py"
    script.write_text(REDUCE_SCRIPT.format(root=ROOT, out=str(tmp_path)))
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
                         # which gradients exist (4 flags), then two buckets: not one call per tensor
                         "CALLS [4, 10, 4]",
                         "EQUAL 0 True", "EQUAL 2 True", "EQUAL 3 True",
                         "FILLED True"], rank


def test_reduce_gradients_with_one_process_changes_nothing():
    from accelerate import Accelerator

    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, 2.0, 3.0])
    run.reduce_gradients([p, q], Accelerator(cpu=True))
    assert torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0])) and q.grad is None
