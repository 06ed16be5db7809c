"""The engine behind rollout.py's one generate(rows, ...) call: a KV cache a batch of token rows
keeps across calls, and one decode step of fixed shapes, a CUDA graph on a GPU.

Decoder.generate(rows, max_new_tokens, ...) runs into the cache only what each row holds beyond
what its cache row has (a dialogue's new turn), then decodes token by token: each step draws from
the full tempered softmax (gumbel_max, no top-k, no top-p) and keeps each token's log-prob, the
sampler's log-prob that the trainers' importance weights compare with. The policy
(rollout.play_dialogues) and the `same` user (rollout.LocalBackend) each keep one for a run. It
knows no chat, no user and no loss, and imports nothing of the project: what a token means is
rollout.py's.
"""
import numpy as np
import torch

# ----------------------------------------------------------------------------------------------
# One KV cache a batch of token rows keeps across calls, and one decode step
# ----------------------------------------------------------------------------------------------
class KVCache:
    """The keys and values of a batch of token rows, (rows, kv heads, columns, head size) a layer:
    row b's token at position p sits in column p, so a row grows by appending (a Decoder copies
    the rows into a longer cache when they need more columns). The model's attention layers hand
    their new keys and values to update(), which writes them at `columns` (rows, new tokens) and
    returns the first `width` columns for attention, both set before each pass (run_into)."""

    def __init__(self, model, rows, length):
        config = model.config.get_text_config()
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        embeddings = model.get_input_embeddings().weight  # the dtype the layers compute in
        self.keys, self.values = ([embeddings.new_zeros(rows, heads, length, size)
                                   for _ in range(config.num_hidden_layers)] for _ in range(2))
        self.columns = self.width = None

    def update(self, keys, values, layer, *args, **kwargs):
        index = self.columns[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        self.keys[layer].scatter_(2, index, keys)
        self.values[layer].scatter_(2, index, values)
        return self.keys[layer][:, :, :self.width], self.values[layer][:, :, :self.width]


def run_into(model, cache, ids, lengths, width):
    """Run ids (B, S) through the decoder, row b's tokens at positions lengths[b], lengths[b] + 1,
    ..., their keys and values into those columns of cache (a column past the cache's last for
    padding goes to the last, which no token owns), each attending to its row's columns up to its
    own among the first `width`. Returns the hidden states (B, S, H). Padding after a row's tokens
    writes columns its later tokens overwrite before anything attends to them."""
    positions = lengths[:, None] + torch.arange(ids.shape[1], device=ids.device)        # (B, S)
    cache.columns = positions.clamp(max=cache.keys[0].shape[2] - 1)
    cache.width = width
    seen = torch.arange(width, device=ids.device) <= positions[:, :, None]              # (B, S, W)
    dtype = cache.keys[0].dtype
    mask = torch.zeros(seen.shape, dtype=dtype, device=ids.device)
    mask = mask.masked_fill(~seen, torch.finfo(dtype).min)[:, None]                  # (B, 1, S, W)
    # (a PeftModel hands get_decoder on to its base model; its LoRA layers run inside)
    return model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=positions,
                               cache=cache, use_cache=True).last_hidden_state


PREFILL_CHUNK = 1024  # prompt tokens a pass takes into the cache (masks linear in the context)
WIDTH_STEP = 256  # attention runs over the cache's used columns rounded up to a multiple of this
SYNC_EVERY = 8  # decode steps between two looks of the host at whether every row is done (CUDA)
GROW_COLUMNS = 1024  # a cache grows in steps of this many columns, as its rows need them
# Eager steps before a CUDA graph is captured (torch.cuda.graphs asks for warm-up runs): they
# write into as many spare output columns past the last step's, never into a step's own
WARMUP_STEPS = 2


def gumbel_max(logprobs):
    """One draw a row from softmax(logprobs) (B, V) -> (B,), without multinomial's host
    synchronisation: the argmax of log p + G, G = -log(-log u) Gumbel noise, u ~ U(0, 1) (the
    Gumbel-max trick). In float64: in float32 u lies on multiples of 2^-24, so G is at most 16.6
    and a token more than that below the top is never drawn (one nearer is drawn too rarely),
    while its recorded log-prob, and the trainer's, say it could be; float64's 2^-53 moves that
    bound to 36.7 nats, where even 152k tokens (Qwen2.5's vocabulary) hold less than 2e-11."""
    u = torch.rand(logprobs.shape, dtype=torch.float64, device=logprobs.device)           # (B, V)
    return (logprobs.double() - u.log().neg().log()).argmax(-1)


class Decoder:
    """Token-by-token generation for a batch of token rows, the policy's and the `same` user's
    alike, with one KVCache kept between calls: generate() runs into the cache only the tokens a
    row holds beyond those it has of it (a dialogue's new turn: its rows only grow), then decodes.
    Each new token comes out of step(), one pass of fixed shapes that never waits for the host; on
    CUDA it is captured once per attention width as a CUDA graph and replayed, and the host looks
    at whether every row is done every SYNC_EVERY steps. A row that is done (or sits a call out,
    None) stays in the batch, its writes going to a column it does not use yet."""

    def __init__(self, model, eos_ids, pad_id, length=None):
        # length: the most columns the cache may take (None: no bound); it takes them as needed
        self.model, self.pad_id, self.length = model, pad_id, length
        device = model.get_input_embeddings().weight.device
        self.eos = torch.tensor(eos_ids, device=device)
        # CUDA graphs, but not for bitsandbytes' 4-bit layers (not tried under capture)
        self.graphs = {} if device.type == "cuda" and not getattr(
            model, "is_loaded_in_4bit", False) else None
        self.cache = None
        self.steps = 0  # the decode steps the output buffers hold
        self.held = []  # the tokens the cache holds, a list a row

    def allocate(self, rows, length, steps):
        """Buffers for `rows` rows of `length` columns (the cache's), the decode state's and the
        outputs of up to `steps` steps (and WARMUP_STEPS spare columns, which only a graph's warm-up
        writes), the old cache's rows copied in (what they hold stays); the captured graphs, which
        write into the old buffers, go with them."""
        model = self.model
        device = self.eos.device
        old, self.cache = self.cache, KVCache(model, rows, length)
        if old is not None:
            for new, kept in zip(self.cache.keys + self.cache.values, old.keys + old.values):
                new[:kept.shape[0], :, :kept.shape[2]] = kept
        vocabulary = model.get_output_embeddings().weight.shape[0]
        self.steps = steps
        self.state = dict(
            token=torch.zeros(rows, dtype=torch.long, device=device),     # each row's input token
            lengths=torch.zeros(rows, dtype=torch.long, device=device),   # its tokens in the cache
            done=torch.ones(rows, dtype=torch.bool, device=device),
            step=torch.zeros((), dtype=torch.long, device=device),        # the step of this call
            seen=torch.zeros(rows, vocabulary, device=device),            # tokens it holds, counted
            temperature=torch.ones((), device=device),
            penalty=torch.ones((), device=device),                        # repetition penalty
            # each step's token and its log-prob, a column a step, then the warm-up's spare columns
            out_tokens=torch.zeros(rows, steps + WARMUP_STEPS, dtype=torch.long, device=device),
            out_logprobs=torch.zeros(rows, steps + WARMUP_STEPS, device=device))
        self.held += [[] for _ in range(rows - len(self.held))]
        if self.graphs is not None:
            self.graphs, self.pool = {}, torch.cuda.graph_pool_handle()

    def width(self, columns):
        """The attention width for rows that use at most `columns` columns, at most the cache's:
        where graphs are captured, a multiple of WIDTH_STEP (few widths: few graphs)."""
        multiple = WIDTH_STEP if self.graphs is not None else 1
        return min(self.cache.keys[0].shape[2], -(-columns // multiple) * multiple)

    def step(self, width, greedy, penalised):
        """One token for every row, in fixed shapes and without a host synchronisation: the input
        token's keys and values go to the row's next column, the next token is drawn from
        log softmax(logits / temperature) (greedy: the argmax of the logits; penalised: a logit of
        a token the row holds is divided by the repetition penalty where positive, multiplied where
        negative, as transformers does), its log-prob kept; a row that is done stays so and draws
        padding."""
        s = self.state
        hidden = run_into(self.model, self.cache, s["token"][:, None], s["lengths"], width)
        logits = self.model.get_output_embeddings()(hidden[:, -1]).float()               # (B, V)
        if penalised:
            scaled = torch.where(logits > 0, logits / s["penalty"], logits * s["penalty"])
            logits = torch.where(s["seen"] > 0, scaled, logits)
        logprobs = torch.log_softmax(logits / s["temperature"], -1)                       # (B, V)
        if greedy:  # the logits' argmax (two logits may round to one log-prob)
            token = logits.argmax(-1)                                                         # (B,)
        else:
            token = gumbel_max(logprobs)                                                      # (B,)
        picked = logprobs.gather(-1, token[:, None])[:, 0]                                    # (B,)
        token = torch.where(s["done"], self.pad_id, token)
        s["out_tokens"].index_copy_(1, s["step"][None], token[:, None])
        picked = torch.where(s["done"], 0.0, picked)
        s["out_logprobs"].index_copy_(1, s["step"][None], picked[:, None])
        if penalised:
            s["seen"].scatter_add_(1, token[:, None], (~s["done"]).float()[:, None])
        s["lengths"].add_(~s["done"])  # the input token is the row's now
        s["done"].logical_or_(torch.isin(token, self.eos))
        s["token"].copy_(token)
        s["step"].add_(1)

    def replay(self, *key):
        """step(width, greedy, penalised): eager, or on CUDA its graph, captured at the first need
        (warmed up on a side stream, as torch.cuda.graphs asks, with every row done so that neither
        the warm-up nor the capture moves a row, and from the spare output columns past the last
        step's, so that the warm-up writes no step's tokens, whichever step first needs the
        graph)."""
        if self.graphs is None:
            return self.step(*key)
        if key not in self.graphs:
            s = self.state
            kept = {k: s[k].clone() for k in ("done", "token", "step")}
            s["done"].fill_(True)
            s["step"].fill_(self.steps)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(WARMUP_STEPS):
                    self.step(*key)
            torch.cuda.current_stream().wait_stream(stream)
            self.graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graphs[key], pool=self.pool):
                self.step(*key)
            for k, value in kept.items():
                s[k].copy_(value)
        self.graphs[key].replay()

    def prefill(self, rows, keep):
        """Run into the cache all but the last of each row's tokens past its first keep[b] (the
        decode step runs the last), in chunks. Rows that hold and add the same tokens (the samples
        of one prompt: a GRPO group's first turn) run once, into a copy of their cache columns,
        which then fills every row of theirs."""
        given = [b for b, row in enumerate(rows) if row and len(row) - keep[b] > 1]
        if not given:
            return
        # each given row's source: its place among the distinct rows, the first that has its
        # (kept, tokens)
        place, distinct, source = {}, [], []
        for b in given:
            key = (keep[b], tuple(rows[b]))
            if key not in place:
                place[key] = len(distinct)
                distinct.append(b)
            source.append(place[key])
        # the rows' columns, the last of which no token written here owns (padding goes there)
        columns = max(len(rows[b]) for b in distinct)
        if len(distinct) == len(given):  # nothing twice (later turns): straight into the cache
            part, batch = self.cache, range(len(rows))
        else:  # a small cache of the distinct rows' columns, copied back below
            part, batch = KVCache(self.model, len(distinct), columns), distinct
            for mine, whole in zip(part.keys + part.values, self.cache.keys + self.cache.values):
                mine.copy_(whole[distinct, :, :columns])
        pending = [rows[b][keep[b]:-1] if rows[b] else [] for b in batch]
        lengths = [keep[b] for b in batch]
        device = self.eos.device
        for start in range(0, max(map(len, pending)), PREFILL_CHUNK):
            chunk = [p[start:start + PREFILL_CHUNK] for p in pending]
            size = max(map(len, chunk))
            ids = torch.tensor([c + [self.pad_id] * (size - len(c)) for c in chunk], device=device)
            width = min(columns, max(lengths) + size)
            run_into(self.model, part, ids, torch.tensor(lengths, device=device), width)
            lengths = [n + len(c) for n, c in zip(lengths, chunk)]
        if part is not self.cache:
            for whole, mine in zip(self.cache.keys + self.cache.values, part.keys + part.values):
                whole[given, :, :columns] = mine[source]

    @torch.no_grad()
    def generate(self, rows, max_new_tokens, temperature=1.0, greedy=False, penalty=1.0,
                 fresh=False, seat=False):
        """New tokens after each of `rows` (lists of token ids; None: a row that sits this call
        out), a (tokens, log-probs) pair a row, in order: up to and including its first
        end-of-turn token, at most max_new_tokens (None for a row that sat out). Row k goes to the
        cache's row k, or with seat to the free one whose tokens share the longest start with it
        (a user's re-ask extends its appraisal); what a cache row holds of the tokens it is given,
        up to where they differ, is kept, and only the rest runs. fresh: the cache holds nothing
        (the policy's weights have changed since it was filled). Sets prompt_tokens and
        reused_tokens: the given rows' tokens, and those of them read from the cache."""
        need = max(len(r) for r in rows if r) + max_new_tokens + 1
        if (self.cache is None or len(rows) > len(self.held) or need > self.cache.keys[0].shape[2]
                or max_new_tokens > self.steps):
            # the columns the rows need, in steps of GROW_COLUMNS, up to self.length: memory is
            # taken as dialogues grow, never for a context no dialogue reaches
            length = -(-need // GROW_COLUMNS) * GROW_COLUMNS
            if self.length is not None:
                length = max(need, min(length, self.length))
            steps = max(max_new_tokens, self.steps)
            self.allocate(max(len(rows), len(self.held)), length, steps)
        if fresh:
            self.held = [[] for _ in self.held]
        order = list(range(len(rows)))
        if seat:  # each row to the free cache row with the longest common start
            free = list(range(len(self.held)))
            for k, row in enumerate(rows):
                if row:
                    order[k] = max(free, key=lambda b: common_prefix(row, self.held[b]))
                    free.remove(order[k])
        placed = [None] * len(self.held)
        for k, row in zip(order, rows):
            placed[k] = row
        # what each row keeps (all but its last token at most: the step runs that one) and adds
        keep = [min(common_prefix(r, h), len(r) - 1) if r else len(h)
                for r, h in zip(placed, self.held)]
        self.prompt_tokens = sum(len(r) for r in rows if r)
        self.reused_tokens = sum(k for r, k in zip(placed, keep) if r)
        self.prefill(placed, keep)
        s = self.state
        s["lengths"].copy_(torch.tensor([len(r) - 1 if r else len(h)
                                         for r, h in zip(placed, self.held)]))
        s["token"].copy_(torch.tensor([r[-1] if r else self.pad_id for r in placed]))
        s["done"].copy_(torch.tensor([not r for r in placed]))
        s["step"].zero_()
        penalised = penalty != 1.0
        if penalised:  # the tokens each row holds, for the repetition penalty
            s["seen"].zero_()
            for b, row in enumerate(placed):
                if row:
                    s["seen"][b, row] = 1.0
        s["temperature"].fill_(temperature)
        s["penalty"].fill_(penalty)
        s["out_tokens"].fill_(self.pad_id)
        s["out_logprobs"].zero_()
        top = max(len(r) for r in rows if r)  # the longest row: each step adds a column at most
        sync = SYNC_EVERY if self.graphs is not None else 1
        for k in range(max_new_tokens):
            self.replay(self.width(top + k), greedy, penalised)
            if (k + 1) % sync == 0 and bool(s["done"].all()):
                break
        tokens = s["out_tokens"][:, :max_new_tokens].tolist()
        logprobs = s["out_logprobs"][:, :max_new_tokens].tolist()
        eos = set(self.eos.tolist())
        out = []
        for b, (row, length) in enumerate(zip(placed, s["lengths"].tolist())):
            if row:
                # up to and including the first end-of-turn token
                end = next((i + 1 for i, t in enumerate(tokens[b]) if t in eos), max_new_tokens)
                out.append((tokens[b][:end], logprobs[b][:end]))
                self.held[b] = (row + tokens[b][:end])[:length]
            else:
                out.append(None)
        return [out[k] for k in order]


def common_prefix(a, b):
    """How many tokens the lists a and b share from their start."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n
