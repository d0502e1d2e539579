"""Logit biases and repetition, frequency and presence penalties (lapheads.apps.penalties): the formulas of OpenAI,
transformers and vLLM in vLLM's order, each request adjusted from its own prompt and output when decoded with
others, and the log-probabilities a request reports left the model's own."""

from __future__ import annotations

import pytest
import torch

from lapheads.apps.batching import Generation, generate_together
from lapheads.apps.penalties import Penalties, penalized
from lapheads.models.gpt import GPT, GPTConfig, sample_token
from tests.models.test_gpt_2026 import EVERY_OPTION, _random_weights


def _reference(logits: torch.Tensor, asked: Penalties, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row (V,) adjusted by the peers' own definitions, in vLLM's order: OpenAI's logit_bias added, then
    transformers' RepetitionPenaltyLogitsProcessor over the prompt and output (what it sees as input_ids), then
    OpenAI's frequency and presence penalties as its docs write them, token by token."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    row = logits.clone()
    for token, bias in asked.logit_bias:
        row[token] += bias
    if asked.repetition != 1.0:
        seen = torch.tensor([[*prompt, *output]])
        row = RepetitionPenaltyLogitsProcessor(asked.repetition)(seen, row[None])[0]
    for token in set(output):
        row[token] -= output.count(token) * asked.frequency + asked.presence
    return row


CASES = [
    Penalties(),
    Penalties(presence=0.7),
    Penalties(frequency=-0.4),
    Penalties(repetition=1.3),
    Penalties(repetition=0.6),
    Penalties(logit_bias=((2, 5.0), (7, -100.0), (11, 0.5))),
    Penalties(presence=1.5, frequency=0.25, repetition=1.2, logit_bias=((1, 3.0), (4, -2.0))),
]


@pytest.mark.parametrize("seed", range(5))
def test_each_row_is_adjusted_as_the_peers_define_it(seed):
    """Rows with every kind of adjustment and rows with none, beside each other; each prompt and output draws
    repeated tokens, and the logits hold both signs, so a penalty applied to the wrong tokens, in another order
    (the bias after the repetition penalty), or to the wrong row, fails."""
    g = torch.Generator().manual_seed(seed)
    vocab = 16
    logits = torch.randn(len(CASES), vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in CASES]
    outputs = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in torch.randint(0, 9, (len(CASES),))]
    out = penalized(logits, CASES, prompts, outputs)
    for row, asked in enumerate(CASES):
        torch.testing.assert_close(out[row], _reference(logits[row], asked, prompts[row], outputs[row]))
    assert torch.equal(out[0], logits[0])


def test_rows_that_ask_for_nothing_are_passed_through_and_the_callers_logits_stay_the_models():
    logits = torch.randn(3, 10)
    assert penalized(logits, [Penalties()] * 3, [[1]] * 3, [[2, 2]] * 3) is logits
    kept = logits.clone()
    penalized(logits, [Penalties(), Penalties(presence=2.0), Penalties()], [[1]] * 3, [[2, 2]] * 3)
    assert torch.equal(logits, kept)


def test_a_repetition_penalty_that_is_not_positive_is_refused_in_one_line():
    from lapheads.errors import InputError

    for bad in (0.0, -1.2, float("nan")):
        with pytest.raises(InputError, match="repetition penalty .*; allowed: a number > 0"):
            Penalties(repetition=bad)


def _alone(model: GPT, request: Generation) -> list[int]:
    """The textbook loop for one request: each step's logits adjusted by the reference from its prompt and the
    tokens it generated so far, then sample_token with its own generator."""
    generator = torch.Generator().manual_seed(request.seed)
    cache = model.new_kv_cache(1)
    last = model(torch.tensor([request.prompt]), kv_cache=cache)[0, -1].float()
    tokens: list[int] = []
    while len(tokens) < request.max_tokens and cache.pos < model.config.sequence_len:
        adjusted = _reference(last, request.penalties, list(request.prompt), tokens)
        token = int(sample_token(adjusted[None], request.temperature, request.top_k, generator, request.top_p))
        if token in request.stop_ids:
            break
        tokens.append(token)
        last = model(torch.tensor([[token]]), kv_cache=cache)[0, -1].float()
    return tokens


def test_requests_with_penalties_decoded_together_generate_what_each_generates_alone():
    """Greedy and sampled requests, penalised and not, in one batch: each gets the tokens of the textbook loop
    alone (its penalties from its own prompt and output, not a neighbour's), and each penalised one differs from
    the same request without them (the penalties did something)."""
    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))
    prompt = lambda n, seed: tuple(torch.randint(0, 40, (n,), generator=torch.Generator().manual_seed(seed)).tolist())  # noqa: E731
    requests = [
        Generation(prompt(4, 1), 12, penalties=Penalties(presence=2.0, frequency=1.0)),
        Generation(prompt(6, 2), 12, temperature=1.0, seed=3),
        Generation(prompt(3, 3), 12, temperature=0.9, top_k=8, seed=4, penalties=Penalties(repetition=1.8)),
        Generation(prompt(5, 4), 12, temperature=1.0, seed=5, penalties=Penalties(logit_bias=((7, 4.0), (9, 4.0)))),
        Generation(prompt(2, 5), 12),
    ]
    together = generate_together(model, requests)
    for request, generated in zip(requests, together):
        assert generated.tokens == _alone(model, request)
        if request.penalties:
            plain = generate_together(model, [Generation(request.prompt, 12, request.temperature, request.top_k,
                                                         request.top_p, request.seed)])[0]  # fmt: skip
            assert plain.tokens != generated.tokens


def test_a_logit_bias_chooses_the_tokens_and_the_reported_logits_stay_the_models():
    """Greedy with +100 on one token: every token is that one; the logits each token is reported with are the
    model's own (what log-probabilities are computed from), equal to the unbiased run's at the first step."""
    model = _random_weights(GPT(GPTConfig(**EVERY_OPTION)))
    prompt = (3, 1, 4, 1, 5)
    plain_first = generate_together(model, [Generation(prompt, 1)])[0].tokens[0]
    chosen = (plain_first + 1) % 40
    seen: list[torch.Tensor] = []
    biased = Generation(prompt, 6, penalties=Penalties(logit_bias=((chosen, 100.0),)))
    out = generate_together(model, [biased], lambda index, token, logits: seen.append(logits.clone()))[0]
    assert out.tokens == [chosen] * 6
    assert int(seen[0].argmax()) == plain_first  # the model's own logits: the bias only chose the token
