"""The native step: one token of one sequence, or of several, on the CPU in a single C++ call (csrc/), and the
engine's backend that runs every step with it (NativeBackend).

What it serves: every architecture model.py builds, in float32 or bfloat16 weights on the CPU, or int8 ones
(gptkit.weights.quantization's Int8Linear: one scale per row; each product's float32 input is rounded to 16-bit
integers with one scale, so that the products run in integer lanes), or int4 ones (Int4Linear, GGUF's Q4_1: the
codes, as bytes, multiplied by the inputs rounded to 16-bit integers with one scale per group of 32 values, each
integer as its two bytes, in panels of rows), or a GGUF file's Q8_0 ones (Int8GroupedLinear: its layers', or a head
of its own kind beside int4 layers), their 8-bit codes widened to 16 bits against the same 16-bit inputs:
learned, sinusoidal or rotary positions (the model's own cos and sin tables, so a rope_scaling is exact); LayerNorm or
RMSNorm, with or without a weight or bias; the GELU (tanh or exact), squared-ReLU or SwiGLU MLP; multi-head or
grouped-query attention, heads of any width; QK-norm with or without a weight; a Q, K, V bias of its own; a norm of
the embeddings and soft-capped logits (nanochat); a tied or separate head (native_problem says why a model does not
fit). The engine runs every step with it: one row (NativeStep.__call__), or several rows of any lengths in one call
(NativeStep.step_rows: each weight read from memory once a step, whatever the rows: one pass over each panel of
float32 or int4 weights multiplies up to 12 rows with AVX-512, 6 (int4: 4) with AVX2, and the passes for more rows
read the panel from the cache); it fills prompts with the native prefill (NativeStep.prefill: the prompts of the
requests admitted together, of one length, in one pass) up to PREFILL_LIMITS' tokens in all.

Caveat: the step reads a packed copy of the weights (their memory twice over, but for int4 products left in a GGUF
file, FileInt4Linear, of which the model holds nothing: gptkit.infer.native.packing), made
once per model and remade when a parameter or buffer (int8 weights are buffers) is changed in place (an optimizer
step, a load_state_dict, a `.data` replaced), which `NativeStep.for_model` notices by their version counters and
addresses (gptkit.infer.backend.weight_versions).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from gptkit.core.errors import UserError
from gptkit.infer.backend import EagerBackend, weight_versions
from gptkit.infer.memory import huge_page_zeros
from gptkit.infer.native import build
from gptkit.infer.native.packing import (
    GROUPED_WEIGHTS,
    INT4_PANELS,
    grouped_panel_bytes,
    grouped_panels,
    layer_tensors,
    norm_vectors,
    packed,
    panels_of,
    vector_sizes,
    weight_and_scale,
    weights_name,
)
from gptkit.weights.quantization import FileEmbedding, Int4Linear, Int8GroupedLinear, Int8Linear

if TYPE_CHECKING:
    from gptkit.infer.engine import KVCache
    from gptkit.infer.next_token import Sampling

ACTIVATIONS = {"gelu_tanh": 0, "gelu": 1, "relu2": 2, "swiglu": 3}  # csrc/elementwise.h's Activation codes
# How to fall back, said in every error about this path: the compiled step serves every model and batch.
OTHER_PATHS = "use --decode=auto, eager or compiled instead"


def native_problem(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the native step cannot run `model` computing in `dtype` (None: it can); the one place its rules live."""
    config, device = model.config, next(model.parameters()).device
    if device.type != "cpu":
        return f"the native step runs on the CPU only, and this model is on {device}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the native step computes in float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    products, head = 4 * config.n_layer, model.lm_head
    grouped_head = isinstance(head, (Int4Linear, Int8GroupedLinear))  # its panels of its own kind
    kinds = [
        ("int8", Int8Linear, isinstance(head, Int8Linear)),
        ("int4", Int4Linear, grouped_head),
        ("Q8_0", Int8GroupedLinear, grouped_head),
    ]
    for kind, layer, head_fits in kinds:
        if head_fits and sum(isinstance(m, layer) for m in model.transformer.h.modules()) == products:
            return None if dtype == torch.float32 else f"the native step's {kind} products compute in float32 only"
    if sum(isinstance(m, nn.Linear) for m in model.modules()) != products + 1:
        return (
            "the native step needs every product to be a plain Linear layer, or every one int8 (--quantize=int8), "
            "or every one int4 (--quantize=int4) or in a GGUF file's Q8_0 blocks"
        )
    return None


# The most prompt tokens (filled in one pass) the engine gives the native prefill, by weights; longer ones take the
# eager pass, whose GEMM libraries (MKL; fbgemm's int8 products with 7-bit activations, against the native pass's
# 16-bit ones) pass the native pass's products as prompts grow. bfloat16 prompts of any length: PyTorch's eager
# bfloat16 products are slow on a CPU without bfloat16 instructions. int4 and Q8_0 prompts of any length: the eager
# pass dequantizes every weight at each call. AVX-512's 32-row float32 panels keep the native pass the faster for
# longer prompts (PREFILL_LIMITS_AVX512). The limits were measured (docs/benchmarks.md, how the native step was tuned).
PREFILL_LIMITS = {"float32": 64, "bfloat16": None, "int8": 32, "int4": None, "q8_0": None}
PREFILL_LIMITS_AVX512 = {**PREFILL_LIMITS, "float32": 256}
PACKED_WEIGHTS = 1 << 18  # an int4 product's weights packed at once (whole panels' rows): bounds the temporaries

# Each model's steps by dtype; a model that is garbage collected takes its packed weights with it.
PACKED_STEPS: weakref.WeakKeyDictionary[nn.Module, dict[torch.dtype, NativeStep]] = weakref.WeakKeyDictionary()


class NativeStep:
    """The packed weights of one model and the call that decodes one token with them (see the module's docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        """Pack `model`'s weights for products in `dtype` (float32 or bfloat16: the weights' own dtype, or the one
        CPU autocast computes in); UserError when the model does not fit (native_problem)."""
        problem = native_problem(model, dtype)
        if problem:
            raise UserError(f"{problem}; {OTHER_PATHS}")
        config, transformer = model.config, model.transformer
        self.dtype = dtype  # the products' inputs, the cache's and the logits' compute dtype
        products, vectors = [], []
        for block in transformer.h:
            block_products, block_vectors = layer_tensors(block)
            products += block_products
            vectors += block_vectors
        products.append(model.lm_head)
        C = config.n_embd
        vectors += norm_vectors(transformer.ln_f, C)
        vectors += norm_vectors(transformer.ln_emb, C) if config.embed_norm else [torch.ones(C), None]
        self.weights = weights_name(model, dtype)
        self.panel_rows = 0  # float32 matrices' panels: 32 rows with AVX-512, 16 with AVX2 (none without vectors)
        # grouped weights: the layers' panels of one kind (int4 without minimums where every one's are -8 times its
        # scales, Q4_0's blocks), the head's of its own (a file's Q4_0 products may come with a Q4_1 or a Q8_0 head)
        grouped = self.weights in GROUPED_WEIGHTS
        self.layer_panels = panels_of(products[:-1]) if grouped else INT4_PANELS
        self.head_panels = panels_of(products[-1:]) if grouped else INT4_PANELS
        if grouped:
            kinds = [self.layer_panels] * (len(products) - 1) + [self.head_panels]
            self.matrices, self.scales = self._grouped_matrices(products, kinds), torch.empty(0)
        else:
            self._pack_plain(products, dtype)
        self.vectors = packed(vectors, vector_sizes(config), torch.float32)
        self.file_embedding = transformer.wte if isinstance(transformer.wte, FileEmbedding) else None
        self.embedding = self._embedding_table(model, dtype)
        self.positions = self._position_table(model)
        flags = [config.norm == "rmsnorm", config.qk_norm, config.pos_encoding == "rope", config.embed_norm]
        flags += [self.layer_panels, self.head_panels]
        self.shapes = [config.n_embd, config.mlp_hidden, config.vocab_size, config.n_layer, config.n_head]
        self.shapes += [config.n_kv_head, config.head_dim, *map(int, flags)]
        self.activation = ACTIVATIONS[config.activation]
        # the norms' epsilon, QK-norm's and the soft cap of the logits (0: none). An RMSNorm without an epsilon
        # takes float32's machine epsilon, bfloat16 inputs too (torch computes the norm in float32).
        q_norm = getattr(model.transformer.h[0].attn, "q_norm", None)
        qk_eps = q_norm.eps if q_norm is not None and q_norm.eps is not None else torch.finfo(torch.float32).eps
        self.constants = [transformer.ln_f.eps, qk_eps, config.logit_softcap or 0.0]
        self.versions = weight_versions(model)
        self.kernel = build.extension().decode_step
        self.rows_kernel = build.extension().decode_rows
        self.prefill_kernel = build.extension().prefill

    def _pack_plain(self, products: Sequence[nn.Module], dtype: torch.dtype) -> None:
        """The float or int8 products' weights (and int8's row scales) packed one after another; float32 ones in
        the panels the step reads (float32_blocks; none in a build without vectors)."""
        matrices, scales = zip(*map(weight_and_scale, products))
        int8 = self.weights == "int8"
        blocks = [] if int8 or dtype != torch.float32 else build.extension().float32_blocks()
        self.panel_rows = blocks[0] if blocks else 0
        self.matrices = packed(matrices, [m.numel() for m in matrices], torch.int8 if int8 else dtype, blocks)
        self.scales = packed(scales, [m.shape[0] for m in matrices], torch.float32) if int8 else torch.empty(0)

    def _embedding_table(self, model: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
        """A tied head's rows are the token embeddings, unless panels interleave them: then the model's own table
        (an int8 or int4 head has weights of its own: the quantizers untie it); a table left in a file: None, its
        rows are read at each call (_embeddings)."""
        head, table = getattr(model.lm_head, "weight", None), model.transformer.wte
        if self.file_embedding is not None:
            return None
        if table.weight is head and not self.panel_rows:
            return self.matrices[-head.numel() :].view_as(head)
        return table.weight.detach().to(dtype).contiguous()

    @staticmethod
    def _grouped_matrices(products: Sequence[nn.Module], kinds: Sequence[int]) -> torch.Tensor:
        """The grouped products' weights (int4, Q8_0) in the step's panels, each of its kind (grouped_panels),
        back to back. A product's panels lie one after another, so it is packed some PACKED_WEIGHTS weights (whole
        panels) at a time: besides the buffer there are only one slice's blocks and panels, small enough for the
        allocator to reuse their memory, and the blocks of a product left in a file (FileInt4Linear,
        Int8GroupedLinear) are read a slice at a time."""
        rows = build.extension().int4_panel_rows()
        sizes = [grouped_panel_bytes(product, rows, kind) for product, kind in zip(products, kinds)]
        buffer = huge_page_zeros(sum(sizes), torch.uint8)
        start = 0
        for product, kind in zip(products, kinds):
            step = max(1, PACKED_WEIGHTS // product.in_features // rows) * rows
            for first in range(0, product.out_features, step):
                panels = grouped_panels(product, first, first + step, rows, kind)
                buffer[start : start + panels.numel()] = panels
                start += panels.numel()
        return buffer

    def _embeddings(self, tokens: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """The embedding table the C++ reads and each token's row in it: the model's own table, or for one left in a
        file (FileEmbedding) the tokens' rows alone, read now."""
        if self.file_embedding is None:
            return self.embedding, list(tokens)
        # its lookup, not a module call: this runs every token
        rows = self.file_embedding.lookup(list(tokens)).to(self.dtype).contiguous()
        return rows, list(range(len(tokens)))

    @staticmethod
    def _position_table(model: nn.Module) -> torch.Tensor:
        """float32 (block_size, n_embd): the row added to each position's embedding, learned or sinusoidal; or for
        rotary positions (block_size, head_dim): the model's own cos and sin tables side by side (so that a
        rope_scaling is the model's exactly)."""
        config = model.config
        if config.pos_encoding == "rope":
            return torch.cat((model.rope_cos, model.rope_sin), dim=1).float().contiguous()
        table = model.transformer.wpe.weight if config.pos_encoding == "learned" else model.pos_table
        return table.detach().float().contiguous()

    @classmethod
    def for_model(cls, model: nn.Module, dtype: torch.dtype) -> NativeStep:
        """The step for `model` in `dtype`: packed once, and again only after its weights changed."""
        steps = PACKED_STEPS.setdefault(model, {})
        if dtype in steps and steps[dtype].versions == weight_versions(model):
            return steps[dtype]
        steps.pop(dtype, None)  # a stale copy goes first: never two packed copies at once
        steps[dtype] = cls(model, dtype)
        return steps[dtype]

    @torch.no_grad()
    def __call__(
        self,
        token: int,
        position: int,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        temperature: float = 0.0,
        top_k: int | None = None,
        uniform: float = 0.0,
    ) -> tuple[torch.Tensor, int]:
        """Logits (vocab,) float32 for `token` at `position`, and the next token: greedy at temperature 0 (the first
        largest logit), else drawn with `uniform` (in [0, 1)) from the top_k (None: all) as sample_next_token would.

        keys[layer], values[layer]: the cache's storage (rows, n_head, positions, head_dim) in the step's dtype;
        row 0 gets this token's key and value at `position` and attends over positions 0..position."""
        embedding, (token,) = self._embeddings([token])
        return self.kernel(
            self.matrices,
            self.scales,
            self.vectors,
            embedding,
            self.positions[position],
            list(keys),
            list(values),
            self.shapes,
            token,
            position,
            self.activation,
            self.constants,
            temperature,
            top_k or 0,
            uniform,
        )

    @torch.no_grad()
    def step_rows(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        temperature: float = 0.0,
        top_k: int | None = None,
        uniforms: Sequence[float] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """One step of several rows: logits (rows, vocab) float32 and each row's next token, chosen as __call__
        chooses it (every row with `temperature` and `top_k`; uniforms[b]: row b's number in [0, 1)).

        Row b of the cache (storage as __call__ takes it, with at least len(tokens) rows) gets tokens[b]'s key and
        value at positions[b] and attends over its own positions 0..positions[b]: rows may differ in length. Each
        weight is read from memory once a step (the passes for more rows read it from the cache), so the step costs
        little more than one row's while it is bound by the memory's speed."""
        embedding, tokens = self._embeddings(tokens)
        return self.rows_kernel(
            self.matrices,
            self.scales,
            self.vectors,
            embedding,
            self.positions[list(positions)],
            list(keys),
            list(values),
            self.shapes,
            tokens,
            list(positions),
            self.activation,
            self.constants,
            temperature,
            top_k or 0,
            list(uniforms) if uniforms is not None else [0.0] * len(tokens),
        )

    @property
    def prefill_limit(self) -> int | None:
        """The most tokens in all the engine fills with prefill at once (PREFILL_LIMITS; None: any number)."""
        limits = PREFILL_LIMITS_AVX512 if self.panel_rows == 32 else PREFILL_LIMITS
        return limits[self.weights]

    def prefills(self, tokens: int) -> bool:
        """Whether the engine fills prompts of `tokens` tokens in all with prefill rather than eagerly."""
        return self.prefill_limit is None or tokens <= self.prefill_limit

    @torch.no_grad()
    def prefill(
        self,
        contexts: Sequence[Sequence[int]],
        start: int,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
    ) -> None:
        """Store the keys and values of contexts[r] (equally long) at positions start, start + 1, ... in row r of the
        cache (storage as __call__ takes it), each token attending over those of its row before it; no logits (the
        next step feeds the token that follows). One pass reads each weight once for many tokens, every row's
        together, where steps would read it per token."""
        length = len(contexts[0])
        if any(len(context) != length for context in contexts):
            raise ValueError("prefill takes contexts of one length")
        embedding, tokens = self._embeddings([token for context in contexts for token in context])
        self.prefill_kernel(
            self.matrices,
            self.scales,
            self.vectors,
            embedding,
            self.positions[start : start + length].repeat(len(contexts), 1),
            list(keys),
            list(values),
            self.shapes,
            tokens,
            start,
            len(contexts),
            self.activation,
            self.constants,
        )


class NativeBackend(EagerBackend):
    """The engine's steps through the native step (one row, or several in one call), and its prefills where the
    native pass is the faster (NativeStep.prefills; longer prompts fill eagerly). It chooses the tokens itself when
    the rows share settings it samples with, else returns the logits."""

    name = "native"
    chooses_tokens = True

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        """UserError when the step cannot run `model` computing in `dtype` (native_problem)."""
        super().__init__(model)
        self.step = NativeStep.for_model(model, dtype)

    def prefill(self, cache: KVCache, row: int, contexts: Sequence[Sequence[int]]) -> None:
        rows, length = len(contexts), len(contexts[0])
        if not self.step.prefills(rows * length):
            return super().prefill(cache, row, contexts)
        self._allocate(cache)
        keys = [layer[row : row + rows] for layer in cache.keys]
        values = [layer[row : row + rows] for layer in cache.values]
        self.step.prefill(contexts, 0, keys, values)
        cache.lengths[row : row + rows] = [length] * rows

    def decode(
        self, cache: KVCache, tokens: Sequence[int], sampling: Sampling | None, uniform: torch.Tensor | None
    ) -> tuple[torch.Tensor, list[int] | None]:
        self._allocate(cache)
        rows = len(tokens)
        positions = cache.lengths[:rows]
        temperature, top_k = (sampling.temperature, sampling.top_k) if sampling is not None else (0.0, None)
        uniforms = uniform[:, 0].tolist() if uniform is not None else [0.0] * rows
        if rows == 1:
            logits, token = self.step(
                tokens[0], positions[0], cache.keys, cache.values, temperature, top_k, uniforms[0]
            )
            logits, chosen = logits[None], [token]
        else:
            logits, chosen = self.step.step_rows(
                tokens, positions, cache.keys, cache.values, temperature, top_k, uniforms
            )
        cache.lengths[:rows] = [position + 1 for position in positions]
        return logits, chosen if sampling is not None else None

    def _allocate(self, cache: KVCache) -> None:
        """Every layer's cache storage in the step's dtype, made now if it is not there: the step writes into it."""
        config = self.model.config
        cache.allocate(config.n_kv_head, config.head_dim, self.step.dtype, self.device)
