"""bench.py: the learning report on hand-written run folders, the learning driver's skip / resume /
pass-through logic with the trainer subprocess replaced, `bench.py step` at tiny sizes, `bench.py gpu
--tiny` end to end as a subprocess, and `bench.py gpu --check`. No real learning run happens here."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import bench
from cli import command as command_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(out, name, rewards):
    """A run folder as the benchmark's trainer leaves it: its metrics, and a config.json naming the
    trainer (no other setting saved: none differs from the benchmark's)."""
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"script": name.split("-")[0] + ".py"}, f)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for i, r in enumerate(rewards):
            f.write(json.dumps({"iteration": i + 1, "reward_mean": r, "reward_std": 0.1}) + "\n")
    return folder


# PPO rises by 0.2 in every seed (target met); GRPO by about 0.05 (not met). Six iterations, window 2.
PPO = {0: [0.30, 0.32, 0.40, 0.45, 0.50, 0.52], 1: [0.28, 0.30, 0.38, 0.44, 0.48, 0.50],
       2: [0.32, 0.34, 0.42, 0.47, 0.52, 0.54]}
GRPO = {0: [0.30, 0.30, 0.31, 0.33, 0.35, 0.35], 1: [0.31, 0.29, 0.30, 0.32, 0.34, 0.36],
        2: [0.29, 0.31, 0.33, 0.33, 0.34, 0.35]}


@pytest.fixture
def fake_runs(tmp_path):
    out = str(tmp_path / "bench")
    for seed in range(3):
        write_run(out, f"ppo-seed{seed}", PPO[seed])
        write_run(out, f"grpo-seed{seed}", GRPO[seed])
    return out


def learning(out, *flags):
    return bench.main(["learning", "--out", out, "--iterations", "6", "--window", "2", *flags])


def no_trainer(*args, **kwargs):
    raise AssertionError("every run is complete: no trainer should start")


def test_report_means_std_and_target(fake_runs, monkeypatch, capsys):
    """Every run complete: no trainer starts; the table (first and last 2 of 6 iterations, mean ± std over
    seeds with ddof=1, the rise, the target) is written to learning.md and printed."""
    monkeypatch.setattr(bench, "run_command", no_trainer)
    learning(fake_runs)
    with open(os.path.join(fake_runs, "learning.md")) as f:
        lines = f.read().splitlines()
    assert lines[0] == ("Made by `python tools/bench.py learning --out %s --iterations 6 --window 2`."
                        % fake_runs)
    assert lines[2].startswith("| algorithm | seeds | first 2 iterations | last 2 iterations | rise | "
                               "target met")
    # PPO rises by 0.2 in every seed; no timings logged: "-"
    assert lines[4] == "| ppo | 3 | 0.310 ± 0.020 | 0.510 ± 0.020 | +0.200 ± 0.000 | yes | - |"
    first = [np.mean(GRPO[s][:2]) for s in range(3)]
    last = [np.mean(GRPO[s][-2:]) for s in range(3)]
    rise = np.subtract(last, first)
    std = [f"{np.std(x, ddof=1):.3f}" for x in (first, last, rise)]
    assert lines[5] == (f"| grpo | 3 | 0.300 ± {std[0]} | 0.348 ± {std[1]} | +{rise.mean():.3f} ± {std[2]} "
                        "| no | - |")
    assert lines[4] in capsys.readouterr().out


def test_incomplete_runs_are_named_not_averaged(fake_runs, monkeypatch):
    write_run(fake_runs, "grpo-seed2", GRPO[2][:4])                  # killed after 4 of 6 iterations
    write_run(fake_runs, "ppo-seed0", PPO[0] + [0.9, 0.9])           # logged past the asked number: cut
    monkeypatch.setattr(bench, "run_command", lambda *a, **k: 0)    # a trainer that logs nothing more
    learning(fake_runs)
    text = open(os.path.join(fake_runs, "learning.md")).read()
    assert "| grpo | 2 |" in text and "Not counted (incomplete): grpo-seed2 (4 of 6 iterations)" in text
    assert "| ppo | 3 | 0.310 ± 0.020 | 0.510 ± 0.020 |" in text
    learning(fake_runs, "--algos", "ppo", "--seeds", "7")            # no run at all
    assert "| ppo | 0 | no complete run |" in open(os.path.join(fake_runs, "learning.md")).read()


def test_window_must_not_overlap(tmp_path, capsys):
    argv = ["learning", "--out", str(tmp_path / "bench"), "--iterations", "6", "--window", "4"]
    with pytest.raises(SystemExit) as stop:  # bad input: one line, exit code 2, before any run starts
        command_line(bench.main)(argv)
    assert stop.value.code == 2 and "error: --window 4" in capsys.readouterr().err
    assert not (tmp_path / "bench").exists()


def test_learning_driver_skips_resumes_and_passes_flags(fake_runs, monkeypatch, capsys):
    """ppo seeds are complete (skipped); grpo seed 1 is a run folder the trainer made (its config.json)
    that stopped before its first checkpoint: resumed with --resume, which starts it again from its
    beginning; grpo seed 2 never started: a fresh run into a new --out. The stand-in subprocess logs the
    missing iterations as a trainer would."""
    write_run(fake_runs, "grpo-seed1", GRPO[1][:3])
    with open(os.path.join(fake_runs, "grpo-seed1", "config.json"), "w") as f:
        json.dump({"script": "grpo.py"}, f)
    shutil.rmtree(os.path.join(fake_runs, "grpo-seed2"))
    calls = []

    def run(command, log=None, cores=None, timeout=None, env=None):
        assert cores is None and log is None          # --jobs 1: no pinning, output to the terminal
        calls.append(command)
        folder, seed = command[-1], int(command[command.index("--seed") + 1])
        write_run(os.path.dirname(folder), os.path.basename(folder), GRPO[seed])
        return 0

    monkeypatch.setattr(bench, "run_command", run)
    learning(fake_runs, "--", "--max-new-tokens", "24")
    assert [c[1] for c in calls] == ["grpo.py", "grpo.py"]
    resumed, fresh = calls
    assert resumed[resumed.index("--seed") + 1] == "1"
    assert resumed[-2:] == ["--resume", os.path.join(fake_runs, "grpo-seed1")]
    assert fresh[fresh.index("--seed") + 1] == "2"
    assert fresh[-2:] == ["--out", os.path.join(fake_runs, "grpo-seed2")]
    assert "--out" not in resumed and "--resume" not in fresh and "--overwrite" not in resumed + fresh
    for c in calls:
        assert c[0] == sys.executable and c[2:4] == ["--preset", "cpu-learn"]
        assert c[c.index("--iterations") + 1] == "6"
        assert c.index("--max-new-tokens") > c.index("--preset")  # extra flags come later, so they win
    printed = capsys.readouterr().out
    assert "| ppo | 3 | 0.310 ± 0.020 | 0.510 ± 0.020 | +0.200 ± 0.000 | yes | - |" in printed


def test_minutes_per_run_from_the_logged_iteration_times(fake_runs, monkeypatch):
    for seed, seconds in ((0, 60.0), (1, 120.0), (2, 90.0)):
        folder = os.path.join(fake_runs, f"ppo-seed{seed}")
        rows = [dict(json.loads(line), time_iteration=seconds)
                for line in open(os.path.join(folder, "metrics.jsonl"))]
        rows.append({"iteration": 7, "reward_mean": 0.6, "time_iteration": 1e6})  # past --iterations
        with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    monkeypatch.setattr(bench, "run_command", no_trainer)
    learning(fake_runs)
    lines = open(os.path.join(fake_runs, "learning.md")).read().splitlines()
    assert lines[4].endswith("| yes | 9 |") and lines[5].endswith("| no | - |")  # 6, 12, 9 min; grpo untimed


def test_a_metrics_line_cut_short_is_not_read(tmp_path):
    folder = write_run(str(tmp_path), "run", [0.3, 0.4])
    with open(os.path.join(folder, "metrics.jsonl"), "a") as f:
        f.write('{"iteration": 3, "rew')                             # a kill during the write
    assert [r["iteration"] for r in bench.read_metrics(folder)] == [1, 2]
    assert bench.read_metrics(str(tmp_path / "none")) == []


def test_jobs_run_side_by_side_on_separate_cores(fake_runs, monkeypatch, capsys):
    """--jobs 2 on 4 usable cores: two runs at a time, each on its own 2 cores, output to a log."""
    import threading

    for seed in range(3):
        shutil.rmtree(os.path.join(fake_runs, f"grpo-seed{seed}"))
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    lock, running, calls = threading.Lock(), [], []
    both = threading.Barrier(2, timeout=10)   # the first two runs must be running at the same time

    def run(command, log=None, cores=None, timeout=None, env=None):
        seed = int(command[command.index("--seed") + 1])
        with lock:
            assert all(not set(cores) & set(c) for c in running)   # no core shared with a running job
            running.append(cores)
            calls.append((seed, cores, log))
        if seed < 2:
            both.wait()
        folder = command[-1]
        write_run(os.path.dirname(folder), os.path.basename(folder), GRPO[seed])
        with lock:
            running.remove(cores)
        return 0

    monkeypatch.setattr(bench, "run_command", run)
    learning(fake_runs, "--algos", "grpo", "--jobs", "2")
    assert sorted(seed for seed, _, _ in calls) == [0, 1, 2]
    assert all(len(cores) == 2 and set(cores) <= {0, 1, 2, 3} for _, cores, _ in calls)
    assert {log for _, _, log in calls} == {os.path.join(fake_runs, f"grpo-seed{s}.log") for s in range(3)}
    with pytest.raises(SystemExit) as stop:  # bad input: one line, exit code 2 (issue 26)
        command_line(bench.main)(["learning", "--out", fake_runs, "--jobs", "5"])
    assert stop.value.code == 2 and "error: --jobs 5" in capsys.readouterr().err


def test_a_pinned_trainer_sees_only_its_cores(tmp_path):
    core = sorted(os.sched_getaffinity(0))[-1]
    log = str(tmp_path / "run.log")
    code = bench.run_command([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)), "
                              "os.environ['OMP_NUM_THREADS']); raise SystemExit(4)"], log, [core])
    assert code == 4
    with open(log) as f:
        assert f.read().strip() == f"[{core}] 1"


def test_learning_driver_reports_a_failed_run(fake_runs, monkeypatch):
    os.remove(os.path.join(fake_runs, "ppo-seed1", "metrics.jsonl"))
    monkeypatch.setattr(bench, "run_command", lambda *a, **k: 3)
    with pytest.raises(SystemExit, match="ppo-seed1 failed"):
        learning(fake_runs)
    with open(os.path.join(fake_runs, "learning.md")) as f:
        assert "ppo-seed1 (0 of 6 iterations)" in f.read()


def test_trainer_flags_only_for_the_trainer_benchmarks(capsys):
    with pytest.raises(SystemExit) as stop:
        command_line(bench.main)(["rollout", "--", "--lr", "1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "unrecognized arguments: -- --lr 1" in err and err.count("\n") == 1


def test_gpu_tiny_end_to_end():
    """The gpu benchmark's driver (random Qwen2 model handed to ppo.main, two PPO iterations with the
    rules user, every decode call timed, the plain-generate baseline, the rollout at 4 dialogues,
    the bandwidth bound, the report) on CPU with a 2-layer model, with the paper preset's settings
    but its sizes (gradient checkpointing, LoRA r 32, RLVER's value clip and entropy bonus). Not
    covered: CUDA (its graphs), bf16, and the 7B model's speed and memory."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "tools/bench.py", "gpu", "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    for flag in ("--gradient-checkpointing True", "--lora-r 32", "--lora-alpha 64", "--value-clip 0.5",
                 "--ent-coef 0.001", "--lr 1e-05", "--simulator rules --thinking false"):
        assert flag in out[0], flag  # the ppo.py command it ran
    assert out[-4].startswith("rollout ") and "plain generate's" in out[-4] and "bandwidth" in out[-4]
    assert out[-3].startswith("at 4 dialogues") and out[-2].startswith("update")
    result = json.loads(out[-1])
    # random weights never end a turn early: 2 dialogues x 2 turns x 4
    assert result["policy_tokens"] == 2 * 2 * 4
    assert result["rollout_tokens_per_s"] > 0 and result["update_agent_tokens_per_s"] > 0
    plain = result["plain_generate_tokens_per_s"]
    assert result["ratio"] == pytest.approx(result["rollout_tokens_per_s"] / plain, rel=1e-3) and plain > 0
    assert result["first_turn_tokens_per_s"] > 0 and result["later_turns_tokens_per_s"] > 0
    assert 0 < result["bandwidth_fraction"] and result["rollout_tokens_per_s_at_4"] > 0
    assert result["graphs"] == 0 and result["peak_memory_gb"] > 0  # no CUDA graph on a CPU


def test_gpu_tiny_paper_shape_and_flags_for_ppo():
    """--shape paper runs the paper preset's kind of dialogue (thinking on, every turn of it: the rules
    user from 60; 3 turns at tiny sizes), and flags after `--` reach ppo.py last, so they win (here
    4 new tokens a turn)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "tools/bench.py", "gpu", "--tiny", "--shape", "paper", "--",
               "--max-new-tokens", "4"]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    assert "--simulator rules --start-emotion 60 --thinking true" in out[0] and "--max-turns 3" in out[0]
    assert out[0].endswith("--max-new-tokens 4")
    assert json.loads(out[-1])["policy_tokens"] == 4 * 3 * 4  # every dialogue runs every turn


def test_gpu_without_cuda_says_so_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, "tools/bench.py", "gpu"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2  # as every command's refusals (issue 26)
    assert proc.stderr.strip().count("\n") == 0 and "needs a CUDA GPU" in proc.stderr


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_bench_step_prints_iteration_floor_and_ratio(tiny_model_dir, algo, capsys):
    # The single-turn job at tiny sizes: two iterations, each after its floor, and the ratio lines.
    result = bench.main(["step", "--algo", algo, "--model", tiny_model_dir, "--iterations", "2",
                         "--dialogues", "4", "--group-size", "2", "--max-new-tokens", "4",
                         "--micro-batch-size", "2"])
    out = capsys.readouterr().out.strip().splitlines()
    ratio_line, sampling_line = out[-3:-1]
    assert ratio_line.startswith("ratio: the iteration's ") and "(medians of 2)" in ratio_line
    assert ratio_line.endswith(f"(target <= {bench.STEP_TARGET[algo]})")
    printed = float(re.search(r"= ([\d.]+) \(target", ratio_line).group(1))
    assert printed == pytest.approx(result["ratio"], abs=0.006)
    assert result["ratio"] == pytest.approx(result["iteration_seconds"] / result["floor_seconds"])
    assert 0 < result["floor_seconds"] and 0 < result["iteration_seconds"]
    assert json.loads(out[-1])["ratio"] == pytest.approx(result["ratio"], rel=1e-3)
    assert sampling_line.startswith("sampling: ")
    assert sampling_line.endswith(f"(target >= {bench.SAMPLING_TARGET})")
    assert result["sampling_ratio"] == pytest.approx(result["sampling_tokens_per_s"]
                                                     / result["floor_sampling_tokens_per_s"])
    assert result["floor_sampling_tokens_per_s"] > 0


# ----------------------------------------------------------------------------------------------
# The built tokenizer and `bench.py gpu --check`
# ----------------------------------------------------------------------------------------------
def test_chatml_tokenizer_is_the_same_every_build_and_grows_dialogues_token_by_token(tmp_path):
    """The tokenizer the GPU machine's random models use (no embedded wheel there): the same ids
    from two builds, ChatML's special tokens at SmolLM2's ids, any text (bytes) round-trips, and a
    dialogue grown by ChatTokens' pieces tokenizes as the chat template renders it whole."""
    from transformers import AutoTokenizer

    import rollout

    first, second = bench.chatml_tokenizer(), bench.chatml_tokenizer()
    assert first.get_vocab() == second.get_vocab() and len(first) == 4096
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert [first.convert_tokens_to_ids(t) for t in specials] == [0, 1, 2]
    assert first.pad_token_id == first.eos_token_id == 2 and first.padding_side == "left"
    assert rollout.eos_ids(first) == [2]
    text = "ça va? 再见 🙂 </think> i didn't get the promotion"
    ids = first(text, add_special_tokens=False)["input_ids"]
    assert first.decode(ids) == text and len(ids) < len(text.encode())  # merges learned, bytes kept
    chat = rollout.ChatTokens(first)
    agent = first("I hear you.", add_special_tokens=False)["input_ids"] + [2]  # the sampled reply and its EOS
    grown = chat.prompt("hello") + agent + chat.user_turn("thanks", agent[-1])
    whole = first.apply_chat_template([{"role": "system", "content": rollout.THINK_PROMPT},
                                       {"role": "user", "content": "hello"},
                                       {"role": "assistant", "content": "I hear you."},
                                       {"role": "user", "content": "thanks"}], add_generation_prompt=True,
                                      tokenize=False)
    assert first.decode(grown) == whole
    first.save_pretrained(tmp_path)  # the tests' tiny_model_dir saves it next to the model
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(text)["input_ids"] == ids and loaded.chat_template == first.chat_template


def test_the_suite_hides_cuda_unless_told_and_checks_its_device_choice(device):
    if device == "cpu":  # the default: CUDA hidden from the tests and the scripts they start
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
    for flags, words in ((["--device", "tpu"], "choose --device from cpu|cuda"),
                         (["--dtype", "fp16"], "--dtype from float32|bfloat16")):
        command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                   "tests/test_help.py", *flags]
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 4 and words in proc.stderr, proc.stderr


def check_args(folder, *extra):
    """The dry run's flags with its results and logs in a new folder, `folder`/check."""
    return ["gpu", "--check", "--dry-run", "--out", str(folder / "check"), *extra]


@pytest.mark.parametrize("argv, words", [
    (["gpu", "--dry-run"], "unrecognized arguments: --dry-run"),   # a flag of the check alone
    (["gpu", "--check", "--steps", "versions,tets"], "--steps 'versions,tets': must be a comma-separated"),
    (["gpu", "--check", "--budget", "0"], "--budget 0.0: must be")])
def test_gpu_check_flags_are_checked(argv, words, capsys):
    with pytest.raises(SystemExit) as stop:
        command_line(bench.main)(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and words in err and err.strip().count("\n") == 0, err


@pytest.mark.parametrize("inside, words", [("", "cannot be written"), ("check", "cannot be made")],
                         ids=["an empty folder", "a folder to make in it"])
def test_gpu_check_with_a_read_only_out_is_one_line_before_any_step(tmp_path, inside, words):
    # through tests/faults.py, which makes the folder read-only for the script (root writes through chmod)
    from test_bad_input import assert_one_line, shell

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    out = read_only / inside
    check = ["gpu", "--check", "--dry-run", "--steps", "versions", "--out", str(out)]
    code, stdout, err, _ = shell(os.path.join("tests", "faults.py"), "--read-only", str(read_only), "--",
                               "tools/bench.py", *check)
    assert_one_line(code, err, str(out), words)
    assert stdout == "" and os.listdir(read_only) == []  # no step ran, nothing was written


def test_gpu_check_goes_on_after_a_failed_or_hung_step(tmp_path, monkeypatch, capsys):
    """A step that fails, or runs past its time limit (killed with its process group), is reported
    and the next one still runs; the results file is whole after each step; a step that no longer
    fits the budget is skipped."""
    commands = {"versions": "import sys; print('{\"a\": 1}'); sys.exit(3)",
                "tests-fp32": "import time; print('{\"row\": 1}', flush=True); time.sleep(60)",
                "tests-bf16": "print('1 passed, 2 skipped in 0.1s')"}
    monkeypatch.setattr(bench, "check_command", lambda step, args: [sys.executable, "-c", commands[step]])
    monkeypatch.setitem(bench.CHECK_STEPS, "tests-fp32", 2)
    with pytest.raises(SystemExit) as stop:
        command_line(bench.main)(check_args(tmp_path, "--steps", "versions,tests-fp32,tests-bf16"))
    assert stop.value.code == 1
    out = capsys.readouterr().out.splitlines()
    report = json.loads((tmp_path / "check" / "check.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert [s["status"] for s in report["steps"]] == ["fail", "fail", "pass"] and not report["passed"]
    assert steps["versions"]["exit_code"] == 3 and steps["versions"]["numbers"] == {"partial": [{"a": 1}]}
    assert steps["tests-fp32"]["exit_code"] is None and steps["tests-fp32"]["seconds"] < 30
    assert steps["tests-fp32"]["numbers"]["timed_out_after_s"] == 2
    assert steps["tests-bf16"]["numbers"] == {"passed": 1, "skipped": 2}
    assert out[1].startswith("versions       FAIL") and out[3].startswith("tests-bf16     PASS")
    assert out[-1].startswith("FAILED: versions, tests-fp32; 1 passed, 2 failed, 0 skipped")
    assert (tmp_path / "check" / "tests-fp32.log").read_text().startswith('{"row": 1}')
    # no step failed (a new --out, as every check takes)
    again = check_args(tmp_path / "again", "--steps", "tests-bf16", "--budget", "5")
    report = command_line(bench.main)(again)
    assert report["steps"][0]["status"] == "skip" and report["passed"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("0 passed, 0 failed, 1 skipped")


def test_gpu_check_dry_run_runs_every_step(tmp_path):
    """`bench.py gpu --check --dry-run` (what CI can run of the GPU check): every step on CPU at tiny
    sizes with CUDA hidden and the built tokenizer, each passing with its key numbers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "tools/bench.py", *check_args(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "check" / "check.json").read_text())
    assert [s["name"] for s in report["steps"]] == list(bench.CHECK_STEPS) and report["dry_run"]
    assert all(s["status"] == "pass" for s in report["steps"]) and report["passed"]
    lines = proc.stdout.splitlines()
    for step in bench.CHECK_STEPS:
        assert any(line.startswith(f"{step} ") and " PASS " in line for line in lines), step
    n = {s["name"]: s["numbers"] for s in report["steps"]}
    assert n["versions"]["device"] == "cpu (dry run)" and n["versions"]["tokenizer_size"] == 4096
    for dtype in ("fp32", "bf16"):  # every test marked gpu also runs on the CPU
        assert n[f"tests-{dtype}"]["passed"] >= 4 and "skipped" not in n[f"tests-{dtype}"]
        assert "failed" not in n[f"tests-{dtype}"]
    assert n["learning"]["passed"] == 1 and "failed" not in n["learning"]  # the reward rose
    assert n["bench-gpu"]["policy_tokens"] == 2 * 2 * 4
    rates = n["rollout-rates"]
    assert rates["tokens_per_s"] > 0
    assert rates["logprob_gap_max"] < 1e-4 and abs(rates["mismatch_kl"]) < 1e-9  # float32 on the CPU
    assert n["4bit"]["linear4bit_layers"] > 0 and 0 <= n["4bit"]["reward_mean"] <= 1  # NF4 on the CPU


# ----------------------------------------------------------------------------------------------
# credit: the grid of trainer x credit x seed, its table, picture and judges
# ----------------------------------------------------------------------------------------------
def credit_emotions(trainer, credit, seed):
    """A stand-in run's final emotion, 4 iterations: grpo-turn starts at 30 and ends at 40, 44, 48
    (seeds 0, 1, 2); every other cell starts at 30 and ends at 35 + the seed."""
    if (trainer, credit) == ("grpo", "turn"):
        return [30.0, 33.0, 36.0, 40.0 + 4 * seed]
    return [30.0, 31.0, 33.0, 35.0 + seed]


def stand_in_trainer(calls, scores=None):
    """run_command for bench credit: a trainer writes its config.json (its real settings, as the
    trainer would) and 4 iterations of metrics.jsonl; evaluate.py writes a complete results.json
    (base 30, the adapter scores[run name])."""
    import cli

    def run(command, log=None, cores=None, timeout=None, env=None):
        calls.append(command)
        if command[1] == "evaluate.py":
            out, run_dir = command[-1], command[command.index("--adapter") + 1]
            os.makedirs(out)
            models = [{"label": label, "measures": {"final_emotion": {"value": score}}}
                      for label, score in (("base", 30.0),
                                           ("adapter", scores[os.path.basename(run_dir)]))]
            with open(os.path.join(out, "results.json"), "w") as f:
                json.dump({"complete": True, "judges": [{"judge": "rules", "models": models}]}, f)
            return 0
        trainer, folder = command[1][:-3], command[-1]
        flags = command[2:-2]
        settings = bench.checked(trainer, flags + ["--out", folder])
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cli.public_config(settings, command[1]), f)
        seed = flags[flags.index("--seed") + 1]
        emotions = credit_emotions(trainer, flags[flags.index("--reward") + 1], int(seed))
        with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
            for i, e in enumerate(emotions):
                f.write(json.dumps({"iteration": i + 1, "final_emotion_mean": e,
                                    "time_iteration": 30.0}) + "\n")
        return 0
    return run


def test_credit_grid_runs_every_cell_at_equal_dialogues_and_writes_its_table(tmp_path, monkeypatch,
                                                                              capsys):
    """2 trainers x 3 credits x 3 seeds at --preset cpu-turns (8 dialogues an iteration in both),
    each cell's final emotion over its first and last iteration, mean [95% Student-t interval] over
    the seeds, by hand for grpo-turn: last 40, 44, 48: 44 +- 4.303 x 4 / sqrt(3) = [34.1, 53.9]."""
    out, calls = str(tmp_path / "credit"), []
    monkeypatch.setattr(bench, "run_command", stand_in_trainer(calls))
    bench.main(["credit", "--out", out, "--iterations", "4", "--window", "1"])
    assert len(calls) == 18
    for c in calls:
        assert c[0] == sys.executable and c[2:4] == ["--preset", "cpu-turns"] and c[-2] == "--out"
    cells = {(c[1], c[c.index("--reward") + 1]) for c in calls}
    assert cells == {(t, r) for t in ("ppo.py", "grpo.py") for r in ("final", "turn", "mixed")}
    assert bench.checked("ppo", ["--preset", "cpu-turns"]).dialogues_per_iteration == 8
    grpo_settings = bench.checked("grpo", ["--preset", "cpu-turns"])
    assert grpo_settings.personas_per_iteration * grpo_settings.group_size == 8
    assert grpo_settings.max_turns == 3
    table = open(os.path.join(out, "credit.md")).read()
    assert "| grpo | turn | 3 | 30.0 [30.0, 30.0] | 44.0 [34.1, 53.9] | +14.0 [+4.1, +23.9] | 2 |" in table
    assert "| ppo | mixed | 3 | 30.0 [30.0, 30.0] | 36.0 [33.5, 38.5] | +6.0 [+3.5, +8.5] | 2 |" in table
    results = json.load(open(os.path.join(out, "credit.json")))
    (cell,) = [c for c in results["cells"] if (c["trainer"], c["credit"]) == ("grpo", "turn")]
    assert cell["last"]["low"] == pytest.approx(44 - 4.303 * 4 / 3 ** 0.5)
    assert os.path.getsize(os.path.join(out, "credit.png")) > 0
    assert "written:" in capsys.readouterr().out


def test_credit_grid_continues_its_own_runs_and_no_other(tmp_path, monkeypatch, capsys):
    out, calls = str(tmp_path / "credit"), []
    monkeypatch.setattr(bench, "run_command", stand_in_trainer(calls))
    grid = ["credit", "--out", out, "--iterations", "4", "--window", "1", "--seeds", "0",
            "--credits", "turn"]
    bench.main(grid)
    assert len(calls) == 2
    # every run complete: nothing runs again
    bench.main(grid)
    assert len(calls) == 2
    # a run cut short continues with --resume in its own folder
    with open(os.path.join(out, "grpo-turn-seed0", "metrics.jsonl")) as f:
        first_two = f.readlines()[:2]
    with open(os.path.join(out, "grpo-turn-seed0", "metrics.jsonl"), "w") as f:
        f.writelines(first_two)
    bench.main(grid)
    assert calls[-1][1] == "grpo.py" and calls[-1][-2:] == ["--resume",
                                                            os.path.join(out, "grpo-turn-seed0")]
    # the same folder with other settings (another learning rate) is refused in one line
    for argv in (grid + ["--", "--lr", "1e-4"], ["credit", "--out", str(tmp_path)]):
        with pytest.raises(SystemExit) as stop:
            command_line(bench.main)(argv)
        assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: --out" in err and "ppo-turn-seed0 is not this grid's run (--lr" in err
    assert "holds files this command did not make" in err
    assert len(calls) == 3


def test_credit_grid_scores_each_final_adapter_under_each_judge(tmp_path, monkeypatch):
    out, calls = str(tmp_path / "credit"), []
    scores = {f"{t}-{c}-seed{s}": 40.0 + s for t in ("ppo", "grpo") for c in ("final", "turn")
              for s in range(2)}
    monkeypatch.setattr(bench, "run_command", stand_in_trainer(calls, scores))
    bench.main(["credit", "--out", out, "--iterations", "4", "--window", "1", "--seeds", "0,1",
                "--credits", "final,turn", "--judges", "rules"])
    judged = [c for c in calls if c[1] == "evaluate.py"]
    assert len(judged) == 8
    for c in judged:
        assert c[c.index("--simulator") + 1] == "rules" and c[c.index("--split") + 1] == "test"
        assert c[c.index("--max-turns") + 1] == "3" and c[c.index("--start-emotion") + 1] == "30"
        assert c[c.index("--personas") + 1] == os.path.join(ROOT, "personas.json")  # the runs'
    # each in its own folder, once complete
    assert bench.judged(os.path.join(out, "judge-rules", "grpo-turn-seed1"))
    table = open(os.path.join(out, "credit.md")).read()
    # 40 and 41: 40.5 +- 12.706 x 0.707 / sqrt(2) = [34.1, 46.9]; the base's 30
    assert "| 40.5 [34.1, 46.9] (30.0) |" in table
    bench.main(["credit", "--out", out, "--iterations", "4", "--window", "1", "--seeds", "0,1",
                "--credits", "final,turn", "--judges", "rules"])
    assert len(calls) == 16  # nothing again


def test_credit_grid_of_one_real_cell_judged_by_the_rules_user(tmp_path, tiny_model_dir,
                                                               personas_file):
    """One cell (grpo, per-turn credit), one seed, two iterations on the tiny model, through the
    real grpo.py and evaluate.py as subprocesses: the run, its score under the rules user, the
    table."""
    out = str(tmp_path / "credit")
    bench.main(["credit", "--out", out, "--trainers", "grpo", "--credits", "turn", "--seeds", "0",
                "--iterations", "2", "--window", "1", "--judges", "rules", "--",
                "--model", tiny_model_dir, "--personas", personas_file, "--split", "test",
                "--max-new-tokens", "4", "--max-context", "512", "--lora-r", "4",
                "--lora-alpha", "8"])
    results = bench.judged(os.path.join(out, "judge-rules", "grpo-turn-seed0"))
    assert results and [m["label"] for m in results["judges"][0]["models"]][0] == "base"
    assert results["settings"]["max_turns"] == 3 and results["settings"]["split"] == "test"
    assert results["persona_ids"] == ["p0", "p1", "p2"]  # the test split of the runs' personas
    records = [json.loads(line) for line in open(os.path.join(out, "grpo-turn-seed0",
                                                               "rollouts.jsonl"))]
    assert all(len(r["advantages"]) == len(r["changes"]) for r in records)
    table = open(os.path.join(out, "credit.md")).read()
    assert "| grpo | turn | 1 |" in table and "| rules (test split; base) |" in table


@pytest.mark.parametrize("flag", ["--reward", "--seed", "--preset"])
def test_credit_grid_sets_each_runs_credit_seed_and_preset_itself(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        command_line(bench.main)(["credit", "--out", str(tmp_path / "c"), "--", flag, "1"])
    assert stop.value.code == 2 and f"error: {flag} after --: the grid sets it" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "c")
