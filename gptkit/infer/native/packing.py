"""The native step's packed weights: every matrix of the model in one buffer, in the order and layout the C++ reads
them (csrc/layout.h's Shapes), and every vector (norms, biases) in another.

float32 matrices lie in panels of rows stored column after column (copy_in_blocks: csrc/panels.h multiplies each
column by every input's value at once); bfloat16 and int8 ones row after row (int8 with one float32 scale per row);
int4 ones in panels of codes with their groups' scales and minimums (none where every minimum is -8 times its scale,
as in Q4_0's blocks: int4_panels, csrc/int4.h), and GGUF's Q8_0 ones (a Q8_0 file's, or a Q8_0 head beside int4
layers) in panels of 8-bit codes with their groups' scales (int8_panels). The buffers lie on
2 MB pages where they are large enough (gptkit.infer.memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

from gptkit.infer.memory import huge_page_zeros
from gptkit.weights.quantization import GROUP, Int4Linear, Int8Blocks, Int8GroupedLinear, Int8Linear

# The kinds of grouped products' panels (the layers', the head's), numbered as csrc/int4.h's Grouped: int4 with
# minimums, int4 without them (Q4_0's blocks), Q8_0's.
INT4_PANELS, INT4_SYMMETRIC_PANELS, INT8_PANELS = 0, 1, 2


def int8_weights(model: nn.Module) -> bool:
    """Whether `model`'s products have int8 weights (gptkit.weights.quantization's Int8Linear)."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def int4_weights(model: nn.Module) -> bool:
    """Whether `model`'s products have int4 weights (gptkit.weights.quantization's Int4Linear)."""
    return any(isinstance(m, Int4Linear) for m in model.modules())


# The weights whose products are grouped (csrc/int4.h), as weights_name names them.
GROUPED_WEIGHTS = ("int4", "q8_0")


def weights_name(model: nn.Module, dtype: torch.dtype) -> str:
    """The products' weights: int8, q8_0 (the layers' GGUF Q8_0 blocks), int4, or else the compute dtype's."""
    if int8_weights(model):
        return "int8"
    if q8_0_weights(model):
        return "q8_0"
    return "int4" if int4_weights(model) else str(dtype).removeprefix("torch.")


def q8_0_weights(model: nn.Module) -> bool:
    """Whether `model`'s layers' products have GGUF's Q8_0 weights (gptkit.weights.quantization's
    Int8GroupedLinear)."""
    return any(isinstance(m, Int8GroupedLinear) for m in model.transformer.h.modules())


def norm_vectors(norm: nn.Module, width: int) -> list[torch.Tensor | None]:
    """A norm's (LayerNorm or RMSNorm) weight and bias as the step reads them: ones for a norm without a
    weight, None (zeros) for one without a bias."""
    weight = norm.weight if norm.weight is not None else torch.ones(width)
    return [weight, getattr(norm, "bias", None)]


def layer_tensors(block: nn.Module) -> tuple[list[nn.Module], list[torch.Tensor | None]]:
    """One block's products (Linear, Int8Linear or Int4Linear) and vectors in the order the step reads them
    (csrc/layout.h's Shapes; None: a bias the model lacks)."""
    attn, mlp = block.attn, block.mlp
    products = [attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj]
    head_norms = [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]  # QK-norm's, else ones (unread)
    vectors = [
        *norm_vectors(block.ln_1, attn.c_attn.in_features),
        attn.c_attn.bias,
        attn.c_proj.bias,
        *norm_vectors(block.ln_2, mlp.c_fc.in_features),
        mlp.c_fc.bias,
        mlp.c_proj.bias,
    ]
    for norm in head_norms:
        vectors.append(torch.ones(attn.head_dim) if norm is None else norm_vectors(norm, attn.head_dim)[0])
    return products, vectors


def vector_sizes(config) -> list[int]:
    """The sizes of the vectors the step reads (layer_tensors' for each layer, then ln_f's and ln_emb's
    weight and bias)."""
    C, D = config.n_embd, config.head_dim
    qkv = (config.n_head + 2 * config.n_kv_head) * D
    fc = (2 if config.activation == "swiglu" else 1) * config.mlp_hidden
    return [C, C, qkv, C, C, C, fc, C, D, D] * config.n_layer + [C, C, C, C]


def weight_and_scale(product: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A product's (out, in) weight as the step reads it, and its rows' scales (int8; None for a plain Linear)."""
    if isinstance(product, Int8Linear):
        return product.weight_int8, product.scale.float()
    return product.weight, None


def copy_in_blocks(destination: torch.Tensor, matrix: torch.Tensor, block_rows: int, chunk: int) -> None:
    """Copy `matrix` (rows, columns) into the 1-D `destination` as csrc/panels.h reads float32 matrices: blocks of
    `block_rows` rows (the last block holds the rows left), each holding `chunk` values of each of its rows in turn
    (its panels: chunks of one value, so a block holds its rows' values column after column)."""
    rows, columns = matrix.shape
    whole = rows // block_rows * block_rows
    for first, last, height in ((0, whole, block_rows), (whole, rows, rows - whole)):
        if last > first:
            blocks = (last - first) // height
            place = destination[first * columns : last * columns].as_strided(
                (blocks, height, columns // chunk, chunk), (height * columns, chunk, height * chunk, 1)
            )
            place.copy_(matrix[first:last].reshape(blocks, height, columns // chunk, chunk))


def int4_panel_bytes(product: Int4Linear, panel_rows: int, minimums: bool = True) -> int:
    """The bytes int4_panels makes of `product`."""
    panels, groups = -(-product.out_features // panel_rows), -(-product.in_features // GROUP)  # no blocks read
    return panels * groups * panel_rows * (GROUP // 2 + (4 if minimums else 2))


def int4_panels(product: Int4Linear, panel_rows: int, minimums: bool = True) -> torch.Tensor:
    """An int4 product's weights (uint8, 1-D) as csrc/int4.h reads them (its panels): panels of `panel_rows`
    rows (the last filled up with rows of zeros), each a record per group: the codes of the group's 32 columns, word
    w (4 bytes, little-endian) of row r at (w * panel_rows + r) * 4 holding the code of column 8w + 2k + h in its bits
    16h + 4k .. 16h + 4k + 3 (a mask leaves its even nibbles as 4 bytes, a shift and a mask its odd ones), then
    the rows' float16 scales, then their minimums (not without `minimums`: csrc/int4.h's Int4Symmetric, whose
    minimums are -8 times the scales)."""
    codes, scale, minimum = product.codes(), product.scale, product.minimum
    panels, groups = -(-scale.shape[0] // panel_rows), scale.shape[1]
    # (panel, row, group, word, half h, pair k) -> (..., word, byte 2h + k // 2, nibble k % 2): column 8w + 2k + h
    by_half = whole_panels(codes, panel_rows).view(panels, panel_rows, groups, 4, 4, 2).transpose(-1, -2)
    nibbles = by_half.reshape(panels, panel_rows, groups, 4, 4, 2)
    words = (nibbles[..., 0] | (nibbles[..., 1] << 4)).permute(0, 2, 3, 1, 4)  # (panel, group, word, row, byte)
    by_group = [words.reshape(panels, groups, -1)]
    for halves in (scale, minimum) if minimums else (scale,):
        by_group.append(group_halves(halves, panel_rows))
    return torch.cat(by_group, dim=2).reshape(-1)


def whole_panels(tensor: torch.Tensor, panel_rows: int) -> torch.Tensor:
    """A tensor of rows (rows, ...) filled up with rows of zeros to whole panels, (panels, panel_rows, ...)."""
    rows = tensor.shape[0]
    filler = tensor.new_zeros(-rows % panel_rows, *tensor.shape[1:])
    return torch.cat((tensor, filler)).view(-1, panel_rows, *tensor.shape[1:])


def group_halves(halves: torch.Tensor, panel_rows: int) -> torch.Tensor:
    """Float16 values a row's group (rows, groups) as each panel's records hold them: (panel, group, row), as
    bytes."""
    return whole_panels(halves, panel_rows).transpose(1, 2).contiguous().view(torch.uint8)


def int8_panel_bytes(product: Int8GroupedLinear, panel_rows: int) -> int:
    """The bytes int8_panels makes of `product`'s blocks."""
    panels, groups = -(-product.out_features // panel_rows), -(-product.in_features // GROUP)
    return panels * groups * panel_rows * (GROUP + 2)


def int8_panels(blocks: Int8Blocks, panel_rows: int) -> torch.Tensor:
    """Q8_0 blocks (uint8, 1-D) as csrc/int4.h reads Int8Grouped panels: panels of `panel_rows` rows (the last
    filled up with rows of zeros), each a record per group: the codes of the group's 32 columns a pair of columns
    after another, columns 2j and 2j + 1 of row r at bytes (j * panel_rows + r) * 2 and one on (a load of a pair's
    bytes widened to 16 bits gives each row its pair), then the rows' float16 scales."""
    panels, groups = -(-blocks.scale.shape[0] // panel_rows), blocks.scale.shape[1]
    pairs = whole_panels(blocks.codes, panel_rows).view(panels, panel_rows, groups, GROUP // 2, 2)
    codes = pairs.permute(0, 2, 3, 1, 4).reshape(panels, groups, -1).view(torch.uint8)  # (panel, group, pair, row, 2)
    return torch.cat((codes, group_halves(blocks.scale, panel_rows)), dim=2).reshape(-1)


def panels_of(products: Sequence[nn.Module]) -> int:
    """The kind of panels grouped products take together (the layers', or the head alone): Q8_0's for
    Int8GroupedLinear ones, else int4's without minimums where every one's are -8 times its scales (Q4_0's), else
    with them."""
    if isinstance(products[0], Int8GroupedLinear):
        return INT8_PANELS
    return INT4_SYMMETRIC_PANELS if all(product.symmetric() for product in products) else INT4_PANELS


def grouped_panel_bytes(product: nn.Module, panel_rows: int, kind: int) -> int:
    """The bytes grouped_panels makes of a whole product."""
    if kind == INT8_PANELS:
        return int8_panel_bytes(product, panel_rows)
    return int4_panel_bytes(product, panel_rows, minimums=kind == INT4_PANELS)


def grouped_panels(product: nn.Module, start: int, stop: int, panel_rows: int, kind: int) -> torch.Tensor:
    """Rows start .. stop - 1 (whole panels') of an Int4Linear or Int8GroupedLinear in the step's panels of `kind`,
    its blocks read for them alone (row_blocks)."""
    blocks = product.row_blocks(start, stop)
    if kind == INT8_PANELS:
        return int8_panels(blocks, panel_rows)
    return int4_panels(Int4Linear(*blocks, product.in_features, None), panel_rows, minimums=kind == INT4_PANELS)


def packed(
    tensors: Iterable[torch.Tensor | None], sizes: Sequence[int], dtype: torch.dtype, blocks: Sequence[int] = ()
) -> torch.Tensor:
    """One contiguous buffer (on huge pages where it is large enough) holding `tensors` back to back, each flattened
    from its logical (row-major) order, or matrices in blocks of (rows, chunk) (copy_in_blocks) where `blocks` says
    so, then a block's rows of zeros (csrc/panels.h reads a last block of fewer rows a whole block's column at a
    time); None stands for `size` zeros (a missing bias). `tensors` are taken one at a time (int4 panels are made as
    they are copied)."""
    buffer = huge_page_zeros(sum(sizes) + (blocks[0] if blocks else 0), dtype)
    start = 0
    for tensor, size in zip(tensors, sizes):
        if tensor is not None and blocks and tensor.dim() == 2:
            copy_in_blocks(buffer[start : start + size], tensor.detach(), *blocks)
        elif tensor is not None:
            buffer[start : start + size].view(tensor.shape).copy_(tensor.detach())
        start += size
    return buffer
