"""An OpenAI-compatible HTTP server for a trained model, with a playground page: what serve.py runs.

    GET  /                 the playground (gptkit/serve/static/playground.html: plain HTML and JS, no outside assets)
    GET  /health           status, the model, slots, queue, counters (no key needed)
    GET  /metrics          Prometheus metrics: requests, tokens, latencies, batch occupancy (gptkit.serve.metrics)
    GET  /v1/models        the one model served, as OpenAI lists models; GET /v1/models/{id} for one
    POST /v1/completions   OpenAI's completions: prompt (string, list, token ids), max_tokens, temperature, top_p,
                           n, best_of, stop, seed, stream (server-sent events, then `data: [DONE]`),
                           stream_options.include_usage, logprobs, echo (max_tokens 0: score the prompt only),
                           presence_penalty, frequency_penalty, logit_bias; top_k as an extension
    POST /v1/chat/completions  the same for chat messages, rendered with the model's chat template; logprobs and
                           top_logprobs in the chat format
    GET  /tokenizer_info, POST /tokenize, /detokenize   vLLM's tokenizer endpoints (lm-eval's remote tokenizer)

FastAPI parses and checks requests; uvicorn speaks HTTP; gptkit.serve.batcher decodes every request's choices together
(continuous batching). `Guard` checks the API key and the body size before anything reads the body. Every error is
an OpenAI error body (gptkit.serve.openai_api); a client that disconnects cancels its choices at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import h11
import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from gptkit.core.devices import Runtime
from gptkit.core.errors import UserError
from gptkit.core.settings import setting
from gptkit.data.chat import ChatError
from gptkit.data.hf_tokenizer import HFTokenizer
from gptkit.data.tokenizer import (
    Tokenizer,
    completion_stops,
    encode_with_special_tokens,
    no_chat_reason,
    prompt_opening,
    reply_stops,
)
from gptkit.infer import engine, next_token
from gptkit.infer.decoding import Decoding
from gptkit.infer.engine import TokenLogprob
from gptkit.infer.textstream import TextStream
from gptkit.serve import openai_api as api
from gptkit.serve.batcher import Batcher, Job, ServerBusyError
from gptkit.serve.metrics import CountAnswers, ServerMetrics
from gptkit.serve.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_response,
)
from gptkit.weights.source_settings import ModelSource


@dataclass(kw_only=True)
class ServeSettings(ModelSource, Decoding, Runtime):
    model_name: str = setting("", "the model id clients send ('' = the out_dir's name, or init_from)")
    host: str = setting("127.0.0.1", "address to listen on (127.0.0.1: this machine only)")
    port: int = setting(8000, "port to listen on (0 = any free port; the URL is printed)", rule="non_negative")
    api_key: str = setting("", "require `Authorization: Bearer KEY` on every /v1 request ('' = no key)")
    allow_public_without_key: bool = setting(False, "allow a non-loopback --host without --api_key")
    slots: int = setting(16, "requests decoded together, one batch per step", rule="positive")
    max_queue: int = setting(64, "requests waiting for a slot; more get 429 with Retry-After", rule="non_negative")
    retry_after: int = setting(1, "seconds a 429 answer asks the client to wait (Retry-After)", rule="positive")
    max_tokens: int = setting(2048, "the largest max_tokens a request may ask for", rule="positive")
    default_max_tokens: int = setting(
        16, "max_tokens of a request that gives none (at most --max_tokens)", rule="positive"
    )
    max_n: int = setting(16, "the most choices one request may ask for: n × the number of prompts", rule="positive")
    long_prompts: str = setting(
        "truncate",
        "a prompt longer than the context: truncate (keep its last tokens) or refuse (400)",
        choices=("truncate", "refuse"),
    )
    max_body_bytes: int = setting(1_000_000, "the largest request body accepted (413 beyond)", rule="positive")
    access_log: bool = setting(True, "log each request on stdout")

    def validate(self) -> None:
        super().validate()
        if self.port > 65535:
            raise UserError(f"--port must be at most 65535, got {self.port}")
        if self.max_n > self.slots + self.max_queue:
            raise UserError(f"--max_n ({self.max_n}) exceeds what --slots plus --max_queue hold; lower it")
        if not is_loopback(self.host) and not self.api_key and not self.allow_public_without_key:
            raise UserError(
                f"--host={self.host} lets other machines reach the server, and no --api_key is set; give "
                "--api_key=KEY, or --allow_public_without_key=True if that is really meant"
            )


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (localhost, 127.x.x.x, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class Guard:
    """ASGI middleware run before any body is read: the API key on /v1 paths (compared in constant time), then the
    body size (the Content-Length header, and the bytes actually received when there is none)."""

    def __init__(self, app: ASGIApp, api_key: str, max_body_bytes: int) -> None:
        self.app, self.api_key, self.max_body_bytes = app, api_key.encode(), max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        if self.api_key and scope["path"].startswith("/v1"):
            scheme, _, given = headers.get("authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key)):
                answer = error_response(
                    status=401,
                    message="missing or wrong API key: send the header `Authorization: Bearer KEY`",
                    kind="invalid_request_error",
                    code="invalid_api_key",
                )
                return await answer(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None and not declared.isdigit():
            answer = error_response(
                status=400, message=f"Content-Length {declared!r} is not a number", kind="invalid_request_error"
            )
            return await answer(scope, receive, send)
        if declared is not None and int(declared) > self.max_body_bytes:
            answer = error_response(
                status=413,
                message=f"the request body is larger than {self.max_body_bytes} bytes",
                kind="invalid_request_error",
                code="request_too_large",
            )
            return await answer(scope, receive, send)
        await self.app(scope, BodyReader(receive, self.max_body_bytes), send)


# How long a request's body may take to arrive: a client that sends part of it and then nothing would otherwise hold
# its connection, and a worker's read, for good.
BODY_SECONDS = 30.0


class BodyReader:
    """A request's `receive` that answers 413 once its body passes max_bytes, and 408 when the body stops arriving
    for BODY_SECONDS; after the body, it waits as long as the server does (for the client to go)."""

    def __init__(self, receive: Receive, max_bytes: int) -> None:
        self.receive, self.max_bytes = receive, max_bytes
        self.received, self.complete = 0, False

    async def __call__(self) -> dict:
        if self.complete:
            return await self.receive()
        try:
            message = await asyncio.wait_for(self.receive(), BODY_SECONDS)
        except TimeoutError:
            raise APIError(
                status=408, message=f"the request body did not arrive within {BODY_SECONDS:g} s", code="timeout"
            ) from None
        self.complete = message["type"] != "http.request" or not message.get("more_body", False)
        self.received += len(message.get("body", b""))
        if self.received > self.max_bytes:
            raise APIError(
                status=413, message=f"the request body is larger than {self.max_bytes} bytes", code="request_too_large"
            )
        return message


class JobStream(StreamingResponse):
    """A streamed completion that cancels its jobs however the response ends: done, failed, or the client gone
    (even before the first chunk, when the event generator never ran)."""

    def __init__(self, events: AsyncIterator[bytes], jobs: list[Job], batcher: Batcher) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self.jobs, self.batcher = jobs, batcher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.batcher.cancel(self.jobs)


class Service:
    """What the routes do: turn a completions request into jobs for the batcher and its events into answers."""

    def __init__(
        self, model: torch.nn.Module, tokenizer: Tokenizer, cfg: ServeSettings, device: torch.device, dtype: torch.dtype
    ) -> None:
        self.cfg, self.tokenizer, self.name = cfg, tokenizer, cfg.model_name or "model"
        self.block_size, self.created = model.config.block_size, int(time.time())
        self.metrics = ServerMetrics(cfg.slots)
        self.batcher = Batcher(model, cfg.slots, cfg.max_queue, device, dtype, decode=cfg.decode, metrics=self.metrics)
        self.playground = (resources.files("gptkit.serve") / "static" / "playground.html").read_bytes()

    async def page(self) -> HTMLResponse:
        return HTMLResponse(self.playground, headers={"Cache-Control": "no-cache"})

    async def scrape(self) -> Response:
        """GET /metrics: the metrics in Prometheus' text format, the gauges read now."""
        return self.metrics.render(self.batcher.stats())

    async def health(self) -> dict[str, Any]:
        chat = self.tokenizer.chat is not None
        return {
            "status": "ok",
            "model": self.name,
            "context_length": self.block_size,
            "chat": chat,
            **self.batcher.stats(),
        }

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "gpt-toolkit",
            "context_length": self.block_size,
            "chat": self.tokenizer.chat is not None,  # whether /v1/chat/completions can answer
        }

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    async def get_model(self, model: str) -> dict[str, Any]:
        if model != self.name:
            raise APIError(
                status=404,
                message=f"the model {model!r} does not exist; this server has {self.name!r}",
                param="model",
                code="model_not_found",
            )
        return self.model_card()

    async def tokenizer_info(self) -> dict[str, Any]:
        """The tokenizer as vLLM's /tokenizer_info describes it (what lm-eval's remote tokenizer reads)."""
        eot, chat = self.tokenizer.eot_token, self.tokenizer.chat
        begin = "" if chat is None or chat.begin is None else self.tokenizer.decode([chat.begin])
        # A Hugging Face tokenizer names its own bos and pad tokens; ours have neither.
        named = self.tokenizer.special_tokens_map if isinstance(self.tokenizer, HFTokenizer) else {}
        return {
            "tokenizer_class": self.tokenizer.kind,
            "eos_token": None if eot is None else self.tokenizer.decode([eot]),
            "bos_token": named.get("bos_token"),
            "pad_token": named.get("pad_token"),
            "vocab_size": self.tokenizer.vocab_size,
            "model_max_length": self.block_size,
            "chat_template": None if chat is None else chat.to_jinja(begin),
        }

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: a prompt's ids, special tokens' texts read as those tokens (as Hugging Face's
        tokenizers read them), or the ids of chat messages rendered for a reply."""
        if body.model is not None:
            await self.get_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(status=400, message="give a prompt or messages", param="prompt")
        try:
            if body.prompt is not None:
                ids = await run_in_threadpool(encode_with_special_tokens, self.tokenizer, body.prompt)
            elif self.tokenizer.chat is None:
                raise APIError(
                    status=400,
                    message=f"{no_chat_reason(self.tokenizer, 'this model has no chat template')}; give a prompt",
                    param="messages",
                    code="model_not_chat",
                )
            else:
                messages = api.message_dicts(body.messages)
                ids = self.tokenizer.chat.render_prompt(messages, self.tokenizer, body.add_generation_prompt)
        except (ChatError, UserError, UnicodeError) as exc:
            raise APIError(
                status=400,
                message=f"cannot be tokenized: {exc}",
                param="prompt" if body.prompt is not None else "messages",
            ) from None
        return {"count": len(ids), "max_model_len": self.block_size, "tokens": ids}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        if body.model is not None:
            await self.get_model(body.model)
        self.check_ids(body.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        await self.get_model(body.model)
        body.check()
        given = self.prompt_list(body)
        prompts = [await run_in_threadpool(self.encode, prompt) for prompt in given]
        prompts = [self.fit_echo(ids) if body.echo else self.fit_context(ids) for ids in prompts]
        # The bos a text prompt opens with (encode) is not the client's: an echo neither shows nor scores it.
        unshown = [len(prompt_opening(self.tokenizer)) if isinstance(prompt, str) else 0 for prompt in given]
        jobs = self.make_jobs(body, prompts, self.completion_stops(), unshown)
        self.submit(jobs)
        head = {**api.completion_id(), "model": self.name}
        prompt_tokens = sum(len(ids) for ids in prompts)
        if body.stream:
            events = self.stream(jobs, head, prompt_tokens, body, api.choice)
            return JobStream(events, jobs, self.batcher)
        return await self.collect(jobs, head, prompt_tokens, request, body, api.choice)

    def completion_stops(self) -> tuple[int, ...]:
        """The tokens that end a completion (gptkit.data.tokenizer.completion_stops): the end of text, and on a chat
        model its reply stops and every special token of its template (Qwen3's <think> is text, never a stop)."""
        return tuple(completion_stops(self.tokenizer))

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        """A chat completion: the messages rendered with the model's chat template, the reply decoded up to the end
        of its turn on the same batcher as completions."""
        await self.get_model(body.model)
        body.check()
        template = self.tokenizer.chat
        if template is None:
            none = "this model has no chat template (it was not fine-tuned on conversations)"
            raise APIError(
                status=400,
                message=f"{no_chat_reason(self.tokenizer, none)}; use /v1/completions",
                param="messages",
                code="model_not_chat",
            )
        try:
            ids = await run_in_threadpool(template.render_prompt, body.message_dicts(), self.tokenizer)
        except (ChatError, UserError, UnicodeError) as exc:  # a wrong role, empty content, a character never seen
            raise APIError(status=400, message=f"messages: {exc}", param="messages") from None
        ids = self.fit_context(ids)
        jobs = self.make_jobs(body, [ids], tuple(reply_stops(self.tokenizer)))
        self.submit(jobs)
        if body.stream:
            head = {**api.chat_completion_id(streamed=True), "model": self.name}
            events = self.stream(jobs, head, len(ids), body, api.chat_delta)
            return JobStream(events, jobs, self.batcher)
        head = {**api.chat_completion_id(streamed=False), "model": self.name}
        return await self.collect(jobs, head, len(ids), request, body, api.chat_choice)

    def submit(self, jobs: list[Job]) -> None:
        """Queue the jobs on the batcher, or answer 429 when it is full."""
        try:
            self.batcher.submit(jobs)
        except ServerBusyError as exc:
            raise APIError(
                status=429,
                message=f"the server is busy ({exc}); retry after {self.cfg.retry_after} s",
                code="rate_limit_exceeded",
                kind="rate_limit_error",
                headers={"Retry-After": str(self.cfg.retry_after)},
            ) from None

    def prompt_list(self, body: CompletionRequest) -> list[str | list[int]]:
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise APIError(status=400, message="prompt is an empty list", param="prompt")
        return list(prompt)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of one prompt, checked, and cut to the context (or refused) as --long_prompts says."""
        eot = self.tokenizer.eot_token
        if isinstance(prompt, str):
            try:
                opening = prompt_opening(self.tokenizer)  # a Llama's bos, as transformers and llama.cpp prompt it
                ids = opening + self.tokenizer.encode(prompt) if prompt else (opening or ([] if eot is None else [eot]))
            except (UserError, ValueError, UnicodeError) as exc:  # e.g. a character a char-level model never saw
                raise APIError(status=400, message=f"prompt cannot be encoded: {exc}", param="prompt") from None
        else:
            ids = self.check_ids(prompt, "prompt")
        if not ids:
            raise APIError(
                status=400,
                message="prompt is empty and this model has no end-of-text token to start from",
                param="prompt",
            )
        return ids

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """Token ids sent by a client, or APIError naming `param` for one outside the vocabulary."""
        if any(not 0 <= token < self.tokenizer.vocab_size for token in ids):
            raise APIError(
                status=400, message=f"{param}: token ids must be in [0, {self.tokenizer.vocab_size})", param=param
            )
        return ids

    def fit_echo(self, ids: list[int]) -> list[int]:
        """An echoed prompt whole, or refused: its tokens are scored and shown, so a cut one would not line up
        with what the client sent. It may hold block_size + 1 tokens (the last is scored, never read)."""
        if len(ids) > self.block_size + 1:
            raise APIError(
                status=400,
                message=f"the prompt has {len(ids)} tokens; an echoed prompt is scored whole, in at most {self.block_size + 1} "
                f"tokens (the context, and one more): shorten it (lm-eval: max_length={self.block_size + 2})",
                param="prompt",
                code="context_length_exceeded",
            )
        return ids

    def fit_context(self, ids: list[int]) -> list[int]:
        """A prompt longer than the context: cut to its last block_size tokens, or refused, as --long_prompts says."""
        if len(ids) > self.block_size:
            if self.cfg.long_prompts == "refuse":
                raise APIError(
                    status=400,
                    message=f"the prompt has {len(ids)} tokens; this model's context is {self.block_size}",
                    param="prompt",
                    code="context_length_exceeded",
                )
            ids = ids[-self.block_size :]
        return ids

    def make_jobs(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        stop_tokens: tuple[int, ...],
        unshown: list[int] | None = None,
    ) -> list[Job]:
        """One job per choice: prompt i's j-th choice has index i * n + j and, with a seed, seed + j (n: best_of
        when it asks for more). Each ends at one of `stop_tokens` (end of text; a chat's end of turn), at a stop
        string, or at its token budget. An echo leaves out prompt i's first unshown[i] tokens."""
        n = body.candidates
        if n * len(prompts) > self.cfg.max_n:
            raise APIError(
                status=400,
                message=f"{n * len(prompts)} choices asked (n × prompts); this server allows at most {self.cfg.max_n}",
                param="n",
            )
        settings = self.request_settings(body)
        stops = body.stops()
        echo = isinstance(body, CompletionRequest) and bool(body.echo)
        events, loop = asyncio.Queue(), asyncio.get_running_loop()
        jobs = []
        for i, ids in enumerate(prompts):
            for j in range(n):
                seed = None if body.seed is None else (body.seed + j) % (api.SEED_RANGE[1] + 1)
                request = engine.Request(prompt=ids, stop_tokens=stop_tokens, seed=seed, **settings)
                stream = TextStream(self.tokenizer, stops, stop_tokens)
                hidden = unshown[i] if unshown else 0
                echoed = {}
                if echo:
                    echoed = {"echo": self.tokenizer.decode(ids[hidden:]), "score_prompt": body.logprob_count}
                    echoed["unshown"] = hidden
                jobs.append(Job(request=request, stream=stream, events=events, loop=loop, index=i * n + j, **echoed))
        return jobs

    def request_settings(self, body: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """The engine Request's settings every choice of `body` shares; APIError for values this server refuses."""
        cfg, budget = self.cfg, body.token_budget
        max_tokens = min(cfg.default_max_tokens, cfg.max_tokens) if budget is None else budget
        if max_tokens > cfg.max_tokens:
            raise APIError(
                status=400,
                message=f"max_tokens is {max_tokens}; this server allows at most {cfg.max_tokens}",
                param="max_tokens",
            )
        temperature = 1.0 if body.temperature is None else body.temperature
        problem = next_token.sampling_problem(temperature, body.top_k, body.top_p)
        if problem:
            raise APIError(status=400, message=problem, param=problem.split()[0])
        count, vocab_size = body.logprob_count, self.tokenizer.vocab_size
        if count is not None and count > vocab_size:
            param = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
            raise APIError(
                status=400, message=f"{param} is {count}; the vocabulary has {vocab_size} tokens", param=param
            )
        # best_of ranks its candidates by their tokens' log-probabilities, asked for or not
        ranked = body.candidates > (body.n or 1)
        return {
            "max_new_tokens": max_tokens,
            "temperature": temperature,
            "top_k": body.top_k,
            "top_p": body.top_p,
            "presence_penalty": body.presence_penalty or 0.0,
            "frequency_penalty": body.frequency_penalty or 0.0,
            "logit_bias": body.bias(self.tokenizer.vocab_size),
            "logprobs": 0 if ranked and body.logprob_count is None else body.logprob_count,
        }

    async def events(self, jobs: list[Job]) -> AsyncIterator[dict[int, tuple[str, str | None, list]]]:
        """What the jobs made since the last time, merged per choice: {index: (text, finish_reason, logprobs)},
        until every job has finished. A choice that ends with "error" has the error's message as its text."""
        queue, running = jobs[0].events, len(jobs)
        while running:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            merged: dict[int, tuple[str, str | None, list]] = {}
            for index, text, reason, logprobs in batch:
                old_text, old_reason, old_logprobs = merged.get(index, ("", None, []))
                text = text if reason == "error" else old_text + text
                merged[index] = (text, reason or old_reason, old_logprobs + logprobs)
                running -= reason is not None
            yield merged

    def logprobs_object(
        self, body: CompletionRequest | ChatCompletionRequest, entries: list[TokenLogprob], offsets: api.TextOffsets
    ) -> dict | None:
        """The logprobs of a choice (or of a chunk's new tokens) in the API's format; None when not asked for."""
        if body.logprob_count is None:
            return None
        if isinstance(body, ChatCompletionRequest):
            return api.chat_logprobs(entries, self.tokenizer)
        return api.completion_logprobs(entries, self.tokenizer, offsets)

    async def stream(
        self,
        jobs: list[Job],
        head: dict,
        prompt_tokens: int,
        body: CompletionRequest | ChatCompletionRequest,
        make_choice: Callable,
    ) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed completion: a chunk per choice with new text (made by
        `make_choice`: text, or a chat delta after a first chunk naming the role), then `[DONE]`."""
        options = body.stream_options
        every_chunk = bool(options and options.continuous_usage_stats)
        offsets = [api.TextOffsets() for _ in jobs]  # where each choice's next token starts in its text

        def counts() -> dict[str, int]:
            return api.usage(prompt_tokens, sum(job.completion_tokens for job in jobs))

        try:
            if make_choice is api.chat_delta:
                for job in jobs:
                    yield api.sse({**head, "choices": [api.chat_role_delta(job.index)]})
            async for merged in self.events(jobs):
                for index, (text, reason, entries) in sorted(merged.items()):
                    if reason == "error":
                        kind = "invalid_request_error" if jobs[index].error_status < 500 else "server_error"
                        yield api.sse(api.error_body(text, kind))
                        continue
                    logprobs = self.logprobs_object(body, entries, offsets[index])
                    for choice in stream_choices(make_choice, index, text, reason, logprobs):
                        chunk = {**head, "choices": [choice]}
                        yield api.sse({**chunk, "usage": counts()} if every_chunk else chunk)
            if options and (options.include_usage or every_chunk):
                yield api.sse({**head, "choices": [], "usage": counts()})
            yield api.sse("[DONE]")
        finally:  # also when the client went away: Starlette cancels this generator, and its jobs stop
            self.batcher.cancel(jobs)

    async def collect(
        self,
        jobs: list[Job],
        head: dict,
        prompt_tokens: int,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        make_choice: Callable,
    ) -> Response:
        texts, reasons, entries = [""] * len(jobs), [None] * len(jobs), [[] for _ in jobs]
        errors: dict[int, str] = {}  # a failed choice's message

        async def gather() -> None:
            async for merged in self.events(jobs):
                for index, (text, reason, logprobs) in merged.items():
                    if reason == "error":
                        errors[index] = text
                    else:
                        texts[index] += text
                    reasons[index] = reason or reasons[index]
                    entries[index] += logprobs

        work, gone = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()
            self.batcher.cancel(jobs)
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # the client closed the connection: nobody reads this
        if errors:
            index = min(errors)
            raise APIError(status=jobs[index].error_status, message=errors[index])
        choices = []
        for number, index in enumerate(best_choices(jobs, body)):
            logprobs = self.logprobs_object(body, entries[index], api.TextOffsets())
            choices.append(make_choice(number, texts[index], reasons[index], logprobs))
        completion_tokens = sum(job.completion_tokens for job in jobs)
        return JSONResponse({**head, "choices": choices, "usage": api.usage(prompt_tokens, completion_tokens)})


def stream_choices(
    make_choice: Callable, index: int, text: str, reason: str | None, logprobs: dict | None
) -> list[dict[str, Any]]:
    """The streamed choices of one event. A chat choice's finish reason comes alone, in a last chunk with an empty
    delta after its content, as OpenAI sends it; a completion's comes with its last text."""
    if make_choice is not api.chat_delta or reason is None:
        return [make_choice(index, text, reason, logprobs)]
    content = [make_choice(index, text, None, logprobs)] if text or logprobs else []
    return [*content, make_choice(index, "", reason)]


def best_choices(jobs: list[Job], body: CompletionRequest | ChatCompletionRequest) -> list[int]:
    """The jobs whose choices are answered, in order: all of them, or with best_of the n of each prompt's candidates
    whose tokens have the highest mean log-probability (as OpenAI ranks them)."""
    n, candidates = body.n or 1, body.candidates
    if candidates == n:
        return list(range(len(jobs)))
    chosen = []
    for start in range(0, len(jobs), candidates):
        group = sorted(range(start, start + candidates), key=lambda index: -mean_logprob(jobs[index]))
        chosen += group[:n]
    return chosen


def mean_logprob(job: Job) -> float:
    made = job.request.token_logprobs
    return sum(entry.logprob for entry in made) / max(1, len(made))


async def disconnected(request: Request) -> None:
    """Return once the client has closed the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    cfg: ServeSettings,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> FastAPI:
    """The ASGI app serving `model` (eval mode, on `device`) with `tokenizer`; its decode thread runs while the
    app does (started and stopped by the app's lifespan). `app.state.service` holds the Service."""
    service = Service(model, tokenizer, cfg, device or next(model.parameters()).device, dtype)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.batcher.start()
        try:
            yield
        finally:
            service.batcher.stop()

    app = FastAPI(title="gpt-toolkit", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.service = service
    app.add_api_route("/", service.page, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", service.health, methods=["GET"])
    app.add_api_route("/metrics", service.scrape, methods=["GET"])
    app.add_api_route("/v1/models", service.list_models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", service.get_model, methods=["GET"])
    app.add_api_route("/v1/completions", service.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", service.chat_completions, methods=["POST"])
    app.add_api_route("/tokenizer_info", service.tokenizer_info, methods=["GET"])
    app.add_api_route("/tokenize", service.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", service.detokenize, methods=["POST"])
    app.add_exception_handler(APIError, lambda request, exc: exc.response())
    app.add_exception_handler(RequestValidationError, lambda request, exc: api.validation_error(exc).response())
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(
        Exception, lambda request, exc: error_response(status=500, message="internal server error", kind="server_error")
    )
    app.add_middleware(Guard, api_key=cfg.api_key, max_body_bytes=cfg.max_body_bytes)
    app.add_middleware(CountAnswers, metrics=service.metrics, routes=app.router.routes)  # outside Guard: sees its 401s
    return app


def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (unknown path, wrong method) with an OpenAI error body."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = {404: f"no such path: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(
        status=exc.status_code,
        message=message.get(exc.status_code, str(exc.detail)),
        kind="invalid_request_error",
        code=code,
        headers=getattr(exc, "headers", None),
    )


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; UserError when the address cannot be used (e.g. the port is taken)."""
    sock = None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are TCP, and without it
        # Nagle's algorithm and the client's delayed ACK hold each small answer back ~40 ms
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        if sock is not None:
            sock.close()
        reason = exc.strerror or str(exc)
        raise UserError(f"cannot listen on {host}:{port}: {reason}; choose another --host or --port") from None
    return sock


class JSONErrorProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, but a request it cannot parse (a header that is no header, a Content-Length that
    is no number) is answered with the JSON error body every other bad request gets, not uvicorn's plain text."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(api.error_body(f"malformed HTTP request: {msg}", "invalid_request_error")).encode()
        length = str(len(body)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", length), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers), h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def serve(app: FastAPI, sock: socket.socket, access_log: bool = True) -> None:
    """Run uvicorn on `sock` until Ctrl-C or SIGTERM (open streams get 3 s to finish)."""
    config = uvicorn.Config(
        app,
        http=JSONErrorProtocol,
        log_level="info",
        access_log=access_log,
        timeout_graceful_shutdown=3,
        timeout_keep_alive=5,
    )
    uvicorn.Server(config).run(sockets=[sock])
