"""Prometheus metrics for the server: what `GET /metrics` answers, in Prometheus' text format (no key needed).

    gptkit_requests_total{endpoint, status}           HTTP answers, 401/413/429 and other refusals included; the
                                                      endpoint is the route's path (e.g. /v1/completions), "other"
                                                      for a path the server does not serve
    gptkit_prompt_tokens_total                        prompt tokens prefilled (a prompt counts once per choice)
    gptkit_generated_tokens_total                     tokens generated, abandoned choices' included
    gptkit_time_to_first_token_seconds                histogram: from a choice's acceptance (queueing included) to
                                                      its first token
    gptkit_time_per_output_token_seconds              histogram: the gaps between a choice's consecutive tokens
    gptkit_batch_occupancy                            histogram: choices decoding in each engine step
    gptkit_requests_finished_total{finish_reason}     choices ended: stop, length, cancelled (client gone), error
    gptkit_queue_length, gptkit_active_slots, gptkit_slots   gauges, read when scraped

A "choice" is one of a request's n answers (a batcher Job). `ServerMetrics` owns its own registry, so several apps
in one process (the tests) keep separate counts; the batcher calls its job_* and step methods from the decode
thread, `CountAnswers` counts every HTTP answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.responses import Response
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Choice(Protocol):
    """What the metrics read of a choice, and the clock they keep on it (gptkit.serve.batcher's Job is one)."""

    clock: float  # when it was accepted, then made its latest token
    request: Any  # the engine's Request: its prompt is counted when prefilled

    @property
    def completion_tokens(self) -> int: ...


class ServerMetrics:
    """The server's counters, histograms and gauges in a registry of their own; `render` is the /metrics answer."""

    def __init__(self, slots: int) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "gptkit_requests", "HTTP answers by endpoint and status", ["endpoint", "status"], registry=registry
        )
        self.prompt_tokens = Counter(
            "gptkit_prompt_tokens", "prompt tokens prefilled (once per choice)", registry=registry
        )
        self.generated_tokens = Counter("gptkit_generated_tokens", "tokens generated", registry=registry)
        self.ttft = Histogram(
            "gptkit_time_to_first_token_seconds",
            "seconds from a choice's acceptance to its first token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.token_gap = Histogram(
            "gptkit_time_per_output_token_seconds",
            "seconds between a choice's consecutive tokens",
            buckets=TOKEN_GAP_BUCKETS,
            registry=registry,
        )
        self.occupancy = Histogram(
            "gptkit_batch_occupancy",
            "choices decoding in an engine step",
            buckets=occupancy_buckets(slots),
            registry=registry,
        )
        self.finished = Counter(
            "gptkit_requests_finished", "choices ended, by finish reason", ["finish_reason"], registry=registry
        )
        self.queued = Gauge("gptkit_queue_length", "choices waiting for a slot", registry=registry)
        self.active = Gauge("gptkit_active_slots", "slots decoding or prefilling a choice", registry=registry)
        Gauge("gptkit_slots", "slots in the batch (--slots)", registry=registry).set(slots)

    # ------------------------------------------------------------------ called by the batcher
    def jobs_accepted(self, jobs: Sequence[Choice]) -> None:
        """The batcher queued the jobs: their time to first token starts now."""
        now = time.monotonic()
        for job in jobs:
            job.clock = now

    def jobs_started(self, jobs: Sequence[Choice]) -> None:
        """The jobs' prompts were prefilled into the engine."""
        self.prompt_tokens.inc(sum(len(job.request.prompt) for job in jobs))

    def step(self, jobs: Sequence[Choice]) -> None:
        """One engine step made a token for each of `jobs` (one per active row)."""
        now = time.monotonic()
        self.occupancy.observe(len(jobs))
        self.generated_tokens.inc(len(jobs))
        for job in jobs:
            first = job.completion_tokens == 1
            (self.ttft if first else self.token_gap).observe(now - job.clock)
            job.clock = now

    def job_finished(self, reason: str) -> None:
        self.finished.labels(finish_reason=reason).inc()

    # ------------------------------------------------------------------ called by the app
    def answered(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self, stats: dict[str, Any]) -> Response:
        """The /metrics answer; `stats` is Batcher.stats() (the gauges are read when scraped)."""
        self.queued.set(stats["queued"])
        self.active.set(stats["active"])
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def occupancy_buckets(slots: int) -> list[float]:
    """1, 2, 4, ... up to `slots`, and `slots` itself: few buckets even for a wide batch, and "full" is one."""
    sizes, size = {slots}, 1
    while size < slots:
        sizes.add(size)
        size *= 2
    return sorted(float(size) for size in sizes)


class CountAnswers:
    """ASGI middleware, outermost of the app's own: counts every HTTP answer by its route's path and status, the
    ones refused before routing (401, 413) included. A path no route serves counts as "other", so labels stay
    few whatever clients ask for."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, routes: list[BaseRoute]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    def endpoint(self, scope: Scope) -> str:
        for route in self.routes:
            if route.matches(scope)[0] != Match.NONE:
                return getattr(route, "path_format", "other")
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        counted = CountedSend(send, self.metrics, self.endpoint(scope))
        try:
            await self.app(scope, receive, counted)
        except Exception:  # Starlette's outermost layer answers it with a 500
            if not counted.started:
                self.metrics.answered(counted.endpoint, 500)
            raise


class CountedSend:
    """An ASGI `send` that counts the answer it starts."""

    def __init__(self, send: Send, metrics: ServerMetrics, endpoint: str) -> None:
        self.send, self.metrics, self.endpoint = send, metrics, endpoint
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.metrics.answered(self.endpoint, message["status"])
        await self.send(message)
