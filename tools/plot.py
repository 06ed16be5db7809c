"""Runs' curves side by side, from their metrics.jsonl, and each run's summary.

    python tools/plot.py RUN [RUN ...] --out curves.png [--metrics reward_mean,kl_ref,...]

By default four panels: the reward (reward_mean, in a band of +- reward_std, the spread of the
iteration's dialogues), and beside it the figures that explain a move of it: clip_frac (the share
of tokens the clip held back), kl_ref (how far the policy has gone from its base) and cut_reply_rate
(replies cut at --max-new-tokens: a policy that learns to write long). final_emotion_mean is not
drawn: under --reward final it is reward_mean's curve x 100. --metrics picks any figures of
metrics.jsonl (docs/metrics.md); a figure NAME_mean is drawn in a band of +- NAME_std where the runs
log one. One line a run, in one colour in every panel, and one legend naming each run by its
script, its preset (custom: settings other than every preset's, cli.preset_changes) and its seed,
from its config.json. The x axis counts whole iterations; a panel of figures that are never
negative starts at 0, so that a move is seen against its size. Each run's summary (run.summary) is
printed.

It reads the runs and writes only --out: a new file, created here (one that exists is never
overwritten), in a folder that exists. What it reads is checked as the trainers check their input:
a missing folder, an empty metrics.jsonl (a run in its first iteration), a line that is not an
object, an iteration that is not an integer above the line before's, or a figure that is not a
number is one line, exit code 2; a torn last line (a run killed while it appended) is left out, as
its resume cuts it. matplotlib is optional for the project: without it this is one
line naming `pip install matplotlib`, exit code 2.
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
import grpo  # noqa: E402
import ppo  # noqa: E402
from cli import command, fail, parse_json, preset_changes, read_run, read_text  # noqa: E402
from run import summary, write_failure  # noqa: E402

METRICS = "reward_mean,clip_frac,kl_ref,cut_reply_rate"
FORMATS = (".png", ".pdf", ".svg")
TRAINERS = {"ppo.py": ppo, "grpo.py": grpo}  # a run's script -> its settings and presets
SUMMED = ("reward_mean", "final_emotion_mean", "time_iteration")  # what run.summary reads


def spread_of(metric):
    """The figure a metric is drawn in a band of: NAME_std for NAME_mean, else None."""
    return f"{metric[:-len('_mean')]}_std" if metric.endswith("_mean") else None


def read_rows(folder, metrics):
    """The rows of a run's metrics.jsonl, each checked for what the plot reads (a trainer writes
    an object a line, iterations counting up, each figure a number or null): else one line."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isdir(folder):
        fail(f"{folder}: no such folder")
    if not os.path.isfile(path):
        fail(f"{folder}: no metrics.jsonl (not a run folder)")
    text = read_text(path, fail)
    # a run killed while it appended leaves a torn last line, without its newline, which its resume
    # cuts: left out here too (every line a trainer writes ends in one)
    lines = [(i, parse_json(line, f"{path}: line {i + 1}", fail))
             for i, line in enumerate(text[:text.rfind("\n") + 1].splitlines()) if line.strip()]
    if not lines:
        fail(f"{path} is empty: the run is in its first iteration; plot it once one is logged")
    read = [*metrics, *filter(None, map(spread_of, metrics)), *SUMMED]
    before = 0
    for i, row in lines:
        where = f"{path}: line {i + 1}"
        if not isinstance(row, dict):
            fail(f"{where}: not a JSON object")
        iteration = row.get("iteration")
        if type(iteration) is not int or iteration <= before:
            fail(f"{where}: 'iteration' is {iteration!r}, not an integer above the line "
                 f"before's ({before})")
        before = iteration
        for key in read:
            if row.get(key) is not None and type(row[key]) not in (int, float):
                fail(f"{where}: '{key}' is {type(row[key]).__name__}, not a number")
    return [row for _, row in lines]


def label(folder):
    """A run in the legend: its script, its preset (the one it was started with, else any whose
    settings its own equal, else custom) and its seed, from its config.json; its folder's name
    where it has none."""
    config = read_run(folder) or {}
    script = config.get("script")
    trainer = TRAINERS.get(script) if isinstance(script, str) else None
    if trainer is None:
        return os.path.basename(folder)
    names = [config.get("preset"), *trainer.PRESETS]
    preset = next((name for name in names if isinstance(name, str) and name in trainer.PRESETS
                   and not preset_changes(trainer.Settings, trainer.PRESETS,
                                          {**config, "preset": name})), "custom")
    return f"{script[:-3]} {preset} seed {config.get('seed')}"


def draw(runs, metrics):
    """A matplotlib Figure (no pyplot state): a panel a metric, a line a run (runs: {label: rows}),
    one colour a run throughout, a band of +- NAME_std around NAME_mean, one legend below."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    columns = math.ceil(math.sqrt(len(metrics)))
    lines = math.ceil(len(metrics) / columns)
    figure = Figure(figsize=(4.5 * columns, 3.2 * lines + 0.5), layout="constrained")
    axes = list(figure.subplots(lines, columns, squeeze=False).flat)
    for ax, metric in zip(axes, metrics):
        spread = spread_of(metric)
        banded = False
        drawn = []  # every value the panel shows, the bands' edges too
        for colour, (name, rows) in enumerate(runs.items()):
            # an iteration that did not measure it (null, or the other trainer's figure) is left out
            points = [row for row in rows if row.get(metric) is not None]
            x = [row["iteration"] for row in points]
            y = [row[metric] for row in points]
            ax.plot(x, y, marker=".", color=f"C{colour}", label=name)
            drawn += y
            if spread and points and all(row.get(spread) is not None for row in points):
                low = [row[metric] - row[spread] for row in points]
                high = [row[metric] + row[spread] for row in points]
                if len(points) > 1:
                    ax.fill_between(x, low, high, color=f"C{colour}", alpha=0.2, linewidth=0)
                else:  # a band of one iteration has no width: its bar
                    ax.vlines(x, low, high, color=f"C{colour}", alpha=0.4, linewidth=4)
                drawn += low
                banded = True
        ax.set_title(f"{metric} ± {spread}" if banded else metric)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if drawn and min(drawn) >= 0:
            ax.set_ylim(bottom=0)
    for ax in axes[len(metrics):]:
        ax.axis("off")
    shown = {name: line for name, line in zip(runs, axes[0].get_lines())}
    figure.legend(shown.values(), shown.keys(), loc="outside lower center",
                  ncols=min(3, len(shown)))
    return figure


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/plot.py", description=__doc__.split("\n")[0])
    parser.error = fail  # one line, exit code 2
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders (their metrics.jsonl)")
    parser.add_argument("--out", required=True, help=f"a new {' | '.join(FORMATS)} file")
    parser.add_argument("--metrics", default=METRICS,
                        help=f"comma-separated figures of metrics.jsonl (default: {METRICS})")
    args = parser.parse_intermixed_args(argv)  # RUN ... before or after the flags
    metrics = args.metrics.split(",")
    for metric in metrics:
        if not metric or metrics.count(metric) > 1:
            fail(f"--metrics {args.metrics}: give each figure once, by name (docs/metrics.md)")
    if os.path.lexists(args.out) or not args.out.endswith(FORMATS):
        fail(f"--out {args.out}: must be a new {' | '.join(FORMATS)} file (nothing is overwritten)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        fail(f"--out {args.out}: its folder does not exist")
    # each run labelled by its settings; two of one label (one preset and seed in two benchmarks)
    # also by their folders' names, or their paths where those are the same
    folders = [os.path.normpath(folder) for folder in args.runs]
    labels = [label(folder) for folder in folders]
    names = [os.path.basename(folder) for folder in folders]
    if len(set(names)) < len(set(folders)):
        names = folders
    if len(set(labels)) < len(set(folders)):
        labels = [f"{said} ({name})" for said, name in zip(labels, names)]
    runs = {said: read_rows(folder, metrics) for said, folder in zip(labels, folders)}
    for metric in metrics:
        if not any(row.get(metric) is not None for rows in runs.values() for row in rows):
            fail(f"--metrics {metric}: no run logged it (docs/metrics.md lists the figures)")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("tools/plot.py needs matplotlib: pip install matplotlib")

    for said, rows in runs.items():
        print(f"{said}: {summary(rows)}")
    figure = draw(runs, metrics)
    made = False
    try:
        with open(args.out, "xb") as f:  # created here, or not at all: nothing is overwritten
            made = True
            figure.savefig(f, format=os.path.splitext(args.out)[1][1:])
    except OSError as e:
        if made:  # what this command wrote of it (a full disk)
            os.remove(args.out)
        fail(f"--out {args.out}: cannot be written ({write_failure(e, args.out)})")
    print(f"-> {args.out}")


if __name__ == "__main__":
    command(main)()
