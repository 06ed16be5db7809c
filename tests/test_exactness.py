"""Same seed, same numbers, on every path (issue 25): a run whose first command converts the embedded
model, the old log-probs under dropout (LoRA's and the model's own), masked positions that make no NaN,
the decode step on every adapter set-up, --load-in-4bit without its parts.

    OMP_NUM_THREADS=1 python -m pytest tests/test_exactness.py -q
"""
import json
import random

import numpy as np
import pytest
import torch

from personas import load_personas
from policy import load_model, resolve_model
from rl import token_logprobs
import grpo
import ppo
import rollout
import cli
import run
import simulator
import users
from conftest import read_metrics, tiny_tokenizer

# What differs between two runs of the same computation: the clock and the memory it took.
UNTIMED = ("time_", "_seconds", "_per_s", "peak_memory_gb")


def rng_states():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def same_rng(a, b):
    return (torch.equal(a[0], b[0]) and a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1])
            and a[1][2:] == b[1][2:] and a[2] == b[2])


def rules_user(max_turns, **kwargs):
    return simulator.Simulator(users.RulesBackend(), max_turns=max_turns, **kwargs)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def timeless(row):
    return {k: v for k, v in row.items() if not any(part in k for part in UNTIMED)}


# ----------------------------------------------------------------------------------------------
# 1. The first run on a machine: converting the embedded model must not draw from the seeded streams
# ----------------------------------------------------------------------------------------------
def test_loading_with_a_cold_cache_leaves_every_random_stream_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))  # empty: load_model converts the GGUF
    run.set_seed(3)
    before = rng_states()
    load_model("smollm2")
    assert (tmp_path / "cache").is_dir() and any((tmp_path / "cache").iterdir())  # it did convert
    assert same_rng(before, rng_states())
    load_model("smollm2")  # and with the cache filled
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


# ----------------------------------------------------------------------------------------------
# 2. Old log-probs under dropout: from the scoring pass (eval mode), not the update's (train mode)
# ----------------------------------------------------------------------------------------------
def tiny_run(script, model_dir, personas, out, *extra):
    """The smallest run of a trainer on a tiny model and the rules user, one step per batch (one
    epoch, the minibatch the whole batch)."""
    size = (["--dialogues-per-iteration", "2"] if script is ppo else
            ["--personas-per-iteration", "1", "--group-size", "2"])
    return ["--preset", "cpu", "--model", str(model_dir), "--simulator", "rules", "--personas", personas,
            "--split", "test", *size, "--minibatch-size", "2", "--micro-batch-size", "1", "--max-turns", "1",
            "--max-new-tokens", "6", "--max-context", "512", "--lora-r", "4", "--lora-alpha", "8",
            "--out", str(out), *extra]


@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_lora_dropout_takes_the_old_logprobs_from_the_scoring_pass(script, tiny_model_dir, personas_file,
                                                                  tmp_path):
    """With --lora-dropout 0.3 the update's forward pass (train mode) carries dropout noise, so its
    log-probs are not the sampling policy's: the old log-probs come from the scoring pass (eval mode),
    and then they equal the sampled ones to float round-off. Iteration 2, once lora_B has moved (at
    iteration 1 B = 0 and the dropped adapter input changes nothing)."""
    out = tmp_path / "run"
    script.main(tiny_run(script, tiny_model_dir, personas_file, out, "--lora-dropout", "0.3",
                         "--iterations", "2", "--lr", "5e-2", "--ent-coef", "0.01"))
    m = read_metrics(out)
    assert m[1]["kl_ref"] > 1e-4  # the adapter moved: dropout on its input changes its output
    for row in m:
        assert row["sample_logprob_gap"] < 1e-5, row["sample_logprob_gap"]


def model_with(folder, tmp_path, **changes):
    """The model in folder saved again with config changes (attention_dropout=0.3) or its lm_head scaled
    (head=300)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    head = changes.pop("head", 1.0)
    model = AutoModelForCausalLM.from_pretrained(folder, **changes)
    with torch.no_grad():
        model.lm_head.weight.mul_(head)
    model.save_pretrained(tmp_path / "model")
    AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_a_base_models_own_dropout_takes_the_scoring_pass_too(script, tiny_model_dir, personas_file,
                                                               tmp_path):
    """Attention dropout is a rate in the model's config, not a module: the update's train-mode pass is not
    the sampling policy there either, and the old log-probs come from the scoring pass (the shortcut took
    the train-mode pass and logged a gap of 0.0158 and kl_ref 2.2e-4 where both are 0)."""
    model = model_with(tiny_model_dir, tmp_path, attention_dropout=0.3)
    script.main(tiny_run(script, model, personas_file, tmp_path / "run"))
    m = read_metrics(tmp_path / "run")[0]
    assert m["sample_logprob_gap"] < 1e-4 and m["kl_ref"] < 1e-6, m


@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_masked_positions_make_no_nan(script, tiny_model_dir, write_personas, persona_entry, tmp_path):
    """A scoring pass in length-sorted micro-batches and an update in random ones hold log-probs at
    different non-agent positions (a row's user token where another row of its micro-batch has an agent
    token); with lm_head x 300 their difference overflowed exp, inf x 0 made NaN, and every update was
    skipped (the stop then blamed the learning rate). Off the mask the difference is 0 now, and k3's
    exponent is clamped: two iterations train with finite gradients."""
    model = model_with(tiny_model_dir, tmp_path, head=300.0)
    openings = ["i lost my job.",
                "my sister did not invite me to her wedding and i found out online.",
                "i can't sleep.",
                "my dog died last week and everyone says it was just a dog, so i stay quiet."]
    personas = write_personas([persona_entry(id=f"p{k}", opening=o) for k, o in enumerate(openings)])
    sizes = ["--dialogues-per-iteration", "4"] if script is ppo else ["--personas-per-iteration", "2"]
    script.main(tiny_run(script, model, personas, tmp_path / "run", *sizes, "--minibatch-size", "4",
                         "--micro-batch-size", "2", "--update-epochs", "2", "--max-turns", "2",
                         "--kl-loss-coef", "0.1", "--iterations", "2", "--seed", "1"))
    grad = "actor_grad_norm" if script is ppo else "grad_norm"
    for m in read_metrics(tmp_path / "run"):
        assert None not in (m[grad], m["kl_ref_loss"]) and np.isfinite([m[grad], m["kl_ref_loss"]]).all(), m


# ----------------------------------------------------------------------------------------------
# 3. The decode step samples the adapter's function, whatever the adapter holds
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    """A 2-layer random Llama on the smollm2 tokenizer, as conftest's tiny model, but with tied
    input and output embeddings (as SmolLM2) and biases on the attention projections (as Qwen2)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    folder = tmp_path_factory.mktemp("tied_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def adapted(model_dir, **lora):
    """A PeftModel on the model in model_dir whose adapter parts are all moved off their
    initialisation (lora_B, a LoRA bias, a modules_to_save copy): a fresh adapter equals the base."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=4, **lora))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.3)
    return policy.eval(), tokenizer


ADAPTER_CASES = {  # LoraConfig of adapter set-ups whose parts are not plain LoRA matrices
    "lm_head on tied embeddings": dict(target_modules=["q_proj", "lm_head"]),
    "modules_to_save": dict(target_modules=["q_proj"], modules_to_save=["o_proj"]),
    "lora_bias": dict(target_modules=["q_proj", "v_proj"], lora_bias=True),
    "bias all": dict(target_modules=["q_proj", "v_proj"], bias="all"),
}


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_the_decoder_samples_the_adapters_function(case, tied_model_dir, personas_file):
    """Greedy dialogues through the rollout's Decoder (its own KV cache and decode step) have, on
    every token, the log-prob a full pass through the adapter gives (the trainers'): a part of the
    adapter the decode step left out would show, since each part moves the logits."""
    from rl import eval_logprobs, pad_records

    policy, tokenizer = adapted(tied_model_dir, **ADAPTER_CASES[case])
    ids = torch.tensor([tokenizer("i feel so stupid for hoping")["input_ids"]])
    with torch.no_grad():
        with_adapter = policy(input_ids=ids).logits
        with policy.disable_adapter():
            assert (policy(input_ids=ids).logits - with_adapter).abs().max() > 1e-2  # it matters
    personas = load_personas(personas_file)
    records, _ = rollout.play_dialogues(policy, rules_user(2), personas,
                                        chat=rollout.ChatTokens(tokenizer), greedy=True,
                                        max_new_tokens=6, progress=False)
    batch = pad_records(records, tokenizer.pad_token_id, "cpu")
    mask = batch["action_mask"].bool()
    assert mask.sum() > 12
    torch.testing.assert_close(eval_logprobs(policy, batch)[mask], batch["sample_logprobs"][mask],
                               atol=1e-5, rtol=0)


def test_lm_head_on_tied_embeddings_trains_on_what_it_sampled(tied_model_dir, personas_file, tmp_path):
    """GRPO with lm_head among the target modules of a model with tied embeddings: the log-probs the
    update computes are those the rollout sampled with, at iteration 2 too (the adapter has moved)."""
    out = tmp_path / "run"
    grpo.main(tiny_run(grpo, tied_model_dir, personas_file, out, "--target-modules", "q_proj,lm_head",
                       "--iterations", "2", "--lr", "5e-2", "--ent-coef", "0.01"))
    m = read_metrics(out)
    assert m[1]["kl_ref"] > 1e-4
    for row in m:
        assert row["sample_logprob_gap"] < 1e-5, row["sample_logprob_gap"]


@pytest.mark.parametrize("script", [ppo, grpo], ids=["ppo", "grpo"])
def test_a_target_module_the_model_lacks_is_one_line_before_the_weights_load(script, tiny_model_dir,
                                                                            personas_file, tmp_path, capsys,
                                                                            monkeypatch):
    def no_weights(*a, **k):
        raise AssertionError("the weights loaded")
    monkeypatch.setattr("policy.load_model", no_weights)
    with pytest.raises(SystemExit) as stop:
        cli.command(script.main)(tiny_run(script, tiny_model_dir, personas_file, tmp_path / "run",
                             "--target-modules", "q_proj,qkv_proj"))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--target-modules" in err and "qkv_proj" in err and "q_proj, " in err  # it lists the model's


# Model classes whose forward changes the logits after lm_head, which token_logprobs (the decoder's
# hidden states times the output embedding) does not do: (class prefix, config extras, field, value).
# Gemma-2's weights are drawn large enough that its logits reach the cap, as a trained model's do.
AFTER_HEAD = {"gemma2": ("Gemma2", dict(head_dim=16, initializer_range=1.0), "final_logit_softcapping", 30.0),
              "cohere": ("Cohere", {}, "logit_scale", 0.0625)}


@pytest.fixture(scope="module", params=list(AFTER_HEAD))
def after_head_model(request, tmp_path_factory):
    """(kind, folder, model, tokenizer): a tiny random model of such a class, saved with the test
    tokenizer."""
    import transformers

    prefix, extras, _, _ = AFTER_HEAD[request.param]
    tokenizer = tiny_tokenizer()
    config = getattr(transformers, prefix + "Config")(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **extras)
    torch.manual_seed(0)
    model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return request.param, str(folder), model, tokenizer


def test_the_trainers_logprobs_skip_what_these_models_apply_after_lm_head(after_head_model):
    # the gap the refusal below guards: the model's own logits (what generate samples from) against
    # the trainer's log-probs of the same tokens
    kind, _, model, tokenizer = after_head_model
    ids = torch.tensor([tokenizer("i feel so stupid for hoping. they gave it to the new guy.")["input_ids"]])
    with torch.no_grad():
        everywhere = torch.ones_like(ids)
        trainer, _ = token_logprobs(model, ids, everywhere, everywhere)              # (1, T)
        own = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)             # (T-1, V)
    gap = (trainer[0, 1:] - own.gather(-1, ids[0, 1:, None])[:, 0]).abs().max()
    assert gap > 0.1, (kind, gap)


def test_a_model_that_changes_its_logits_after_lm_head_is_one_line_before_the_weights_load(
        after_head_model, personas_file, tmp_path, capsys, monkeypatch):
    kind, folder, _, _ = after_head_model
    _, _, field, value = AFTER_HEAD[kind]

    def no_weights(*a, **k):
        raise AssertionError("the weights loaded")
    monkeypatch.setattr("policy.load_model", no_weights)
    with pytest.raises(SystemExit) as stop:
        cli.command(ppo.main)(tiny_run(ppo, folder, personas_file, tmp_path / "run"))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1, err
    assert folder in err and f"{field} {value}" in err and "sampler" in err, err


# ----------------------------------------------------------------------------------------------
# 7. --load-in-4bit where bitsandbytes or CUDA is missing: one line at the settings check
# ----------------------------------------------------------------------------------------------
def no_package(monkeypatch, name):
    """importlib.util.find_spec answers None for `name`, as where the package is not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a, **k: None if n == name else real(n, *a, **k))


def four_bit_argv(script, model_dir, personas, out):
    import evaluate

    if script is evaluate:
        return ["--model", str(model_dir), "--simulator", "rules", "--personas", personas, "--split", "test",
                "--dialogues", "1", "--out", str(out), "--load-in-4bit"]
    return tiny_run(script, model_dir, personas, out, "--load-in-4bit", "true")


@pytest.mark.parametrize("script", ["ppo", "grpo", "evaluate"])
@pytest.mark.parametrize("missing", ["bitsandbytes", "cpu kernels"])
def test_load_in_4bit_without_its_parts_is_one_line_before_any_model_loads(script, missing, tiny_model_dir,
                                                                          personas_file, tmp_path, capsys,
                                                                          monkeypatch):
    import importlib

    import bitsandbytes.functional

    script = importlib.import_module(script)

    def no_model(*a, **k):
        raise AssertionError("a model loaded")

    def no_kernel(*a, **k):  # what a bitsandbytes built without CPU kernels raises
        raise NotImplementedError("no CPU kernel for quantize_4bit")
    monkeypatch.setattr("policy.load_model", no_model)
    if missing == "bitsandbytes":  # a CUDA machine without the package: nothing below touches CUDA
        no_package(monkeypatch, "bitsandbytes")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    else:
        monkeypatch.setattr(bitsandbytes.functional, "quantize_4bit", no_kernel)
    with pytest.raises(SystemExit) as stop:
        cli.command(script.main)(four_bit_argv(script, tiny_model_dir, personas_file, tmp_path / "run"))
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    advice = "install bitsandbytes" if missing == "bitsandbytes" else "CPU"
    assert "--load-in-4bit" in err and advice in err, err
    assert not (tmp_path / "run").exists()  # nothing written either


