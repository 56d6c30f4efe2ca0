"""Choosing the next token from logits: greedy, temperature, top-k and top-p sampling, and the rules of their settings.

sample_next_token is the rule, written once for every Python path: the engine's own sampling and the compiled step's
graph (gptkit.infer.compiled) call it; the native step's C++ (gptkit/infer/native/csrc/sampling.h) follows it, and
model.py's plain `generate` is the reference its greedy choice matches (it samples by its own draw). A step's draw
takes one uniform number a row (inverse transform sampling), from the row's generator or given by the caller: a
backend that samples inside its step gets numbers the engine draws beforehand, so a seeded request makes the same
tokens whichever backend runs it. In a compiled graph, top-k searches a large vocabulary by blocks (largest_k).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch.nn import functional as F

# Column counts tried, smallest first, for the most likely tokens that hold a top-p nucleus: a partial top-k is much
# cheaper than sorting a whole vocabulary, and with a trained model the nucleus is usually small.
NUCLEUS_PREFIXES = (256, 4096)
# Columns per block of largest_k's search inside a compiled graph (one AVX-512 vector of float32).
TOP_K_BLOCK = 16
# Temperatures below this choose greedily, as vLLM's do: logits / temperature would overflow float32 (a temperature
# of 1e-38 times a logit) or round a small one to 0, and already at this one the softmax is the largest logit's alone
# but for logits within about 1e-5 of it.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How a request chooses its tokens, in one form for settings that choose alike (Sampling.of): greedy has no top-k
    or top-p, and a top-p of 1 is none. So equal settings sample alike: the engine samples the rows of equal settings
    (and generator) in one call, and a backend may choose every row's token inside its step when all rows share
    theirs."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    @classmethod
    def of(
        cls, temperature: float, top_k: int | None = None, top_p: float | None = None, vocab_size: int | None = None
    ) -> Sampling:
        """The settings in their one form: temperature 0 (or below GREEDY_BELOW) is greedy, and a top-k of the whole
        vocabulary (vocab_size) or more, or a top-p of 1 or more, keeps every token."""
        if temperature < GREEDY_BELOW:
            return cls(temperature=0.0)
        if top_k is not None and vocab_size is not None and top_k >= vocab_size:
            top_k = None
        return cls(temperature=temperature, top_k=top_k, top_p=None if top_p is None or top_p >= 1.0 else top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def next_token(
        self, logits: torch.Tensor, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
    ) -> torch.Tensor:
        """sample_next_token with these settings."""
        return sample_next_token(logits, self.temperature, self.top_k, self.top_p, generator, uniform)


def sample_next_token(
    logits: torch.Tensor,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick one token per row from logits (B, V): greedy at temperature 0, else sampled after top-k/top-p with one
    uniform number a row: drawn from `generator` (None: torch's global one), or given as `uniform` (B, 1) in [0, 1).
    temperature: a number (below GREEDY_BELOW: greedy), or a 0-d tensor, never below GREEDY_BELOW (a compiled
    graph's input, so that a new value compiles nothing). The most likely token is always in a top-p nucleus, however
    small top_p is."""
    fixed = not isinstance(temperature, torch.Tensor)
    # max, not argmax: the same first largest column, and in bfloat16 argmax is slower
    if fixed and temperature < GREEDY_BELOW:
        return logits.max(dim=-1).indices
    logits = logits.float() if fixed and temperature == 1.0 else logits.float() / temperature
    candidates = None  # the token id of each column, once logits are narrowed and sorted
    if top_k is not None and top_k < logits.size(-1):
        logits, candidates = largest_k(logits, top_k)  # then sample among k columns, not all V
    if top_p is not None and top_p < 1.0:
        probs = logits.softmax(dim=-1)  # of all tokens, or of the top k (top-p then applies to those, renormalized)
        if candidates is None:
            probs, candidates = most_likely_holding(probs, top_p)
            logits = logits.gather(-1, candidates)
        outside = probs.cumsum(dim=-1) - probs >= top_p  # the mass before them reaches p
        outside[..., 0] = False  # a top_p that float32 rounds to 0 would leave no token
        logits = logits.masked_fill(outside, float("-inf"))
    choice = draw(F.softmax(logits, dim=-1), generator, uniform)
    return (choice if candidates is None else candidates.gather(-1, choice)).squeeze(-1)


def largest_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of logits (B, V), in descending order, and their columns: torch.topk's.

    Inside a compiled graph (gptkit.infer.compiled) over a large vocabulary, by blocks of TOP_K_BLOCK columns: the
    k blocks with the largest maxima hold the k largest entries (an entry outside them is no larger than any of those
    k maxima), so torch.topk runs on the V / TOP_K_BLOCK block maxima and then on the k best blocks' entries, not on
    all V; inductor computes the maxima in one vectorized pass. The values are torch.topk's; among entries that tie
    at the k-th place, the columns kept may differ. Eagerly each extra op is a dispatch, and one topk is faster.
    """
    columns = logits.size(-1)
    if not torch.compiler.is_compiling() or 4 * k * TOP_K_BLOCK > columns:  # the k blocks: a quarter of V at most
        return torch.topk(logits, k, dim=-1)
    blocks = -(-columns // TOP_K_BLOCK)
    padded = F.pad(logits, (0, blocks * TOP_K_BLOCK - columns), value=float("-inf"))
    by_block = padded.view(logits.size(0), blocks, TOP_K_BLOCK)
    best_blocks = torch.topk(by_block.amax(dim=-1), k, dim=-1).indices  # (B, k)
    entries = by_block.gather(1, best_blocks[..., None].expand(-1, -1, TOP_K_BLOCK)).flatten(1)  # (B, k * BLOCK)
    values, places = torch.topk(entries, k, dim=-1)
    return values, best_blocks.gather(1, places // TOP_K_BLOCK) * TOP_K_BLOCK + places % TOP_K_BLOCK


def most_likely_holding(probs: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest probabilities of each row of probs (B, V), sorted descending, with their columns: enough of them
    that every row's add up to `mass` (so no token after them is in that row's nucleus), else all of them."""
    largest = probs.amax(dim=-1)
    for size in NUCLEUS_PREFIXES:
        if size >= probs.size(-1):
            break
        if bool((largest * size < mass).any()):  # some row's `size` largest cannot add up to the mass: skip the top-k
            continue
        top, columns = torch.topk(probs, size, dim=-1)
        if bool((top.sum(dim=-1) >= mass).all()):
            return top, columns
    return torch.sort(probs, descending=True, dim=-1)


def draw(
    probs: torch.Tensor, generator: torch.Generator | None = None, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """One column per row of probs (B, N) (not necessarily normalized), with probability proportional to its
    entry: (B, 1). Inverse transform sampling, one uniform number a row (`uniform` (B, 1), else drawn from
    `generator`): torch.multinomial draws a random number for every entry, which over a whole vocabulary costs
    several times the rest of sampling."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()  # searchsorted wants contiguous values
    if uniform is None:
        uniform = torch.rand(total.shape, generator=generator, device=probs.device, dtype=cdf.dtype)
    column = torch.searchsorted(cdf, uniform * total, right=True)  # the first column whose cdf exceeds the draw
    # A draw that rounds up to the total would land past the end: it takes the last column with a positive entry.
    return torch.minimum(column, torch.searchsorted(cdf, total))


def is_whole_number(value: object) -> bool:
    """An int (numpy's too), not a bool nor a float that happens to be whole: a count of tokens."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def sampling_problem(temperature: float, top_k: int | None, top_p: float | None) -> str | None:
    """What is wrong with these sampling settings (None: nothing); the one place their rules live."""
    if not 0 <= temperature < math.inf:
        return f"temperature must be a finite number >= 0, got {temperature}"
    if top_k is not None and (not is_whole_number(top_k) or top_k <= 0):
        return f"top_k must be a positive integer or None, got {top_k!r}"
    if top_p is not None and not 0.0 < top_p <= 1.0:
        return f"top_p must be in (0, 1], got {top_p}"
    return None
