"""vLLM's ``stop_token_ids``, ``ignore_eos`` and ``min_tokens`` (lapheads.apps.batching.Stopping): each request ends
where vLLM's would, decoded alone or beside others, and stop strings before ``min_tokens`` are passed over as vLLM
passes them over."""

from __future__ import annotations

import random

import pytest
import torch

from lapheads.apps.batching import Generation, Stopping, generate_together
from lapheads.apps.detokenize import first_stop
from lapheads.apps.penalties import Penalties
from lapheads.apps.serving import until_stop
from lapheads.models.gpt import GPT, GPTConfig, sample_token
from tests.models.test_gpt_2026 import EVERY_OPTION, _random_weights

END, WORD = 0, 7  # the model's own stop token, and an ordinary one


def _alone(model: GPT, request: Generation) -> tuple[list[int], str]:
    """The textbook loop for one request, written from vLLM's definitions: the tokens that would end it have
    logits -inf while fewer than min_tokens are generated; a sampled stop token of the model ends it unkept (unless
    ignore_eos), a stop_token_id ends it (kept where it is not special), else it runs to max_tokens."""
    stopping = request.stopping
    generator = torch.Generator().manual_seed(request.seed)
    cache = model.new_kv_cache(1)
    last = model(torch.tensor([request.prompt]), kv_cache=cache)[0, -1].float()
    own = set() if stopping.ignore_eos else set(request.stop_ids)
    tokens: list[int] = []
    while len(tokens) < request.max_tokens:
        logits = last.clone()
        for token, bias in request.penalties.logit_bias:
            logits[token] += bias
        if len(tokens) < stopping.min_tokens:
            for token in own | stopping.kept_ids | stopping.unkept_ids:
                logits[token] = float("-inf")
        token = int(sample_token(logits[None], request.temperature, request.top_k, generator, request.top_p))
        if token in own or token in stopping.unkept_ids:
            return tokens, "stop"
        tokens.append(token)
        if token in stopping.kept_ids:
            return tokens, "stop"
        last = model(torch.tensor([[token]]), kv_cache=cache)[0, -1].float()
    return tokens, "length"


def _prompt(n: int, seed: int) -> tuple[int, ...]:
    return tuple(torch.randint(1, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def test_requests_decoded_together_end_where_each_ends_alone_by_vllms_rules():
    """Every kind of ending in one batch, greedy and sampled: a stop token pushed up by a bias ends a request at
    once, later with min_tokens, never with ignore_eos; an ordinary stop_token_id is kept as the last token, a
    special one is not. Each request gets the textbook loop's tokens and finish reason alone."""
    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))
    push = lambda token, bias=100.0: Penalties(logit_bias=((token, bias),))  # noqa: E731
    requests = [
        Generation(_prompt(4, 1), 10, stop_ids=frozenset({END}), penalties=push(END)),
        Generation(_prompt(4, 1), 10, stop_ids=frozenset({END}), penalties=push(END), stopping=Stopping(min_tokens=4)),
        Generation(
            _prompt(4, 1), 10, stop_ids=frozenset({END}), penalties=push(END), stopping=Stopping(ignore_eos=True)
        ),
        Generation(
            _prompt(5, 2), 10, 1.0, seed=3, penalties=push(WORD, 3.0), stopping=Stopping(kept_ids=frozenset({WORD}))
        ),
        Generation(
            _prompt(5, 2), 10, 1.0, seed=3, penalties=push(WORD, 3.0), stopping=Stopping(unkept_ids=frozenset({WORD}))
        ),
        Generation(
            _prompt(3, 4),
            10,
            0.9,
            seed=5,
            stop_ids=frozenset({END}),
            penalties=push(WORD, 3.0),
            stopping=Stopping(kept_ids=frozenset({WORD}), min_tokens=3, ignore_eos=True),
        ),
        Generation(_prompt(6, 5), 10, 1.0, seed=6),
    ]
    together = generate_together(model, requests)
    alone = [_alone(model, request) for request in requests]
    assert [(out.tokens, out.finish_reason) for out in together] == alone
    (ended, _), (held, _), (ran, _), (kept, _), (unkept, _), (mixed, _) = alone[:6]
    assert ended == [] and len(held) == 4 and len(ran) == 10 and END in ran  # the bias is strong enough to matter
    assert kept[-1] == WORD and WORD not in unkept and kept[:-1] == unkept  # the same draws, one kept token apart
    assert mixed[-1] == WORD and len(mixed) > 3 and END in {*ran}  # a kept stop after min_tokens, with ignore_eos


def test_min_tokens_masks_the_stop_tokens_of_a_request_alone():
    """A greedy request whose stop token is pushed to the top generates exactly min_tokens tokens, none of them the
    stop token, then stops; with min_tokens equal to max_tokens it ends at its length."""
    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))
    ask = dict(prompt=_prompt(4, 9), stop_ids=frozenset({END}), penalties=Penalties(logit_bias=((END, 100.0),)))
    for least, reason in ((0, "stop"), (3, "stop"), (8, "length")):
        (out,) = generate_together(model, [Generation(max_tokens=8, stopping=Stopping(min_tokens=least), **ask)])
        assert len(out.tokens) == least and END not in out.tokens and out.finish_reason == reason


def _vllm_stop_strings(texts: list[str], stops: list[str], min_tokens: int) -> tuple[str, str | None]:
    """vLLM's detokenizer, token by token: after the k-th token (k > min_tokens), a stop string that ends in the
    text that token added cuts the output where it begins."""
    out = ""
    for k, new in enumerate(texts, start=1):
        out += new
        if k > min_tokens and new:
            for stop in stops:
                at = out.find(stop, max(0, len(out) - len(new) - len(stop) + 1))
                if at >= 0:
                    return out[:at], "stop"
    return out, None


@pytest.mark.parametrize("seed", range(40))
def test_until_stop_passes_over_stop_strings_in_the_first_min_tokens_as_vllm(seed):
    """Random token texts (zero to three characters: none for a split character's first bytes) over a small
    alphabet, so a stop string appears early, late and across the min_tokens boundary; each piece is one token's
    text with the reader's count, as the batcher hands them: the shown text and the finish reason are vLLM's."""
    rng = random.Random(seed)
    texts = ["".join(rng.choice("abc") for _ in range(rng.choice([0, 1, 1, 2, 3]))) for _ in range(20)]
    stop = "".join(rng.choice("abc") for _ in range(rng.randint(1, 3)))
    least = rng.choice([0, 0, 3, 8, 25])
    outcome: dict = {}

    def pieces():
        for k, text in enumerate(texts, start=1):
            outcome["completion_tokens"] = k
            yield text

    shown = "".join(until_stop(pieces(), [stop], outcome, least))
    assert (shown, outcome.get("finish_reason")) == _vllm_stop_strings(texts, [stop], least), (texts, stop, least)


def test_first_stop_finds_only_the_stop_strings_that_end_past_the_floor():
    assert first_stop("abcabc", ["bc"]) == (1, 3)
    assert first_stop("abcabc", ["bc"], after=3) == (4, 6)  # the first "bc" ends at 3: passed over
    assert first_stop("abcabc", ["bc"], after=2) == (1, 3)  # it ends at 3, past 2: found
    assert first_stop("abcabc", ["x", "ca"]) == (2, 4) and first_stop("abc", ["x"]) is None
    assert first_stop("abcd", ["abc", "ab"]) == (0, 3) and first_stop("abcd", ["ab", "abc"]) == (0, 2)  # list order


def test_until_stop_shows_the_stop_string_when_asked():
    """vLLM's include_stop_str_in_output: the text ends with the stop string, what came after it is not shown."""
    outcome: dict = {}
    assert "".join(until_stop(iter(["ab", "c<", "|e", "nd|>x"]), ["<|end|>"], outcome, include=True)) == "abc<|end|>"
    assert outcome == {"finish_reason": "stop", "stop_reason": "<|end|>"}
