"""The URL user's client: any OpenAI-compatible /v1/chat/completions server (vLLM, SGLang,
llama.cpp, a hosted API) answering the simulated user's prompts.

OpenAIBackend.chat(conversations, max_new_tokens) -> texts, as every backend of the user answers
(rollout.make_backend picks one). It holds only the transport: a deadline for every request,
retries with backoff, a bounded reply, the key from an environment variable. The prompts, the
parser and the emotion are simulator.py's; this file imports cli.py (the key's variable, redact)
and simulator.py's SimulatorError only.
"""
import concurrent.futures
import http.client
import json
import os
import re
import socket
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field

from cli import KEY_VARIABLE, redact
from simulator import SimulatorError


# A bearer token as RFC 6750 spells one (b64token): what an issued key is made of
BEARER_TOKEN = re.compile(r"[A-Za-z0-9._~+/-]+=*")


def is_secret(key):
    """Whether a key is a secret that no reply may hold: one that looks like a key to cli.redact
    (an sk- or hf_ key), or a bearer token (BEARER_TOKEN) of 8 characters or more that mixes
    letters and digits, as issued keys do. Anything else is a placeholder for a server that ignores
    the key ("EMPTY", vLLM's; "x", "password", "assistant", "not-needed", "Change: -5"): sent, and
    never looked for in a reply, whose words it may equal."""
    mixed = any(c.isalpha() for c in key) and any(c.isdigit() for c in key)
    token = BEARER_TOKEN.fullmatch(key) is not None
    return redact(key) != key or (token and len(key) >= 8 and mixed)


class ReplyError(ValueError):
    """A server reply that is not a usable chat completion."""


@dataclass
class OpenAIBackend:
    """Any OpenAI-compatible /v1/chat/completions server (vLLM, SGLang, llama.cpp, a hosted
    API).
    The key comes from an environment variable and is never logged or saved.

    Limits, so that no server can hang or flood a run: each request has a total deadline of
    `timeout` seconds from connecting to its last byte, however slowly the server trickles; each
    call (all its tries and waits) at most timeout x (max_retries + 1); a reply is read up to
    max_reply_bytes. A failed try (a 429, a 5xx, a broken connection, a malformed reply) is tried
    again after an exponential backoff (backoff x 1, 2, 4 ... seconds) while the call's deadline
    allows; a Retry-After header is not read. A reply whose choices[0].message.content is not a
    string, or holds the key (is_secret), is a malformed response. Errors name the server (any
    password in its URL redacted), never the key."""
    base_url: str
    model: str = "default"
    api_key_env: str = KEY_VARIABLE
    timeout: float = 60.0
    max_retries: int = 4
    backoff: float = 1.0
    concurrency: int = 8
    max_reply_bytes: int = 1_000_000
    # a server's replies are not counted in tokens (the simulator's tokens/s: 0)
    counts: Counter = field(default_factory=Counter, init=False)
    name = "url"

    def __post_init__(self):
        # the path grows; a query (?api_key=...) stays after it
        parts = urllib.parse.urlsplit(self.base_url)
        self.url = parts._replace(path=parts.path.rstrip("/") + "/chat/completions")

    def _post(self, messages, max_new_tokens):
        """The reply's text, every type on the way checked. Each try takes at most its `seconds`
        in all: the socket timeout bounds each read, and a timer that shuts the socket down bounds
        their sum, which a server sending one byte at a time would otherwise stretch forever
        (shutting a socket down wakes a read blocked on it; the timer holds the socket itself,
        which the connection hands over to the response)."""
        body = json.dumps({"model": self.model, "messages": messages, "max_tokens": max_new_tokens,
                           "temperature": 0.0}).encode()
        # stripped: a key pasted with its newline still works
        key = os.environ.get(self.api_key_env, "").strip()
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        kind = http.client.HTTPConnection
        if self.url.scheme == "https":
            kind = http.client.HTTPSConnection
        path = self.url._replace(scheme="", netloc="").geturl()
        deadline = time.monotonic() + self.timeout * (self.max_retries + 1)
        for attempt in range(self.max_retries + 1):
            seconds = min(self.timeout, deadline - time.monotonic())
            end = time.monotonic() + seconds
            connection = kind(self.url.hostname, self.url.port, timeout=seconds)
            try:
                connection.connect()
                timer = threading.Timer(end - time.monotonic(), connection.sock.shutdown,
                                        [socket.SHUT_RDWR])
                timer.start()
                try:
                    connection.request("POST", path, body, headers)
                    response = connection.getresponse()
                    status, data = response.status, response.read(self.max_reply_bytes + 1)
                finally:
                    timer.cancel()
                    connection.close()
                if time.monotonic() >= end:  # a read the timer cut short
                    raise TimeoutError
                if len(data) > self.max_reply_bytes:
                    raise ReplyError(f"reply longer than the {self.max_reply_bytes} bytes allowed")
                if status == 200:
                    try:
                        content = json.loads(data)["choices"][0]["message"]["content"]
                    # not UTF-8 nor JSON: ValueErrors
                    except (ValueError, TypeError, KeyError, IndexError):
                        raise ReplyError("no choices[0].message.content in a JSON reply") from None
                    if not isinstance(content, str):
                        raise ReplyError(f"choices[0].message.content is {type(content).__name__}, "
                                         "not a string")
                    # a proxy that echoes the key: the reply is refused, never scrubbed (which would
                    # rewrite the user's words wherever a key equals them), so no text changes and
                    # the key is written nowhere
                    if is_secret(key) and key in content:
                        raise ReplyError(f"its text holds the key of ${self.api_key_env}, as a "
                                         "proxy that echoes the Authorization header would")
                    return content
                problem = f"HTTP {status}"
                if status in (401, 403):
                    problem += f" (is the key in ${self.api_key_env} right?)"
                if status != 429 and status < 500:  # a client error (a wrong key too) stays one
                    break
            except ReplyError as e:
                problem = f"malformed response ({e})"
            except (OSError, http.client.HTTPException) as e:
                # a timeout, or any error past the deadline
                late = isinstance(e, TimeoutError) or time.monotonic() >= end
                why = getattr(e, "reason", None) or e or type(e).__name__
                problem = (f"no complete reply within {seconds:.3g} s" if late
                           else f"connection failed ({why})")

            pause = self.backoff * 2 ** attempt
            if attempt == self.max_retries or time.monotonic() + pause >= deadline:
                break
            time.sleep(pause)
        raise SimulatorError(f"simulator server {redact(self.url.geturl())}: {problem} "
                             f"after {attempt + 1} tries")

    def check(self):
        """One request for one token, made before any model loads and before a folder is made
        (rollout.reach_simulator): a server that is down, or a wrong port, path, key or model name,
        is one line in seconds, not after minutes of loading, and leaves nothing behind. It is the
        request a dialogue makes, with its deadline and retries (a server still starting gets
        them), so what passes here is what a dialogue needs."""
        self._post([{"role": "user", "content": "Say ready."}], 1)

    def chat(self, conversations, max_new_tokens, repetition_penalty=None):
        """repetition_penalty is unused: the request sends none, so the server applies none (a
        server keeps its own prefix cache, as vLLM and SGLang do)."""
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return [text.strip()
                    for text in pool.map(lambda m: self._post(m, max_new_tokens), conversations)]
