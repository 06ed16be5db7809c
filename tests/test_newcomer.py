"""What a newcomer sees of a run and shows (issues 54 and 66): the rollout's progress bar counts the
work done (agent turns, a dialogue that ended counting all of its own); a run ends with its summary
and where its adapter is, and its folder keeps that line (and a stop's advice) in summary.txt; each
saved adapter holds the project's model card; tools/plot.py draws runs side by side (the reward in
its band, each run by script, preset and seed) or says in one line what is wrong; a URL user is
reached before anything loads; a mistyped flag names the nearest one."""
import importlib.util
import json
import os
import re
import shutil
import sys

import pytest
from safetensors.torch import load_file
from tqdm import tqdm

import cli
import evaluate
import grpo
import policy
import ppo
import rollout
from conftest import ROOT, read_metrics, reply
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


def plot_command(capsys, *argv):
    """tools/plot.py's command line, in this process: (exit code, stdout, stderr, the figure drawn)."""
    spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "tools", "plot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    drawn = []
    module.draw = lambda *a, draw=module.draw: drawn.append(draw(*a)) or drawn[-1]
    try:
        command(module.main)(list(argv))
        code = 0
    except SystemExit as stop:
        code = stop.code
    return (code, *capsys.readouterr(), drawn[-1] if drawn else None)


# A path of this machine in a text: a slash after a space, a quote, a parenthesis or a line's start
ABSOLUTE = re.compile(r"(?:^|[\s\"'`(=])/[\w.-]+/", re.M)


def test_a_run_ends_with_its_summary_kept_in_its_folder_and_a_card_in_each_adapter(
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
    # the folder keeps the line, with the time it was written
    kept = (tmp_path / "ppo" / "summary.txt").read_text().splitlines()
    assert len(kept) == 1 and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", kept[0][:19])
    assert kept[0][20:] == done
    # each adapter's card is the project's: what it is, from what, its figures, how to load it, and no
    # path of this machine; adapter_config.json names the base by its name, not its path
    saved = tmp_path / "ppo" / "checkpoints" / "iter_000002"
    base = os.path.basename(tiny_model_dir)
    for adapter in ("default", "critic"):
        card = (saved / adapter / "README.md").read_text()
        assert "[More Information Needed]" not in card and not ABSOLUTE.search(card), card
        assert str(tmp_path) not in card and os.path.expanduser("~") + "/" not in card
        assert f"A LoRA adapter on `{base}` (a local folder), trained by `ppo.py`" in card
        assert "- settings: `--preset cpu`, seed 0; different from the preset: `--model " + base in card
        assert "- iteration 2 of 2" in card and f"reward_mean {metrics[1]['reward_mean']:.4g}" in card
        assert f'PeftModel.from_pretrained(base, "ppo/checkpoints/iter_000002/{adapter}")' in card
        assert "base_model:" not in card  # a local folder is no hub id
        config = json.loads((saved / adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == base
    assert "`value_head` in ../state.pt" in (saved / "critic" / "README.md").read_text()
    # plain peft loads it as the card says, the saved weights and all
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                       str(saved / "default"))
    weights = load_file(str(saved / "default" / "adapter_model.safetensors"))
    state = loaded.state_dict()
    assert weights and all(torch_equal(state[name.replace(".weight", ".default.weight")], w)
                           for name, w in weights.items())

    # tools/plot.py on this run and a GRPO one: a PNG and each run's summary, named by its settings
    tiny_run(grpo, tiny_model_dir, personas_file, tmp_path / "grpo",
             "--personas-per-iteration", "1", "--group-size", "2", "--minibatch-size", "2")
    runs = [str(tmp_path / "ppo"), str(tmp_path / "grpo")]
    capsys.readouterr()
    # without matplotlib: one line that names how to get it
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "matplotlib", None)
        assert plot_command(capsys, *runs, "--out", str(tmp_path / "c.png")) == (
            2, "", "error: tools/plot.py needs matplotlib: pip install matplotlib\n", None)
    assert not os.path.exists(tmp_path / "c.png")
    pytest.importorskip("matplotlib")
    code, out, err, _ = plot_command(capsys, *runs, "--out", str(tmp_path / "c.png"))
    assert code == 0, err[-2000:]
    lines = out.splitlines()  # each run's summary, then the file
    assert lines[0].startswith("ppo custom seed 0: 2 iterations in ")
    assert lines[1].startswith("grpo custom seed 0: 2 iterations in ")
    with open(tmp_path / "c.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # two runs of one label in two places (one benchmark's ppo-seed0 against another's): each drawn
    # and summarised, its label followed by its path
    shutil.copytree(tmp_path / "ppo", tmp_path / "again" / "ppo")
    code, out, err, _ = plot_command(capsys, *runs, "--out", str(tmp_path / "d.png"),
                                     str(tmp_path / "again" / "ppo"))
    assert code == 0, err[-2000:]
    named = [line.split(": ")[0] for line in out.splitlines()[:3]]
    assert named == [f"ppo custom seed 0 ({tmp_path / 'ppo'})", f"grpo custom seed 0 ({tmp_path / 'grpo'})",
                     f"ppo custom seed 0 ({tmp_path / 'again' / 'ppo'})"]


def torch_equal(a, b):
    return a.shape == b.shape and bool((a == b).all())


def test_a_saved_adapter_names_its_base_by_its_public_name(tmp_path):
    assert policy.public_name("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert policy.public_name("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"  # a hub id as given
    folder = tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct" / "snapshots" / "abc123"
    folder.mkdir(parents=True)
    assert policy.public_name(str(folder)) == "Qwen/Qwen2.5-7B-Instruct"  # the hub's cache
    (tmp_path / "my-model").mkdir()
    assert policy.public_name(str(tmp_path / "my-model") + "/") == "my-model"  # a local folder


@pytest.mark.smollm2
def test_the_card_of_an_adapter_on_the_embedded_model_names_the_hub_model(tmp_path):
    """A run of `--preset cpu` as it stands: the card's base is the hub's SmolLM2, said to be the
    embedded copy of it, with nothing off the preset and no path of this machine."""
    import run

    args = cli.parse_settings(ppo.Settings, ["--preset", "cpu", "--out", str(tmp_path / "run")],
                              presets=ppo.PRESETS, prog="ppo.py")
    the_run = run.Run(args, "ppo.py", adapters=["default"])
    try:
        the_run.model, _ = policy.load_policy("smollm2", device="cpu", lora_r=2)
        card = the_run.model_card("default", 3, rows_of([0.3, 0.31, 0.33], [0.1, 0.1, 0.1]))
    finally:
        the_run.accelerator.end_training()
        cli.release()
    hub = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.startswith(f"---\nbase_model: {hub}\nlibrary_name: peft\n")
    assert f"Trained on `--model smollm2`, the project's embedded copy of `{hub}`" in card
    assert "- settings: `--preset cpu`, seed 0; different from the preset: none" in card
    assert f'base = AutoModelForCausalLM.from_pretrained("{hub}")\n' in card
    assert "- iteration 3 of 3" in card and "reward_mean 0.33, reward_std 0.1" in card
    assert not ABSOLUTE.search(card) and str(tmp_path) not in card


def run_folder(folder, script, argv, rows):
    """A run's folder as the trainer writes it, made small: config.json from the settings the command
    line gives (cli.parse_settings, cli.public_config) and metrics.jsonl's rows."""
    trainer = {"ppo.py": ppo, "grpo.py": grpo}[script]
    args = cli.parse_settings(trainer.Settings, argv, presets=trainer.PRESETS, prog=script)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cli.public_config(args, script)))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(folder)


def rows_of(rewards, spreads):
    """metrics.jsonl rows with these rewards and spreads (final emotion = 100 x reward, as under
    --reward final) and figures that differ from each other."""
    return [{"iteration": i + 1, "reward_mean": r, "reward_std": s, "final_emotion_mean": 100 * r,
             "clip_frac": 0.1 + 0.02 * i * i, "kl_ref": 0.003 * i, "cut_reply_rate": 0.5 - 0.01 * i * i * i,
             "time_iteration": 30.0} for i, (r, s) in enumerate(zip(rewards, spreads))]


def test_plot_bands_the_reward_and_names_each_run_by_script_preset_and_seed(tmp_path, capsys):
    """A cpu and a cpu-learn run (folders made small here): the figure read back has one legend
    naming script, preset and seed, the reward's panel a band of reward_mean +- reward_std for each
    run, whole iterations on every x axis, and no two panels drawing the same series."""
    pytest.importorskip("matplotlib")
    rows = [rows_of([0.3, 0.32, 0.31], [0.05, 0.04, 0.06]), rows_of([0.29, 0.33, 0.37], [0.02, 0.03, 0.01])]
    cpu = run_folder(tmp_path / "a", "ppo.py", ["--preset", "cpu"], rows[0])
    learn = run_folder(tmp_path / "b", "grpo.py", ["--preset", "cpu-learn", "--seed", "1"], rows[1])
    code, out, err, figure = plot_command(capsys, cpu, learn, "--out", str(tmp_path / "c.png"))
    assert code == 0, err[-2000:]
    labels = ["ppo cpu seed 0", "grpo cpu-learn seed 1"]
    assert [line.split(":")[0] for line in out.splitlines()[:2]] == labels
    assert len(figure.legends) == 1 and all(ax.get_legend() is None for ax in figure.axes)
    assert [t.get_text() for t in figure.legends[0].get_texts()] == labels
    panels = [ax for ax in figure.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["reward_mean ± reward_std", "clip_frac", "kl_ref",
                                                 "cut_reply_rate"]
    reward = panels[0]
    for run_rows, line, band in zip(rows, reward.get_lines(), reward.collections):
        assert list(line.get_ydata()) == [row["reward_mean"] for row in run_rows]
        assert band.get_facecolor()[0][:3].tolist() == pytest.approx(list(matplotlib_rgb(line.get_color())))
        edges = {(round(x, 9), round(y, 9)) for x, y in band.get_paths()[0].vertices}
        for row in run_rows:
            for y in (row["reward_mean"] - row["reward_std"], row["reward_mean"] + row["reward_std"]):
                assert (row["iteration"], round(y, 9)) in edges
    assert len(reward.collections) == 2 and not any(ax.collections for ax in panels[1:])
    for ax in panels:
        assert all(float(tick).is_integer() for tick in ax.get_xticks())
    # no panel is another's curve scaled (final_emotion_mean is reward_mean x 100 here)
    series = [ax.get_lines()[0].get_ydata() for ax in panels]
    for i, a in enumerate(series):
        for b in series[i + 1:]:
            assert len({round(y / x, 9) for x, y in zip(a, b) if x}) > 1
    # a run killed while it appended: its torn last line (no newline) is left out, as its resume cuts it
    with open(os.path.join(learn, "metrics.jsonl"), "a") as f:
        f.write('{"iteration": 4, "reward_me')
    code, out, err, figure = plot_command(capsys, cpu, learn, "--out", str(tmp_path / "torn.png"))
    assert code == 0 and out.splitlines()[1].startswith("grpo cpu-learn seed 1: 3 iterations"), err
    # settings other than every preset's: custom; a cpu-learn run made longer is still cpu-learn
    other = run_folder(tmp_path / "c", "grpo.py", ["--preset", "cpu", "--lr", "1e-3"], rows[0])
    longer = run_folder(tmp_path / "d", "ppo.py", ["--preset", "cpu-learn", "--iterations", "40"], rows[1])
    code, out, err, figure = plot_command(capsys, other, longer, "--out", str(tmp_path / "d.png"),
                                          "--metrics", "final_emotion_mean")
    assert code == 0, err[-2000:]
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["grpo custom seed 0",
                                                                     "ppo cpu-learn seed 0"]
    assert [ax.get_title() for ax in figure.axes if ax.get_title()] == ["final_emotion_mean"]
    # a run of one iteration: its band has no width, so it is a bar from mean - std to mean + std
    single = run_folder(tmp_path / "e", "ppo.py", ["--preset", "cpu"], rows_of([0.3], [0.1]))
    code, out, err, figure = plot_command(capsys, single, "--out", str(tmp_path / "e.png"))
    assert code == 0, err[-2000:]
    bar = figure.axes[0].collections[0].get_segments()[0]
    assert bar.tolist() == [[1, pytest.approx(0.2)], [1, pytest.approx(0.4)]]


def matplotlib_rgb(colour):
    from matplotlib.colors import to_rgb

    return to_rgb(colour)


@pytest.mark.parametrize("case", ["no iteration", "a list", "strings", "iteration a string", "empty",
                                  "no folder", "out exists", "out's folder missing", "a figure twice"])
def test_plot_says_in_one_line_what_it_cannot_read_or_write(case, tmp_path, capsys):
    good = {"iteration": 1, "reward_mean": 0.3, "reward_std": 0.1}
    lines = {"no iteration": [{"reward_mean": 0.3}], "a list": [good, [1, 2]],
             "strings": [good, {**good, "iteration": 2, "reward_mean": "0.3"}],
             "iteration a string": [{**good, "iteration": "1"}], "empty": []}.get(case, [good])
    run = run_folder(tmp_path / "run", "ppo.py", ["--preset", "cpu"], lines)
    out = tmp_path / "c.png"
    argv = [run, "--out", str(out)]
    if case == "no folder":
        argv[0] = str(tmp_path / "gone")
    if case == "out exists":
        out.write_bytes(b"mine")
    if case == "out's folder missing":
        argv[2] = str(tmp_path / "missing" / "c.png")
    if case == "a figure twice":
        argv += ["--metrics", "reward_mean,reward_mean"]
    said = {"no iteration": "line 1: 'iteration' is None", "a list": "line 2: not a JSON object",
            "strings": "line 2: 'reward_mean' is str, not a number",
            "iteration a string": "line 1: 'iteration' is '1'",
            "empty": "is empty: the run is in its first iteration", "no folder": "gone: no such folder",
            "out exists": "must be a new", "out's folder missing": "its folder does not exist",
            "a figure twice": "give each figure once"}[case]
    code, stdout, err, _ = plot_command(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and said in err, err
    assert "Traceback" not in err and stdout == ""
    assert (out.read_bytes() == b"mine") if case == "out exists" else not out.exists()


# ----------------------------------------------------------------------------------------------
# A URL user reached before any model loads; a mistyped flag names the nearest one
# ----------------------------------------------------------------------------------------------
def nothing_loads(monkeypatch):
    def loaded(*args, **kwargs):
        raise AssertionError("a model or a tokenizer loaded")
    for module in (ppo, grpo, evaluate):
        for name in ("check_openings_fit", "check_model", "load_policy", "load_models"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, loaded)


@pytest.mark.parametrize("script", ["ppo.py", "grpo.py", "evaluate.py", "evaluate.py --agreement"])
def test_a_url_user_that_cannot_be_reached_is_one_line_before_anything_loads(script, tmp_path, capsys,
                                                                             monkeypatch):
    nothing_loads(monkeypatch)
    main = {"ppo.py": ppo.main, "grpo.py": grpo.main}.get(script, evaluate.main)
    out = tmp_path / "run"
    argv = ["--simulator", "http://127.0.0.1:9/v1", "--api-retries", "0", "--out", str(out)]
    if script == "evaluate.py --agreement":
        data = os.path.join(ROOT, "tests", "data")
        argv += ["--agreement", os.path.join(data, "sage_results", "warm_result.jsonl"),
                 "--personas", os.path.join(data, "sage_sample.jsonl")]
    else:
        argv += ["--preset", "cpu"] if script != "evaluate.py" else ["--model", "smollm2"]
    with pytest.raises(SystemExit) as stop:
        command(main)(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: --simulator: simulator server http://127.0.0.1:9/v1/chat/completions: "
                          "connection failed (") and err.endswith("no model loaded, nothing written\n"), err
    assert not out.exists()


def test_a_url_user_that_refuses_the_key_is_one_line_and_no_run_folder(server, tmp_path, capsys, monkeypatch):
    nothing_loads(monkeypatch)
    asked = []
    srv = server(lambda handler, n, body: asked.append(body) or reply(handler, 401, b"{}"))
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        command(ppo.main)(["--preset", "cpu", "--simulator", srv.url, "--out", str(out)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert "HTTP 401 (is the key in $OPENAI_API_KEY right?) after 5 tries" not in err  # a client error: once
    assert "HTTP 401 (is the key in $OPENAI_API_KEY right?) after 1 tries" in err
    assert not out.exists() and len(asked) == 1 and asked[0]["max_tokens"] == 1  # one short request


def test_a_mistyped_flag_names_the_nearest_one(capsys):
    with pytest.raises(SystemExit) as stop:
        command(ppo.main)(["--preset", "cpu", "--lr-critic", "1e-5", "--warmup-step", "3", "--zzz"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err == (
        "error: unrecognized arguments: --lr-critic 1e-5 --warmup-step 3 --zzz; --lr-critic: did you mean "
        "--critic-lr?; --warmup-step: did you mean --warmup-steps?\n")
