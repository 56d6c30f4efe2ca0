"""Continuous batching for a server: one decode thread owns the Engine; requests come and go between its steps.

The server (gptkit.serve.app, asyncio) turns each choice of an HTTP request into a `Job` and `submit`s them; the
decode thread admits waiting jobs into free slots before each step (scoring their prompts first when asked: echo
with logprobs), runs `engine.step()` for every active job at once, turns each new token into text
(gptkit.infer.textstream: UTF-8 safe, stop strings) and hands (index, text, finish_reason, logprobs) events to the
job's asyncio queue with `loop.call_soon_threadsafe`. A job that is `cancel`led (its
client went away) leaves the engine before the next step, so it costs no more compute. A job whose logits the
engine finds NaN or infinite ends with an error of its own (REFUSED_STATUS); the others decode on. A job's tokens
do not depend on the others in the batch (see gptkit.infer.engine).

When `slots` jobs decode and `max_queue` more wait, `submit` raises ServerBusyError (the server answers 429).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from gptkit.core.devices import autocast
from gptkit.infer.engine import Engine, GenerationError, Request, TokenLogprob
from gptkit.infer.textstream import TextStream
from gptkit.serve.metrics import ServerMetrics

# The answer to a request the model cannot continue (its logits came out NaN or infinite on this text): the request
# was well formed, but this model cannot process it.
REFUSED_STATUS = 422


class ServerBusyError(Exception):
    """Every slot is busy and the queue is full: try again later."""


@dataclass(eq=False, kw_only=True)
class Job:
    """One choice of one HTTP request: the engine's Request, its text stream, and where its events go.

    Events are (index, text, finish_reason, logprobs) tuples put on `events` (an asyncio.Queue of `loop`): text is
    what became printable after a token (possibly ""); finish_reason is None until the last event ("stop", "length",
    or "error" with the message as text, and `error_status` the HTTP status to answer it with); logprobs are the
    TokenLogprobs of the tokens made since the last event (when the request asked for them). `echo` is text the
    choice begins with (the prompt, for echo); with `score_prompt` = k the first event also brings the prompt's
    tokens' TokenLogprobs, with k alternatives each.
    """

    request: Request
    stream: TextStream
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    index: int = 0
    echo: str = ""
    score_prompt: int | None = None
    unshown: int = 0  # the prompt's first tokens an echo neither shows nor scores (the bos the server put first)
    finish_reason: str | None = None
    error_status: int = 500  # a failure of the server's own, unless the model could not continue this job
    cancelled: bool = field(default=False, repr=False)
    reported: int = field(default=0, repr=False)  # the request's token_logprobs already sent in an event
    clock: float = field(default=0.0, repr=False)  # for metrics: when it was accepted, then made its latest token

    @property
    def completion_tokens(self) -> int:
        return len(self.request.output)

    def post(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None = None) -> None:
        """Hand an event to the job's event loop (from any thread); dropped when that loop has closed."""
        deliver([(self, text, finish_reason, logprobs or [])])

    def new_logprobs(self) -> list[TokenLogprob]:
        """The TokenLogprobs of the tokens made since the last call."""
        made = self.request.token_logprobs[self.reported :]
        self.reported += len(made)
        return made


def deliver(events: list[tuple[Job, str, str | None, list[TokenLogprob]]]) -> None:
    """Hand (job, text, finish_reason, logprobs) events to their jobs' event loops, with one wake-up per loop (a
    step's events travel together: fewer thread switches on a busy machine). Events for a closed loop are dropped."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple]]] = {}
    for job, text, finish_reason, logprobs in events:
        if finish_reason is not None:
            job.finish_reason = finish_reason
        event = (job.index, text, finish_reason, logprobs)
        by_loop.setdefault(job.loop, []).append((job.events, event))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is gone, nobody listens
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, tuple]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


class Batcher:
    """The decode thread and its queue. `start()` once, `stop()` at shutdown; `submit` and `cancel` from any thread.

    `engine` is built here, under autocast for `dtype`, with the backend `decode` (gptkit.infer.decoding), so it
    decodes as sample.py would.
    Counters for /health: `steps` (engine steps run), `tokens` (tokens made), `finished` (jobs that ran to their
    end, or failed), `cancelled` (jobs that left the engine because their client went away). With `metrics`, the
    decode thread also reports tokens, their timing and how jobs end there (for GET /metrics).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        slots: int,
        max_queue: int,
        device: torch.device,
        dtype: torch.dtype,
        decode: str = "auto",
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.device, self.dtype, self.max_queue = device, dtype, max_queue
        self.metrics = metrics
        with autocast(device, dtype):
            self.engine = Engine(model, slots=slots, decode=decode)
        self.slots = slots
        self._cond = threading.Condition()
        self._pending: deque[Job] = deque()
        self._cancelled: list[Job] = []
        self._running: dict[Request, Job] = {}  # the jobs in the engine, by their request
        self._starting = 0  # jobs taken from the queue whose prompts are being prefilled
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self.steps = self.tokens = self.finished = self.cancelled = 0

    # ------------------------------------------------------------------ called from the server's threads
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """End the decode thread after its current step; jobs still waiting or decoding end with an error."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, jobs: list[Job]) -> None:
        """Queue jobs for decoding, all or none: ServerBusyError when they do not fit in the free slots and queue."""
        with self._cond:
            if self._stopping:
                raise ServerBusyError("the server is shutting down")
            waiting = len(self._pending) + len(jobs) - max(0, self.slots - len(self._running) - self._starting)
            if waiting > self.max_queue:
                raise ServerBusyError(f"all {self.slots} slots are busy and {len(self._pending)} requests wait")
            if self.metrics:  # before the decode thread can see them
                self.metrics.jobs_accepted(jobs)
            self._pending.extend(jobs)
            self._cond.notify()

    def cancel(self, jobs: Iterable[Job]) -> None:
        """Stop the unfinished jobs among `jobs`: a waiting one never starts, a decoding one leaves before the
        next step."""
        with self._cond:
            for job in jobs:
                if job.finish_reason is None and not job.cancelled:
                    job.cancelled = True
                    if job in self._pending:  # it frees its place in the queue at once
                        self._pending.remove(job)
                        job.finish_reason = "cancelled"
                        if self.metrics:
                            self.metrics.job_finished("cancelled")
                    else:
                        self._cancelled.append(job)
            self._cond.notify()

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "slots": self.slots,
                "active": len(self._running) + self._starting,
                "queued": len(self._pending),
                "max_queue": self.max_queue,
                "steps": self.steps,
                "tokens_generated": self.tokens,
                "requests_finished": self.finished,
                "requests_cancelled": self.cancelled,
            }

    # ------------------------------------------------------------------ the decode thread
    def _run(self) -> None:
        with autocast(self.device, self.dtype):
            while True:
                with self._cond:
                    while not (self._pending or self._cancelled or self._running or self._stopping):
                        self._cond.wait()
                    if self._stopping:
                        break
                    cancelled, self._cancelled = self._cancelled, []
                    room = self.slots - len(self._running) + sum(job.request in self._running for job in cancelled)
                    admitted = []
                    while self._pending and len(admitted) < room:
                        job = self._pending.popleft()
                        if not job.cancelled:
                            admitted.append(job)
                    self._starting = len(admitted)
                try:
                    self._drop(cancelled)
                    self._admit(admitted)
                    self._step()
                except Exception as exc:  # a bug: end what was decoding, keep serving the next requests
                    self._fail_running(f"generation failed: {type(exc).__name__}: {exc}")
        self._fail_running("the server is shutting down", waiting_too=True)

    def _drop(self, jobs: list[Job]) -> None:
        """Take cancelled jobs out of the engine: their rows are free for the next step."""
        for job in jobs:
            if job.request in self._running:
                self.engine.remove(job.request)
                with self._cond:
                    del self._running[job.request]
                    self.cancelled += 1
            if job.finish_reason is None:
                job.finish_reason = "cancelled"  # nobody listens: no event
                if self.metrics:
                    self.metrics.job_finished("cancelled")

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill the admitted jobs' prompts into free rows, equally long ones in one pass (outside the lock: submit
        need not wait for it). A job the engine refuses ends with an error; the others start. A job that echoes its
        prompt gets the prompt (and its scores) as its first event; one with no tokens to make ends there."""
        jobs = self._echo(jobs)
        try:
            self.engine.add_many([job.request for job in jobs])
        except Exception:  # a request the server should have refused: add one by one, to find it
            for job in jobs:
                if job.request not in self.engine.active:
                    try:
                        self.engine.add(job.request)
                    except Exception as exc:
                        self._finish(job, "error", f"could not start this request: {exc}")
        with self._cond:
            self._running.update((job.request, job) for job in jobs if job.request in self.engine.active)
            self._starting = 0
        if self.metrics:
            self.metrics.jobs_started([job for job in jobs if job.request in self._running])
        for job in jobs:
            if job.request.finish_reason == "length" and job.request not in self.engine.active:  # max_tokens 0
                self._finish(job, "length", "")

    def _echo(self, jobs: list[Job]) -> list[Job]:
        """Post each echoing job's prompt text, with its tokens scored when asked (once per distinct prompt); a job
        whose prompt the model cannot score (non-finite logits) ends with an error. Returns the jobs that go on."""
        scores: dict[tuple, list[TokenLogprob] | Exception] = {}
        going = []
        for job in jobs:
            if job.score_prompt is not None:
                key = (tuple(job.request.prompt), job.score_prompt)
                if key not in scores:
                    try:
                        scores[key] = self.engine.prompt_logprobs(job.request.prompt, job.score_prompt)
                    except Exception as exc:  # this job ends with it; the others go on (a bug's is a 500)
                        scores[key] = exc
                failure = scores[key]
                if isinstance(failure, GenerationError):
                    job.error_status = REFUSED_STATUS
                    self._finish(job, "error", str(failure))
                    continue
                if isinstance(failure, Exception):
                    self._finish(job, "error", f"could not score this prompt: {type(failure).__name__}: {failure}")
                    continue
                job.post(job.echo, None, scores[key][job.unshown :])
            elif job.echo:
                job.post(job.echo, None)
            going.append(job)
        return going

    def _step(self) -> None:
        if not self._running:
            return
        made = self.engine.step()
        self.steps += 1
        self.tokens += len(made)
        if self.metrics:
            self.metrics.step([self._running[request] for request, _ in made])
        events = []
        for request, token in made:
            job = self._running[request]
            text = job.stream.push(token)
            if job.stream.done and request.finish_reason is None:  # a stop string: free the row now
                self.engine.remove(request, "stop")
            if request.finish_reason is None:
                if text:
                    events.append((job, text, None, job.new_logprobs()))
            else:
                # "stop": a stop string or the end-of-text token; "length": max_tokens made
                reason = "stop" if job.stream.done else request.finish_reason
                events.append(self._finish(job, reason, text + job.stream.finish(), post=False))
        for request, job in list(self._running.items()):
            if request.finish_reason == "error":  # the engine ended it: its logits were not finite
                job.error_status = REFUSED_STATUS
                events.append(self._finish(job, "error", request.error, post=False))
        deliver(events)

    def _finish(self, job: Job, reason: str, text: str, post: bool = True) -> tuple[Job, str, str, list[TokenLogprob]]:
        """Take a job out of the running ones and post its last event (or, with post=False, return it)."""
        with self._cond:
            self._running.pop(job.request, None)
            self.finished += 1
        if self.metrics:
            self.metrics.job_finished(reason)
        logprobs = job.new_logprobs()
        if post:
            job.post(text, reason, logprobs)
        return job, text, reason, logprobs

    def _fail_running(self, message: str, waiting_too: bool = False) -> None:
        """End every decoding job (and with waiting_too, every waiting one) with an error event."""
        with self._cond:
            jobs = list(self._running.values())
            if waiting_too:
                jobs += list(self._pending)
                self._pending.clear()
        for job in jobs:
            if job.request in self.engine.active:
                self.engine.remove(job.request)
            if not job.cancelled:
                self._finish(job, "error", message)
            with self._cond:
                self._running.pop(job.request, None)
