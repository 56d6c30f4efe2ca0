"""The OpenAI completions and chat completions wire format: request bodies, the error body, responses and chunks.

Only what the server speaks: `POST /v1/completions` and `/v1/chat/completions` bodies are checked by pydantic in strict mode (a string is never
taken for a number, nor a float for an integer); every error, whatever raised it, is answered as OpenAI answers:
`{"error": {"message", "type", "param", "code"}}` with a 4xx status (5xx only for the server's own failures).
"""

from __future__ import annotations

import codecs
import json
import time
import uuid
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from gptkit.data.tokenizer import Tokenizer
from gptkit.infer.engine import TokenLogprob

MAX_STOPS = 4  # as OpenAI: up to 4 stop strings
SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API and vLLM allow
MAX_BIAS = 100.0  # logit_bias values lie in [-100, 100], as OpenAI's


class APIError(HTTPException):
    """An answer with an OpenAI error body. An HTTPException, so FastAPI passes it through while it reads a body."""

    def __init__(
        self,
        *,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, headers)
        self.message, self.param, self.code = message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        return error_response(
            status=self.status_code,
            message=self.message,
            kind=self.kind,
            param=self.param,
            code=self.code,
            headers=self.headers,
        )


def error_response(
    *,
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object, the body of every answer to a bad request."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    """include_usage: a last chunk with the usage; continuous_usage_stats (vLLM's extension): usage in every chunk."""

    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingRequest(BaseModel):
    """The fields completions and chat completions share. `top_k` is an extension; the others are OpenAI's.
    Unknown fields are ignored, as other OpenAI-compatible servers do."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def stops(self) -> list[str]:
        return stop_list(self.stop)

    def bias(self, vocab_size: int) -> dict[int, float]:
        """logit_bias with token ids as ints; APIError for a key that is not a token id of this model, or a value
        outside [-100, 100]."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not is_token_id(key, vocab_size):
                raise APIError(
                    status=400,
                    message=f"logit_bias keys are token ids in [0, {vocab_size}), got {key!r}",
                    param="logit_bias",
                )
            if not -MAX_BIAS <= value <= MAX_BIAS:
                raise APIError(
                    status=400,
                    message=f"logit_bias values lie in [-100, 100], got {value} for {key}",
                    param="logit_bias",
                )
            bias[int(key)] = value
        return bias

    @property
    def logprob_count(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
        raise NotImplementedError

    def refuse_unsupported(self) -> None:
        """APIError 400 naming the first field set to something this server cannot do."""
        name = self.unsupported()
        if name:
            raise APIError(
                status=400,
                message=f"{name} is not supported by this server; leave it out",
                param=name,
                code="unsupported_parameter",
            )

    def unsupported(self) -> str | None:
        raise NotImplementedError


class CompletionRequest(SamplingRequest):
    """The body of POST /v1/completions. `max_tokens: 0` with `echo` scores a prompt without generating. `suffix`
    (insertion) is refused, never silently ignored."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        return "suffix" if self.suffix else None

    def check(self) -> None:
        """APIError for fields that contradict each other."""
        self.refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(
                status=400,
                message="max_tokens 0 generates nothing: give echo=true to score the prompt",
                param="max_tokens",
            )
        if self.best_of is not None and self.best_of < (self.n or 1):
            raise APIError(
                status=400, message=f"best_of ({self.best_of}) must be at least n ({self.n or 1})", param="best_of"
            )
        if self.candidates > (self.n or 1) and self.stream:
            raise APIError(
                status=400,
                message="best_of > n cannot be streamed: the best choices are known only at the end",
                param="best_of",
            )

    @property
    def candidates(self) -> int:
        """Choices generated per prompt: best_of, else n."""
        return self.best_of or self.n or 1

    @property
    def logprob_count(self) -> int | None:
        return self.logprobs

    @property
    def token_budget(self) -> int | None:
        return self.max_tokens


def is_token_id(key: str, vocab_size: int) -> bool:
    """Whether a logit_bias key is a token id of a vocabulary of vocab_size, written in ASCII digits (str.isdigit
    takes other scripts' digits and superscripts, and int() refuses some of them and very long ones)."""
    return key.isascii() and key.isdigit() and len(key) <= len(str(vocab_size)) and int(key) < vocab_size


def stop_list(stop: str | list[str] | None) -> list[str]:
    """A request's stop strings as a list; APIError for too many or an empty one."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise APIError(status=400, message=f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
    if any(item == "" for item in stops):
        raise APIError(status=400, message="stop strings must not be empty", param="stop")
    return stops


class ContentPart(BaseModel):
    """One part of a message's content list; only text parts can be read by a text model."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """The body of POST /v1/chat/completions: OpenAI's fields (`max_completion_tokens`, and the older `max_tokens`),
    `top_k` as an extension. Fields this server cannot honour (tools, response_format other than text) are
    refused, never silently ignored."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    response_format: dict | None = None

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        asked = {
            "tools": bool(self.tools),
            "response_format": self.response_format not in (None, {"type": "text"}),
        }
        return next((name for name, on in asked.items() if on), None)

    def check(self) -> None:
        """APIError for fields that contradict each other."""
        self.refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(status=400, message="top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def candidates(self) -> int:
        return self.n or 1

    @property
    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, str]]:
        return message_dicts(self.messages)


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """The messages as {role, content} with a content list's text parts joined; APIError for other parts."""
    plain = []
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            other = next((part.type for part in content if part.type != "text" or part.text is None), None)
            if other is not None:
                raise APIError(
                    status=400,
                    message=f"messages[{index}]: only text content parts are read, not {other!r}",
                    param="messages",
                )
            content = "".join(part.text for part in content)
        plain.append({"role": message.role, "content": content})
    return plain


class TokenizeRequest(BaseModel):
    """The body of POST /tokenize (vLLM's): a prompt, or chat messages rendered with the template."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # our tokenizers add no begin-of-text token: nothing to add
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    """The body of POST /detokenize (vLLM's)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def validation_error(exc: RequestValidationError) -> APIError:
    """The OpenAI answer for a body pydantic refused: malformed JSON, a missing field, a wrong type, a value out of
    range. Names the field (param) and says what it needs."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": "value_error"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return APIError(status=400, message="the request body is not valid JSON", code="invalid_json")
    if not loc:
        return APIError(
            status=400, message="the request body must be a JSON object, sent with Content-Type: application/json"
        )
    param = loc[0]
    if param == "prompt" and len(loc) > 1:  # the completions prompt's union (/tokenize's is a string)
        return APIError(
            status=400,
            message="prompt must be a string, a list of strings, a list of token ids, or a list of lists of token ids",
            param=param,
        )
    where = ".".join(loc) if len(loc) == 1 or not loc[1].isidentifier() else param
    return APIError(
        status=400, message=f"{where}: {first.get('msg', 'invalid value')}", param=param, code=first.get("type")
    )


def completion_id() -> dict[str, Any]:
    """The fields every response and chunk of one completion share, but the model."""
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time())}


def chat_completion_id(streamed: bool) -> dict[str, Any]:
    """The same for a chat completion: its response, or (streamed) its chunks."""
    kind = "chat.completion.chunk" if streamed else "chat.completion"
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": kind, "created": int(time.time())}


def choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_delta(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict[str, Any]:
    """A streamed chat choice: new text as a delta, or (with a finish reason) the last chunk's empty delta."""
    delta = {"content": text} if text or finish_reason is None else {}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def token_text(tokenizer: Tokenizer, token: int) -> str:
    """A token as text; a token that is not whole UTF-8 (part of a character) as OpenAI writes it: "bytes:\\xe2"."""
    piece = tokenizer.decode_bytes([token])
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)


def completion_logprobs(entries: list[TokenLogprob], tokenizer: Tokenizer, offsets: TextOffsets) -> dict[str, list]:
    """The completions API's logprobs object for these tokens; text_offset from `offsets`, which goes on past them
    (a streamed choice's next chunk continues where these end)."""
    top = [
        None if entry.logprob is None else {token_text(tokenizer, t): value for t, value in entry.top}
        for entry in entries
    ]
    return {
        "tokens": [token_text(tokenizer, entry.token) for entry in entries],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": top,
        "text_offset": offsets.starts(tokenizer, [entry.token for entry in entries]),
    }


class TextOffsets:
    """Where a choice's tokens start in its text, in characters (the completions API's text_offset), token after
    token: their bytes decoded one token after another, as the text is, so that a token starting inside a character
    (one whose bytes other tokens hold too) starts at that character, and bytes that are no UTF-8 count as the one
    U+FFFD each shows as."""

    def __init__(self) -> None:
        self.position = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def starts(self, tokenizer: Tokenizer, tokens: list[int]) -> list[int]:
        """Where each of `tokens` starts, the text so far going on by them."""
        starts = []
        for token in tokens:
            starts.append(self.position)
            self.position += len(self._decoder.decode(tokenizer.decode_bytes([token])))
        return starts


def chat_logprobs(entries: list[TokenLogprob], tokenizer: Tokenizer) -> dict[str, list]:
    """The chat API's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}, ...]}."""
    content = []
    for entry in entries:
        top = [chat_token(tokenizer, token, logprob) for token, logprob in entry.top]
        content.append({**chat_token(tokenizer, entry.token, entry.logprob), "top_logprobs": top})
    return {"content": content}


def chat_token(tokenizer: Tokenizer, token: int, logprob: float) -> dict[str, Any]:
    return {"token": token_text(tokenizer, token), "logprob": logprob, "bytes": list(tokenizer.decode_bytes([token]))}


def chat_role_delta(index: int) -> dict[str, Any]:
    """A streamed chat choice's first chunk: who speaks."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
