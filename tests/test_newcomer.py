"""What a newcomer sees of a run (issue 54): the rollout's progress bar counts the work done (agent
turns, a dialogue that ended counting all of its own), a run ends with its summary and where its
adapter is, and tools/plot.py draws runs side by side (skipped without matplotlib) or says in one
line what it needs."""
import importlib.util
import os
import shutil
import sys

import pytest
from tqdm import tqdm

import grpo
import ppo
import rollout
from conftest import ROOT, read_metrics
from personas import load_personas
from cli import command
from simulator import Simulator
from users import RulesBackend


def test_the_rollouts_bar_counts_turns_an_ended_dialogue_all_of_its_own(tiny_model, persona_entry,
                                                                       write_personas, monkeypatch):
    """The bar's total is dialogues x --max-turns; after each turn it stands at the turns played,
    a dialogue that has ended counting all of its turns, so its time estimate is the pace of the
    turns played (a bar of finished dialogues stood still until the end, then guessed hours)."""
    seen = []

    class Recorded(tqdm):
        def update(self, n=1):
            super().update(n)
            seen.append((self.n, self.total))
    monkeypatch.setattr(rollout, "tqdm", Recorded)
    model, tokenizer = tiny_model
    path = write_personas([persona_entry(id=d, difficulty=d) for d in ("easy", "normal", "hard")])
    # off-topic replies (the tiny model's) move a user starting at 13 out of the talk (below 10)
    # after one turn or two, by its difficulty
    simulator = Simulator(RulesBackend(), start_emotion=13, max_turns=4)
    records, _ = rollout.play_dialogues(model, simulator, load_personas(path),
                                        chat=rollout.ChatTokens(tokenizer, False), greedy=True,
                                        max_new_tokens=6, max_context=512, progress=True)
    played = [len(r["turn_ends"]) for r in records]
    assert min(played) < 4  # some ended early
    expected = [sum(4 if n <= turn else turn for n in played) for turn in range(1, max(played) + 1)]
    assert seen == [(n, 12) for n in expected]


def tiny_run(trainer, tiny_model_dir, personas_file, out, *flags):
    trainer.main(["--preset", "cpu", "--model", tiny_model_dir, "--simulator", "rules",
                  "--personas", personas_file, "--split", "test", "--max-turns", "1",
                  "--max-new-tokens", "6", "--max-context", "512", "--lora-r", "4",
                  "--lora-alpha", "8", "--iterations", "2", "--out", str(out), *flags])


def test_a_run_ends_with_its_summary_and_tools_plot_draws_runs_side_by_side(
        tiny_model_dir, personas_file, tmp_path, capsys, monkeypatch):
    tiny_run(ppo, tiny_model_dir, personas_file, tmp_path / "ppo", "--dialogues-per-iteration", "2",
             "--minibatch-size", "2")
    done = capsys.readouterr().out.splitlines()[-1]
    metrics = read_metrics(tmp_path / "ppo")
    minutes = sum(m["time_iteration"] for m in metrics) / 60
    # two iterations: the first one against the last one
    assert done == (f"done: {tmp_path / 'ppo'}: 2 iterations in {minutes:.1f} min; reward_mean "
                    f"{metrics[0]['reward_mean']:.3f} -> {metrics[1]['reward_mean']:.3f}, "
                    f"final_emotion_mean {metrics[0]['final_emotion_mean']:.1f} -> "
                    f"{metrics[1]['final_emotion_mean']:.1f} (first -> last iteration); "
                    f"adapter: {tmp_path / 'ppo'}/checkpoints/iter_000002/default")
    tiny_run(grpo, tiny_model_dir, personas_file, tmp_path / "grpo",
             "--personas-per-iteration", "1", "--group-size", "2", "--minibatch-size", "2")
    runs = [str(tmp_path / "ppo"), str(tmp_path / "grpo")]
    capsys.readouterr()

    def plot(*argv):
        """tools/plot.py's command line, in this process: (exit code, stdout, stderr)."""
        spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "tools", "plot.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        try:
            command(module.main)(runs + list(argv))
            code = 0
        except SystemExit as stop:
            code = stop.code
        return (code, *capsys.readouterr())
    # bad input: one line, exit code 2, nothing written
    for argv, words in ((["--out", str(tmp_path / "ppo" / "config.json")], "must be a new"),
                        (["--out", str(tmp_path / "no" / "c.png")], "its folder does not exist"),
                        (["--out", str(tmp_path / "c.png"), "--keys", "reward"], "--keys reward"),
                        (["--out", str(tmp_path / "c.png"), str(tmp_path)], "no metrics.jsonl")):
        code, _, err = plot(*argv)
        assert code == 2 and err.count("\n") == 1 and words in err, err
    # without matplotlib: one line that names how to get it
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)
        assert plot("--out", str(tmp_path / "c.png")) == (
            2, "", "error: tools/plot.py needs matplotlib: pip install matplotlib\n")
    assert not os.path.exists(tmp_path / "c.png")
    pytest.importorskip("matplotlib")
    code, out, err = plot("--out", str(tmp_path / "c.png"))
    assert code == 0, err[-2000:]
    # each run's summary, then the file
    lines = out.splitlines()
    assert lines[0].startswith("ppo: 2 iterations in ") and lines[1].startswith("grpo: 2 ")
    with open(tmp_path / "c.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # two runs of one name in two places (one benchmark's ppo-seed0 against another's): each drawn
    # and summarised, named by its path
    shutil.copytree(tmp_path / "ppo", tmp_path / "again" / "ppo")
    code, out, err = plot("--out", str(tmp_path / "d.png"), str(tmp_path / "again" / "ppo"))
    assert code == 0, err[-2000:]
    named = [line.split(": ")[0] for line in out.splitlines()[:3]]
    assert named == [str(tmp_path / "ppo"), str(tmp_path / "grpo"), str(tmp_path / "again" / "ppo")]
