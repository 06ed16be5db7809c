"""The statistics of evaluate.py: one bootstrap interval for every figure, and the correlations.

Every interval that evaluate.py writes (a model's score, an adapter's paired difference from the
base, each statistic of the agreement check, Kendall's tau between rankings) comes from
with_interval: the statistic of all groups' rows, and its 95% percentile bootstrap interval when
whole groups are resampled. The correlations are written out in numpy, ties handled, so that each
can be held against a hand computation (tests/test_stats.py).

Pure numpy: it imports no other file of the project (tests/test_layout.py), and reads or writes
nothing.
"""
import numpy as np


# ----------------------------------------------------------------------------------------------
# The one interval
# ----------------------------------------------------------------------------------------------
def with_interval(groups, statistic=np.mean, n_boot=2000, seed=0):
    """{value, low, high}: statistic(rows) of all groups' rows, and its 95% percentile bootstrap
    interval when whole groups (a list of arrays, or an array's first axis) are resampled with
    replacement. A group is what is independent: a persona's score, or a dialogue's replies, which
    share a persona and a history. Resamples where the statistic is undefined (NaN) are dropped."""
    # (n_boot, groups)
    idx = np.random.default_rng(seed).integers(len(groups), size=(n_boot, len(groups)))
    values = np.array([statistic(np.concatenate([groups[k] for k in row])) for row in idx])
    values = values[np.isfinite(values)]
    low = high = np.nan  # no resample defined: no interval
    if len(values):
        # the quantiles (1 -+ level) / 2 at level 0.95, as computed (2.500000000000002, not 2.5):
        # written out as 2.5 and 97.5, an interval's last digits would move
        low, high = np.percentile(values, [50 * (1 - 0.95), 50 * (1 + 0.95)])
    return {"value": statistic(np.concatenate(groups)), "low": low, "high": high}


def mean_with_interval(values, n_boot=2000, seed=0):
    """The mean of one number a persona (values, in the personas' order), with_interval over
    personas: each persona a group of its one row."""
    return with_interval(np.asarray(values, dtype=float)[:, None], np.mean, n_boot, seed)


def paired_difference(treated, base, n_boot=2000, seed=0):
    """Mean of treated - base over the same personas, with a bootstrap interval that resamples
    personas (pairs), not the two lists separately: persona difficulty, which moves both scores
    alike, then cancels out, and the interval is much tighter than from two independent ones."""
    diff = np.subtract(treated, base, dtype=float)
    return {**mean_with_interval(diff, n_boot, seed), "n": len(diff)}


# ----------------------------------------------------------------------------------------------
# Correlations, ties handled (the agreement check: a user's changes against SAGE's recorded ones)
# ----------------------------------------------------------------------------------------------
def average_ranks(x):
    """1-based ranks, ties sharing the mean of the ranks they span:
    [10, 20, 20, 30] -> [1, 2.5, 2.5, 4]."""
    _, where, counts = np.unique(x, return_inverse=True, return_counts=True)
    # a tie group's last rank, less half its width
    return (np.cumsum(counts) - (counts - 1) / 2)[where]


def pearson(x, y):
    """Pearson correlation; NaN when either side is constant (no correlation is defined)."""
    dx, dy = (np.asarray(v, dtype=float) - np.mean(v) for v in (x, y))
    denominator = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    if denominator > 0:
        return (dx * dy).sum() / denominator
    return np.nan


def spearman(x, y):
    """Spearman's rho: the Pearson correlation of the average ranks (ties handled)."""
    return pearson(average_ranks(x), average_ranks(y))


def kendall_tau_b(x, y):
    """Kendall's tau-b of two arrays: (concordant - discordant) / sqrt(pairs untied in x * pairs
    untied in y) over the n(n-1)/2 pairs; NaN when either side is constant."""
    i, j = np.triu_indices(len(x), 1)
    sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])  # (pairs,) each
    denominator = np.sqrt((sx != 0).sum() * (sy != 0).sum())
    if denominator > 0:
        return (sx * sy).sum() / denominator
    return np.nan


# What is compared, each a function of (replies, 2) rows of (recorded, simulated) changes: r.T is
# the recorded column, then the simulated one.
STATISTICS = {"spearman": lambda r: spearman(*r.T),
              "pearson": lambda r: pearson(*r.T),
              "direction_agreement": lambda r: np.mean(np.equal(*np.sign(r.T))),
              "mae": lambda r: np.mean(np.abs(np.subtract(*r.T)))}


def kendall_with_interval(finals, n_boot=2000, seed=0):
    """Kendall's tau-b between the files' (models') mean recorded and simulated final emotions over
    the same scenarios (finals: (files, scenarios, 2)), with an interval from resampling scenarios,
    one draw for every file (paired: a scenario's difficulty moves every model alike). None for
    fewer than 2 files or no scenario."""
    if len(finals) < 2 or finals.shape[1] == 0:
        return None
    # rows (draws, files, 2) -> files' means
    return with_interval(finals.transpose(1, 0, 2)[:, None],
                         lambda rows: kendall_tau_b(*rows.mean(0).T), n_boot, seed)


def shown(x, digits=2, sign=""):
    """A statistic and its interval in results.md (the benchmark's and the agreement check's)."""
    if x is None:
        return "- (needs 2 files or more that share scenarios)"
    if not np.isfinite(x["value"]):
        return "undefined (one side never varies)"
    spec = f"{sign}.{digits}f"
    return f"{x['value']:{spec}} [{x['low']:{spec}}, {x['high']:{spec}}]"
