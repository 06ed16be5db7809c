"""The decode loop (engine.Decoder) and what every loader must hold on a GPU: one KV cache a batch
keeps for the whole rollout, one decode step of fixed shapes that never waits for the host (so that
CUDA can capture it as a graph), greedy tokens and log-probs as transformers' generate and a full
forward pass give them; and models loaded offline, with one set of kernels for sampling and
training (transformers' hub kernels off).

The tests marked gpu run on --device in --dtype (conftest.py); on CUDA the Decoder replays its
captured graphs, so there they hold the graphs to generate's tokens.

    python -m pytest tests/test_decoder.py -q
"""
import contextlib
import copy
import subprocess
import sys

import pytest
import torch

import engine
import rollout
from conftest import BF16_RTOL, ROOT, _tiny_llama, loose
from policy import float32_head, load_model, load_policy


@pytest.fixture(scope="module")
def peaked_model():
    """The tiny Llama with its output layer scaled up 20x: peaked next-token distributions (about
    4 nats, a trained model's are sharper), so that greedy decoding meets no near-ties that bf16
    rounding could break either way."""
    model, tokenizer = _tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


@pytest.fixture
def peaked_here(peaked_model, device, dtype):
    """The peaked model on the gpu-marked tests' device, in their dtype, its output layer in
    float32 as load_policy computes it in bf16 (--fp32-head): bf16 logits tie often at this scale."""
    model, tokenizer = peaked_model
    model = copy.deepcopy(model).to(device, dtype)
    if dtype != torch.float32:
        float32_head(model)
    return model, tokenizer


PROMPTS = ["hello there, how are you today?", "i feel sad about my work and my life",
           "ok", "tell me something kind, please, it has been a long week at the studio"]


def generate_alone(model, row, max_new_tokens, eos, **options):
    """transformers' own greedy generate of one unpadded row: its new tokens up to the first
    end-of-turn token."""
    ids = torch.tensor([row], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos[0],
                         **options)[0, len(row):].tolist()
    return out[:next((i + 1 for i, t in enumerate(out) if t in eos), len(out))]


def assert_same_greedy(ours, theirs, dtype):
    """Greedy tokens of two computations: the same in float32; in bf16 the same for the first 16
    (the two round differently, so a later near-tie between two tokens may break either way)."""
    if dtype == torch.float32:
        assert ours == theirs
    else:
        assert ours[:16] == theirs[:16]


def fresh_logprobs(model, row, tokens):
    """log p(tokens | row, earlier tokens) from one full forward pass."""
    ids = torch.tensor([row + tokens], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(row) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens, device=model.device)[:, None])[:, 0]


@pytest.mark.gpu
def test_greedy_tokens_and_log_probs_equal_generate_and_a_full_pass_over_turns(peaked_here, dtype):
    """Four prompts of different lengths decoded together for two turns, the second appending to
    the first in the same cache (ragged ends, rows done at different steps): each row's tokens are
    those generate() gives it alone, and each stored log-prob is a full forward pass's."""
    model, tokenizer = peaked_here
    chat = rollout.ChatTokens(tokenizer, False)
    decoder = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id, 256)
    rows = [chat.prompt(p) for p in PROMPTS]
    for turn in range(2):
        out = decoder.generate(rows, 10, greedy=True, fresh=turn == 0)
        for row, (tokens, logprobs) in zip(rows, out):
            assert_same_greedy(tokens, generate_alone(model, row, 10, chat.eos_ids), dtype)
            torch.testing.assert_close(torch.tensor(logprobs), fresh_logprobs(model, row, tokens).cpu(),
                                       atol=loose(dtype, 1e-5),
                                       rtol=0 if dtype == torch.float32 else BF16_RTOL)
        rows = [row + tokens + chat.user_turn("go on, please", tokens[-1])
                for row, (tokens, _) in zip(rows, out)]
    assert decoder.reused_tokens > sum(map(len, rows)) // 2  # the second turn ran only what it added


@pytest.mark.gpu
def test_rows_given_twice_run_once_and_decode_as_rows_given_once(peaked_here, dtype, monkeypatch):
    """A GRPO group's samples share their prompt: the prefill runs each distinct row once and
    copies its keys and values to the others. Two prompts given three and two times, greedy over
    two turns (the copies stay alike, so the second turn shares kept columns too): the prefill's
    passes hold two rows, and each row's cache columns, tokens and log-probs are those of a
    decoder given that prompt alone."""
    model, tokenizer = peaked_here
    chat = rollout.ChatTokens(tokenizer, False)
    passes = []
    run_into = engine.run_into
    monkeypatch.setattr(engine, "run_into", lambda model, cache, ids, *rest: (
        passes.append(ids.shape), run_into(model, cache, ids, *rest))[1])
    together = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id, 256)
    alone = [engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id, 256) for _ in PROMPTS[:2]]
    which = (0, 1, 0, 0, 1)
    rows = [chat.prompt(PROMPTS[p]) for p in which]
    for turn in range(2):
        passes.clear()
        out = together.generate(rows, 10, greedy=True, fresh=turn == 0)
        assert [shape[0] for shape in passes if shape[1] > 1] == [2]  # the prefill: 2 rows
        single = [decoder.generate([rows[p]], 10, greedy=True, fresh=turn == 0)[0]
                  for p, decoder in enumerate(alone)]
        for b, (row, (tokens, logprobs), p) in enumerate(zip(rows, out, which)):
            assert tokens == single[p][0]
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(single[p][1]),
                                       atol=loose(dtype, 1e-5), rtol=0)
            for layer in (0, -1):
                torch.testing.assert_close(together.cache.keys[layer][b, :, :len(row) - 1],
                                           alone[p].cache.keys[layer][0, :, :len(row) - 1],
                                           atol=loose(dtype, 1e-5), rtol=0)
        rows = [row + tokens + chat.user_turn("go on, please", tokens[-1])
                for row, (tokens, _) in zip(rows, out)]


@pytest.mark.gpu
def test_the_users_repetition_penalty_is_generates(peaked_here, dtype):
    """Greedy decoding with a repetition penalty of 1.2 (the `same` user's replies) gives the tokens
    generate() gives with it, and 1.0 those without, for each of a few prompts; the penalty changes
    what this model writes for some of them (else an ignored penalty would pass)."""
    model, tokenizer = peaked_here
    eos = rollout.eos_ids(tokenizer)
    decoder = engine.Decoder(model, eos, tokenizer.pad_token_id)
    changed = []
    for text in ["hello", "word word word", "i feel sad", "say it again and again " * 4, "ok ok"]:
        row = rollout.chat_ids(tokenizer, [{"role": "user", "content": text}])
        written = {}
        for penalty in (1.0, 1.2):
            (tokens, _), = decoder.generate([row], 40, greedy=True, penalty=penalty, fresh=True)
            expected = generate_alone(model, row, 40, eos, repetition_penalty=penalty)
            assert_same_greedy(tokens, expected, dtype)
            written[penalty] = tokens
        changed.append(written[1.0] != written[1.2])
    assert any(changed)


def test_sampling_draws_from_the_tempered_softmax(peaked_model):
    """Many rows of one prompt, one sampled token each: how often each token is drawn follows
    softmax(logits / temperature) (the largest gap to it below 5 standard errors), at temperatures 1
    and 0.5, and the stored log-prob is the token's under that softmax."""
    model, tokenizer = peaked_model
    chat = rollout.ChatTokens(tokenizer, False)
    row = chat.prompt("how are you?")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([row])).logits[0, -1].float()
    decoder = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id)
    n = 4000
    torch.manual_seed(0)
    for temperature in (1.0, 0.5):
        out = decoder.generate([row] * n, 1, temperature=temperature, fresh=True)
        drawn = torch.tensor([tokens[0] for tokens, _ in out])
        logprobs = torch.log_softmax(logits / temperature, -1)
        stored = torch.tensor([lp[0] for _, lp in out])
        torch.testing.assert_close(stored, logprobs[drawn], atol=1e-5, rtol=0)
        p = logprobs.exp()
        share = torch.bincount(drawn, minlength=len(p)).float() / n
        gap = (share - p).abs() / (p * (1 - p) / n).sqrt().clamp(min=1e-3)
        assert gap.max() < 5, (temperature, gap.max())


def test_the_decode_step_never_waits_for_the_host(peaked_model):
    """The step compiles as one graph (torch.compile, fullgraph): a .item(), a data-dependent shape
    or any other host synchronisation inside it would break the graph and fail here, as it would
    fail a CUDA graph capture. A stand-in that adds one is caught, so the check can fail."""
    model, tokenizer = peaked_model
    chat = rollout.ChatTokens(tokenizer, False)
    decoder = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id)
    decoder.generate([chat.prompt(p) for p in PROMPTS], 2, fresh=True)
    decoder.state["step"].zero_()
    for greedy, penalised in ((False, False), (True, True)):  # the policy's step, the user's
        torch._dynamo.reset()
        torch.compile(decoder.step, backend="eager", fullgraph=True)(256, greedy, penalised)
    run_into = engine.run_into

    def waits(model, cache, ids, lengths, width):
        if int(lengths.max()) > 10 ** 9:  # a host synchronisation
            pass
        return run_into(model, cache, ids, lengths, width)
    torch._dynamo.reset()
    engine.run_into = waits
    try:
        with pytest.raises(Exception, match="(?i)graph break|data-dependent|item"):
            torch.compile(decoder.step, backend="eager", fullgraph=True)(256, False, False)
    finally:
        engine.run_into = run_into
        torch._dynamo.reset()


def test_a_row_that_sits_out_keeps_its_cache_and_a_seated_row_reuses_the_closest(peaked_model):
    """A row given as None keeps what the cache holds of it (its next call reads it), and with seat
    a conversation goes to the row that shares the longest start with it: a re-ask that extends an
    appraisal runs only what it adds, and answers as the same conversation run whole does."""
    model, tokenizer = peaked_model
    chat = rollout.ChatTokens(tokenizer, False)
    decoder = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id)
    a, b = chat.prompt("first conversation " * 5), chat.prompt("second one, longer " * 8)
    (ta, _), (tb, _) = decoder.generate([a, b], 4, greedy=True, fresh=True)
    decoder.generate([None, b + tb + [5, 6]], 3, greedy=True)  # a sits out
    extended = a + ta + [7, 8, 9]
    (again, logprobs), = decoder.generate([extended], 4, greedy=True, seat=True)
    assert decoder.reused_tokens == len(a) + len(ta) - 1  # a's row: all but its unwritten last token
    whole = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id)
    (expected, expected_logprobs), = whole.generate([extended], 4, greedy=True, fresh=True)
    assert again == expected
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected_logprobs), atol=1e-5,
                               rtol=0)


# ----------------------------------------------------------------------------------------------
# Offline, one set of kernels: transformers' hub kernels never run
# ----------------------------------------------------------------------------------------------
def test_no_loader_turns_hub_kernels_on_or_sets_a_kernels_mode(tiny_model_dir, monkeypatch):
    """transformers 5.25 turns hub kernels on for a from_pretrained model: kernelize at load and at
    every train() / eval() fetches kernel code from the Hugging Face Hub (a ValueError offline) and
    picks kernels by mode, so the sampler (eval) and the trainer (train) would compute apart. Every
    loader here turns them off: through load_model and load_policy, and through train(), eval() and
    a pass of each, nothing asks for kernelize or a kernels mode."""
    import kernels
    import transformers.modeling_utils as modeling

    def refuse(*args, **kwargs):
        raise AssertionError(f"hub kernels used: {args[:1]} {kwargs}")
    monkeypatch.setattr(modeling, "kernelize", refuse)
    monkeypatch.setattr(kernels, "kernelize", refuse)
    set_use = modeling.PreTrainedModel.set_use_kernels
    monkeypatch.setattr(modeling.PreTrainedModel, "set_use_kernels",
                        lambda self, use, *a, **k: refuse(use) if use else set_use(self, use, *a, **k))
    base, tokenizer = load_model(tiny_model_dir)
    policy, _ = load_policy(tiny_model_dir, device="cpu", lora_r=4, gradient_checkpointing=True)
    ids = torch.tensor([tokenizer("hello there")["input_ids"]])
    for model in (base, policy):
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        for train in (True, False):
            model.train(train)
            model(input_ids=ids).logits.sum()
            assert not inner.use_kernels and getattr(inner, "_kernels_mode", None) is None


def test_bitsandbytes_fetches_no_kernel_at_import():
    """bitsandbytes 0.50, at its import on a CPU with AVX512-BF16, asks the `kernels` package for a
    4-bit kernel from the Hugging Face Hub; the loaders import it first with that import failing, so
    the call never comes (on a CPU without AVX512-BF16 it never would: there this cannot fail)."""
    code = ("import kernels, sys\n"
            "calls = []\n"
            "kernels.get_kernel = lambda *a, **k: calls.append(a)\n"
            "import policy\n"
            "policy.import_bitsandbytes()\n"
            "import peft\n"
            "assert 'bitsandbytes' in sys.modules and sys.modules['kernels'] is kernels\n"
            "print('get_kernel calls', calls)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "get_kernel calls []" in done.stdout


@pytest.mark.gpu
def test_a_width_first_met_at_the_last_step_decodes_as_generate(peaked_here, dtype):
    """A 248-token row given 10 new tokens steps up to the attention width 512 at its last step, so
    on CUDA that width's graph is warmed up and captured there (its warm-up must write within the
    outputs); with no end-of-turn id the row runs every step, beside a short one. The tokens are
    generate()'s with no end-of-turn token either, the log-probs a full pass's."""
    model, tokenizer = peaked_here
    rows = [[5 + (k % 300) for k in range(248)], [7] * 100]
    decoder = engine.Decoder(model, [-1], tokenizer.pad_token_id, 1024)
    out = decoder.generate(rows, 10, greedy=True, fresh=True)
    for row, (tokens, logprobs) in zip(rows, out):
        ids = torch.tensor([row], device=model.device)
        expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  do_sample=False, max_new_tokens=10, eos_token_id=None,
                                  pad_token_id=0)[0, len(row):].tolist()
        assert len(tokens) == 10  # (generate may still stop at the config's end-of-turn token)
        assert_same_greedy(tokens[:len(expected)], expected, dtype)
        torch.testing.assert_close(torch.tensor(logprobs), fresh_logprobs(model, row, tokens).cpu(),
                                   atol=loose(dtype, 1e-5),
                                   rtol=0 if dtype == torch.float32 else BF16_RTOL)


class CapturedStep:
    """A CUDA graph as the Decoder uses one, on the CPU: what runs inside `torch.cuda.graph(g)` is
    recorded, not run (a capture launches nothing), and g.replay() runs it. With it the Decoder's
    CUDA control flow (widths in steps of WIDTH_STEP, the host's look every SYNC_EVERY steps, the
    warm-up before each capture) runs on the CPU, eagerly."""
    capturing = None  # the graph being captured

    def __init__(self):
        self.calls = []

    def replay(self):
        for step, key in self.calls:
            step(*key)


def emulate_cuda_graphs(monkeypatch, decoder):
    """The Decoder captures and replays its step as on CUDA (CapturedStep); returns the keys it
    captured, in order."""
    captured = []

    class Capture:
        def __init__(self, graph, pool=None):
            self.graph = graph

        def __enter__(self):
            CapturedStep.capturing = self.graph

        def __exit__(self, *exc):
            CapturedStep.capturing = None

    class Stream:
        def wait_stream(self, other):
            pass

    step = decoder.step

    def recorded_step(*key):
        if CapturedStep.capturing is None:
            return step(*key)
        CapturedStep.capturing.calls.append((step, key))
        captured.append(key)

    monkeypatch.setattr(decoder, "step", recorded_step)
    for name, value in {"CUDAGraph": CapturedStep, "graph": Capture, "Stream": Stream,
                        "stream": lambda stream: contextlib.nullcontext(),
                        "current_stream": Stream, "graph_pool_handle": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    decoder.graphs = {}
    return captured


@pytest.mark.parametrize("prompt_tokens", [248, 241, 250])
def test_a_graph_first_needed_at_the_last_step_writes_within_the_outputs(peaked_model,
                                                                         monkeypatch,
                                                                         prompt_tokens):
    """The CUDA control flow on the CPU (emulate_cuda_graphs): a row of 248 tokens given 10 new
    ones first needs the attention width 512 at its last step, so the graph of that width is
    warmed up and captured there; its warm-up steps must write no column past the outputs (on CUDA
    that write is a device-side assert that ends the run) and none of the steps' own. Two rows
    that never end (no end-of-turn id) decode through every step and the host's looks; the tokens
    and log-probs equal the eager decoder's (no graphs), step for step, with the widths met
    earlier (241: at step 7, just before a look) and later (250: never)."""
    model, tokenizer = peaked_model
    never = [-1]  # an end-of-turn id no token has: every row runs to the last step
    rows = [[5 + (k % 300) for k in range(prompt_tokens)], [7] * 100]
    eager = engine.Decoder(model, never, tokenizer.pad_token_id, 1024)
    expected = eager.generate(rows, 10, greedy=True, fresh=True)
    graphed = engine.Decoder(model, never, tokenizer.pad_token_id, 1024)
    captured = emulate_cuda_graphs(monkeypatch, graphed)
    out = graphed.generate(rows, 10, greedy=True, fresh=True)
    widths = [key[0] for key in captured]
    assert widths == ([256, 512] if prompt_tokens + 9 > 256 else [256]), widths
    for (tokens, logprobs), (want, want_logprobs) in zip(out, expected):
        assert len(tokens) == 10 and tokens == want
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs),
                                   atol=1e-5, rtol=0)
    # a second call with every width captured already: replays only, the same tokens
    assert graphed.generate(rows, 10, greedy=True, fresh=True) == out


def test_the_sampler_draws_a_far_tail_as_often_as_its_log_prob_says():
    """One token at log-prob about 0 and 8,191 at -16 below it (1.1e-7 each, where float32 noise
    starts to fall short): 16,000 draws of engine.gumbel_max, the decode step's draw, find the
    tail about 15 times, as its recorded mass 9.2e-4 says, within a chi-square's 99% interval. A
    float32 draw fails a tail further out (tools/bench.py tail measures both: docs/results.md);
    here the draw must be the float64 Gumbel-max of its stream, which a float32 one is not."""
    vocabulary, gap, n, chunk = 8192, 16.0, 16_000, 2000
    logits = torch.full((vocabulary,), -gap)
    logits[0] = 0.0
    logprobs = torch.log_softmax(logits, -1)
    # the law the draw follows: the softmax of the log-probs it is given, summed in float64 (in
    # float32, 1 + 1e-8 is 1: the top token's own log-prob misses a tenth of the tail)
    tail = torch.softmax(logprobs.double(), -1)[1:].sum().item()
    torch.manual_seed(0)
    found = sum(int((engine.gumbel_max(logprobs.expand(chunk, -1)) != 0).sum())
                for _ in range(n // chunk))
    expected = n * tail
    chi_square = (found - expected) ** 2 / expected + (found - expected) ** 2 / (n - expected)
    assert chi_square < 6.63, (found, expected)  # the 99% point with one degree of freedom
    # the same uniforms, drawn in float64, make the draw: a float32 stream would be another
    rows = torch.log_softmax(torch.randn(4, 50) * 3, -1)
    torch.manual_seed(1)
    drawn = engine.gumbel_max(rows)
    torch.manual_seed(1)
    u = torch.rand(rows.shape, dtype=torch.float64)
    assert torch.equal(drawn, (rows.double() - u.log().neg().log()).argmax(-1))


def test_the_cache_takes_columns_as_rows_need_them(peaked_model):
    """--max-context bounds the policy's cache, it does not allocate it: a Decoder allowed a
    million columns holds 1,024 for short rows and grows by 1,024 when a row needs more (its rows
    copied in), and decodes as one whose cache was as long from the start."""
    model, tokenizer = peaked_model
    chat = rollout.ChatTokens(tokenizer, False)
    rows = [chat.prompt(p) for p in PROMPTS]
    growing = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id, 1_000_001)
    whole = engine.Decoder(model, chat.eos_ids, tokenizer.pad_token_id, 2049)
    whole.allocate(len(rows), 2049, 10)
    for turn, length in enumerate((1024, 2048)):
        out = growing.generate(rows, 10, greedy=True, fresh=turn == 0)
        assert growing.cache.keys[0].shape[2] == length
        assert out == whole.generate(rows, 10, greedy=True, fresh=turn == 0)
        # the next turn holds more than 1,024 tokens: the cache grows, what it held is kept
        rows = [row + tokens + chat.user_turn("go on, " * 600, tokens[-1])
                for row, (tokens, _) in zip(rows, out)]
    assert growing.reused_tokens > 0 and whole.cache.keys[0].shape[2] == 2049
