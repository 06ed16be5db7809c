"""Tests for personas.py: persona files (ours, SAGE's and RLVER's profile lines), every error one line
naming the file, the entry and the field, and the openings command that writes the first messages
RLVER's profiles lack.

    python -m pytest tests/test_personas.py -q
"""
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import evaluate
import ppo
import cli
import rl
import simulator
import users
from personas import PERSONA_FIELDS, PersonaError, load_personas
from conftest import RLVER, SAGE, chat_completion, completion, in_process, openings, reply
from test_bad_input import ENV, assert_one_line, error_lines, shell

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "evaluate.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


# ----------------------------------------------------------------------------------------------
# Personas
# ----------------------------------------------------------------------------------------------
def _drop(entry, *keys):
    target = entry
    for k in keys[:-1]:
        target = target[k]
    del target[keys[-1]]


def _set(entry, value, *keys):
    target = entry
    for k in keys[:-1]:
        target = target[k]
    target[keys[-1]] = value


# (name, how to break the second entry, words the message must contain)
BROKEN = [
    ("missing field", lambda e: _drop(e, "goal"), ["entry p2", "'goal'", "missing"]),
    ("missing profile field", lambda e: _drop(e, "profile", "job"),
     ["entry p2", "profile", "'job'", "missing"]),
    ("missing reaction", lambda e: _drop(e, "reactions", "bad"),
     ["entry p2", "reactions", "'bad'", "missing"]),
    ("age as a string", lambda e: _set(e, "29", "profile", "age"),
     ["entry p2", "profile", "'age'", "int", "str"]),
    ("age as a bool", lambda e: _set(e, True, "profile", "age"), ["entry p2", "'age'", "int", "bool"]),
    ("opening as a list", lambda e: _set(e, ["hi", "there"], "opening"),
     ["entry p2", "'opening'", "str", "list"]),
    ("profile as a string", lambda e: _set(e, "Maya, 29", "profile"),
     ["entry p2", "'profile'", "dict", "str"]),
    ("empty opening", lambda e: _set(e, "   ", "opening"), ["entry p2", "'opening'", "empty"]),
    ("unknown split", lambda e: _set(e, "dev", "split"), ["entry p2", "'split'", "'dev'"]),
    ("unknown difficulty", lambda e: _set(e, "extreme", "difficulty"),
     ["entry p2", "'difficulty'", "'extreme'"]),
    ("unknown band", lambda e: _set(e, {"X": "hm"}, "band_lines"), ["entry p2", "'band_lines'"]),
    ("missing id names the index", lambda e: _drop(e, "id"), ["entry 1", "'id'", "missing"]),
    # a field the schema does not read would be dropped without a word (a typo, a forker's new field)
    ("unknown field", lambda e: _set(e, "work", "topic"), ["entry p2", "'topic'", "not one", "goal"]),
    ("unknown profile field", lambda e: _set(e, "Leeds", "profile", "location"),
     ["entry p2", "profile", "'location'", "not one", "speaking_style"]),
    ("a misspelt reaction", lambda e: _set(e, "she smiles", "reactions", "god"),
     ["entry p2", "reactions", "'god'", "not one"]),
]


@pytest.mark.parametrize("name,breaker,words", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_persona_names_file_entry_and_field(name, breaker, words, persona_entry, write_personas):
    bad = persona_entry(id="p2")
    breaker(bad)
    path = write_personas([persona_entry(id="p1"), bad])
    with pytest.raises(PersonaError) as info:
        load_personas(path)
    message = str(info.value)
    assert message.startswith(path + ":"), message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert "\n" not in message


def test_duplicate_id(persona_entry, write_personas):
    path = write_personas([persona_entry(id="p1"), persona_entry(id="p2", split="train"),
                           persona_entry(id="p1")])
    with pytest.raises(PersonaError, match=r"entry p1: field 'id' is a duplicate") as info:
        load_personas(path)
    assert path in str(info.value)


def test_entry_that_is_not_an_object(persona_entry, write_personas):
    path = write_personas([persona_entry(id="p1"), "just a string"])
    with pytest.raises(PersonaError) as info:
        load_personas(path)
    assert str(info.value) == f"{path}: entry 1: must be a JSON object"


def test_unreadable_and_invalid_files(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(PersonaError, match="cannot read") as info:
        load_personas(missing)
    assert missing in str(info.value)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"id": "p1",]')
    with pytest.raises(PersonaError, match="not valid JSON") as info:
        load_personas(str(broken))
    assert str(broken) in str(info.value)


def test_valid_file_and_split_filter(persona_entry, write_personas):
    path = write_personas([persona_entry(id="a", split="train"), persona_entry(id="b"),
                           persona_entry(id="c", difficulty="hard")])
    everyone = load_personas(path)
    assert [p.id for p in everyone] == ["a", "b", "c"]
    assert [p.id for p in load_personas(path, split="test")] == ["b", "c"]
    assert [p.id for p in load_personas(path, split="train")] == ["a"]
    b = everyone[1]
    assert b.profile["age"] == 29 and b.band_lines["B"] == "maybe. i don't know."
    assert b.opening == persona_entry()["opening"]
    only_train = write_personas([persona_entry(id="a", split="train")], name="train_only.json")
    with pytest.raises(PersonaError, match="no personas in split 'test'"):
        load_personas(only_train, split="test")


def test_cli_bad_personas_exits_2_with_one_line(persona_entry, write_personas, tmp_path):
    path = write_personas([persona_entry(id="p1", profile={**persona_entry()["profile"], "age": "29"})])
    done = run_cli("--write-openings", str(tmp_path / "o.jsonl"), "--personas", path, "--simulator", "rules")
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error:") and path in lines[0] and "'age'" in lines[0]
    assert "Traceback" not in done.stderr + done.stdout


def test_project_personas_file():
    personas = load_personas(os.path.join(ROOT, "personas.json"))
    assert len(personas) >= 60
    assert {p.split for p in personas} == {"train", "test"}
    assert {p.difficulty for p in personas} == {"easy", "normal", "hard"}


# SAGE profile files: one JSON object per line, no split or difficulty
def test_sage_import(tmp_path):
    lines = [
        {"id": "s1", "player": "Tom, 40, a plumber who jokes when nervous.", "scene": "His dog died.",
         "main_cha": "Tom", "topic": "grief", "task": "wants to hear it is fine to miss a dog.",
         "first_talk": "So my dog died on Tuesday. Stupid to be this upset, right?"},
        {"id": 7, "player": "Ana, 19, a student.", "scene": {"place": "dorm", "event": "failed an exam"},
         "main_cha": "Ana", "topic": "study", "task": "wants a plan.",
         "first_talk": "I failed calculus again."},
    ]
    path = tmp_path / "sage.jsonl"
    path.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n\n", encoding="utf-8")
    personas = load_personas(str(path))
    assert [p.id for p in personas] == ["s1", "7"]
    for p, raw in zip(personas, lines):
        assert (p.split, p.difficulty) == ("test", "normal")
        assert p.opening == raw["first_talk"]
        assert p.profile["character"] == raw["main_cha"] and p.profile["description"] == raw["player"]
        assert p.goal == raw["task"]
    assert personas[0].background == "His dog died."
    assert "place: dorm" in personas[1].background and "event: failed an exam" in personas[1].background
    assert load_personas(str(path), split="test") == personas
    # no split field: the entries belong to whichever split the reading script asks for
    train = load_personas(str(path), split="train")
    assert [(p.id, p.split) for p in train] == [("s1", "train"), ("7", "train")]
    assert "Tom" in simulator.persona_card(personas[0])  # the prompts can be built from it


def test_sage_errors_name_line_id_and_field(tmp_path):
    good = {"id": "s1", "player": "p", "scene": "s", "first_talk": "hello"}
    path = tmp_path / "sage.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "id": "s2", "first_talk": 3}) + "\n")
    with pytest.raises(PersonaError) as info:
        load_personas(str(path))
    message = str(info.value)
    assert (message.startswith(str(path)) and "line 2" in message and "s2" in message
            and "'first_talk'" in message)
    path.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(PersonaError, match="line 2: not valid JSON"):
        load_personas(str(path))
    path.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(PersonaError, match="entry s1: field 'id' is a duplicate"):
        load_personas(str(path))


def test_sage_sample_file():
    path = os.path.join(ROOT, "tests", "data", "sage_sample.jsonl")
    if not os.path.exists(path):
        pytest.skip("tests/data/sage_sample.jsonl is not there yet")
    with open(path, encoding="utf-8") as f:
        raw = [json.loads(line) for line in f if line.strip()]
    personas = load_personas(path)
    assert len(personas) == len(raw) > 0
    for p, r in zip(personas, raw):
        assert p.id == str(r["id"]) and p.opening == r["first_talk"]
        assert (p.split, p.difficulty) == ("test", "normal")


# ----------------------------------------------------------------------------------------------
# The paper's profile files: no openings, no split fields (moved from tests/test_paper_data.py)
# ----------------------------------------------------------------------------------------------
def read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_lines(path, entries):
    path.write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in entries), encoding="utf-8")
    return str(path)


def test_profiles_without_openings_name_the_command():
    with pytest.raises(PersonaError) as info:
        load_personas(RLVER)
    message = str(info.value)
    assert message.startswith(f"{RLVER}: line 1 (id rl-001): field 'first_talk' is missing")
    assert "python evaluate.py --write-openings NEW_FILE --personas " + RLVER in message
    assert "\n" not in message


def test_profiles_without_split_fields_belong_to_the_split_asked_for(tmp_path):
    lines = read_lines(SAGE)
    lines[1]["split"] = "test"  # one entry says where it belongs; the others do not
    path = write_lines(tmp_path / "profiles.jsonl", lines)
    train = load_personas(path, "train")
    test = load_personas(path, "test")
    assert [p.id for p in train] == ["sage-001", "sage-003", "sage-004"]  # the file's own ids
    assert [p.id for p in test] == ["sage-001", "sage-002", "sage-003", "sage-004"]
    assert {p.split for p in train} == {"train"} and {p.split for p in test} == {"test"}
    lines[1]["split"] = "dev"
    path = write_lines(tmp_path / "profiles.jsonl", lines)
    with pytest.raises(PersonaError, match=r"line 2 \(id sage-002\): field 'split' must be one of"):
        load_personas(path)


def test_an_unknown_field_of_a_profile_line_is_one_line(tmp_path, capsys):
    """SAGE's and RLVER's lines: their free-text fields are read, any other is refused by name, as
    a trainer's command line says it, before any model loads."""
    entries = [{**e, "first_talk": "hi"} for e in read_lines(SAGE)]
    entries[1]["emotion_start"] = 40
    path = write_lines(tmp_path / "p.jsonl", entries)
    code, _, err = in_process(ppo.main, ["--preset", "cpu", "--personas", path, "--split", "all",
                                         "--out", tmp_path / "run"], capsys)
    assert_one_line(code, err, path, "line 2", "'emotion_start'", "not one")
    assert not os.path.exists(tmp_path / "run")


def test_every_field_a_card_shows_has_its_label_in_every_language(persona_entry, write_personas,
                                                                  tmp_path):
    """The card lists a persona's profile with each field's label in the persona's language: ours
    (PERSONA_FIELDS' profile) and SAGE's and RLVER's (the profile _sage_persona builds). A field
    added to the schema without its labels fails here; a Chinese card shows no English label."""
    ours = [load_personas(write_personas([persona_entry()]))[0]]
    theirs = load_personas(write_lines(tmp_path / "p.jsonl", [{**e, "first_talk": "hi"}
                                                            for e in read_lines(RLVER)]))
    fields = {*PERSONA_FIELDS["profile"], *(k for p in ours + theirs for k in p.profile)}
    for lang, prompts in simulator.PROMPTS.items():
        assert fields <= prompts["profile"].keys(), (lang, fields - prompts["profile"].keys())
        if lang == "zh":
            assert not any(re.search("[A-Za-z]", prompts["profile"][k]) for k in fields)
    for persona in ours + theirs:
        persona.language = "zh"
        card = simulator.persona_card(persona)
        labels = [line.split(":")[0] for line in card.splitlines() if line.startswith("- ")]
        assert len(labels) == len(persona.profile) and not any(re.search("[A-Za-z]", x) for x in labels)


def test_rlver_fields_reach_the_card_in_the_personas_language(tmp_path):
    entries = [{**e, "first_talk": "hi"} for e in read_lines(RLVER)]
    owen, _, han = load_personas(write_lines(tmp_path / "p.jsonl", entries))
    assert owen.profile == {"character": "passive", "description": entries[0]["player"],
                            "traits": "dry, proud, tired"}
    card = simulator.persona_card(han)
    assert han.language == "zh"
    assert "回避型" in card and "温和, 敏感, 固执" in card
    assert not re.search(r"[A-Za-z]{3,}", card), card  # no English words around a Chinese profile


# ----------------------------------------------------------------------------------------------
# Writing the openings (moved from tests/test_paper_data.py and tests/test_hostile.py, issue 30
# items 6 and 12)
# ----------------------------------------------------------------------------------------------
def test_write_openings_with_a_server_writes_all_or_nothing(tmp_path, server):
    asked = []

    def handle(handler, n, body):
        system, ask = body["messages"][0]["content"], body["messages"][1]["content"]
        asked.append((system, ask))
        if "Leila" in system and not ok_now:
            reply(handler, 400, b"{}")  # a client error: not retried
        elif "韩小北" in system:
            reply(handler, 200, chat_completion("【我的心情不好】唉……有件事一直堵在心里。\n\n机器人：你好"))
        else:
            reply(handler, 200, chat_completion("[note] Long week, honestly. Can I just talk for a minute?"))
    ok_now = False
    srv = server(handle)
    out = tmp_path / "with_openings.jsonl"
    code, _, err, _ = shell(*openings(out, srv.url))
    said = f"--write-openings {out}: simulator server {srv.url}/chat/completions: HTTP 400 after 1 tries"
    assert error_lines(err) == [f"error: {said}; nothing written"] and code == 2, err[-2000:]
    assert os.listdir(tmp_path) == []  # never half-written, nothing kept
    ok_now = True
    code, _, err, _ = shell(*openings(out, srv.url))
    assert code == 0, err
    # the user's own prompt family, in the persona's language
    personas = load_personas(RLVER, need_opening=False)
    zh = [a for a in asked if "韩小北" in a[0]][-1]
    # where an agent's first message would be
    ask = {"role": "agent", "text": simulator.PROMPTS["zh"]["opening"]}
    expected = simulator.user_turn_messages(simulator.UserState(personas[2], 30, [ask]))
    assert list(zh) == [m["content"] for m in expected]
    # at the mood training starts from (issue 30, item 6), declared once, with the trainers' settings
    assert rl.DialogueSettings.start_emotion == 30
    assert simulator.PROMPTS["zh"]["reply_rules"] in zh[0] and "你的心情：30/100" in zh[1]
    written, source = read_lines(out), read_lines(RLVER)
    english = "Long week, honestly. Can I just talk for a minute?"  # cleaned as the user's turns are
    assert [w["first_talk"] for w in written] == [english, english, "唉……有件事一直堵在心里。"]
    assert [w["first_talk_emotion"] for w in written] == [30, 30, 30]  # the mood they were written at
    assert [{k: v for k, v in w.items() if not k.startswith("first_talk")} for w in written] == source
    assert os.listdir(tmp_path) == [out.name]
    code, _, err, _ = shell(*openings(out, "rules"))
    assert_one_line(code, err, "the file exists")  # nothing is overwritten


def test_write_openings_refuses_an_opening_that_cleans_to_nothing(tmp_path, serve, capsys):
    s = serve(lambda n, body: completion("[only a note]"))
    code, _, err = in_process(evaluate.main, openings(tmp_path / "out.jsonl", s.url)[1:], capsys)
    assert_one_line(code, err, "nothing usable for id rl-001", "nothing written")
    assert os.listdir(tmp_path) == []


def test_write_openings_keeps_existing_ones_and_rules_write_fixed_lines(tmp_path, capsys):
    entries = read_lines(RLVER)
    entries[0]["first_talk"] = "Long shift. Can we talk?"
    out = tmp_path / "all.jsonl"
    source = write_lines(tmp_path / "some.jsonl", entries)
    code, _, err = in_process(evaluate.main, openings(out, "rules", source)[1:], capsys)
    assert not code, err
    en, zh = users.OPENING_LINES["en"], users.OPENING_LINES["zh"]
    assert [e["first_talk"] for e in read_lines(out)] == ["Long shift. Can we talk?", en, zh]
    assert [e.get("first_talk_emotion") for e in read_lines(out)] == [None, 30, 30]


def test_rlver_profiles_get_openings_then_train_one_ppo_iteration(tiny_model_dir, tmp_path, monkeypatch,
                                                                   capsys):
    import ppo
    from conftest import read_metrics

    monkeypatch.setattr(ppo, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    args = ["--preset", "cpu", "--model", tiny_model_dir, "--simulator", "rules", "--split", "train",
            "--dialogues-per-iteration", "2", "--minibatch-size", "2", "--micro-batch-size", "1",
            "--max-turns", "2", "--max-new-tokens", "6", "--max-context", "1024", "--lora-r", "4",
            "--lora-alpha", "8", "--iterations", "1"]
    with pytest.raises(SystemExit) as stop:
        cli.command(ppo.main)([*args, "--personas", RLVER, "--out", str(tmp_path / "refused")])
    assert stop.value.code == 2
    assert "--write-openings NEW_FILE --personas " + RLVER in capsys.readouterr().err
    monkeypatch.undo()

    out = tmp_path / "rlver_with_openings.jsonl"
    code, _, err, _ = shell(*openings(out, "same"), "--model", tiny_model_dir)  # `same`: the --model alone
    assert code == 0, err
    written = read_lines(out)
    assert all(w["first_talk"].strip() and w["first_talk"] != "..." for w in written)
    assert [w["id"] for w in written] == ["rl-001", "rl-002", "rl-003"]
    ppo.main([*args, "--personas", str(out), "--out", str(tmp_path / "run")])
    metrics = read_metrics(tmp_path / "run")
    assert [m["iteration"] for m in metrics] == [1] and np.isfinite(metrics[0]["reward_mean"])


def faulty(*argv):
    """shell() through tests/faults.py: faulty(FAULT FLAGS..., "--", SCRIPT, ARGS...)."""
    return shell(os.path.join("tests", "faults.py"), *argv)


def test_write_openings_into_a_folder_it_cannot_write_ends_with_one_line(tmp_path, capsys):
    """A folder that does not exist (said before the model loads: with a model, a write that failed
    after the generation would say "No such file"), a read-only one and a disk that fills while OUT is
    written: one line each, exit 2, and nothing left behind (nor a temporary file)."""
    missing = tmp_path / "no" / "such" / "openings.jsonl"
    code, _, err = in_process(evaluate.main, openings(missing, "same")[1:], capsys)
    assert_one_line(code, err, str(missing), "its folder does not exist")
    for fault, folder, words in (("--read-only", tmp_path / "read_only", "Read-only"),
                                 ("--disk-full", tmp_path / "full", "disk is full")):
        folder.mkdir()
        free = ["--free", "1000"] if fault == "--disk-full" else []
        code, _, err, _ = faulty(fault, str(folder), *free, "--", *openings(folder / "o.jsonl", "rules"))
        assert_one_line(code, err, str(folder), words, "nothing written")
        assert os.listdir(folder) == []


@pytest.mark.parametrize("name", ["SIGINT", "SIGTERM"])
def test_write_openings_stopped_by_a_signal_writes_nothing(name, tmp_path, server):
    """Ctrl-C or SIGTERM while the openings are asked of a server that never answers: at once one line
    saying OUT was not written, exit 130 / 143, no traceback, no OUT."""
    import signal

    srv = server(lambda handler, n, body: srv.stop.wait(120))  # a server that never answers
    out, log = tmp_path / "openings.jsonl", tmp_path / "err.txt"
    argv = openings(out, srv.url)  # the client's deadline: 60 s a try, far beyond the wait below
    with open(log, "w") as stderr:
        proc = subprocess.Popen([sys.executable, *map(str, argv)], cwd=ROOT, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        t0 = time.time()
        while srv.count < 1:
            assert proc.poll() is None and time.time() - t0 < 240, log.read_text()[-2000:]
            time.sleep(0.05)
        proc.send_signal(getattr(signal, name))
        code = proc.wait(20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    err = log.read_text()
    assert code == 128 + getattr(signal, name) and "Traceback" not in err and not out.exists(), err[-2000:]
    said = [line for line in re.split(r"[\r\n]", err) if name in line]
    assert said == [f"stopped by {name}; {out} not written"], err[-2000:]
