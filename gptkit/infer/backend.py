"""The one interface between the engine and a decoding backend, and the eager backend every other one builds on.

A backend runs the engine's two kinds of pass over the KV cache (gptkit.infer.engine.KVCache): `prefill` fills rows
with prompts, `decode` makes one step of the active rows, 0..n-1. Which one runs is chosen once, when the engine is
built (gptkit.infer.decoding.make_backend); the engine knows only this interface:

- eager (EagerBackend, here): the model's own forward pass over the cache; the reference path.
- onednn (gptkit.infer.onednn.OneDNNBackend): eager, on a copy of the model whose float32 products call oneDNN
  directly on transposed weights.
- compiled (gptkit.infer.compiled.CompiledBackend): each step one torch.compile graph (a CUDA graph on CUDA); its
  prefills stay eager.
- native (gptkit.infer.native.NativeBackend): each step, and short prefills, one C++ call on the CPU.

A backend that `chooses_tokens` picks each row's token inside its step, with the settings all rows share
(gptkit.infer.next_token.Sampling) and one uniform number a row that the engine draws from the rows' generators as
its own sampling would: a seeded request makes the same tokens whichever backend runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from gptkit.infer.engine import KVCache
    from gptkit.infer.next_token import Sampling


class Backend(Protocol):
    """What the engine asks of a decoding backend."""

    name: str  # its decode name: eager, onednn, compiled or native
    model: nn.Module  # the model its eager passes run (the engine scores prompts with it too)
    full_cache: bool  # whether the cache must hold block_size positions, however far the rows go
    chooses_tokens: bool  # whether `decode` picks the tokens itself when the rows share their settings

    def prefill(self, cache: KVCache, row: int, contexts: Sequence[Sequence[int]]) -> None:
        """Fill rows row, row + 1, ... of the cache (each of length 0) with contexts[i] (equally long, at least one
        token each); their lengths become the contexts'."""
        ...

    def decode(
        self, cache: KVCache, tokens: Sequence[int], sampling: Sampling | None, uniform: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int] | None]:
        """One step of rows 0..len(tokens)-1: tokens[r] goes at position cache.lengths[r], which advances by one.
        Returns the logits (rows, vocab) and, when `sampling` is given (to a backend that chooses tokens: settings
        every row shares, without top-p), each row's token chosen with it, drawn with uniform[r] (rows, 1) unless
        greedy; else None, and the caller samples the logits."""
        ...


def weight_versions(model: nn.Module) -> tuple[tuple[int, int], ...]:
    """Where each of `model`'s parameters and buffers lies and its in-place version counter: a copy made for decoding
    (packed, transposed) is stale once an optimizer or a load writes a weight, or `.data` (to(), float()) replaces
    one, which keeps the counter."""
    return tuple((t.data_ptr(), t._version) for t in (*model.parameters(), *model.buffers()))


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a pass of `model` computes in, and so the dtype its keys come out as: autocast's (where it is on for
    the model's device), else the weights'."""
    device_type = next(model.parameters()).device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return next(model.parameters()).dtype


class EagerBackend:
    """The model's own forward pass over the cache: one PyTorch call per layer and operation. Any model, device and
    batch."""

    name = "eager"
    full_cache = False
    chooses_tokens = False

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    def prefill(self, cache: KVCache, row: int, contexts: Sequence[Sequence[int]]) -> None:
        idx = torch.tensor([list(context) for context in contexts], device=self.device)
        self.model.hidden_states(idx, cache=cache.rows(row, row + len(contexts)))  # no head: the next step needs none

    def decode(
        self, cache: KVCache, tokens: Sequence[int], sampling: Sampling | None, uniform: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int] | None]:
        idx = torch.tensor([[token] for token in tokens], device=self.device)
        return self.model(idx, cache=cache.rows(0, len(tokens)))[0][:, -1], None
