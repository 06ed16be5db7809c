"""The statistics of evaluate.py (stats.py), each against a hand computation: the one bootstrap
interval (groups resampled whole, seeded), the paired difference, average ranks, Pearson, Spearman,
Kendall's tau-b and its paired interval, the agreement check's per-reply statistics.

    OMP_NUM_THREADS=1 python -m pytest tests/test_stats.py -q
"""
import numpy as np
import pytest

from stats import (STATISTICS, average_ranks, kendall_tau_b, kendall_with_interval,
                   mean_with_interval, paired_difference, pearson, spearman, with_interval)


# ----------------------------------------------------------------------------------------------
# The bootstrap interval and the paired difference
# ----------------------------------------------------------------------------------------------
def interval(values, n_boot=2000, seed=0):
    x = with_interval(list(np.asarray(values, dtype=float)[:, None]), np.mean, n_boot, seed)
    return x["low"], x["high"]


def test_constant_scores_give_a_zero_width_interval():
    assert interval([55.0] * 7, n_boot=500, seed=3) == (55.0, 55.0)


def test_bootstrap_interval_against_hand_computation():
    # [0, 100]: resampled means are 0, 50, 100 with probabilities 1/4, 1/2, 1/4, so the 2.5% and
    # 97.5% quantiles are the extremes.
    assert interval([0, 100]) == (0.0, 100.0)
    assert mean_with_interval([0, 100]) == {"value": 50.0, "low": 0.0, "high": 100.0}
    # [0, 0, 0, 100]: P(mean = 0) = (3/4)^4 = 0.32 > 0.025; P(mean >= 75) = 0.051 > 0.025 but
    # P(mean = 100) = 0.004 < 0.025, so the upper end is 75.
    assert interval([0, 0, 0, 100]) == (0.0, 75.0)


def test_bootstrap_interval_is_about_the_normal_one_and_seeded():
    values = np.arange(1, 41, dtype=float)  # mean 20.5
    low, high = interval(values, n_boot=4000, seed=1)
    half = 1.96 * values.std() / np.sqrt(len(values))  # 3.58
    assert low < 20.5 < high
    assert abs((high - low) / 2 - half) < 0.15 * half
    assert interval(values, n_boot=500, seed=7) == interval(values, n_boot=500, seed=7)
    assert interval(values, n_boot=500, seed=7) != interval(values, n_boot=500, seed=8)


def test_the_interval_resamples_groups_not_rows():
    # dialogue A: three replies with error 0; dialogue B: one reply with error 4. Resampling the two
    # dialogues gives a pooled MAE of 0 (A, A), 1 (A, B) or 4 (B, B; probability 1/4), so the 97.5%
    # quantile is 4. Resampling the 4 replies would give 4 only with probability (1/4)^4 < 2.5%.
    groups = [np.array([[1, 1], [2, 2], [3, 3]]), np.array([[0, 4]])]
    mae = STATISTICS["mae"]
    assert with_interval(groups, mae, n_boot=2000, seed=0) == {"value": 1.0, "low": 0.0, "high": 4.0}
    assert with_interval([groups[1], groups[1]], mae) == {"value": 4.0, "low": 4.0, "high": 4.0}


def test_paired_difference_cancels_persona_difficulty():
    base = [10, 50, 90, 30]
    treated = [b + 5 for b in base]
    # every persona moved by exactly +5: a paired interval has no width, while two separate
    # intervals of the spread-out scores would overlap widely
    assert paired_difference(treated, base, n_boot=1000) == {"value": 5.0, "low": 5.0, "high": 5.0, "n": 4}
    worse = paired_difference([b - d for b, d in zip(base, [1, 2, 3, 4])], base, n_boot=1000)
    assert worse["value"] == -2.5 and worse["low"] < -2.5 < worse["high"] <= -1.0
    with pytest.raises(ValueError):
        paired_difference([1, 2], [1, 2, 3])


# ----------------------------------------------------------------------------------------------
# Ranks and correlations
# ----------------------------------------------------------------------------------------------
def test_average_ranks_share_ties():
    assert average_ranks([10, 20, 20, 30]).tolist() == [1, 2.5, 2.5, 4]
    assert average_ranks([3, 1, 3, 3]).tolist() == [3, 1, 3, 3]


def test_pearson_spearman_kendall_by_hand():
    x, y = [1, 2, 3, 4], [2, 4, 5, 4]
    # deviations (-1.5, -0.5, 0.5, 1.5) and (-1.75, 0.25, 1.25, 0.25): 3.5 / sqrt(5 * 4.75)
    assert pearson(x, y) == pytest.approx(3.5 / np.sqrt(5 * 4.75), abs=1e-12)
    # ranks of y: (1, 2.5, 4, 2.5), deviations (-1.5, 0, 1.5, 0): 3 / sqrt(5 * 4.5)
    assert spearman(x, y) == pytest.approx(3 / np.sqrt(5 * 4.5), abs=1e-12)
    # pairs of (1,2,3,4) vs (1,3,2,2): 3 concordant, 2 discordant, 1 tied in y: 1 / sqrt(6 * 5)
    tau = kendall_tau_b(np.array([1, 2, 3, 4]), np.array([1, 3, 2, 2]))
    assert tau == pytest.approx(1 / np.sqrt(30), abs=1e-12)
    assert kendall_tau_b(np.array([1, 2, 3]), np.array([3, 2, 1])) == -1.0
    assert np.isnan(pearson([1, 2, 3], [5, 5, 5]))
    assert np.isnan(kendall_tau_b(np.array([1, 1]), np.array([1, 2])))
    rows = np.array([[3, 1], [0, 0], [-2, 2], [1, 0]])
    assert STATISTICS["direction_agreement"](rows) == 0.5
    assert STATISTICS["mae"](rows[:3]) == 2.0


def test_kendall_interval_draws_the_same_scenarios_for_every_file():
    # (recorded, simulated) final per scenario s1, s2: file A (10, 20), (90, 80); file B (15, 15),
    # (95, 75). On each scenario B is above A in the record and below it in the simulation, so every
    # paired resample gives tau -1. Resampling each file on its own would often give +1 (A's s2 twice
    # against B's s1 twice: 90 > 15 and 80 > 15), and the interval would reach +1.
    finals = np.array([[[10, 20], [90, 80]], [[15, 15], [95, 75]]], dtype=float)  # (files, scenarios, 2)
    tau = kendall_with_interval(finals, n_boot=500)
    assert (tau["value"], tau["low"], tau["high"]) == (-1.0, -1.0, -1.0)
