"""Same seed, same numbers, on every path (issue 25): a run whose first command converts the embedded
model, the old log-probs under dropout, merged sampling on adapters it cannot fold, --drop-zero-spread
with a flat group beside a non-flat one, --load-in-4bit without bitsandbytes, and --static-cache's
stable shapes and buffers.

    OMP_NUM_THREADS=1 python -m pytest tests/test_exactness.py -q
"""
import random

import numpy as np
import torch

import ppo
import rollout
import simulator
from conftest import read_metrics

# What differs between two runs of the same computation: the clock and the memory it took.
UNTIMED = ("time_", "_seconds", "_per_s", "peak_memory_gb")


def rng_states():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def same_rng(a, b):
    return (torch.equal(a[0], b[0]) and a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1])
            and a[1][2:] == b[1][2:] and a[2] == b[2])


def timeless(row):
    return {k: v for k, v in row.items() if not any(part in k for part in UNTIMED)}


# ----------------------------------------------------------------------------------------------
# 1. The first run on a machine: converting the embedded model must not draw from the seeded streams
# ----------------------------------------------------------------------------------------------
def test_loading_with_a_cold_cache_leaves_every_random_stream_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))  # empty: load_model converts the GGUF
    rollout.set_seed(3)
    before = rng_states()
    simulator.load_model("smollm2")
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").iterdir())  # it did convert
    assert same_rng(before, rng_states())
    simulator.load_model("smollm2")  # and with the cache filled
    assert same_rng(before, rng_states())


def test_a_cold_cache_and_a_warm_cache_run_log_the_same_numbers(personas_file, tmp_path, monkeypatch):
    """ppo.py on the embedded model: the first run converts it (an empty RLVER_CACHE), the second
    finds it converted. Every number both log, except the clock's, must be the same."""
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))
    argv = ["--preset", "cpu", "--simulator", "rules", "--personas", personas_file, "--split", "test",
            "--dialogues-per-iteration", "2", "--minibatch-size", "2", "--max-turns", "1",
            "--max-new-tokens", "4", "--iterations", "1"]
    for name in ("cold", "warm"):
        ppo.main([*argv, "--out", str(tmp_path / name)])
    cold, warm = read_metrics(tmp_path / "cold"), read_metrics(tmp_path / "warm")
    assert cold[0]["actor_grad_norm"] > 0 and cold[0]["policy_tokens"] > 0
    assert len(cold) == len(warm)
    for a, b in zip(cold, warm):
        a, b = timeless(a), timeless(b)
        assert a.keys() == b.keys() and {k: (a[k], b[k]) for k in a if a[k] != b[k]} == {}
