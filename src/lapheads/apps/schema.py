"""The request bodies of ``lapheads serve``'s OpenAI endpoints as typed pydantic models, one source for what a
field may hold, what it does, the one-line refusal and the docs' field tables.

Design choices:

* **Strict and closed**: ``extra="forbid"`` refuses any field these models do not name (OpenAI itself refuses
  unknown arguments), and strict types take ``true`` for no integer and ``"2"`` for no number.
* **A field's description starts with what it allows**, then says what it does after ": "; a refusal is
  ``"<field> <value>; allowed: <description>"`` (``"<field>=<value> is not supported by this server; ..."`` for a
  feature it does not have: "0 only", "none only") with the field in OpenAI's ``param``, so the allowed values a
  client reads are the ones the model checks.
* **Bounds a server sets** (``--max-tokens``, the model's vocabulary and context) are checked after validation,
  in the same words, by the endpoints' own code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from lapheads.apps.batching import Stopping
from lapheads.apps.penalties import Penalties
from lapheads.errors import LapheadsError

if TYPE_CHECKING:
    from lapheads.data.tokenizers import Tokenizer

__all__ = [
    "ChatCompletionBody",
    "CompletionBody",
    "PageChatBody",
    "RequestError",
    "requested_penalties",
    "requested_stopping",
    "validated",
]

#: the most choices (``n``) and stop strings one request may ask for: OpenAI's own limit on stop strings is 4, but
#: lm-eval adds its end-of-text string to a task's ``until`` list (a humaneval-style task sends 6) and vLLM takes any
#: number, so the bound is one no shipped lm-eval task reaches
MAX_CHOICES, MAX_STOPS = 8, 16
#: the longest stop string: each is searched for in the text after every token, so a 60,000-character one held the
#: event loop for seconds (issue 76); a stop sequence is a few words
MAX_STOP_CHARS = 200
#: the most alternatives per token ``top_logprobs`` / ``logprobs`` may ask for (OpenAI's chat limit; vLLM's)
MAX_TOP_LOGPROBS = 20
#: the most tokens one ``logit_bias`` may name: a bound of this server's (a request biases a few tokens, or a
#: class's labels), each entry applied at every step
MAX_LOGIT_BIAS = 1024
#: the most ``stop_token_ids`` one request may name: a bound of this server's (a model has a few end tokens)
MAX_STOP_TOKEN_IDS = 64


class RequestError(LapheadsError):
    """A refused request field: the message, and the field's name for OpenAI's error object (``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _field(description: str) -> Any:
    return Field(None, description=description)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _TextFormat(_Body):
    type: Literal["text"]


class _StreamOptions(_Body):
    include_usage: bool | None = None


Text = Annotated[str, Field(min_length=1)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)]
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Sampling(_Body):
    """The fields both endpoints share."""

    model: str | None = _field("this server's one model (GET /v1/models)")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = _field(
        "a number in [0, 2]: sampling temperature (0 = greedy)"
    )
    top_k: Annotated[int, Field(ge=0, le=200)] | None = _field(
        "an integer in [0, 200]: top-k sampling (0: all; an extension vLLM and llama.cpp also take)"
    )
    top_p: Annotated[float, Field(gt=0, le=1)] | None = _field(
        "a number in (0, 1]: nucleus sampling, the likeliest tokens holding this probability"
    )
    min_p: Annotated[float, Field(ge=0, le=1)] | None = _field(
        "a number in [0, 1]: min-p sampling, only the tokens at least this times as likely as the likeliest, at the "
        "temperature and before top-k and top-p (an extension vLLM, llama.cpp and transformers also take)"
    )
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = _field(
        f"an integer in [1, {MAX_CHOICES}]: that many choices, choice i sampled with seed + i"
    )
    seed: Seed | None = _field(
        "an integer in [0, 2**63 - 1]: the sampler's seed; a given seed reproduces, none draws a fresh one"
    )
    stop: Stop | None = _field(
        f"a string or a list of up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters: the text "
        "ends before the first that appears (finish_reason stop)"
    )
    user: str | None = _field("a string: an end-user id, recorded nowhere, changes nothing")
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = _field(
        "a number in [-2, 2]: subtracted from a token's logit once per time the reply already holds it"
    )
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = _field(
        "a number in [-2, 2]: subtracted once from the logit of every token the reply already holds"
    )
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = _field(
        "a number in (0, 2], 1 = none: a token seen in the prompt or the reply has its logit divided by it where "
        "positive, multiplied where not (an extension vLLM and transformers also take)"
    )
    logit_bias: Annotated[dict[TokenId, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = _field(
        f"up to {MAX_LOGIT_BIAS} pairs of a token id (as a string) and a number in [-100, 100]: added to that "
        "token's logit before sampling"
    )
    # vLLM's extensions for how a reply ends (its benchmarks send ignore_eos): lapheads.apps.batching.Stopping
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = _field(
        f"a list of up to {MAX_STOP_TOKEN_IDS} token ids: the reply ends at the first sampled (finish_reason "
        "stop), kept as its last where it is text, left out where it is a special token (an extension vLLM "
        "takes)"
    )
    include_stop_str_in_output: bool | None = _field(
        "true or false: the stop string that ended the reply is shown as its end (an extension vLLM takes)"
    )
    ignore_eos: bool | None = _field(
        "true or false: the model's own end tokens do not end the reply, which runs to max_tokens (an extension "
        "vLLM takes, for benchmarks)"
    )
    min_tokens: Annotated[int, Field(ge=0)] | None = _field(
        "an integer from 0 to max_tokens: no end token is sampled and no stop string looked for before the reply "
        "holds this many tokens (an extension vLLM takes)"
    )


class ChatCompletionBody(_Sampling):
    """``POST /v1/chat/completions``: OpenAI's chat completions request."""

    messages: list[Any] = Field(
        description="a non-empty list of system (or developer) / user / assistant turns, the last the user's (the "
        "assistant's with continue_final_message); "
        "content a string or a list of text parts"
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = _field(
        "an integer from 1 to the server's --max-tokens: the reply's length limit"
    )
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = _field(
        "an integer from 1 to the server's --max-tokens: the reply's length limit"
    )
    stream: bool | None = _field("true or false: server-sent chunks")
    stream_options: _StreamOptions | None = _field('{"include_usage": true or false}: usage in a last chunk')
    logprobs: bool | None = _field("true or false: the sampled tokens' log-probabilities, the model's log-softmax")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = _field(
        f"an integer in [0, {MAX_TOP_LOGPROBS}], with logprobs true: that many likeliest tokens beside each one"
    )
    response_format: _TextFormat | None = _field('{"type": "text"} only')
    # vLLM's chat-template extensions, for a prefilled reply (lapheads.data.conversations.render_for_completion)
    add_generation_prompt: bool | None = _field(
        "true or false, default true: the reply starts a new assistant turn; false only with continue_final_message "
        "true (an extension vLLM takes)"
    )
    continue_final_message: bool | None = _field(
        "true or false: the last message is the assistant's started reply, which the model continues (a prefill; "
        "the reply holds the new text only); with add_generation_prompt false, as vLLM asks (an extension vLLM takes)"
    )
    tools: Annotated[list, Field(max_length=0)] | None = _field("none only: no tools here")
    tool_choice: Literal["none"] | None = _field("'none' only: no tools here")
    # accepted and ignored, as vLLM accepts them: each has no meaning for this server (docs/language-models.md)
    store: bool | None = _field("true or false: accepted and ignored (this server stores no completion)")
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = _field(
        "up to 16 string pairs: accepted and ignored (nothing is stored to tag)"
    )
    parallel_tool_calls: bool | None = _field("true or false: accepted and ignored (no tools here)")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = _field(
        "'auto', 'default', 'flex', 'scale' or 'priority': accepted and ignored (one tier here)"
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = _field(
        "'none', 'minimal', 'low', 'medium' or 'high': accepted and ignored (the model does not reason apart)"
    )

    def checked(self) -> ChatCompletionBody:
        """What no single field says: ``stream_options`` only with ``stream`` true, as OpenAI refuses it; a
        prefill (``continue_final_message``) only without a new turn (``add_generation_prompt`` false), as vLLM
        refuses both, and no new turn only for a prefill (the model would have to open its turn itself)."""
        continuing, new_turn = bool(self.continue_final_message), self.add_generation_prompt is not False
        if continuing == new_turn:
            raise RequestError(
                f"continue_final_message {str(continuing).lower()} with add_generation_prompt "
                f"{str(new_turn).lower()}; allowed: continue_final_message true with add_generation_prompt false "
                "(a prefilled reply), or neither (a new reply)",
                "add_generation_prompt" if not new_turn else "continue_final_message",
            )
        return _stream_options_with_stream(self)


class PageChatBody(_Sampling):
    """``POST /chat/completions``: the web page's request (its conversation, and sampling as OpenAI's)."""

    messages: list[Any] = Field(
        description="a non-empty list of system / user / assistant turns, the last the user's; content a string"
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = _field(
        "an integer from 1 to the server's --max-tokens: the reply's length limit"
    )


class CompletionBody(_Sampling):
    """``POST /v1/completions``: OpenAI's legacy completions request."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists: each a "
        "document, BOS put in front"
    )
    max_tokens: Annotated[int, Field(ge=0)] | None = _field(
        "an integer from 1 (0 with echo) to the server's --max-tokens, default 16: the completion's length limit"
    )
    echo: bool | None = _field("true or false: the prompt (and its tokens' log-probabilities) before the completion")
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = _field(
        f"an integer in [0, {MAX_TOP_LOGPROBS}]: each token's log-probability and that many likeliest alternatives"
    )
    stream: bool | None = _field("true or false: server-sent text_completion chunks")
    stream_options: _StreamOptions | None = _field('{"include_usage": true or false}: usage in a last chunk')
    suffix: Literal[""] | None = _field("none only")
    best_of: Literal[1] | None = _field("1 only")

    def checked(self) -> CompletionBody:
        """What no single field says: ``stream_options`` only with ``stream`` true, as OpenAI refuses it."""
        return _stream_options_with_stream(self)


def _stream_options_with_stream(body: ChatCompletionBody | CompletionBody) -> Any:
    """``body``, or a RequestError where it has ``stream_options`` without ``stream`` true."""
    if body.stream_options is not None and not body.stream:
        raise RequestError(
            f"stream_options {body.stream_options.model_dump(exclude_none=True)}; allowed: only with stream true",
            "stream_options",
        )
    return body


#: the fields that adjust the logits before sampling (:mod:`lapheads.apps.penalties`), in both endpoints
PENALTY_FIELDS = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")


def requested_penalties(given: dict[str, Any], vocab_size: int) -> Penalties:
    """The :class:`Penalties` of a validated request's fields (``given``: a body's :data:`PENALTY_FIELDS`, absent
    or None where not asked), or a RequestError naming a ``logit_bias`` token the model does not have."""
    bias = given.get("logit_bias") or {}
    for token in bias:
        if int(token) >= vocab_size:
            raise RequestError(f"logit_bias token {token!r}; allowed: token ids in [0, {vocab_size - 1}]", "logit_bias")
    return Penalties(
        presence=given.get("presence_penalty") or 0.0,
        frequency=given.get("frequency_penalty") or 0.0,
        repetition=given.get("repetition_penalty") or 1.0,
        logit_bias=tuple(sorted((int(token), float(value)) for token, value in bias.items())),
    )


#: vLLM's fields for how a reply ends (:class:`lapheads.apps.batching.Stopping`), in both endpoints
STOPPING_FIELDS = ("stop_token_ids", "ignore_eos", "min_tokens")


def requested_stopping(given: dict[str, Any], tokenizer: Tokenizer, max_tokens: int) -> Stopping:
    """The :class:`Stopping` of a validated request's fields (``given``: a body's :data:`STOPPING_FIELDS`, absent or
    None where not asked) for a reply of at most ``max_tokens``, or a RequestError naming a token the model does
    not have or a ``min_tokens`` above ``max_tokens`` (vLLM refuses it too)."""
    ids = given.get("stop_token_ids") or []
    for token in ids:
        if token >= tokenizer.vocab_size:
            raise RequestError(
                f"stop_token_ids token {token}; allowed: token ids in [0, {tokenizer.vocab_size - 1}]", "stop_token_ids"
            )
    least = given.get("min_tokens") or 0
    if least > max_tokens:
        raise RequestError(f"min_tokens {least}; allowed: an integer in [0, max_tokens {max_tokens}]", "min_tokens")
    special = tokenizer.special_ids
    return Stopping(
        kept_ids=frozenset(ids) - special,
        unkept_ids=frozenset(ids) & special,
        ignore_eos=bool(given.get("ignore_eos")),
        min_tokens=least,
    )


#: the chat fields accepted and ignored (their descriptions say why): the docs' table of them
IGNORED_CHAT_FIELDS = ("store", "metadata", "parallel_tool_calls", "service_tier", "reasoning_effort")

Body = TypeVar("Body", bound=BaseModel)


def validated(schema: type[Body], body: Any) -> Body:
    """``body`` as ``schema``, or a RequestError naming the first refused field and what it allows."""
    if not isinstance(body, dict):
        fields = ", ".join(map(repr, schema.model_fields))
        raise RequestError(f"the request is not a JSON object; allowed: {{{fields}}}")
    try:
        return schema.model_validate(body)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        field = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "extra_forbidden":
            raise RequestError(
                f"unrecognized request argument {field!r}; allowed: {', '.join(schema.model_fields)}", field
            ) from None
        if field not in schema.model_fields:  # pragma: no cover - every location starts with a field of the body
            raise RequestError(" ".join(str(err).split())[:300]) from None
        value, allowed = body.get(field), schema.model_fields[field].description
        if allowed.split(":")[0].endswith(" only"):  # a feature this server does not have, asked for
            message = f"{field}={value!r} is not supported by this server; allowed: {allowed}"
        else:
            message = f"{field} {value!r}; allowed: {allowed}"
        raise RequestError(message, field) from None
