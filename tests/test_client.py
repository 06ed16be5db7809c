"""Tests for client.py, the URL user's client, against OpenAI-compatible servers on 127.0.0.1: answers,
retries, deadlines, caps, keys, malformed replies, and the simulator's reasoned read-out through it.

    python -m pytest tests/test_client.py -q
"""
import json
import os
import re
import time

import pytest

from client import OpenAIBackend
from personas import load_personas
import evaluate
from conftest import chat_completion, completion, in_process, openings, reply, transcript
from test_bad_input import ENV, assert_one_line, shell, error_lines
from simulator import Simulator, SimulatorError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARM = ("That sounds really painful, especially after you were promised it. It makes sense that you "
        "feel hurt. What has been the hardest part of this for you?")


# ----------------------------------------------------------------------------------------------
# URL backend against a local OpenAI-compatible server
# ----------------------------------------------------------------------------------------------
MESSAGES = [{"role": "user", "content": "hello"}]


def test_url_backend_normal_answer(serve):
    server = serve(lambda n, body: completion("  echo: " + body["messages"][-1]["content"] + " "))
    backend = OpenAIBackend(server.url + "/", model="sim-model", backoff=0.01)
    conversations = [[{"role": "user", "content": f"message {k}"}] for k in range(6)]
    assert backend.chat(conversations, 17) == [f"echo: message {k}" for k in range(6)]  # in order, stripped
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["body"]["model"] == "sim-model" and request["body"]["max_tokens"] == 17
    assert request["body"]["temperature"] == 0.0 and request["body"]["messages"][0]["role"] == "user"


def test_url_backend_retries_then_succeeds(serve):
    server = serve(lambda n, body: (500, b"{}") if n < 2 else completion("fine"))
    backend = OpenAIBackend(server.url, max_retries=3, backoff=0.01)
    assert backend.chat([MESSAGES], 8) == ["fine"]
    assert len(server.requests) == 3


def test_url_backend_gives_up_after_bounded_tries(serve, monkeypatch):
    monkeypatch.setenv("RLVER_TEST_KEY", "sk-very-secret-123")
    server = serve(lambda n, body: (500, b'{"error": "boom"}'))
    backend = OpenAIBackend(server.url, api_key_env="RLVER_TEST_KEY", max_retries=2, backoff=0.01)
    with pytest.raises(SimulatorError) as info:
        backend.chat([MESSAGES], 8)
    message = str(info.value)
    assert len(server.requests) == 3
    assert server.url + "/chat/completions" in message and "HTTP 500" in message and "3 tries" in message
    assert "sk-very-secret-123" not in message


def test_url_backend_client_error_is_not_retried(serve):
    server = serve(lambda n, body: (400, b'{"error": "bad request"}'))
    with pytest.raises(SimulatorError, match="HTTP 400 after 1 tries"):
        OpenAIBackend(server.url, max_retries=3, backoff=0.01).chat([MESSAGES], 8)
    assert len(server.requests) == 1


def test_url_backend_timeout_is_bounded(serve):
    server = serve(lambda n, body: "hang")
    backend = OpenAIBackend(server.url, timeout=0.2, max_retries=1, backoff=0.01)
    t0 = time.time()
    with pytest.raises(SimulatorError) as info:
        backend.chat([MESSAGES], 8)
    elapsed = time.time() - t0
    assert elapsed < 3.0, elapsed
    assert server.url in str(info.value) and "2 tries" in str(info.value)
    assert len(server.requests) == 2


@pytest.mark.parametrize("data", [b"this is not json", b'{"id": "x", "object": "chat.completion"}',
                                  b'{"choices": []}'])
def test_url_backend_malformed_response(serve, data):
    server = serve(lambda n, body: (200, data))
    with pytest.raises(SimulatorError, match="malformed response") as info:
        OpenAIBackend(server.url, max_retries=1, backoff=0.01).chat([MESSAGES], 8)
    assert server.url in str(info.value)
    assert len(server.requests) == 2


def test_url_backend_sends_key_from_env(serve, monkeypatch):
    server = serve(lambda n, body: completion("ok"))
    monkeypatch.setenv("RLVER_TEST_KEY", "sk-very-secret-123")
    OpenAIBackend(server.url, api_key_env="RLVER_TEST_KEY").chat([MESSAGES], 8)
    assert server.requests[-1]["headers"]["Authorization"] == "Bearer sk-very-secret-123"
    monkeypatch.delenv("RLVER_TEST_KEY")
    OpenAIBackend(server.url, api_key_env="RLVER_TEST_KEY").chat([MESSAGES], 8)
    assert "Authorization" not in server.requests[-1]["headers"]


def test_url_backend_connection_refused():
    import socket

    with socket.socket() as s:  # a port nobody listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SimulatorError, match="connection failed"):
        OpenAIBackend(f"http://127.0.0.1:{port}/v1", max_retries=1, backoff=0.01).chat([MESSAGES], 8)


def test_simulator_over_url_backend(serve, persona):
    def respond(n, body):
        asked = body["messages"][-1]["content"]
        return completion("It helps a bit.\nChange: +4" if "Change: N" in asked else "you: okay. i guess.")
    server = serve(respond)
    sim = Simulator(OpenAIBackend(server.url))
    assert sim.readout == "reasoned"
    s = sim.start(persona)
    sim.step([s], [WARM])
    assert s.emotion == 44 and s.history[-1] == {"role": "user", "text": "okay. i guess.", "canned": False}
    assert len(server.requests) == 2


# ----------------------------------------------------------------------------------------------
# The command line
# ----------------------------------------------------------------------------------------------
# (appraisal the server writes, its answer to the one retry or None, the change expected)
SERVER_CASES = [
    ("Got right: it named the promotion.\nMissed: my hurt.\nInner reaction: R0.\nChange: \u22123", None, -3),
    ("Inner reaction: R1.\nChange\uff1a-3", None, -3),
    ("Inner reaction: R2.\n\u53d8\u5316\uff1a-3", None, -3),
    ("Inner reaction: R3.\nChange: \u20132", None, -2),
    ("Inner reaction: R4.\n**Change:** +4", None, 4),
    ("Inner reaction: R5.\nChange: 41 \u2192 38", "Change: -3", -3),       # unread, then read on retry
    ("Inner reaction: R6.\nChange: 45", "Change: +4", 4),                # beyond the scale, then within
    ("On a scale from -10 to +10 it is fine.\nInner reaction: R7.\nChange: +2", None, 2),
    ("Inner reaction: R8.\nChange: N", "I'd rather not say.", None),       # unread twice: the end
]


def test_reasoned_readout_against_a_fake_server(serve, persona):
    """Numbered agent replies against a URL simulator with the reasoned read-out, end to end: the
    server reads which reply is being appraised from the prompt and answers in one of the formats
    above."""
    seen = []

    def appraised(message):  # which scripted reply is the newest one in this appraisal
        newest = message["content"].split("The chatbot's newest reply:")[-1]
        return int(re.search(r"Reply number (\d)", newest).group(1))

    def respond(n, body):
        messages = body["messages"]
        seen.append(messages)
        if "could not be read" in messages[-1]["content"]:  # the retry follows the appraisal and its answer
            return completion(SERVER_CASES[appraised(messages[-3])][1])
        if "Change: N" in messages[-1]["content"]:
            return completion(SERVER_CASES[appraised(messages[-1])][0])
        # the user's reply echoes its private note and a score; none of it may reach the transcript
        return completion("[A note only you can see. Your mood: 47 out of 100.]\nInner reaction: LEAK.\n"
                          "Mood: 47/100\nI hear you. Go on.")
    server = serve(respond)
    sim = Simulator(OpenAIBackend(server.url), start_emotion=50,
                    max_turns=len(SERVER_CASES))
    state = sim.start(persona)
    while not state.end_reason:
        sim.step([state], [f"Reply number {state.turns}. How are you holding up?"])
    turns = transcript(state)
    agent = [t for t in turns if t["role"] == "agent"]
    assert [t["change"] for t in agent] == [c for _, _, c in SERVER_CASES]
    assert state.end_reason == "unread" and sim.counts["clamped_changes"] == 0
    assert sum("(re-asked for the change)" in t["appraisal"] for t in agent) == 3
    assert state.emotion == 50 + sum(c for _, _, c in SERVER_CASES[:-1])
    users = [t["text"] for t in turns if t["role"] == "user"][1:]
    assert users == ["I hear you. Go on."] * (len(SERVER_CASES) - 1)  # none after the unread one
    # each user reply was written from the reaction of the appraisal just before it, in a note
    replies_asked = [m for m in seen if "Change: N" not in m[-1]["content"]
                     and "could not be read" not in m[-1]["content"]]
    assert [re.findall(r"reaction to that reply: (R\d)", m[-1]["content"]) for m in replies_asked] == \
        [[f"R{k}"] for k in range(len(SERVER_CASES) - 1)]


def test_difficulty_override(write_personas, persona_entry):
    path = write_personas([persona_entry(id="a", difficulty="easy"),
                           persona_entry(id="b", difficulty="hard")])
    assert [p.difficulty for p in load_personas(path)] == ["easy", "hard"]
    assert ([p.difficulty for p in load_personas(path, None, "normal")]
            == ["normal", "normal"])


# ----------------------------------------------------------------------------------------------
# The URL client against a local server (cases 9, 10, 11 of issue 16; case 8 of issue 26)
# ----------------------------------------------------------------------------------------------
def test_a_trickling_server_hits_the_deadline(server):
    def trickle(handler, n, body):
        handler.send_response(200)
        handler.send_header("Content-Length", "1000000")
        handler.end_headers()
        for _ in range(400):  # a byte every 50 ms: every read succeeds, the reply takes 14 hours
            handler.wfile.write(b" ")
            handler.wfile.flush()
            time.sleep(0.05)
    s = server(trickle)
    t0 = time.time()
    with pytest.raises(SimulatorError, match="no complete reply within") as info:
        OpenAIBackend(s.url, timeout=1.0, max_retries=1, backoff=0.01).chat([MESSAGES], 8)
    assert time.time() - t0 < 4, time.time() - t0  # 2 tries of 1 s, not forever
    assert s.url in str(info.value) and "2 tries" in str(info.value)


def test_a_huge_reply_is_capped(server):
    s = server(lambda h, n, body: reply(h, 200, chat_completion("x" * 10_000_000)))
    with pytest.raises(SimulatorError, match="longer than the 1000000 bytes allowed") as info:
        OpenAIBackend(s.url, max_retries=0).chat([MESSAGES], 8)
    assert s.url in str(info.value)

    def chunked(handler, n, body):  # no Content-Length: the cap holds on what is read
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for _ in range(40):
            handler.wfile.write(b"40000\r\n" + b"y" * 0x40000 + b"\r\n")
        handler.wfile.write(b"0\r\n\r\n")
    s = server(chunked)
    with pytest.raises(SimulatorError, match="longer than the 1000000 bytes allowed"):
        OpenAIBackend(s.url, max_retries=0).chat([MESSAGES], 8)


def test_a_busy_server_is_retried_after_the_backoff_whatever_retry_after_asks(server):
    def busy(status):
        return lambda h, n, body: (reply(h, status, b"{}", [("Retry-After", "3600")]) if n == 1
                                   else reply(h, 200, chat_completion("ok")))
    for status in (429, 503):
        s = server(busy(status))
        t0 = time.time()
        assert OpenAIBackend(s.url, backoff=0.01).chat([MESSAGES], 8) == ["ok"]
        assert time.time() - t0 < 2 and s.count == 2


@pytest.mark.parametrize("data, words", [
    (b'[{"choices": []}]', "no choices[0].message.content"),
    (json.dumps({"choices": [{"message": {"content": ["a", "b"]}}]}).encode(), "list, not a string"),
    (json.dumps({"choices": [{"message": {"content": None}}]}).encode(), "NoneType, not a string"),
])
def test_a_wrong_json_type_is_a_retried_malformed_response(server, data, words):
    s = server(lambda h, n, body: reply(h, 200, data))
    with pytest.raises(SimulatorError, match="malformed response") as info:
        OpenAIBackend(s.url, max_retries=2, backoff=0.01).chat([MESSAGES], 8)
    assert words in str(info.value) and s.url in str(info.value) and s.count == 3


def test_a_401_names_the_keys_variable_never_the_key(server, tmp_path):
    s = server(lambda h, n, body: reply(h, 401, b'{"error": "bad key"}'))
    code, _, err, _ = shell(*openings(tmp_path / "out.jsonl", s.url), "--api-key-env", "RLVER_TEST_KEY",
                          timeout=120, env={**ENV, "RLVER_TEST_KEY": "sk-live-secret-999"})
    assert_one_line(code, err, "HTTP 401", s.url, "1 tries", "$RLVER_TEST_KEY", "nothing written")
    assert "sk-live-secret-999" not in err


def test_a_key_with_a_line_break_is_refused_unshown_and_its_trailing_newline_is_dropped(server, tmp_path):
    seen = []

    def respond(h, n, body):
        seen.append(h.headers["Authorization"])
        reply(h, 200, json.dumps({"choices": [{"message": {"content": "Long week."}}]}).encode())
    s = server(respond)
    argv = [*openings(tmp_path / "bad.jsonl", s.url), "--api-key-env", "RLVER_TEST_KEY"]
    code, _, err, _ = shell(*argv, timeout=120, env={**ENV, "RLVER_TEST_KEY": "sk-live-secret\n999"})
    assert code == 2 and len(error_lines(err)) == 1 and "$RLVER_TEST_KEY" in err, err[-2000:]
    assert "secret" not in err and "999" not in err and not seen
    argv = [*openings(tmp_path / "good.jsonl", s.url), "--api-key-env", "RLVER_TEST_KEY"]
    code, _, err, _ = shell(*argv, timeout=120, env={**ENV, "RLVER_TEST_KEY": "sk-live-secret-999\n"})
    assert code == 0 and seen and set(seen) == {"Bearer sk-live-secret-999"}, err[-2000:]


def test_a_simulator_url_with_a_query_keeps_it_after_the_path(serve, tmp_path, capsys):
    """Case 8: --simulator http://HOST/v1?api_key=X posts to /v1/chat/completions?api_key=X."""
    s = serve(lambda n, body: completion("Long week. Can I just talk?"))
    argv = [*openings(tmp_path / "out.jsonl", s.url + "?api_key=X")[1:], "--api-retries", "0"]
    code, _, err = in_process(evaluate.main, argv, capsys)
    paths = {r["path"] for r in s.requests}
    assert code == 0 and paths == {"/v1/chat/completions?api_key=X"}, (paths, err[-2000:])
