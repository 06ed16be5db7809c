"""Shared fixtures: the embedded model, a tiny random Llama on the same tokenizer, and persona files.

The models are module-scoped on purpose: a test module that wraps a model in LoRA adapters or
trains it changes it in place, and the next module should start from clean weights (loading the
embedded model takes about a second).
"""
import copy
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import simulator  # noqa: E402

# One intra-op thread unless told otherwise. On a 2-core machine that is also running anything else,
# two OpenMP threads wait on each other and a 12-token generation on the embedded model went from
# about 2 s to about 30 s; one thread keeps the suite fast and its timing predictable.
torch.set_num_threads(int(os.environ.get("RLVER_TEST_THREADS", "1")))


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, exactly as load_model() gives them."""
    return simulator.load_model("smollm2")


@pytest.fixture(scope="module")
def tiny_model():
    """(model, tokenizer): a randomly initialised 2-layer Llama (seed 0) on the smollm2 tokenizer,
    for tests that need a real transformers model but not a sensible one."""
    model, tokenizer = _tiny_llama()
    tokenizer.padding_side = "left"  # as load_model() sets it up
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def _tiny_llama():
    """A 2-layer random Llama (seed 0) sized to the smollm2 tokenizer, and that tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(simulator.resolve_model("smollm2"))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tokenizer


BASE_PERSONA = {
    "id": "p1",
    "split": "test",
    "difficulty": "normal",
    "topic": "work",
    "profile": {"name": "Maya Lin", "age": 29, "job": "graphic designer",
                "personality": "quiet, self-critical", "speaking_style": "short sentences, lowercase"},
    "background": "Maya was passed over for a promotion she had been promised, and her manager "
                  "gave it to a colleague who joined six months ago.",
    "goal": "wants to vent about the promotion and decide whether to stay at the studio.",
    "hidden_intention": "wants to hear that feeling hurt does not make her petty or ungrateful.",
    "opening": "i didn't get the promotion. they gave it to the new guy. i feel so stupid for hoping.",
    "reactions": {"good": "She opens up about how long she has waited.",
                  "bad": "She says it doesn't matter and goes quiet."},
    "band_lines": {"S": "thank you. really. goodbye for now.",
                   "A": "yeah. that's exactly it, i think.",
                   "B": "maybe. i don't know.",
                   "C": "that's not what i meant.",
                   "F": "i'm done here."},
}


@pytest.fixture
def persona_entry():
    """A factory for valid personas.json entries: persona_entry(id="x", difficulty="hard", ...).
    Every call returns a fresh deep copy, so a test may break one field without touching others."""
    def make(**overrides):
        entry = copy.deepcopy(BASE_PERSONA)
        entry.update(copy.deepcopy(overrides))
        return entry
    return make


@pytest.fixture
def write_personas(tmp_path):
    """write_personas(entries, name="personas.json") -> path of a JSON list file in tmp_path."""
    def write(entries, name="personas.json"):
        path = tmp_path / name
        path.write_text(json.dumps(entries, ensure_ascii=False, indent=1), encoding="utf-8")
        return str(path)
    return write


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A folder holding a tiny random Llama (the tiny_model config and seed) and the smollm2
    tokenizer, written with save_pretrained. Pass it as a model name to load_model(),
    rollout.load_policy() or a script's --model: any name but 'smollm2' goes to from_pretrained.
    Built on its own rather than from tiny_model, which a test may have wrapped in LoRA in place."""
    model, tokenizer = _tiny_llama()
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)
