"""Runs' curves side by side, from their metrics.jsonl, and each run's summary.

    python tools/plot.py RUN [RUN ...] --out curves.png [--keys reward_mean,kl_ref,...]

One panel a figure of metrics.jsonl (docs/metrics.md) by iteration, one line a run, named by its
folder; each run's summary (run.summary: first and last iterations' reward and emotion, minutes) is
printed. It reads the runs and writes only --out, a new file. matplotlib is optional for the
project: without it this is one line naming `pip install matplotlib`, exit code 2.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
from cli import command, fail, read_json_lines  # noqa: E402
from run import summary  # noqa: E402

KEYS = "reward_mean,final_emotion_mean,kl_ref,clip_frac,entropy,time_iteration"
FORMATS = (".png", ".pdf", ".svg")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="tools/plot.py", description=__doc__.split("\n")[0])
    parser.error = fail  # one line, exit code 2
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folders (their metrics.jsonl)")
    parser.add_argument("--out", required=True, help=f"a new {' | '.join(FORMATS)} file")
    parser.add_argument("--keys", default=KEYS, help=f"comma-separated figures (default: {KEYS})")
    args = parser.parse_intermixed_args(argv)  # RUN ... before or after the flags
    # each run named by its folder, or by its path where two folders share a name (the same seed of
    # two benchmarks)
    folders = [os.path.normpath(folder) for folder in args.runs]
    names = [os.path.basename(folder) for folder in folders]
    if len(set(names)) < len(set(folders)):
        names = folders
    runs = {}
    for name, folder in zip(names, folders):
        path = os.path.join(folder, "metrics.jsonl")
        if not os.path.isfile(path):
            fail(f"{folder}: no metrics.jsonl (not a run folder, or no iteration logged yet)")
        runs[name] = [row for _, row in read_json_lines(path, fail)]
    keys = args.keys.split(",")
    for key in keys:
        if not any(key in row for rows in runs.values() for row in rows):
            fail(f"--keys {key}: no run logged it (docs/metrics.md lists the figures)")
    if os.path.exists(args.out) or not args.out.endswith(FORMATS):
        fail(f"--out {args.out}: must be a new {' | '.join(FORMATS)} file (nothing is overwritten)")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        fail(f"--out {args.out}: its folder does not exist")
    try:
        import matplotlib
    except ImportError:
        fail("tools/plot.py needs matplotlib: pip install matplotlib")
    matplotlib.use("Agg")  # a file, no window
    import matplotlib.pyplot as plt

    for name, rows in runs.items():
        print(f"{name}: {summary(rows)}")
    columns = min(3, len(keys))
    lines = -(-len(keys) // columns)  # rows of panels
    figure, axes = plt.subplots(lines, columns, figsize=(4.5 * columns, 3.2 * lines), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for name, rows in runs.items():
            # an iteration that did not measure the figure (None, or a key of the other trainer's)
            # is left out
            points = [(row["iteration"], row[key]) for row in rows if row.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker=".", label=name)
        ax.set_title(key)
        ax.set_xlabel("iteration")
    for ax in axes.flat[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(args.out)
    print(f"-> {args.out}")


if __name__ == "__main__":
    command(main)()
