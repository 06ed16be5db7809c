"""Hostile cases, round 5 (issue 44), the text of a URL user, the model cache and the key: a reply of up
to a megabyte is read in linear time and a bounded number of digits, the embedded model's cache is taken
only whole and refused in one line where it cannot be written, and redaction changes nothing that is not
a secret, in every file a run writes. Each test holds one of the issue's cases (4, 5, 6, 10 and 11),
through the simulator's readers, the real URL client against a server on 127.0.0.1, or the command line
(the script's main(argv) in this process, or a subprocess where the process is part of the case), as
tests/test_hostile_round4.py does for round 4."""
import importlib.metadata
import importlib.util
import json
import os
import shutil
import time

import pytest

from client import OpenAIBackend
from personas import load_personas
from policy import EMBEDDED, PUBLIC_NAMES, load_model, load_policy, resolve_model
import simulator
from conftest import ROOT, is_appraisal, reply
from test_bad_input import ENV, assert_one_line, tiny
from test_hostile import command, faulty

MB = 1_000_000
PERSONA = load_personas(os.path.join(ROOT, "personas.json"))[0]
# B of the issue: the embedded model, the rules user, one iteration of two one-turn dialogues
B = ["--preset", "cpu", "--iterations", "1", "--dialogues-per-iteration", "2", "--minibatch-size", "2",
     "--max-turns", "1"]


def environ(monkeypatch, name, value=None):
    """Set (None: unset) an environment variable for this process and for the scripts test_bad_input.cli
    starts (a command runs in a subprocess with RLVER_TEST_SUBPROCESS=1)."""
    for env in (os.environ, ENV):
        if value is None:
            monkeypatch.delitem(env, name, raising=False)
        else:
            monkeypatch.setitem(env, name, value)


# ----------------------------------------------------------------------------------------------
# Cases 4 and 5: a URL user's text is read in linear time and a bounded number of digits
# ----------------------------------------------------------------------------------------------
# A megabyte of each shape that made a reader backtrack (seconds for 20,000 characters, hours for a
# megabyte), of spaces (the whitespace, read in one pass before too) and of the shape slowest to
# read in one pass (pleasantries: a closing clause, then a farewell search over all of it).
SHAPES = {
    "stars": "*" * MB,
    "underscores": "_" * MB,
    "digits": "7" * MB,
    "spaces": " " * MB,
    "newlines": "\n" * MB,
    "a mix, a line each": "\n".join(["*" * (MB // 5), "_" * (MB // 5), "7" * (MB // 5), "\n" * (MB // 5),
                                      "Change" + " " * (MB // 5) + "x"]),
    "stars and underscores": "*_" * (MB // 2),
    "a label, then spaces": "Change" + " " * MB + "x",
    "a label, then stars": "Change" + "*" * MB + "x",
    "a change of a million digits": "Change: +" + "7" * MB,
    "a reaction, then blank lines": "Inner reaction:" + "\n" * MB,
    "good, then spaces": "good" + " " * MB + "x",
    "pleasantries": "ok" * (MB // 2),
}


def reaction_read(text):
    """The user's next message's prompt after an appraisal `text`: its reaction line is read
    (REACTION_LINE) into the private note."""
    history = [{"role": "user", "text": "hi"}, {"role": "agent", "text": "so"}]
    state = simulator.UserState(PERSONA, 30, history)
    state.appraisals.append({"change": 1, "emotion": 31, "appraisal": text})
    return simulator.user_turn_messages(state)


READERS = {"parse_change": simulator.parse_change, "clean_user_text": simulator.clean_user_text,
           "says_goodbye": simulator.says_goodbye,
           "says_goodbye sage": lambda text: simulator.says_goodbye(text, "sage"),
           "the reaction line": reaction_read}


@pytest.mark.parametrize("shape", SHAPES)
def test_a_megabyte_of_each_shape_is_read_by_every_reader_in_under_a_second(shape):
    """Case 5, each reader on its own: seconds of this process's CPU, which another process on the machine
    does not stretch."""
    seconds = {}
    for name, read in READERS.items():
        started = time.process_time()
        read(SHAPES[shape])
        seconds[name] = time.process_time() - started
    assert max(seconds.values()) < 1.0, seconds


@pytest.mark.parametrize("text, change", [("Change: +123456", 123456), ("Change: -0000009", None),
                                          ("Change: +1234567", None), ("Change: +" + "9" * 5000, None),
                                          ("Change:\n" + "9" * 5000, None)],
                         ids=["6 digits", "7 with zeros", "7 digits", "5000 digits", "5000 below"])
def test_a_change_of_more_than_six_digits_is_unread(text, change):
    """Case 4: int() refuses more than 4,300 digits; 6 are read, more are unread, never an exception."""
    assert simulator.parse_change(text) == change


def url_simulator(server, answer, max_turns=8):
    """A Simulator whose user is the real URL client against a server on 127.0.0.1 answering each request
    with answer(n, messages) (n: the request's number, from 1), and the state of one dialogue."""
    def handle(handler, n, body):
        content = json.dumps({"choices": [{"message": {"content": answer(n, body["messages"])}}]})
        reply(handler, 200, content.encode())
    srv = server(handle)
    sim = simulator.Simulator(OpenAIBackend(srv.url, max_retries=0), max_turns=max_turns)
    return sim, sim.start(PERSONA)


@pytest.mark.parametrize("first, again, change", [("Change: +" + "9" * 5000, "Change: +2", 2),
                                                  ("Change: N", "Change: +" + "9" * 5000, None)],
                         ids=["in the first answer", "in the re-ask's"])
def test_a_url_users_change_of_5000_digits_is_unread_in_either_answer(first, again, change, server):
    """Case 4, through the URL client: the first answer's change of 5,000 digits is re-asked; the re-ask's
    is unread, and the dialogue ends there, unread."""
    sim, state = url_simulator(server, lambda n, messages: first if n == 1 else again)
    sim.step([state], ["That sounds hard."])
    assert state.appraisals[-1]["change"] == change
    assert state.end_reason == (None if change else "unread")


def fill(unit, then=""):
    """`unit` repeated to about the most a URL reply may hold (OpenAIBackend.max_reply_bytes, in its JSON:
    a newline takes two bytes there), then `then`; the client strips a reply, so a run of blank lines
    needs a word after it to arrive."""
    return unit * ((OpenAIBackend.max_reply_bytes - 100) // (len(json.dumps(unit)) - 2)) + then


@pytest.mark.parametrize("appraisal, message, end", [
    (fill("*"), "Fine.", "unread"), (fill("_"), "Fine.", "unread"),
    ("Change" + fill(" ", "x"), "Fine.", "unread"), ("Change: +2\n" + fill("\n", "x"), "Fine.", None),
    ("Change: +2", fill("7"), None)],
    ids=["an appraisal of stars", "of underscores", "a label, then spaces", "a change, then blank lines",
         "a message of digits"])
def test_a_url_users_reply_of_a_megabyte_ends_unread_or_goes_on_at_once(appraisal, message, end, server):
    """Case 5, through the URL client: an appraisal that is such a text ends the dialogue unread (after
    its re-ask); one that states its change goes on, its reaction line read, and the user's next message,
    such a text, is cleaned and read for a farewell. Seconds at most, where each of them hung."""
    sim, state = url_simulator(server, lambda n, messages: appraisal if is_appraisal(messages) else message)
    started = time.perf_counter()
    sim.step([state], ["That sounds hard."])
    assert time.perf_counter() - started < 10
    assert state.end_reason == end and (state.appraisals[-1]["change"] is None) == (end == "unread")
    assert state.history[-1]["role"] == ("agent" if end else "user")


# ----------------------------------------------------------------------------------------------
# Case 6: the model cache is taken only whole and made atomically
# ----------------------------------------------------------------------------------------------
def cache_target(cache):
    """Where resolve_model converts the embedded model to in the cache folder `cache`."""
    package, gguf_file = EMBEDDED["smollm2"]
    folder = importlib.util.find_spec(package).submodule_search_locations[0]
    version = importlib.metadata.version(package.replace("_", "-"))
    return cache / f"smollm2-{version}-{os.path.getsize(os.path.join(folder, gguf_file))}"


def half_converted(cache):
    """A cache holding a model's config and tokenizer and an empty model.safetensors, as older code, a
    crash or a full disk could leave it (and a stray file, to see that the folder is replaced, not
    filled in). Each of the three files is there: only what they hold shows it is no model (issue 55)."""
    target = cache_target(cache)
    target.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(os.path.join(resolve_model("smollm2"), name), target)
    (target / "model.safetensors").write_bytes(b"")
    (target / "stray.txt").write_text("left by a crash")
    return target


@pytest.mark.smollm2
@pytest.mark.parametrize("variable", ["RLVER_CACHE", "HOME"])
def test_a_cache_path_that_is_a_file_is_one_line(variable, tmp_path, monkeypatch, capsys):
    """Case 6: $RLVER_CACHE, or $HOME without it, naming a file: one line naming RLVER_CACHE, before
    30 s of converting."""
    (tmp_path / "file").write_text("not a folder")
    environ(monkeypatch, "RLVER_CACHE", None)
    environ(monkeypatch, variable, str(tmp_path / "file"))
    code, _, err, seconds = command(capsys, "ppo.py", *B, "--out", str(tmp_path / "run"))
    assert_one_line(code, err, str(tmp_path / "file"), "Not a directory", "set RLVER_CACHE")
    assert seconds < 20


@pytest.mark.smollm2
def test_a_file_where_the_converted_model_goes_is_one_line(tmp_path, monkeypatch, capsys):
    """Case 6: a writable cache holding a file of the converted folder's name: one line naming that
    path, before 30 s of converting, and the file is left as it was."""
    target = cache_target(tmp_path / "cache")
    target.parent.mkdir()
    target.write_text("not a model")
    environ(monkeypatch, "RLVER_CACHE", str(tmp_path / "cache"))
    code, _, err, seconds = command(capsys, "ppo.py", *B, "--out", str(tmp_path / "run"))
    assert_one_line(code, err, str(target), "File exists", "set RLVER_CACHE")
    assert seconds < 20
    assert target.read_text() == "not a model"
    assert os.listdir(tmp_path / "cache") == [target.name]  # no temporary folder made


@pytest.mark.smollm2
@pytest.mark.parametrize("held", ["nothing", "half a model"])
def test_a_read_only_cache_is_one_line(held, tmp_path, monkeypatch):
    """Case 6: a read-only cache (tests/faults.py: root writes through chmod) that holds no model, or
    half of one: one line naming RLVER_CACHE, not a model taken half or a conversion that cannot be
    saved."""
    cache = tmp_path / "cache"
    cache.mkdir()
    if held == "half a model":
        half_converted(cache)
    environ(monkeypatch, "RLVER_CACHE", str(cache))
    code, _, err, _ = faulty("--read-only", cache, "--", "ppo.py", *B, "--out", tmp_path / "run")
    assert_one_line(code, err, str(cache), "Read-only file system", "set RLVER_CACHE")


@pytest.mark.smollm2
def test_a_half_converted_model_is_converted_again_and_replaces_it(tmp_path, monkeypatch):
    """Case 6: a writable cache holding half a model: converted again into a temporary folder, which
    replaces it whole (the one conversion of this module, about 30 s), and the model loads."""
    whole = resolve_model("smollm2")  # the machine's own cache
    target = half_converted(tmp_path / "cache")
    environ(monkeypatch, "RLVER_CACHE", str(tmp_path / "cache"))
    assert resolve_model("smollm2") == str(target)
    assert sorted(os.listdir(target)) == sorted(os.listdir(whole))  # the stray file went with the half
    assert os.listdir(tmp_path / "cache") == [target.name]  # no temporary folder left
    model, _ = load_model("smollm2")
    assert model.config.num_hidden_layers > 0


# ----------------------------------------------------------------------------------------------
# Cases 10 and 11: redaction changes nothing that is not a secret, and reaches every file
# ----------------------------------------------------------------------------------------------
KEY = "sk-abcdefghijklmnop1234"


@pytest.mark.parametrize("key", ["a", "x", KEY])
def test_the_reply_scrub_changes_no_text_but_the_key_itself(key, server, monkeypatch):
    """Case 10: the URL client scrubbed its key from a reply (a proxy's echo of the header): with
    OPENAI_API_KEY=a, "Change: +2" became "Ch<redacted>nge: +2" and every dialogue was unread. No text is
    ever scrubbed now (issue 61): a placeholder changes nothing, and a reply holding a real key is
    refused, one line naming the server and never the key."""
    monkeypatch.setenv("OPENAI_API_KEY", key)
    text = f"Inner reaction: that lands; the mask{key}ed words.\nseen: Bearer {key}\nChange: +2"
    sim, state = url_simulator(server, lambda n, messages: text, max_turns=1)
    if key == KEY:
        with pytest.raises(simulator.SimulatorError) as error:
            sim.step([state], ["That sounds hard."])
        assert "holds the key of $OPENAI_API_KEY" in str(error.value) and key not in str(error.value)
        assert state.appraisals == []
        return
    sim.step([state], ["That sounds hard."])
    assert state.appraisals[-1]["appraisal"] == text
    assert state.emotion == sim.start_emotion + 2


def test_a_key_in_the_models_path_is_in_no_file_the_run_writes(tiny_model_dir, personas_file, tmp_path,
                                                               capsys):
    """Case 11: a model folder named like a key was redacted on stderr and in config.json, and written in
    clear into each checkpoint's adapter_config.json (base_model_name_or_path) and peft's README.md."""
    model, out = tmp_path / KEY / "model", tmp_path / "run"
    shutil.copytree(tiny_model_dir, model)
    argv = tiny(str(model), personas_file, out, "--iterations", "1", "--save-every", "1")
    code, _, err, _ = command(capsys, "ppo.py", *argv)
    assert code == 0 and KEY not in err, err[-2000:]
    written = {path.relative_to(out): path.read_bytes() for path in out.rglob("*") if path.is_file()}
    assert any(path.name == "adapter_config.json" for path in written)
    assert [str(path) for path, data in written.items() if KEY.encode() in data] == []


@pytest.mark.smollm2
def test_a_key_in_rlver_cache_is_in_no_file_peft_writes(tmp_path, monkeypatch):
    """Case 11 as the issue found it: $RLVER_CACHE a folder named like a key (here holding a link to this
    machine's converted model, so nothing converts): the policy's saved adapter names no key."""
    cache = tmp_path / KEY
    cache.mkdir()
    cache_target(cache).symlink_to(resolve_model("smollm2"))
    environ(monkeypatch, "RLVER_CACHE", str(cache))
    policy, _ = load_policy("smollm2", device="cpu", lora_r=2)
    policy.save_pretrained(tmp_path / "adapter", save_embedding_layers=False)  # as run.Run.save
    texts = {path.name: path.read_text() for path in (tmp_path / "adapter").iterdir()
             if path.suffix != ".safetensors"}
    assert {"adapter_config.json", "README.md"} <= set(texts)
    assert [name for name, text in texts.items() if KEY in text] == []
    # the base by its public name (policy.public_name), not the cache's path
    assert json.loads(texts["adapter_config.json"])["base_model_name_or_path"] == PUBLIC_NAMES["smollm2"]
