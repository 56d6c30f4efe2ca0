"""Generation: a KV cache with one row per request, and a step-based engine that batches requests.

- KVCache: keys and values of every layer for a fixed number of rows ("slots"), each row with its own length.
  A row's tokens sit at positions 0..length-1 (right padding); a forward pass reads and writes a range of rows.
- Request: one prompt with its own sampling settings, stop tokens, token budget and random generator (seed), and
  optionally OpenAI's logit rules (presence and frequency penalties, logit bias) and the log-probabilities of the
  tokens it makes (TokenLogprob).
- Engine: runs requests one token per step. A new request is prefilled into a free row (on its own, or in one
  pass with the equally long prompts add_many adds with it); each step
  feeds the latest token of every active row in one batched forward pass and samples; a finished request frees
  its row. A row whose logits come out NaN or infinite (its activations overflowed) makes no token: its request
  ends with an error, and the others go on. A row whose window is full slides on its own (rebuilt from the last
  3/4 of a window), exactly when it would alone. So a request's tokens do not depend on what else is in the
  batch: greedy tokens are the same, and a seeded request draws the same tokens (up to float rounding, which the
  batch size can change).
- generate, generate_stream: a batch of prompts continued at once through the engine (gptkit.infer.generate), the
  fast path; model.py's GPT.generate is the plain uncached loop whose tokens it must match.

The model is duck-typed, never imported (the backends run its passes): `model(idx, cache=cache)` returns (logits (B, 1, V), _) for the last
position, `model.hidden_states(idx, cache=cache)` does the same pass without the head (to fill a prompt into the
cache; with `model.logits` after it, a prompt's logits at every position), `model.config` has block_size and
n_layer, and both calls run `cache.extend(B, T, device)` once for the
positions of the T new tokens and `cache.update(layer, k, v)` in every layer. Which backend runs the passes is
`decode`, chosen once when the engine is built (gptkit.infer.decoding: auto by default); the engine knows only the
backend's interface (gptkit.infer.backend).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from gptkit.core.errors import UserError
from gptkit.infer.backend import compute_dtype
from gptkit.infer.decoding import make_backend
from gptkit.infer.memory import huge_page_zeros
from gptkit.infer.next_token import Sampling, is_whole_number, sampling_problem


class KVCache:
    """Keys and values of every layer for `slots` rows of up to `capacity` positions each.

    Each layer's storage (slots, n_kv_head, capacity, head_dim) is allocated at its first update, in the dtype and on
    the device of the keys, as zeros: a shorter row's masked positions are still read, so they must be finite.
    `lengths[r]` counts the positions row r holds. The cache stands for all its rows; rows(start, stop) is a view
    of some of them that shares storage and lengths (the engine runs a pass over the active rows, or one row).
    """

    def __init__(self, n_layer: int, capacity: int, slots: int = 1) -> None:
        self.capacity, self.slots = capacity, slots
        self.lengths = [0] * slots
        self.keys: list[torch.Tensor | None] = [None] * n_layer
        self.values: list[torch.Tensor | None] = [None] * n_layer
        self.start, self.stop = 0, slots
        # Set by extend for the pass that follows: where its keys go, and how many positions it attends over.
        self._offset, self._end = 0, 0
        self._positions: torch.Tensor | None = None  # (B, T) when rows differ in length, else None
        self._mask: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> KVCache:
        """A view of rows start..stop-1 for one forward pass over a batch of stop - start rows."""
        if not 0 <= start < stop <= self.slots:
            raise ValueError(f"rows {start}..{stop - 1} are not in a cache of {self.slots} rows")
        view = copy.copy(self)  # shares the storage lists and lengths; the per-pass fields are its own
        view.start, view.stop = start, stop
        return view

    def extend(self, batch: int, new: int, device: torch.device) -> torch.Tensor:
        """Make room for `new` tokens after each row's last and return their positions: (new,) when the rows are
        equally long, else (batch, new). ValueError past capacity or for a batch that is not this view's rows."""
        if batch != self.stop - self.start:
            raise ValueError(f"a batch of {batch} rows for a cache view of {self.stop - self.start} rows")
        lengths = self.lengths[self.start : self.stop]
        self._end = max(lengths) + new
        if self._end > self.capacity:
            raise ValueError(f"sequence of {self._end} tokens is longer than the cache's {self.capacity} positions")
        self.lengths[self.start : self.stop] = [length + new for length in lengths]
        if min(lengths) == max(lengths):  # the common case keeps slice writes and needs no mask beyond causality
            self._offset, self._positions, self._mask = lengths[0], None, None
            return torch.arange(lengths[0], self._end, device=device)
        self._positions = torch.tensor(lengths, device=device)[:, None] + torch.arange(new, device=device)
        # Query t of row b sees keys 0..(its own position): its own earlier tokens, never another row's padding.
        self._mask = (torch.arange(self._end, device=device) <= self._positions[:, :, None])[:, None]
        return self._positions

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Store k, v (B, nh, T, hd) of `layer` for the pass extend prepared. Returns the keys and values to attend
        over (B, nh, S, hd) and a boolean mask (B, 1, T, S), or None when every row is equally long (then query t
        sees keys 0..S-T+t, plain causal attention)."""
        if self.keys[layer] is None:
            self.allocate(k.shape[1], k.shape[3], k.dtype, k.device)
        keys, values = self.keys[layer][self.start : self.stop], self.values[layer][self.start : self.stop]
        if self._positions is None:
            keys[:, :, self._offset : self._end] = k
            values[:, :, self._offset : self._end] = v
        else:  # each row writes at its own positions
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            keys[rows, :, self._positions] = k.transpose(1, 2).to(keys.dtype)  # index_put casts nothing itself
            values[rows, :, self._positions] = v.transpose(1, 2).to(values.dtype)
        return keys[:, :, : self._end], values[:, :, : self._end], self._mask

    def allocate(self, n_head: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """Make every layer's storage now (zeros), unless it exists: the compiled step writes into it in place.

        One position more than the capacity: a view of the storage over all its positions would be contiguous,
        and any shorter one is not, so a compiled step attending over the whole capacity would compile twice."""
        shape = (self.slots, n_head, self.capacity + 1, head_dim)
        for layer, keys in enumerate(self.keys):
            if keys is None:
                self.keys[layer], self.values[layer] = (self._zeros(shape, dtype, device) for _ in range(2))

    @staticmethod
    def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeros for a layer's storage: on the CPU on huge pages (memory.huge_page_zeros), since a step reads every
        row's keys and values and 4 KB pages cost it a TLB miss every 4 KB of them (an engine that knows how far its
        rows go sizes the cache to that: Engine's `positions`)."""
        if device.type == "cpu":
            return huge_page_zeros(math.prod(shape), dtype).view(*shape)
        return torch.zeros(shape, dtype=dtype, device=device)

    def clear(self, row: int) -> None:
        """Zero the positions row `row` holds: its keys and values may be NaN, and whoever takes the row next reads
        the positions past its own length too (masked, but 0 * NaN is NaN)."""
        for storage in (*self.keys, *self.values):
            if storage is not None:
                storage[row, :, : self.lengths[row]] = 0

    def move(self, source: int, target: int) -> None:
        """Copy row `source` (its keys, values and length) over row `target`."""
        length = self.lengths[source]
        for keys, values in zip(self.keys, self.values):
            if keys is not None:
                keys[target, :, :length] = keys[source, :, :length]
                values[target, :, :length] = values[source, :, :length]
        self.lengths[target] = length


@dataclass(kw_only=True)
class TokenLogprob:
    """A token's log-probability under the model (the raw distribution, before temperature, penalties or bias;
    None for a prompt's first token, which nothing precedes) and the `top` most likely tokens at its place as
    (token, log-probability), most likely first."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


class GenerationError(UserError):
    """The model cannot continue a request: its logits came out NaN or infinite."""


@dataclass(eq=False, kw_only=True)
class Request:
    """One prompt to continue. The engine appends the tokens it makes to `output` and sets `finish_reason`
    ("stop": a stop token was made, and is the last of output; "length": max_new_tokens made; "removed"; "error":
    the model's logits were not finite numbers, and `error` says so in a line).

    seed gives the request its own random generator (so its tokens do not depend on the batch); generator
    instead shares a caller's generator (generate's, below); with neither, sampling uses torch's global generator.
    presence_penalty, frequency_penalty and logit_bias change the logits before sampling as OpenAI defines them:
    logit[t] += logit_bias[t] - frequency_penalty * count[t] - presence_penalty * (count[t] > 0), where count[t] is
    how often t is in `output` so far. With `logprobs` = k, each token made gets a TokenLogprob with the k most
    likely alternatives in `token_logprobs`. `sampling`: its settings in one form, set when an engine admits it.
    """

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: Sequence[int] = ()
    seed: int | None = None
    generator: torch.Generator | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    output: list[int] = field(default_factory=list)
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    sampling: Sampling | None = field(default=None, init=False, repr=False)

    @property
    def reads_logits(self) -> bool:
        """Whether this request's step needs its logits in Python: to change them, or to report log-probabilities
        (a backend that chooses tokens inside its step then hands back logits instead)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias) or self.logprobs is not None

    def validate(self) -> None:
        for name, tokens in (("prompt", self.prompt), ("stop_tokens", self.stop_tokens)):
            wrong = (
                [token for token in tokens if not is_whole_number(token)]
                if isinstance(tokens, (list, tuple))
                else [tokens]
            )
            if wrong:
                raise ValueError(f"a request's {name} is a list of token ids (whole numbers), not of {wrong[0]!r}")
        if not self.prompt:
            raise ValueError("a request needs a prompt of at least one token")
        if not is_whole_number(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a whole number >= 0, got {self.max_new_tokens!r}")
        problem = sampling_problem(self.temperature, self.top_k, self.top_p)
        if problem:
            raise ValueError(problem)
        if self.seed is not None and self.generator is not None:
            raise ValueError("give a request a seed or a generator, not both")
        numbers = [self.presence_penalty, self.frequency_penalty, *self.logit_bias.values()]
        if not all(math.isfinite(number) for number in numbers):
            raise ValueError("penalties and logit biases must be finite numbers")
        if self.logprobs is not None and (not is_whole_number(self.logprobs) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a whole number >= 0, got {self.logprobs!r}")

    def last_token(self) -> int:
        """The token the next step feeds: the last one made, or the prompt's last."""
        return self.output[-1] if self.output else self.prompt[-1]


class Engine:
    """Generates for up to `slots` requests at once, one token per step; requests come and go between steps.

    Row r of the cache belongs to active[r]; a finished or removed request's row is refilled by moving the last
    active row into it, so a pass always covers rows 0..n-1. `decode` picks the backend once, here
    (gptkit.infer.decoding: auto, eager, compiled or native; UserError for one that cannot run this model here), and
    `backend` runs every pass. Built under autocast, the engine computes in autocast's dtype. It never changes
    `model`: on the CPU in float32, auto may decode with a copy whose Linear layers are gptkit.infer.onednn's
    (onednn.decoding_copy: the same values). `positions`: the
    most positions a row will reach (a prompt and its new tokens), where the caller knows it ahead (generate): the
    cache then holds that many rather than block_size (less memory to fill, except for a compiled step, whose graphs
    are made for block_size), and a request that would pass it is refused. The backend packs or copies the weights
    as they are when the engine is made: after they change (a training step, load_state_dict), make a new engine
    (generate makes one a call).
    """

    def __init__(self, model: nn.Module, slots: int = 1, decode: str = "auto", positions: int | None = None) -> None:
        if slots <= 0:
            raise ValueError(f"an engine needs at least one slot, got {slots}")
        config = model.config
        self.block_size = config.block_size
        self.keep = config.block_size - config.block_size // 4  # tokens a full window slides down to
        self.device = next(model.parameters()).device
        self.active: list[Request] = []
        self.backend = make_backend(decode, model, slots, compute_dtype(model))
        self.model = self.backend.model  # the model its eager passes run, which scores prompts too
        shorter = positions is not None and positions < config.block_size and not self.backend.full_cache
        self.cache = KVCache(config.n_layer, positions if shorter else config.block_size, slots)

    @property
    def free_slots(self) -> int:
        return self.cache.slots - len(self.active)

    def add(self, request: Request) -> None:
        """Prefill `request`'s prompt (its last block_size tokens) into a free row; its first token comes with the
        next step. A request with max_new_tokens=0 finishes at once and takes no row."""
        self.add_many([request])

    @torch.no_grad()
    def add_many(self, requests: Sequence[Request]) -> None:
        """add() for several requests, all or none. Prompts of the same length are prefilled together, in one pass
        over their rows (a server admitting a burst of requests saves a pass per request)."""
        vocab_size = self.model.config.vocab_size
        for request in requests:
            request.validate()
            if request.finish_reason is not None or request in self.active:
                raise ValueError("this request has already been added")
            if any(not 0 <= token < vocab_size for token in request.logit_bias):
                raise ValueError(f"logit_bias names a token outside the model's vocabulary of {vocab_size}")
            if any(not 0 <= token < vocab_size for token in request.stop_tokens):
                raise ValueError(f"stop_tokens holds a token outside the model's vocabulary of {vocab_size}")
            if request.logprobs is not None and request.logprobs > vocab_size:
                raise ValueError(f"logprobs asks for {request.logprobs} alternatives of a vocabulary of {vocab_size}")
            # Checked before any request joins: a token past the table would fail every later step of the batch.
            if any(not 0 <= token < vocab_size for token in request.prompt):
                raise ValueError(f"a prompt holds a token that is no id of the model's vocabulary of {vocab_size}")
            reach = min(len(request.prompt), self.block_size) + request.max_new_tokens
            if self.cache.capacity < self.block_size and reach > self.cache.capacity:
                raise ValueError(f"a request reaching {reach} positions, past the engine's {self.cache.capacity}")
        starting = [request for request in requests if request.max_new_tokens > 0]
        if len(starting) > self.free_slots:
            raise RuntimeError(f"all {self.cache.slots} slots are busy; step until a request finishes")
        same_length: dict[int, list[Request]] = {}
        for request in requests:
            if request.max_new_tokens == 0:
                request.finish_reason = "length"
                continue
            if request.seed is not None:
                request.generator = torch.Generator(device=self.device).manual_seed(request.seed)
            request.sampling = Sampling.of(
                request.temperature, request.top_k, request.top_p, vocab_size=self.model.config.vocab_size
            )
            same_length.setdefault(min(len(request.prompt), self.block_size), []).append(request)
        for group in same_length.values():
            self.active.extend(group)
            self._fill(len(self.active) - len(group), *(request.prompt[-self.block_size :] for request in group))

    def remove(self, request: Request, reason: str = "removed") -> None:
        """Take an active request out between steps and free its row."""
        row = self.active.index(request)  # ValueError when it is not active
        last = len(self.active) - 1
        if row != last:  # keep the active rows contiguous
            self.cache.move(last, row)
            self.active[row] = self.active[last]
        self.active.pop()
        self.cache.lengths[last] = 0
        request.finish_reason = reason

    @torch.no_grad()
    def step(self) -> list[tuple[Request, int]]:
        """Make one token for every active request; return (request, token) pairs in row order. Requests that
        finish (a stop token, or max_new_tokens reached) leave the engine; so does a request whose logits are not
        finite, with no token (finish_reason "error", see Request)."""
        if not self.active:
            return []
        for row, request in enumerate(self.active):
            if self.cache.lengths[row] == self.block_size:  # window full: slide, as this request would alone
                self._fill(row, (request.prompt + request.output)[-self.keep :])
        sampling = self._shared_sampling() if self.backend.chooses_tokens else None
        uniform = self._uniform_numbers() if sampling is not None and not sampling.greedy else None
        last = [request.last_token() for request in self.active]
        logits, tokens = self.backend.decode(self.cache, last, sampling, uniform)
        if tokens is None:
            tokens = self._sample(logits)
        failed = self._failed_rows(logits, tokens)
        made = []
        for row, (request, token) in enumerate(list(zip(self.active, tokens))):
            if row in failed:
                self._fail(request, failed[row])
                continue
            request.output.append(token)
            made.append((request, token))
            if token in request.stop_tokens:
                self.remove(request, "stop")
            elif len(request.output) >= request.max_new_tokens:
                self.remove(request, "length")
        return made

    def run(self, requests: Iterable[Request]) -> Iterator[list[tuple[Request, int]]]:
        """Generate every request, adding waiting ones in order whenever a row is free (continuous batching);
        yield each step's (request, token) pairs. Requests may be removed between steps. A request that fails
        (see step) ends the run: GenerationError with its reason, since its caller wanted every request's tokens."""
        waiting = deque(requests)
        while True:
            while waiting and self.free_slots:  # all that fit at once: prompts of one length fill in one pass
                self.add_many([waiting.popleft() for _ in range(min(len(waiting), self.free_slots))])
            if not self.active:
                return
            stepping = list(self.active)
            made = self.step()
            failed = next((request for request in stepping if request.finish_reason == "error"), None)
            if failed is not None:
                raise GenerationError(failed.error)
            yield made

    def _failed_rows(self, logits: torch.Tensor, tokens: list[int]) -> dict[int, str]:
        """The rows of this step that made no token, with the reason: a logit that is NaN or infinite (a token
        sampled from it is garbage, or outside the vocabulary), or a token outside the vocabulary that the step
        chose itself (the native step's choice from a row of NaN)."""
        # A row's sum is finite exactly when its logits are (a NaN or infinity carries into it; finite logits of a
        # model are nowhere near float32's largest), and costs one pass without a mask of the logits' size.
        finite = [math.isfinite(total) for total in logits.sum(dim=-1).tolist()]
        vocab_size = self.model.config.vocab_size
        failed = {}
        for row, (request, token) in enumerate(zip(self.active, tokens)):
            if not finite[row] or token == -1:  # -1: the native step found no candidate, every logit NaN
                failed[row] = (
                    f"the model's logits for new token {len(request.output) + 1} are NaN or infinite: its activations "
                    "overflow on this text (or its weights are damaged), so no token can be chosen"
                )
            elif not 0 <= token < vocab_size:
                failed[row] = f"the decoding step chose token {token}, outside the vocabulary of {vocab_size}"
        return failed

    def _fail(self, request: Request, reason: str) -> None:
        """End `request` with an error: its cache row cleared, no log-probability of the logits that failed."""
        self.cache.clear(self.active.index(request))
        del request.token_logprobs[len(request.output) :]
        request.error = reason
        self.remove(request, "error")

    def _shared_sampling(self) -> Sampling | None:
        """The settings every active row chooses its token with, where the backend may apply them inside its step:
        one for all rows, without top-p (its nucleus search stays in Python), and no row that reads its logits.
        None: the step's logits are sampled here."""
        settings = {request.sampling for request in self.active}
        if len(settings) != 1 or any(request.reads_logits for request in self.active):
            return None
        (shared,) = settings
        return shared if shared.top_p is None else None

    def _uniform_numbers(self) -> torch.Tensor:
        """(B, 1) numbers in [0, 1) for a sampled step, drawn as _sample would draw them: one call per generator,
        over its rows in order, so a seeded request makes the same tokens whichever backend samples it."""
        rows_of: dict[int, tuple[torch.Generator | None, list[int]]] = {}
        for row, request in enumerate(self.active):
            rows_of.setdefault(id(request.generator), (request.generator, []))[1].append(row)
        if len(rows_of) == 1:
            return torch.rand((len(self.active), 1), generator=self.active[0].generator, device=self.device)
        uniform = torch.empty((len(self.active), 1), device=self.device)
        for generator, rows in rows_of.values():
            uniform[rows] = torch.rand((len(rows), 1), generator=generator, device=self.device)
        return uniform

    def _fill(self, row: int, *contexts: list[int]) -> None:
        """Make cache rows row, row + 1, ... hold contexts[i][:-1] (equally long), filled by the backend in one pass
        of their own; the next step feeds each context's last token."""
        rows = len(contexts)
        self.cache.lengths[row : row + rows] = [0] * rows
        if len(contexts[0]) > 1:
            self.backend.prefill(self.cache, row, [context[:-1] for context in contexts])

    def _sample(self, logits: torch.Tensor) -> list[int]:
        """One token per active row; rows with the same settings and generator are sampled in one call. Rows with
        penalties or a bias are sampled from their changed logits; log-probabilities are of the raw ones."""
        raw = logits
        if any(request.reads_logits for request in self.active):
            logits = self._apply_logit_rules(logits)
        tokens = self._choose(logits)
        self._record_logprobs(raw, tokens)
        return tokens

    def _choose(self, logits: torch.Tensor) -> list[int]:
        groups: dict[tuple, list[int]] = {}
        for row, request in enumerate(self.active):
            generator = None if request.sampling.greedy else id(request.generator)  # greedy draws nothing
            groups.setdefault((request.sampling, generator), []).append(row)
        tokens = [0] * len(self.active)
        for rows in groups.values():
            first = self.active[rows[0]]
            part = logits if len(rows) == len(tokens) else logits[rows]
            chosen = first.sampling.next_token(part, first.generator)
            for row, token in zip(rows, chosen.tolist()):
                tokens[row] = token
        return tokens

    def _apply_logit_rules(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of logits (B, V) with each row's logit bias and penalties applied (see Request)."""
        logits = logits.float().clone()
        vocab = logits.size(-1)
        for row, request in enumerate(self.active):
            if request.logit_bias:
                columns = torch.tensor(list(request.logit_bias), device=logits.device)
                logits[row, columns] += torch.tensor(list(request.logit_bias.values()), device=logits.device)
            if (request.presence_penalty or request.frequency_penalty) and request.output:
                made = torch.tensor(request.output, device=logits.device)
                counts = torch.bincount(made, minlength=vocab)[:vocab].float()
                logits[row] -= counts * request.frequency_penalty + (counts > 0).float() * request.presence_penalty
        return logits

    def _record_logprobs(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """Append each chosen token's TokenLogprob to the requests that asked for them."""
        rows = [row for row, request in enumerate(self.active) if request.logprobs is not None]
        if not rows:
            return
        chosen = torch.tensor([tokens[row] for row in rows], device=logits.device)
        entries = token_logprobs(logits[rows], chosen, max(self.active[row].logprobs for row in rows))
        for row, entry in zip(rows, entries):
            request = self.active[row]
            entry.top = entry.top[: request.logprobs]
            request.token_logprobs.append(entry)

    @torch.no_grad()
    def prompt_logprobs(self, prompt: Sequence[int], top: int) -> list[TokenLogprob]:
        """Score a prompt (its last block_size + 1 tokens: the last is only scored, never read) in one pass: each
        token's TokenLogprob given the ones before it, with the `top` most likely alternatives; the first token's
        log-probability is None. GenerationError when the logits are not finite numbers."""
        ids = list(prompt[-(self.block_size + 1) :])
        first = TokenLogprob(token=ids[0], logprob=None)
        if len(ids) == 1:
            return [first]
        idx = torch.tensor([ids[:-1]], device=self.device)
        logits = self.model.logits(self.model.hidden_states(idx))[0]
        if not bool(torch.isfinite(logits).all()):
            raise GenerationError(
                "the model's logits over this prompt are NaN or infinite: its activations overflow on this text "
                "(or its weights are damaged), so it cannot be scored"
            )
        return [first, *token_logprobs(logits, torch.tensor(ids[1:], device=self.device), top)]


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> list[TokenLogprob]:
    """For each row of logits (N, V) and its chosen token (N,): the token's log-probability and the `top` most
    likely tokens with theirs (log-softmax in float32)."""
    logprobs = logits.float().log_softmax(dim=-1)
    picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    best_values, best_columns = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], chosen[:, None][:, :0])
    rows = zip(chosen.tolist(), picked, best_columns.tolist(), best_values.tolist())
    return [
        TokenLogprob(token=token, logprob=value, top=list(zip(columns, values)))
        for token, value, columns, values in rows
    ]


def generate_stream(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    decode: str = "auto",
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row of idx (B, T) as a (B,) tensor, up to max_new_tokens steps.

    All rows share `generator` and the settings. A row that has made a stop token repeats it; the stream ends
    early once every row has stopped. See Engine for the cache, the sliding window and `decode`. The model decodes
    in eval mode (no dropout), its own mode restored when the stream ends or is closed (a stream left unfinished
    keeps it in eval mode until then). ValueError for a mistake in the arguments, at the call.
    """
    if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64) or not idx.size(0):
        raise ValueError(
            f"idx must be a (batch, tokens) tensor of int64 or int32 token ids, with a row or more, got {idx.dtype} "
            f"of shape {tuple(idx.shape)}"
        )
    stop_tokens = () if stop_tokens is None else stop_tokens  # a list or tuple of ids: Request.validate says so
    requests = [
        Request(
            prompt=row,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_tokens=stop_tokens,
            generator=generator,
        )
        for row in idx.tolist()
    ]
    for request in requests:
        request.validate()  # here, not at the first token: the caller's mistake is said where it was made
    return _stream(model, requests, idx, decode)


def _stream(model: nn.Module, requests: list[Request], idx: torch.Tensor, decode: str) -> Iterator[torch.Tensor]:
    was_training = model.training
    model.eval()  # decoding: no dropout, as every backend computes; the caller's mode comes back at the end
    try:
        positions = idx.size(1) + requests[0].max_new_tokens
        engine = Engine(model, slots=len(requests), decode=decode, positions=positions)
        for _ in engine.run(requests):
            yield torch.tensor([request.output[-1] for request in requests], dtype=idx.dtype, device=idx.device)
    finally:
        model.train(was_training)


def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    decode: str = "auto",
) -> torch.Tensor:
    """Extend idx (B, T) by up to max_new_tokens sampled tokens and return it (B, T + n): what sample.py does.

    temperature 0 is greedy; top_k keeps the k most likely tokens; top_p keeps the smallest set whose probability
    reaches p; generator makes sampling reproducible. A row that has made a stop token repeats it. decode: the
    backend (gptkit.infer.decoding: auto, eager, compiled, native). It computes in the weights' dtype (int8 weights:
    gptkit.weights.quantization), or in autocast's under torch.autocast.
    """
    steps = generate_stream(model, idx, max_new_tokens, temperature, top_k, top_p, stop_tokens, generator, decode)
    return torch.cat([idx, *(token[:, None] for token in steps)], dim=1)
