"""Requests decoded together (lapheads.apps.batching) generate what each generates alone, for the same seed."""

from __future__ import annotations

import time

import pytest
import torch

from lapheads.apps.batching import Generation, generate_together
from lapheads.errors import InputError
from lapheads.models.gpt import GPT, GPTConfig, sample_token
from tests.models.test_gpt_2026 import EVERY_OPTION, FAMILIES, _random_weights


def _alone(model: GPT, request: Generation) -> list[int]:
    """The textbook loop for one request (as CompletionEngine.complete decodes): its own cache, its own generator."""
    generator = torch.Generator().manual_seed(request.seed)
    cache = model.new_kv_cache(1)
    last = model(torch.tensor([request.prompt]), kv_cache=cache)[0, -1].float()
    tokens: list[int] = []
    while len(tokens) < request.max_tokens and cache.pos < model.config.sequence_len:
        token = int(sample_token(last[None], request.temperature, request.top_k, generator, request.top_p))
        if token in request.stop_ids:
            break
        tokens.append(token)
        if cache.pos >= model.config.sequence_len:
            break
        last = model(torch.tensor([[token]]), kv_cache=cache)[0, -1].float()
    return tokens


@pytest.mark.parametrize("arch", FAMILIES)
def test_requests_decoded_together_generate_what_each_generates_alone(arch):
    """Prompts of different lengths (left padding kept apart), greedy and sampled rows with their own seeds, top-k
    and top-p, a stop token, rows that finish early and leave the batch, and one whose allowance is the context's:
    every row's tokens are the ones it gets alone (the 2026 family: windows, smear, value embeddings, GQA,
    Laplacian heads)."""
    model = _random_weights(GPT(GPTConfig(**dict(EVERY_OPTION, arch=arch))))
    prompt = lambda n, seed: tuple(torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist())  # noqa: E731
    requests = [
        Generation(prompt(3, 1), max_tokens=9),
        Generation(prompt(7, 2), max_tokens=4, temperature=1.0, seed=5),
        Generation(prompt(1, 3), max_tokens=12, temperature=0.8, top_k=5, seed=6),
        Generation(prompt(5, 4), max_tokens=9, temperature=1.2, top_p=0.9, seed=7, stop_ids=frozenset({3, 11})),
        Generation(prompt(26, 5), max_tokens=50, temperature=1.0, seed=8),  # the context ends it (32 tokens)
    ]
    together = generate_together(model, requests)
    for request, generated in zip(requests, together):
        assert generated.tokens == _alone(model, request)
    assert [g.finish_reason for g in together][:3] == ["length", "length", "length"]
    assert len(together[4].tokens) == 32 - 26 and together[4].finish_reason == "length"


def test_the_caller_ends_a_request_and_sees_each_tokens_logits():
    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))
    seen: dict[int, list[int]] = {0: [], 1: []}

    def on_token(index: int, token: int, logits: torch.Tensor) -> bool:
        assert logits.shape == (40,) and int(logits.argmax()) == token  # greedy: the likeliest
        seen[index].append(token)
        return not (index == 1 and len(seen[1]) == 2)  # a stop string, say, ends request 1 at its 2nd token

    out = generate_together(model, [Generation((1, 2, 3), 6), Generation((4, 5), 6)], on_token)
    assert out[0].tokens == seen[0] and len(seen[0]) == 6 and out[0].finish_reason == "length"
    assert out[1].tokens == seen[1] and len(seen[1]) == 2 and out[1].finish_reason == "stop"


def test_a_prompt_that_leaves_no_room_is_refused_in_one_line():
    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))
    with pytest.raises(InputError, match="request 1: a prompt of 32 tokens; allowed: 1 to 31"):
        generate_together(model, [Generation((1,), 2), Generation(tuple(range(32)), 2)])


def test_forced_tokens_are_fed_one_per_step_and_reported_as_alone():
    """A chat's tool output: on_token hands back tokens to feed next; they are fed in order, reported with the logits
    at their position, not sampled (no draw from the request's generator) and not cut by max_tokens; a request
    beside it in the batch is unchanged."""
    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))
    requests = [Generation((5, 6, 7), 4, temperature=1.0, seed=3), Generation((1, 2), 5, temperature=1.0, seed=4)]

    def forcing(log):
        def on_token(index, token, logits):
            log.append((index, token))
            if index == 0 and len([i for i, _ in log if i == 0]) == 2:
                return [30, 31, 32]
            return None

        return on_token

    together, alone = [], []
    out = generate_together(model, requests, forcing(together))
    first = generate_together(model, requests[:1], forcing(alone))[0]
    assert out[0].tokens == first.tokens and out[0].tokens[2:5] == [30, 31, 32] and len(out[0].tokens) == 5
    assert out[1].tokens == _alone(model, requests[1])
    assert [t for i, t in together if i == 0] == out[0].tokens  # every token reported, forced ones included


def test_a_reader_that_stops_reading_ends_its_job_and_the_next_batch_runs():
    """The server's Batcher: a client that stops at a stop string (or disconnects) closes its pieces; its job ends
    at its next token instead of decoding to its max_tokens; the worker then takes the next batch."""
    from lapheads.apps.batching import Batcher

    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))

    class Job:  # one text piece per token, as a chat turn's
        def __init__(self, n: int) -> None:
            self.generation, self.reply, self.sent = Generation((1, 2, 3), n), [], 0

        def on_token(self, index, token, logits):
            time.sleep(0.01)  # a step slower than the reader's close: the test cannot race past it
            self.reply.append(token)

        def pieces(self):
            new, self.sent = len(self.reply) - self.sent, len(self.reply)
            return iter(["x"] * new)

        def finish(self, generated):
            self.finished = generated.finish_reason

    batcher = Batcher(model, gather_s=0.0)
    left, outcome = Job(25), {}
    pieces = batcher.submit(left, outcome)
    assert next(pieces) == "x"
    pieces.close()  # the reader leaves
    after = Job(3)
    assert "".join(batcher.submit(after)) == "xxx"  # the next batch ran to its end
    assert left.finished == "stop" and len(left.reply) < 25


@pytest.mark.parametrize("arch", FAMILIES)
def test_requests_that_join_a_batch_in_flight_generate_what_each_generates_alone(arch):
    """Issue 72 (continuous batching): requests join between steps whatever their lengths and the batch's: greedy
    and sampled, a prompt longer than every row so far, one whose allowance runs to the end of the context; each row
    of the cache holds its own length, and each request generates the tokens it gets alone (the 2026 family:
    windows, smear, value embeddings, GQA, Laplacian heads)."""
    from lapheads.apps.batching import Decoding

    model = _random_weights(GPT(GPTConfig(**dict(EVERY_OPTION, arch=arch))))
    prompt = lambda n, seed: tuple(torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist())  # noqa: E731
    first = [Generation(prompt(4, 1), max_tokens=14), Generation(prompt(2, 2), 6, temperature=1.0, seed=3)]
    later = {3: [Generation(prompt(5, 3), 8, temperature=0.9, top_k=6, seed=4), Generation(prompt(3, 4), 5)],
             6: [Generation(prompt(19, 5), 7, temperature=1.0, seed=9),  # longer than every row so far
                 Generation(prompt(2, 6), 40, temperature=1.0, seed=2)]}  # fmt: skip  # the context ends it
    tokens: dict[int, list[int]] = {}
    decoding = Decoding(model, list(enumerate(first)), lambda i, token, logits: tokens.setdefault(i, []).append(token))
    requests, step = list(first), 0
    while True:
        decoding.sample()
        if not decoding.live:
            break
        decoding.advance()
        step += 1
        if step in later:
            joining = [(len(requests) + n, request) for n, request in enumerate(later[step])]
            decoding.join(joining)
            requests += later[step]
            assert len(decoding.live) == len(decoding.cache.kv[0, 0])
            assert decoding.cache.lengths is not None  # rows of their own lengths
    assert len(requests) == 6
    for index, request in enumerate(requests):
        assert tokens[index] == _alone(model, request), index
    assert len(tokens[5]) == 32 - 2


def test_a_job_submitted_while_a_batch_runs_joins_it_and_ends_before_it():
    """The server's Batcher: a request that arrives mid-batch joins at the next step instead of waiting for the
    batch to end, and reads what it reads alone."""
    from lapheads.apps.batching import Batcher

    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))

    class Job:
        def __init__(self, prompt, n, pause=0.0) -> None:
            self.generation, self.reply, self.sent, self.pause = Generation(prompt, n), [], 0, pause
            self.finished = None

        def on_token(self, index, token, logits):
            time.sleep(self.pause)
            self.reply.append(token)

        def pieces(self):
            new, self.sent = self.reply[self.sent :], len(self.reply)
            return iter(f"{t} " for t in new)

        def finish(self, generated):
            self.finished = generated.finish_reason

    batcher = Batcher(model, gather_s=0.0)
    long, short = Job((1, 2, 3, 4, 5), 25, pause=0.02), Job((7, 8), 4)
    pieces = batcher.submit(long)
    next(pieces)  # the long job is decoding
    text = "".join(batcher.submit(short))
    assert long.finished is None  # the short job joined and ended while the long one still ran
    assert text.split() == [str(t) for t in generate_together(model, [short.generation])[0].tokens]
    assert len("".join(pieces).split()) == 24 and long.finished == "length"
    with pytest.raises(InputError, match="the request: a prompt of 32 tokens; allowed: 1 to 31"):
        batcher.submit(Job(tuple(range(32)), 2))


def test_a_cache_keeps_and_joins_rows_by_their_filled_positions():
    """KVCache.keep and .join move the live rows' filled positions only; the batch's keys and values so far are the
    rows kept, then the rows joined, whatever the storage held before (a left row's stale positions are overwritten
    before they are read)."""
    from lapheads.models.gpt import KVCache

    cache, other = KVCache(3, 1, 8, 2, 1), KVCache(2, 1, 8, 2, 1)
    rows = torch.arange(3 * 5 * 2, dtype=torch.float32).view(1, 3, 1, 5, 2)
    for c, values in ((cache, rows), (other, -rows[:, :2])):
        c.insert(0, values[0].view(-1, 1, 5, 2), values[0].view(-1, 1, 5, 2) + 100)
    cache.keep(torch.tensor([2, 0]))
    cache.join(other)
    k, v = cache.insert(0, torch.zeros(4, 1, 1, 2), torch.zeros(4, 1, 1, 2))
    expected = torch.cat([rows[0, [2, 0]], -rows[0, :2]]).view(4, 1, 5, 2)
    assert cache.pos == 6 and k.shape == (4, 1, 6, 2)
    assert torch.equal(k[:, :, :5], expected) and torch.equal(v[:, :, :5], expected + 100)
    assert torch.equal(k[:, :, 5], torch.zeros(4, 1, 2))


def test_rows_of_their_own_lengths_write_at_their_own_positions_and_see_only_them():
    """A cache joined by rows at another position holds each row's own length: a step writes each row's key at its
    own position and in the query's column (the last), ``attended`` marks each row's own positions (within a window)
    and itself, and when the longest row leaves, the last column moves back to the longest left."""
    from lapheads.models.gpt import KVCache

    cache, other = KVCache(1, 1, 8, 1, 1), KVCache(2, 1, 8, 1, 1)
    cache.insert(0, torch.ones(1, 1, 4, 1), torch.ones(1, 1, 4, 1))  # one row of 4 positions
    other.insert(0, torch.full((2, 1, 2, 1), 2.0), torch.full((2, 1, 2, 1), 2.0))  # two rows of 2
    cache.join(other)
    assert cache.pos == 4 and cache.lengths.tolist() == [4, 2, 2]
    assert cache.attended().tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 1], [1, 1, 0, 0, 1]]
    assert cache.attended(window=1).tolist() == [[0, 0, 0, 1, 1], [0, 1, 0, 0, 1], [0, 1, 0, 0, 1]]
    k, _ = cache.insert(0, torch.tensor([7.0, 8.0, 9.0]).view(3, 1, 1, 1), torch.zeros(3, 1, 1, 1))
    assert k[:, 0, :, 0].tolist() == [[1, 1, 1, 1, 7], [2, 2, 8, 0, 8], [2, 2, 9, 0, 9]]
    assert cache.pos == 5 and cache.lengths.tolist() == [5, 3, 3]
    cache.keep(torch.tensor([1, 2]))  # the longest row leaves: the rest are of one length again
    assert cache.pos == 3 and cache.lengths is None
    with pytest.raises(InputError, match="one token a row"):
        from lapheads.models.gpt import GPT, GPTConfig

        model = GPT(GPTConfig(depth=1, vocab_size=8, sequence_len=8, head_dim=4, aspect_ratio=4))
        ragged, _ = model.prefill([[1, 2, 3], [1]])
        model(torch.ones(2, 2, dtype=torch.long), kv_cache=ragged)
    with pytest.raises(InputError, match=r"prompts of lengths \[2, 0\]; allowed: one or more prompts of at least"):
        model.prefill([[1, 2], []])


def test_a_joining_job_is_prefilled_while_the_batch_goes_on_decoding(monkeypatch):
    """The server prefills a job that joins on its own thread, so the batch's steps go on meanwhile: here the
    prefill waits until the running job has decoded 3 more tokens (on the batch's own thread it would wait out its
    timeout), and the job that joined reads what it reads alone."""
    import threading

    from lapheads.apps import batching

    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))
    progressed, waited, started = threading.Event(), [], []

    class Job:
        def __init__(self, prompt, n, pause=0.0) -> None:
            self.generation, self.reply, self.sent, self.pause = Generation(prompt, n), [], 0, pause

        def on_token(self, index, token, logits):
            time.sleep(self.pause)
            self.reply.append(token)
            if started and len(self.reply) >= started[0] + 3:
                progressed.set()

        def pieces(self):
            new, self.sent = self.reply[self.sent :], len(self.reply)
            return iter(f"{t} " for t in new)

        def finish(self, generated):
            pass

    long, short = Job((1, 2, 3, 4, 5), 25, pause=0.01), Job((7, 8), 4)
    real = batching.prefilled

    def waiting_prefill(model, requests):
        started.append(len(long.reply))
        waited.append(progressed.wait(30))
        return real(model, requests)

    monkeypatch.setattr(batching, "prefilled", waiting_prefill)
    batcher = batching.Batcher(model, gather_s=0.0)
    pieces = batcher.submit(long)
    next(pieces)  # the long job is decoding
    text = "".join(batcher.submit(short))
    assert waited == [True]  # the batch decoded while the joining job was prefilled
    assert text.split() == [str(t) for t in generate_together(model, [short.generation])[0].tokens]
    assert len("".join(pieces).split()) == 24
