"""Weight-only quantization for CPU decoding: fewer weight bytes to read per generated token.

int8 (a quarter of float32's bytes): every nn.Linear (the output head included) becomes an Int8Linear, its weight
stored as int8 with one scale per output row (symmetric, so no zero point), the activations left in floating point.
Both of its kernels are PyTorch's own:
- eager: the x86/fbgemm dynamic int8 product (torch.ops.quantized.linear_dynamic), the fastest eager kernel on
  the machines measured, each row of its input bounded so that it is rounded on its own (Int8Linear);
- under torch.compile (gptkit.infer.compiled): aten._weight_int8pack_mm, which inductor lowers to its C++
  weight-only-int8 GEMM template (bfloat16 activations, int8 weights widened in registers). Product for product it
  is no faster than fbgemm, but in the compiled step (one graph, no per-call costs) a token takes far less time;
  docs/benchmarks.md has the figures.
The native step (gptkit.infer.native, --decode=native) reads the same int8 weights and scales with kernels of its
own (each product's input rounded to 16-bit integers). The embeddings stay float32: a lookup reads one row.

int4 (5 bits a weight, about a sixth of float32's bytes): every nn.Linear becomes an Int4Linear, its weight stored
as GGUF's Q4_1 stores it: groups of 32 weights along a row, each group 32 codes of 4 bits with a float16 scale and
minimum (weight = scale * code + minimum; Q4_0's blocks are minimum = -8 * scale). Its forward pass dequantizes the
weight and multiplies in the input's dtype, on any device: the reference the native step's int4 products (float32
inputs, gptkit.infer.native) are tested against. A weight read from a GGUF file's Q4_0 or Q4_1 blocks keeps them
(keep_int4_blocks): int4 takes those blocks as they are instead of quantizing their values again, and a model whose
every product was read so runs on them under "none" too (the file's own precision). Read for decoding, such a matrix
is never float32: it stays in the file, read at each use (FileInt4Linear; the token embedding FileInt4Embedding,
whose lookups read their rows), so the model holds none of it; a head the file keeps in Q8_0 stays in the file
too, in its own 8 bits (Int8GroupedLinear), and one kept in any other type is quantized to Q8_0 as it is read, near
the precision it is stored in. Read so, a Q8_0 file's products stay in the file as well, in their own 8 bits
(Int8GroupedLinear: GGUF's Q8_0 blocks of 32 int8 codes and a float16 scale, which the native step reads as it reads
int4 blocks), and products in other types until quantization asks for them (FileLinear). A token embedding stored in
any other quantized type stays in the file as well (FileEmbedding).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gptkit.core.errors import UserError

QUANTIZE_CHOICES = ("none", "int8", "int4")
INT8_MAX = 127  # symmetric range [-127, 127]: a row's largest |weight| maps to about 127
GROUP = 32  # int4 weights per scale and minimum (GGUF's Q4_0 and Q4_1 blocks)
INT4_MAX = 15  # int4 codes are 0 .. 15
ROWS_AT_ONCE = 4096  # rows quantized together (bounds the temporary float32 copies of a large head)


ROW_BOUNDS = torch.tensor([-1.0, 1.0])  # the two values Int8Linear's eager pass gives every row of its input


class Int8Linear(nn.Module):
    """y = x Wᵀ + b with W stored as int8 (`weight_int8`, (out, in)) times one scale per output row (`scale`, in
    bfloat16: the compiled kernel's dtype; the eager kernel reads the same values).

    Its eager pass is fbgemm's dynamic int8 product (torch.ops.quantized.linear_dynamic), the fastest eager kernel
    on the machines measured, which rounds its input to 7 bits with one scale and zero point for the whole input.
    So that a row's result is its own, whatever rows are beside it (a request's tokens must not depend on the
    others in its batch), each row's range (from its least to its largest value, 0 included, as the kernel's own
    range is) is mapped onto [-1, 1] and the row given two more values, -1 and +1, against two zero columns of the
    weight: every input then spans exactly [-1, 1], whatever its rows, each row is rounded in steps of its own range,
    and the row's result is mapped back (W x = half W x' + middle W 1).

    For inference only (no gradients flow to the int8 weight). Made from an nn.Linear by `from_linear`.
    """

    def __init__(self, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self._packed = None  # fbgemm's prepacked copy of the weight and its two zero columns, made at the first call
        self._sums = None  # each output's sum of its weights (dequantized), made at the first call

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        weight = linear.weight.detach().float().contiguous()  # (out, in) rows, also from the transposed decoding layout
        scale = (weight.abs().amax(dim=1) / INT8_MAX).clamp_min(torch.finfo(torch.bfloat16).tiny).bfloat16()
        weight_int8 = torch.round(weight / scale.float()[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(weight_int8, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._compiled_forward(x)
        rows = x.reshape(-1, self.in_features).float()
        low, high = torch.aminmax(rows, dim=1, keepdim=True)
        low, high = low.clamp_max_(0), high.clamp_min_(0)
        middle, half = (high + low).mul_(0.5), (high - low).mul_(0.5).clamp_min_(torch.finfo(torch.float32).tiny)
        # each row's own range as [-1, 1] (clamped: rounding could reach past it, and so past the other rows')
        spanned = rows.new_empty(rows.shape[0], self.in_features + 2)
        torch.sub(rows, middle, out=spanned[:, : self.in_features]).div_(half).clamp_(-1.0, 1.0)
        spanned[:, self.in_features :] = ROW_BOUNDS
        # reduce_range: activations in 7 bits, as PyTorch's own dynamic Linear does on x86, so that fbgemm's AVX2
        # int8 products cannot saturate their 16-bit intermediate sums
        y = torch.ops.quantized.linear_dynamic(spanned, self._packed_weight(), reduce_range=True)
        y = y.mul_(half).addcmul_(middle, self._row_sums())  # W x = half W x' + middle W 1
        y = y if self.bias is None else y.add_(self.bias)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def _compiled_forward(self, x: torch.Tensor) -> torch.Tensor:
        # The op inductor lowers to its weight-only int8 GEMM: bfloat16 input and scales, int8 (out, in) weight
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(rows, self.weight_int8, self.scale).to(x.dtype)
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def _row_sums(self) -> torch.Tensor:
        if self._sums is None:
            self._sums = self.weight_int8.float().sum(dim=1).mul_(self.scale.float())[None]
        return self._sums

    def _packed_weight(self) -> torch.ScriptObject:
        if self._packed is None:
            widened = torch.cat([self.weight_int8, self.weight_int8.new_zeros(self.out_features, 2)], dim=1)
            scales, zero_points = self.scale.double(), torch.zeros(self.out_features, dtype=torch.int64)
            with warnings.catch_warnings():  # torch marks quantized tensors deprecated; its eager int8 kernels need one
                warnings.simplefilter("ignore")
                qweight = torch._make_per_channel_quantized_tensor(widened, scales, zero_points, 0)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        return self._packed

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Blocks(NamedTuple):
    """A matrix in Int4Linear's layout (GGUF's Q4_1 blocks): packed codes (rows, groups, 16) uint8, byte j of a
    group holding the code of its weight j in the low 4 bits and of weight j + 16 in the high ones; scale and minimum
    (rows, groups) float16."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor

    def rows(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Int4Blocks:
        """The blocks with their rows moved or picked by `change` (a block lies in one row: rows move whole)."""
        return Int4Blocks(*(change(part) for part in self))

    def values(self, in_features: int) -> torch.Tensor:
        """The (rows, in_features) float32 weight: scale * code + minimum, in float32 as GGUF dequantizes it."""
        codes = torch.cat((self.codes & 15, self.codes >> 4), dim=-1).float()
        # in place: one float32 matrix at a time, not three (LoRA widens every product's weight this way each step)
        groups = codes.mul_(self.scale.float()[..., None]).add_(self.minimum.float()[..., None])
        return groups.reshape(self.codes.shape[0], -1)[:, :in_features]


class DequantizedLinear(nn.Module):
    """A Linear whose weight is stored otherwise (blocks, or a file) and made float32 for each pass: y = x Wᵀ + b with
    W = dequantized_weight(), in the input's dtype. The eager pass of Int4Linear, Int8GroupedLinear and FileLinear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(DequantizedLinear):
    """y = x Wᵀ + b with W stored in groups of GROUP weights along each row, as GGUF's Q4_1 blocks store them:
    `weight_int4` (out, groups, 16) uint8, byte j of a group holding the code of its weight j in the low 4 bits and
    of weight j + 16 in the high ones; `scale` and `minimum` (out, groups) float16; weight = scale * code + minimum.
    A row whose width is not a whole number of groups ends in a group of fewer weights (its codes past the row's end
    unused).

    For inference only. Made from an nn.Linear by `from_linear`; a Q4_0 block (scale d, weight = d * (code - 8)) is
    held exactly as scale d and minimum -8 d.
    """

    def __init__(
        self,
        weight_int4: torch.Tensor,
        scale: torch.Tensor,
        minimum: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_int4.shape[0], in_features
        if weight_int4.shape[1:] != (-(-in_features // GROUP), GROUP // 2) or scale.shape != weight_int4.shape[:2]:
            raise ValueError(
                f"int4 codes {tuple(weight_int4.shape)} and scales {tuple(scale.shape)} for {in_features} inputs"
            )
        self.register_buffer("weight_int4", weight_int4)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int4Linear:
        """The blocks the weight was read from, when it was (stored_int4); else quantized as GGUF's Q4_1 reference
        quantizer does (gguf-py's, in float32): per group, scale = (largest - smallest) / 15 and minimum = smallest,
        stored as float16; code = round((w - smallest) / scale), from the unrounded scale and minimum."""
        stored = stored_int4(linear)
        if stored is not None:
            return stored
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(*quantize_row_slices(weight.split(ROWS_AT_ONCE)), weight.shape[1], bias)

    def codes(self) -> torch.Tensor:
        """The codes (out, groups, GROUP) uint8 in 0 .. 15, weight j of each group at [..., j]."""
        return torch.cat((self.weight_int4 & 15, self.weight_int4 >> 4), dim=-1)

    def blocks(self) -> Int4Blocks:
        """The weight as it is stored (weight_int4, scale, minimum)."""
        return Int4Blocks(self.weight_int4, self.scale, self.minimum)

    def row_blocks(self, start: int, stop: int) -> Int4Blocks:
        """The blocks of rows start .. stop - 1."""
        return self.blocks().rows(lambda part: part[start:stop])

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight: scale * code + minimum for each weight, in float32 as GGUF dequantizes it."""
        return self.blocks().values(self.in_features)

    def symmetric(self) -> bool:
        """Whether every minimum is -8 times its scale, as in Q4_0's blocks (weight = scale * (code - 8))."""
        return torch.equal(self.minimum, -8 * self.scale)


class FileInt4Linear(Int4Linear):
    """An Int4Linear whose blocks stay where they are stored (a GGUF file's Q4_0 or Q4_1 matrices,
    gptkit.weights.gguf_read) and are read each time they are used: the model holds none of them. The native step
    packs them once into its own layout, a slice of rows at a time (row_blocks); an eager pass reads them at each
    call (the same values, more slowly). `read(start, stop)` gives the blocks of rows start .. stop - 1; `symmetric`:
    they are Q4_0's (every minimum -8 times its scale), as the file says."""

    def __init__(
        self,
        read: Callable[[int, int], Int4Blocks],
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None,
        symmetric: bool = False,
    ) -> None:
        nn.Module.__init__(self)  # not Int4Linear's: its blocks are no buffers here
        self.out_features, self.in_features = out_features, in_features
        self.read, self.stored_symmetric = read, symmetric
        self.register_buffer("bias", bias)

    @property
    def weight_int4(self) -> torch.Tensor:
        return self.blocks().codes

    @property
    def scale(self) -> torch.Tensor:
        return self.blocks().scale

    @property
    def minimum(self) -> torch.Tensor:
        return self.blocks().minimum

    def blocks(self) -> Int4Blocks:
        return self.read(0, self.out_features)

    def row_blocks(self, start: int, stop: int) -> Int4Blocks:
        return self.read(start, min(stop, self.out_features))

    def symmetric(self) -> bool:
        return self.stored_symmetric  # what the file says: reading every block to see would take as long as a packing


class Int8Blocks(NamedTuple):
    """A matrix in GGUF's Q8_0 blocks: codes (rows, groups, GROUP) int8 in -127 .. 127, weight j of each group at
    [..., j]; scale (rows, groups) float16; weight = scale * code."""

    codes: torch.Tensor
    scale: torch.Tensor

    def rows(self, change: Callable[[torch.Tensor], torch.Tensor]) -> Int8Blocks:
        """The blocks with their rows moved or picked by `change` (a block lies in one row: rows move whole)."""
        return Int8Blocks(*(change(part) for part in self))

    def values(self, in_features: int) -> torch.Tensor:
        """The (rows, in_features) float32 weight: scale * code, in float32 as GGUF dequantizes it."""
        groups = self.codes.float().mul_(self.scale.float()[..., None])
        return groups.reshape(self.codes.shape[0], -1)[:, :in_features]


class StoredLinear(DequantizedLinear):
    """y = x Wᵀ + b with W read where it is stored (gptkit.weights.gguf_read) each time it is used: `read(start,
    stop)` gives rows start .. stop - 1 (blocks or float32 values, as the subclass says), and `int4_read`, where the
    rows are read from a file's values, their int4 blocks quantized as they are read (what int4 takes:
    int4_of_stored). For inference only."""

    def __init__(
        self,
        read: Callable[[int, int], Int8Blocks | torch.Tensor],
        out_features: int,
        in_features: int,
        bias: torch.Tensor | None = None,
        int4_read: Callable[[int, int], Int4Blocks] | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.read, self.int4_read = read, int4_read
        self.register_buffer("bias", bias)


class Int8GroupedLinear(StoredLinear):
    """A StoredLinear of GGUF's Q8_0 blocks (Int8Blocks): a GGUF file's Q8_0 products, or its Q8_0 head beside
    products left in the file in 4 bits (gptkit.weights.gguf_read), so that the model decodes in the file's own 8
    bits. The native step packs its blocks once, a slice of rows at a time (row_blocks); an eager pass dequantizes
    them at each call, as Int4Linear's does. `int4_read`, for blocks quantized from a file's values of another type,
    gives those values' int4 blocks (not the 8-bit blocks quantized again)."""

    def blocks(self) -> Int8Blocks:
        return self.read(0, self.out_features)

    def row_blocks(self, start: int, stop: int) -> Int8Blocks:
        return self.read(start, min(stop, self.out_features))

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight: scale * code for each weight, in float32 as GGUF dequantizes it."""
        return self.blocks().values(self.in_features)


class FileLinear(StoredLinear):
    """A StoredLinear of a file's float32 values, in a type decoding does not run on (a GGUF file's K-quants, Q5_0,
    Q5_1 or float matrices, gptkit.weights.gguf_read), with `int4_read` their int4 blocks. Quantization replaces it
    before decoding (apply_quantization): int4 with the FileInt4Linear of those blocks, so the weight is never float32
    whole, only a slice of rows at a time; any other setting with the float32 nn.Linear of its values."""

    def dequantized_weight(self) -> torch.Tensor:
        """The (out, in) float32 weight, read from the file."""
        return self.read(0, self.out_features)


class FileEmbedding(nn.Module):
    """A token embedding whose table stays in a file (a GGUF file's quantized token_embd, gptkit.weights.gguf_read):
    a lookup reads and dequantizes the rows of its tokens only, to float32 as GGUF dequantizes them. `read_rows(rows)`
    gives those rows' (len(rows), embedding_dim) float32 values, in that order."""

    def __init__(self, read_rows: Callable[[list[int]], torch.Tensor], num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.read_rows = read_rows

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lookup(idx.reshape(-1).tolist()).view(*idx.shape, self.embedding_dim).to(idx.device)

    def lookup(self, rows: list[int]) -> torch.Tensor:
        """The (len(rows), embedding_dim) float32 values of the tokens `rows`; IndexError for one past the table."""
        if rows and not 0 <= min(rows) <= max(rows) < self.num_embeddings:
            raise IndexError(f"a token past the embedding's {self.num_embeddings} rows")
        return self.values(rows)

    def values(self, rows: list[int]) -> torch.Tensor:
        """The (len(rows), embedding_dim) float32 values of `rows`, in that order."""
        return self.read_rows(rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class FileInt4Embedding(FileEmbedding):
    """A FileEmbedding of a file's Q4_0 or Q4_1 blocks: its `read_rows(rows)` gives the blocks of those rows
    (Int4Blocks), in that order."""

    def values(self, rows: list[int]) -> torch.Tensor:
        return self.read_rows(rows).values(self.embedding_dim)


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 rows (rows, in) in Int4Linear's layout: packed codes (rows, groups, 16) uint8, scale and minimum
    (rows, groups) float16. A last group of fewer than GROUP weights is filled with the row's last weight, which
    changes neither its largest nor its smallest."""
    rows, columns = weight.shape
    padding = -columns % GROUP
    if padding:
        weight = torch.cat((weight, weight[:, -1:].expand(rows, padding)), dim=1)
    groups = weight.reshape(rows, -1, GROUP)
    smallest, largest = torch.aminmax(groups, dim=-1, keepdim=True)
    scale = (largest - smallest) / INT4_MAX
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    # in place on one temporary (a file's whole model passes here); the cast to uint8 truncates, as trunc would
    codes = (groups - smallest).mul_(inverse).add_(0.5).clamp_(0, INT4_MAX).to(torch.uint8)
    packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)
    return packed, scale[..., 0].half(), smallest[..., 0].half()


def quantize_row_slices(slices: Iterable[torch.Tensor]) -> Int4Blocks:
    """A matrix given a slice of rows at a time (at least one), quantized as Int4Linear.from_linear quantizes it: a
    row's blocks depend on that row alone, so only one slice is float32 at once."""
    parts = [quantize_groups(rows.float()) for rows in slices]
    return Int4Blocks(*(torch.cat(part) for part in zip(*parts)))


def quantize_q8_0(weight: torch.Tensor) -> Int8Blocks:
    """Rows (rows, in) as GGUF's Q8_0 blocks, as gguf-py's reference quantizer makes them, in float32: per group of
    GROUP weights, d = largest |w| / 127 and code = w / d rounded half away from zero, d stored as float16. A last
    group of fewer weights is filled with zeros (codes past the row's end, unused)."""
    rows, columns = weight.shape
    groups = F.pad(weight.float(), (0, -columns % GROUP)).view(rows, -1, GROUP)
    d = groups.abs().amax(dim=-1, keepdim=True) / INT8_MAX
    scaled = groups * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    magnitude = scaled.abs()
    whole = magnitude.floor()
    codes = (whole + (2 * (magnitude - whole)).floor()).copysign(scaled)  # as gguf-py's np_roundf, exactly
    return Int8Blocks(codes.to(torch.int8), d[..., 0].half())


def quantize_q8_0_slices(slices: Iterable[torch.Tensor]) -> Int8Blocks:
    """A matrix given a slice of rows at a time (at least one), quantized as quantize_q8_0 quantizes it: only one
    slice is float32 at once."""
    parts = [quantize_q8_0(rows) for rows in slices]
    return Int8Blocks(*(torch.cat(part) for part in zip(*parts)))


def block_products(model: nn.Module) -> list[str]:
    """The names of the products of `model`'s blocks: its Linear layers (plain or int4) in the `h` list of blocks,
    never the head or the embedding. What LoRA's targets choose from and QLoRA holds in int4."""
    products = (nn.Linear, Int4Linear)
    return [name for name, module in model.named_modules() if isinstance(module, products) and ".h." in f".{name}"]


def int4_block_products(model: nn.Module, stored: Callable[[str], torch.Tensor]) -> None:
    """Each product of `model`'s blocks (block_products; made without weights) becomes the Int4Linear of its weight
    as stored(its state dict key) gives it (a state dict's pop; a reader's, which reads it then), the blocks
    Int4Linear.from_linear makes of it, quantized a slice of rows at a time from the stored dtype: QLoRA's base read
    with no float32 copy of its products, and one stored product at a time (gptkit.weights.sources.load's
    int4_products)."""
    for name in block_products(model):
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            weight = stored(f"{name}.weight")
            bias = None if module.bias is None else stored(f"{name}.bias").to(torch.float32, copy=True)
            blocks = quantize_row_slices(weight.split(ROWS_AT_ONCE))
            model.set_submodule(name, Int4Linear(*blocks, weight.shape[1], bias))


def keep_int4_blocks(module: nn.Module, blocks: Int4Blocks) -> None:
    """Record on `module` (an nn.Linear, or the token embedding) the 4-bit blocks its weight was read from (a GGUF
    file's Q4_0 or Q4_1 matrix, gptkit.weights.gguf_read), for stored_int4."""
    # A plain attribute: no state dict entry, and no cast when the model moves to another dtype
    module.int4_blocks = blocks


def stored_int4(module: nn.Module) -> Int4Linear | None:
    """The Int4Linear of the blocks `module`'s weight was read from (keep_int4_blocks), while the weight still holds
    their values (rounded to its dtype: not trained since); None otherwise."""
    blocks = getattr(module, "int4_blocks", None)
    if blocks is None:
        return None
    weight = module.weight.detach()
    blocks = blocks.rows(lambda part: part.to(weight.device))
    if not torch.equal(blocks.values(weight.shape[1]).to(weight.dtype), weight):
        return None
    bias = getattr(module, "bias", None)
    bias = None if bias is None else bias.detach().float().clone()
    return Int4Linear(*blocks, weight.shape[1], bias)


def int4_as_linear(int4: Int4Linear) -> nn.Linear:
    """The float32 nn.Linear an Int4Linear computes, keeping its blocks (so int4 gives them back as they are)."""
    blocks = int4.blocks()  # read once where they stay in a file
    device = blocks.scale.device
    linear = nn.Linear(int4.in_features, int4.out_features, bias=int4.bias is not None, device=device)
    with torch.no_grad():
        linear.weight.copy_(blocks.values(int4.in_features))
        if int4.bias is not None:
            linear.bias.copy_(int4.bias)
    keep_int4_blocks(linear, blocks)
    return linear


def dequantized_linear(product: StoredLinear) -> nn.Linear:
    """The float32 nn.Linear a StoredLinear (Int8GroupedLinear, FileLinear) computes."""
    linear = nn.Linear(product.in_features, product.out_features, bias=product.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(product.dequantized_weight())
        if product.bias is not None:
            linear.bias.copy_(product.bias)
    return linear


def as_linear(product: nn.Module) -> nn.Module:
    """The float32 nn.Linear a product stored otherwise (Int4Linear, Int8GroupedLinear, FileLinear) computes; any
    other module itself."""
    if isinstance(product, Int4Linear):
        return int4_as_linear(product)
    if isinstance(product, StoredLinear):
        return dequantized_linear(product)
    return product


def file_linears_as_float(model: nn.Module) -> nn.Module:
    """`model` (in place, returned) with each FileLinear the float32 nn.Linear of its values, one at a time."""
    return replace_linears(model, dequantized_linear, kind=FileLinear)


def dequantized_copy(model: nn.Module) -> nn.Module:
    """`model` itself when it holds no product stored otherwise than as a Linear (Int4Linear, Int8GroupedLinear,
    FileLinear); else a copy with each one the float32 nn.Linear it computes (as_linear): what code that reads a
    model's float weights (the exporters) takes."""
    if not any(isinstance(module, DequantizedLinear) for module in model.modules()):
        return model
    return replace_linears(copy.deepcopy(model), as_linear, kind=DequantizedLinear)


def keep_stored_int4(model: nn.Module) -> nn.Module:
    """`model` (in place, returned) run on the blocks its products were read from (stored_int4, or left in the file:
    FileInt4Linear) when every one of them was: a GGUF file whose products and head are all Q4_0 or Q4_1 keeps its
    own precision. Products left in the file are never made float32: where every one but the head was (llama.cpp's
    Q4_0 and Q4_1 files keep the head in more bits), the head the reader left in Q8_0 (Int8GroupedLinear) stays so,
    and a float one (a LoRA run's GGUF base, its products read alone) is quantized to int4 as quantize_int4 does, so
    that the native step reads the layers in 4 bits and the head in int4 or Q8_0 panels. Where others
    were not, the products left in the file become the float32 nn.Linear of their values (int4_as_linear), as the
    others are; any other model is left as it is."""
    products = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, (nn.Linear, Int4Linear))
    ]
    int4 = [child if isinstance(child, Int4Linear) else stored_int4(child) for _, _, child in products]
    head = getattr(model, "lm_head", None)
    left_in_file = any(isinstance(child, FileInt4Linear) for _, _, child in products)
    others_int4 = all(product is not None for (_, _, child), product in zip(products, int4) if child is not head)
    if left_in_file and others_int4 and isinstance(head, nn.Linear):  # the head alone in more bits
        int4 = [
            Int4Linear.from_linear(child) if child is head else product
            for (_, _, child), product in zip(products, int4)
        ]
    every_one = all(product is not None for product in int4)
    for (parent, name, child), product in zip(products, int4):
        if every_one:
            setattr(parent, name, product)
        elif isinstance(child, FileInt4Linear):
            setattr(parent, name, int4_as_linear(child))
    return model


def quantize_int4(model: nn.Module) -> nn.Module:
    """`model` (in place, returned; any device and dtype, for inference) with every nn.Linear an Int4Linear: the
    blocks a weight was read from as they are (stored_int4), the others quantized (an Int8GroupedLinear from its
    values, one at a time; a FileLinear's int4 blocks read as they are asked for). A head tied to the token embedding
    gets an int4 copy of its own, so the embedding lookup stays exact."""
    replace_linears(model, int4_of_stored, kind=StoredLinear)
    return replace_linears(model, Int4Linear.from_linear).eval()


def int4_of_stored(product: StoredLinear) -> Int4Linear:
    """The int4 product of an Int8GroupedLinear or a FileLinear: the int4 blocks of the file's values where it reads
    them (int4_read: a FileLinear's, an Int8GroupedLinear's quantized from another type), else of its blocks'
    values."""
    if product.int4_read is None:
        return Int4Linear.from_linear(dequantized_linear(product))
    bias = None if product.bias is None else product.bias.clone()
    return FileInt4Linear(product.int4_read, product.out_features, product.in_features, bias)


def quantize_int8(model: nn.Module) -> nn.Module:
    """`model` (float32, on the CPU, for inference) with every nn.Linear an Int8Linear; in place, returned.

    A head tied to the token embedding gets an int8 copy of its own, so the embedding lookup stays exact.
    """
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32:
        found = "no parameters" if param is None else f"{param.dtype} on {param.device}"
        raise UserError(
            f"int8 quantization needs a float32 model on the CPU, got {found}; use --device=cpu "
            "--dtype=float32 or drop --quantize"
        )
    engines = torch.backends.quantized.supported_engines
    engine = next((name for name in ("x86", "fbgemm", "qnnpack") if name in engines), None)
    if engine is None:
        raise UserError(f"this PyTorch build has no int8 CPU kernels (engines: {engines}); drop --quantize")
    torch.backends.quantized.engine = engine
    # A tied head is converted from its own (shared) weight: the tie is cut and the embedding stays float32.
    return replace_linears(model, Int8Linear.from_linear).eval()


def replace_linears(
    model: nn.Module, replacement: Callable[[nn.Module], nn.Module], kind: type | tuple[type, ...] = nn.Linear
) -> nn.Module:
    """`model` (in place, returned) with every child of `kind` (nn.Linear: subclasses included) replaced by
    replacement(it), one at a time."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, name, replacement(child))
    return model


def apply_quantization(model: nn.Module, quantize: str, compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The scripts' --quantize setting: "none" keeps the weights as they were stored (keep_stored_int4: a model read
    from 4-bit blocks throughout runs on them, any other stays as it is; a FileLinear's values become float32);
    "int4" see quantize_int4 (any compute dtype; a FileLinear becomes int4 a slice of rows at a time); "int8" see
    quantize_int8 (which needs float32 compute: the int8 products return float32, so no bfloat16/float16 autocast
    around them)."""
    if quantize not in QUANTIZE_CHOICES:
        raise UserError(f"unknown --quantize={quantize!r}; use {', '.join(QUANTIZE_CHOICES)}")
    if quantize == "none":
        return keep_stored_int4(file_linears_as_float(model))
    if quantize == "int4":
        return quantize_int4(model)
    if compute_dtype != torch.float32:
        raise UserError(
            f"--quantize=int8 computes in float32, not {str(compute_dtype).removeprefix('torch.')}; "
            "use --dtype=float32 (or auto on the CPU)"
        )
    return quantize_int8(file_linears_as_float(model))
