"""A compiled decoding step: the engine's one-token-per-row pass through torch.compile (inductor).

Why: at batch 1 a step reads every weight once, so its floor is the weight bytes over the memory's read speed.
Eager PyTorch adds two costs on top: its matrix-vector kernels stream the weights well below that speed, and a
step runs ~100 small ops (layer norms, GELU, residual adds, attention), each with its own dispatch. On the CPU,
inductor with freezing and max-autotune replaces the products with its own matrix-vector kernels on prepacked
weights, fuses the small ops, and (cpp_wrapper) calls it all from C++. `python benchmarks/bench.py sample
--paths=compiled` measures it against the memory bound; docs/benchmarks.md has the figures.

The graph also chooses each row's token (gptkit.infer.next_token.sample_next_token, on logits that the head has just left
in the caches): run eagerly after the graph, sampling's ~10 small ops each paid a dispatch and a cold cache. A
sampled step takes the uniform numbers of its draw as an input, drawn by the caller from each request's generator,
so its tokens are the eager path's (save where logits tie at top-k's k-th place: gptkit.infer.next_token.largest_k).
Greedy and sampled steps are different graphs, and so are top-k and a whole vocabulary; the temperature is a tensor
input (a new one compiles nothing, whatever the process compiled before: as a Python float, dynamo specialized it at
sampling's `temperature == 1.0` test and compiled again for a new value once an earlier graph had done so), a new
top_k compiles again. top-p stays eager (its nucleus search branches on the data): the step returns the logits too.

How the step stays one graph for every length: it takes only tensors (the new tokens (B, 1), each row's position
(B,), a mask (B, 1, 1, S) over the positions it attends to, and the cache's whole key and value storage), and S is
a dynamic size, rounded up to a multiple of LENGTH_MULTIPLE. StepCache is the KV cache the model's forward sees
inside the graph: each layer writes the new key and value at the row's position in place and attends over the
first S positions with the mask.
The batch size stays static: each one compiles once (about a minute for GPT-2 124M on 2 cores). On CUDA the step is
replayed as a CUDA graph (one launch a step instead of one a kernel), whose shapes and addresses are fixed: there S
is the cache's whole capacity, and a new cache records the graph again (once a generate call).

Caveats: off CUDA, freezing folds the weights into the compiled graph as constants (a prepacked copy: the weights'
memory twice over), so this is for inference only: weights changed after the first compiled step are not seen. Nor are
changes to the model's modules (their attributes, hooks, train/eval mode): a step checks the model's identity, its
inputs and the global state (grad mode, autocast) before it runs, not every module (see model_identity_guards).
A process keeps every graph it compiled, each with its frozen weights, up to STEP_GRAPH_LIMIT graphs; past that,
dynamo refuses to compile another.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from gptkit.infer.backend import EagerBackend, compute_dtype
from gptkit.infer.next_token import Sampling, sample_next_token
from gptkit.model import CausalSelfAttention

if TYPE_CHECKING:
    from gptkit.infer.engine import KVCache

LENGTH_MULTIPLE = 16  # attended span rounded up to this: padded positions are masked, and S is never 0 or 1


def model_identity_guards(entries: Sequence[Any]) -> list[bool]:
    """Which of dynamo's guards a compiled step keeps (its guard_filter_fn): all but those on the model's modules,
    save the identity of one weight (a frozen graph holds its model's weights, so it must serve that model alone)
    and the shapes of weights that are inputs (none when frozen).

    Why: dynamo checks every guard before every call, and GPT-2 124M's modules carry over a thousand of them
    (each module's hooks, attributes and weights); the step's own inputs and the global state keep theirs.
    """
    keep, identity_kept = [], False
    for entry in entries:
        if not entry.orig_guard.source.is_unspecialized_nn_module() or entry.guard_type == "TENSOR_MATCH":
            keep.append(True)
        elif entry.guard_type == "ID_MATCH" and isinstance(entry.value, torch.Tensor) and not identity_kept:
            keep.append(True)  # the first weight's identity stands for the model's
            identity_kept = True
        else:
            keep.append(False)
    return keep


# Every device: no FX-graph cache. An entry keys a frozen weight by its shape and dtype, not its values, yet the
# kernels pack the weights into new constants saved with it: with the cache, a second model of the same shapes (in
# this process or a later one) ran the first model's bfloat16 and int8 weights (tests/weights/test_quantization.py; float32
# escaped only because oneDNN's prepacked copies cannot be cached). AOTAutograd's cache already skips frozen graphs.
STEP_COMPILE_OPTIONS = {"fx_graph_cache": False, "guard_filter_fn": model_identity_guards}

# Graphs the step may hold in one process: one per model, batch size, greedy or sampled and top_k (see the module's
# docstring). Dynamo's default limit of 8 per function is a hard error under fullgraph=True, which a server's changing
# batch sizes or a process that decodes with several models reached (tests/infer/test_engine.py).
STEP_GRAPH_LIMIT = 64

# CPU: max-autotune lets inductor pick its own matrix-vector kernels (they need frozen weights: see decode_step),
# and cpp_wrapper saves the Python call of each kernel. Its tables of timed choices (tens of lines a model) and a
# deprecation warning of its own code are not the user's to read.
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", module=r"torch\._inductor\.select_algorithm")
CPU_COMPILE_OPTIONS = {
    **STEP_COMPILE_OPTIONS,
    "max_autotune": True,
    "cpp_wrapper": True,
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}

# CUDA: at batch 1 each of a step's ~150 kernels is too small to keep the GPU busy, so launching them sets the step's
# pace (docs/benchmarks.md); inductor's CUDA graphs launch the whole step at once. A graph replays fixed shapes and
# addresses, so on CUDA the step attends over the cache's whole capacity (one graph, not one per span) and the cache's
# storage is a static input, written in place by the graph (see decode_step).
CUDA_COMPILE_OPTIONS = {**STEP_COMPILE_OPTIONS, "triton.cudagraphs": True}


def replays_as_graph(device_type: str) -> bool:
    """Whether the step on this device type is a CUDA graph: the one rule behind its compile options, its frozen or
    unfrozen weights and its span and static cache (see CUDA_COMPILE_OPTIONS); these must agree with each other."""
    return device_type == "cuda"


class StepCache:
    """The KV cache of one compiled decoding step (duck-typed like gptkit.infer.engine.KVCache for one new token).

    keys[layer], values[layer]: the whole storage (rows, n_head, capacity, head_dim), written in place; `mask`
    (B, 1, 1, S), True where row b may look, sets the batch B and the span S attended over.
    """

    def __init__(
        self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], positions: torch.Tensor, mask: torch.Tensor
    ) -> None:
        self.keys, self.values, self.positions, self.mask = keys, values, positions, mask

    def extend(self, batch: int, new: int, device: torch.device) -> torch.Tensor:
        return self.positions[:, None]  # (B, 1): the new token of each row sits at that row's own length

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        rows = torch.arange(k.shape[0], device=k.device)
        keys[rows, :, self.positions] = k[:, :, 0].to(keys.dtype)  # in place: inductor writes into the storage
        values[rows, :, self.positions] = v[:, :, 0].to(values.dtype)
        batch, span = self.mask.shape[0], self.mask.shape[-1]
        return keys[:batch, :, :span], values[:batch, :, :span], self.mask


# Each model's twin with math attention, made once; a model that is garbage collected takes its twin with it.
MATH_TWINS: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()


def math_attention_twin(model: nn.Module) -> nn.Module:
    """`model` with every attention module on the explicit softmax(q k^T / sqrt(d)) v path, sharing the very same
    parameters and buffers (the model itself is untouched). Why: inductor fuses that path's one-query attention into
    its own loops, which was faster than a scaled_dot_product_attention call per layer."""
    if all(m.path == "math" for m in model.modules() if isinstance(m, CausalSelfAttention)):
        return model
    if model not in MATH_TWINS:
        shared = {id(tensor): tensor for tensor in (*model.parameters(), *model.buffers())}
        twin = copy.deepcopy(model, memo=shared)  # new modules around the same tensors
        for module in twin.modules():
            if isinstance(module, CausalSelfAttention):
                module.path = "math"
        MATH_TWINS[model] = twin
    return MATH_TWINS[model]


def _step(
    model: nn.Module,
    idx: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor,
    keys: list,
    values: list,
    temperature: torch.Tensor | None,
    top_k: int | None,
    uniform: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """temperature: None for a greedy step, else a 0-d float32 tensor (sampled with `uniform`)."""
    logits, _ = model(idx, cache=StepCache(keys, values, positions, mask))
    return logits, sample_next_token(logits[:, -1], 0.0 if temperature is None else temperature, top_k, uniform=uniform)


@functools.cache
def step_config_patchers(device_type: str) -> tuple[Callable[[], Callable[[], None]], ...]:
    """What decode_step sets around each call on a device type: freezing (inductor) and the step's graph limit
    (dynamo). Each patcher sets its value and returns the function that restores the old one.

    No freezing on CUDA: it would make the cache's static storage (see decode_step) constants of the graph too, so
    that every later cache's step would still read and write the first one's. Unfrozen, the weights are the graph's
    static inputs, which a CUDA graph reads where they lie.

    Why not `config.patch(...)` as a context manager: entered and left around every call, it took a sizeable share of
    the host's time a token; the closure patchers, which dynamo itself uses on its critical path, cost a fraction of
    that.
    """
    return (
        torch._inductor.config._make_closure_patcher(freezing=not replays_as_graph(device_type)),
        torch._dynamo.config._make_closure_patcher(recompile_limit=STEP_GRAPH_LIMIT),
    )


@functools.cache
def compiled_step(device_type: str) -> Callable:
    """The compiled _step for a device type; one per process, so its graphs serve every engine of a model."""
    if device_type == "cpu":
        options = CPU_COMPILE_OPTIONS
    elif replays_as_graph(device_type):
        options = CUDA_COMPILE_OPTIONS
    else:
        options = STEP_COMPILE_OPTIONS
    return torch.compile(_step, fullgraph=True, options=dict(options))  # a copy: torch.compile pops the guard filter


def padded_batch(rows: int, slots: int) -> int:
    """The batch a step runs for `rows` active rows: the next power of two, at most `slots`. Each batch size is a graph
    of its own (about a minute to compile on a CPU, a CUDA graph to record on a GPU), so a server whose batch changes
    as requests come and go compiles a handful of graphs instead of one per size; the padding rows are free rows of
    the cache."""
    return min(slots, 1 << (rows - 1).bit_length())


def attended_span(lengths: Sequence[int], capacity: int) -> int:
    """Positions a step attends over: the longest row after its new token, rounded up, at most `capacity`."""
    return min(capacity, -(-(max(lengths) + 1) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE)


# No gradients, whatever the caller's mode: in grad mode the step's in-place cache writes would join every step into
# one autograd graph that grows (and holds memory) with each token, and dynamo would compile another graph for it.
@torch.no_grad()
def decode_step(
    model: nn.Module,
    idx: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    lengths: Sequence[int],
    capacity: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (B, 1, V) for idx (B, 1), and each row's next token (B,): greedy at temperature 0, else sampled with
    `uniform` (B, 1), numbers in [0, 1) (see gptkit.infer.next_token.draw). Row r's token goes at position lengths[r] of rows
    0..B-1 of the cache storage keys[layer], values[layer] ((rows, n_head, positions, head_dim) each, positions >
    capacity so that a span is never all of it: see gptkit.infer.engine.KVCache.allocate), written in place there."""
    if temperature != 0 and uniform is None:
        raise ValueError("a sampled step needs its uniform numbers: the graph must not draw from its own generator")
    positions = torch.tensor(lengths, device=idx.device)
    sampled = torch.tensor(temperature, dtype=torch.float32, device=idx.device) if temperature != 0 else None
    graphed = replays_as_graph(idx.device.type)
    span = torch.arange(capacity if graphed else attended_span(lengths, capacity), device=idx.device)
    mask = (span <= positions[:, None])[:, None, None, :]  # (B, 1, 1, S): a row sees its own tokens only
    if graphed:  # the storage's address is part of the graph: a new cache (a new engine) records the graph again
        for storage in (*keys, *values):
            torch._dynamo.mark_static_address(storage, guard=False)
    else:
        torch._dynamo.maybe_mark_dynamic(mask, 3)  # its size is the span: one graph serves every span
    # Freezing must be set while dynamo traces, not only in inductor (compile options reach inductor alone), for the
    # weights to become constants; patched per call so that no other compile in the process is frozen. The graph
    # limit, too, is read while dynamo compiles, and only this function's graphs should get the higher one.
    with contextlib.ExitStack() as restore:
        for patch in step_config_patchers(idx.device.type):
            restore.callback(patch())  # restored in reverse order, also when the step raises
        return compiled_step(idx.device.type)(
            math_attention_twin(model),
            idx,
            positions,
            mask,
            list(keys),
            list(values),
            sampled,
            top_k,
            uniform if sampled is not None else None,
        )


class CompiledBackend(EagerBackend):
    """The engine's steps through decode_step (prefills stay eager): one graph per batch size, which chooses the
    tokens itself when the rows share settings it samples with, else returns the logits."""

    name = "compiled"
    full_cache = True  # its graphs are made for the cache's shape: block_size for every engine
    chooses_tokens = True

    def decode(
        self, cache: KVCache, tokens: Sequence[int], sampling: Sampling | None, uniform: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int] | None]:
        config = self.model.config
        cache.allocate(config.n_kv_head, config.head_dim, compute_dtype(self.model), self.device)  # written in place
        rows = len(tokens)
        padding = padded_batch(rows, cache.slots) - rows
        # Padding rows are free rows of the cache (a new request's prefill or first step writes over position 0).
        lengths = cache.lengths[:rows] + [0] * padding
        idx = torch.tensor([[token] for token in tokens] + [[0]] * padding, device=self.device)
        if padding and uniform is not None:
            uniform = torch.cat([uniform, uniform.new_zeros(padding, 1)])
        temperature, top_k = (sampling.temperature, sampling.top_k) if sampling is not None else (0.0, None)
        logits, chosen = decode_step(
            self.model, idx, cache.keys, cache.values, lengths, cache.capacity, temperature, top_k, uniform
        )
        cache.lengths[:rows] = [length + 1 for length in lengths[:rows]]
        return logits[:rows, -1], chosen[:rows].tolist() if sampling is not None else None
