"""A native decoding step: one token of one sequence, or of several, on the CPU in a single C++ call
(gptkit/infer/csrc/decode_step.cpp).

Why: at batch 1 a step reads every weight once, so its floor is the weight bytes over the memory's read speed. The
compiled step (gptkit.infer.compiled) runs some 150 kernels a token, each its own parallel region, behind
dynamo's and inductor's wrappers; the native step runs the whole pass in one parallel region whose threads meet at
barriers, reading the weights from one buffer in the order the pass reads them (float32 matrices in panels of rows
stored column after column, copy_in_blocks: a product multiplies each column by every input's value at once). `python benchmarks/bench.py sample
--paths=native --paths=native_bf16 --paths=native_int8` measures it against the memory bound; docs/benchmarks.md
has the figures.

What it serves: every architecture model.py builds, in float32 or bfloat16 weights on the CPU, or int8 ones
(gptkit.weights.quantization's Int8Linear: one scale per row; each product's float32 input is rounded to 16-bit
integers with one scale, so that the products run in integer lanes), or int4 ones (Int4Linear, GGUF's Q4_1: the
codes widened to float32 lanes in registers and multiplied by the float32 inputs themselves, in panels of rows:
int4_panels): learned, sinusoidal or rotary positions (the model's own cos and sin tables, so a rope_scaling is
exact); LayerNorm or RMSNorm, with or without a weight or bias; the GELU (tanh or exact), squared-ReLU or SwiGLU MLP;
multi-head or grouped-query attention, heads of any width; QK-norm with or without a weight; a Q, K, V bias of its
own; a norm of the embeddings and soft-capped logits (nanochat); a tied or separate head (native_problem says why a
model does not fit). The engine runs every step with it: one row (NativeStep.__call__), or several rows of any
lengths in one call (NativeStep.step_rows: each weight read from memory once a step, whatever the rows: one pass over
each panel of float32 or int4 weights multiplies up to 12 rows with AVX-512, 6 (int4: 4) with AVX2, and the passes for
more rows read the panel from the cache);
it fills prompts with the native prefill (NativeStep.prefill: the prompts of the requests admitted together, of one
length, in one pass) up to PREFILL_LIMITS' tokens in all.

The C++ source is compiled at set-up (`python -m gptkit.infer.native --build`, which `make demo` and `make test`
run: a C++ compiler and ninja, ~25 s once), for this machine's instruction set: AVX-512 and its bfloat16 products
where the CPU has them, else AVX2 with FMA, else what the compiler makes of plain loops. Each build lies in a
directory of its own under torch's extensions directory, named by a hash of what it is built from (build_directory):
checkouts, worktrees and virtual environments share a build only where it would be the same build, and each finds
its own again after another has built. decode=auto uses the step only once it is built (build_problem);
decode=native builds it when needed.

Caveat: the step reads a packed copy of the weights (their memory twice over), made once per model and remade when
a parameter or buffer (int8 weights are buffers) is changed in place (an optimizer step, a load_state_dict), which
`NativeStep.for_model` notices by their version counters.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import mmap
import os
import platform
import shutil
import sys
import sysconfig
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn as nn

from gptkit.core.errors import UserError
from gptkit.weights.quantization import GROUP, Int4Linear, Int8Linear

SOURCE = Path(__file__).parent / "csrc" / "decode_step.cpp"
MODULE = "gptkit_decode_step"  # the extension's name: its build is MODULE.so
# Tuples: torch's build appends its own flags to the lists it is given.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp")  # -march=native: this CPU's instruction set
LINK_FLAGS = ("-fopenmp",)
ACTIVATIONS = {"gelu_tanh": 0, "gelu": 1, "relu2": 2, "swiglu": 3}  # decode_step.cpp's Activation codes
HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and most arm64 kernels
# How to fall back, said in every error about this path: the compiled step serves every model and batch.
OTHER_PATHS = "use --decode=auto, eager or compiled instead"


def native_problem(model: nn.Module, dtype: torch.dtype) -> str | None:
    """Why the native step cannot run `model` computing in `dtype` (None: it can); the one place its rules live."""
    config, device = model.config, next(model.parameters()).device
    if device.type != "cpu":
        return f"the native step runs on the CPU only, and this model is on {device}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the native step computes in float32 or bfloat16, not {str(dtype).removeprefix('torch.')}"
    products = 4 * config.n_layer + 1
    for kind, layer in (("int8", Int8Linear), ("int4", Int4Linear)):
        if sum(isinstance(m, layer) for m in model.modules()) == products:
            return None if dtype == torch.float32 else f"the native step's {kind} products compute in float32 only"
    if sum(isinstance(m, nn.Linear) for m in model.modules()) != products:
        return (
            "the native step needs every product to be a plain Linear layer, or every one int8 (--quantize=int8), "
            "or every one int4 (--quantize=int4)"
        )
    return None


def cpu_flags() -> str:
    """This CPU's architecture and instruction-set flags (from /proc/cpuinfo where there is one)."""
    flags = platform.machine()
    with contextlib.suppress(OSError):
        flags += next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return flags


def build_directory(source: Path = SOURCE) -> Path:
    """Where the extension built from `source` lies: under torch's extensions directory (TORCH_EXTENSIONS_DIR, else
    torch's default), named by a hash of all the build is made of: the source's text, the flags and the compiler
    (CXX), torch's version and place (its headers), Python's headers and this CPU's instruction set (a home directory
    may be shared by machines of other CPUs). Why: torch remakes a build whenever one of these differs from the last
    build in its directory, so checkouts, worktrees or venvs that shared a directory would rebuild on every switch;
    keyed so, they share a build only where it is the same build. Builds of older sources stay (delete them freely)."""
    from torch.utils import cpp_extension

    parts = [
        *COMPILE_FLAGS,
        *LINK_FLAGS,
        os.environ.get("CXX", "c++"),  # the compiler torch's build runs
        torch.__version__,
        str(Path(torch.__file__).parent),  # its headers and libraries, named in the build's commands
        sysconfig.get_path("include", scheme="posix_prefix") or "",
        cpu_flags(),
    ]
    digest = hashlib.sha256(source.read_bytes())
    for part in parts:
        digest.update(b"\0" + part.encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"{MODULE}_torch{torch.__version__}_{python}_{digest.hexdigest()[:16]}"


def built_in(directory: Path) -> bool:
    """Whether `directory` holds a finished build (the extension's library, which the build links last)."""
    return (directory / f"{MODULE}.so").is_file()


def int8_weights(model: nn.Module) -> bool:
    """Whether `model`'s products have int8 weights (gptkit.weights.quantization's Int8Linear)."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def int4_weights(model: nn.Module) -> bool:
    """Whether `model`'s products have int4 weights (gptkit.weights.quantization's Int4Linear)."""
    return any(isinstance(m, Int4Linear) for m in model.modules())


def is_built(source: Path = SOURCE) -> bool:
    """Whether this machine has a build of `source` as it reads now, with this torch, Python and CPU (decode=auto
    uses the step only then)."""
    return built_in(build_directory(source))


def build_problem(build: bool) -> str | None:
    """Why the native step cannot run here (None: it can): not built (when `build` is False), or a failed build."""
    if not build and not is_built():
        return "the native step is not built (python -m gptkit.infer.native --build)"
    try:
        extension()
    except UserError as error:
        return str(error)
    return None


@contextlib.contextmanager
def builder_lock(directory: Path):
    """Hold this build directory's lock (one process builds or loads at a time) and remove a `lock` file that
    torch's build left behind. Why: torch waits, forever, while its `lock` file exists, and a build killed midway (a
    Ctrl-C, a test's timeout) leaves it; every process that builds here holds this lock first, and the system frees
    it when its holder dies, so a `lock` file found while holding it is a dead build's. A process that finds the lock
    held while the build is not done says, in one line, that it waits for it (a build takes a while)."""
    with open(directory / "gptkit-build.lock", "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not built_in(directory):  # else the holder only loads the build: a moment
                print(
                    f"waiting for another process's build of the native decoding step in {directory}",
                    file=sys.stderr,
                    flush=True,
                )
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def source_copy(directory: Path) -> Path:
    """The build directory's own copy of the source, written once. Why: torch's build names the source by its path,
    and ninja rebuilds when that path changes; compiling the copy, every checkout of the same source finds the
    build done."""
    copy = directory / SOURCE.name
    if not copy.is_file():
        partial = directory / f"{SOURCE.name}.partial"
        shutil.copyfile(SOURCE, partial)
        partial.replace(copy)
    return copy


@functools.cache
def extension():
    """The compiled C++ extension, built when this source has no build yet (build_directory); UserError with what is
    missing when it cannot be built."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the pip package's binary sits outside PATH in a venv that is not activated
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = os.pathsep.join((ninja.BIN_DIR, os.environ.get("PATH", "")))
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with builder_lock(directory):
            if not built_in(directory):
                print(
                    f"building the native decoding step for this CPU in {directory} (once, about 25 s)", file=sys.stderr
                )
            return cpp_extension.load(
                MODULE,
                sources=[str(source_copy(directory))],
                build_directory=str(directory),
                extra_cflags=list(COMPILE_FLAGS),
                extra_ldflags=list(LINK_FLAGS),
            )
    except (OSError, RuntimeError, ImportError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"could not build the native decoding step ({first_line}); it needs a C++ compiler (g++) and "
            "ninja (pip install ninja)"
        ) from error


def norm_vectors(norm: nn.Module, width: int) -> list[torch.Tensor | None]:
    """A norm's (LayerNorm or RMSNorm) weight and bias as decode_step.cpp reads them: ones for a norm without a
    weight, None (zeros) for one without a bias."""
    weight = norm.weight if norm.weight is not None else torch.ones(width)
    return [weight, getattr(norm, "bias", None)]


def layer_tensors(block: nn.Module) -> tuple[list[nn.Module], list[torch.Tensor | None]]:
    """One block's products (Linear, Int8Linear or Int4Linear) and vectors in the order decode_step.cpp reads them
    (its Shapes; None: a bias the model lacks)."""
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
    """The sizes of the vectors decode_step.cpp reads (layer_tensors' for each layer, then ln_f's and ln_emb's
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


def huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros (numel,) in memory that Linux backs with 2 MB pages where it can (transparent huge pages, asked for with
    madvise before the first touch), else in PyTorch's own allocation; PyTorch's zeros for less than 2 MB or
    without mmap's madvise.

    Why: a step streams every weight and its rows' keys and values, and with 4 KB pages that takes a TLB entry per
    4 KB; under a hypervisor each miss walks two page tables. PyTorch's allocator asks for huge pages only when
    THP_MEM_ALLOC_ENABLE is set before it starts. docs/benchmarks.md has the read speeds of both kinds of buffer.
    """
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(numel, dtype=dtype)
    # private: shared anonymous memory is shmem, which the kernel gives huge pages by another setting (often never)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # reads as zeros
    with contextlib.suppress(OSError):  # a kernel without THP: 4 KB pages, the same values
        mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE  # from a 2 MB boundary: only whole aligned 2 MB ranges get huge pages
    return raw[start : start + nbytes].view(dtype)


def copy_in_blocks(destination: torch.Tensor, matrix: torch.Tensor, block_rows: int, chunk: int) -> None:
    """Copy `matrix` (rows, columns) into the 1-D `destination` as decode_step.cpp reads float32 matrices: blocks of
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


def int4_panel_bytes(product: Int4Linear, panel_rows: int) -> int:
    """The bytes int4_panels makes of `product`."""
    panels, groups = -(-product.out_features // panel_rows), product.scale.shape[1]
    return panels * groups * panel_rows * (GROUP // 2 + 4)


def int4_panels(product: Int4Linear, panel_rows: int) -> torch.Tensor:
    """An int4 product's weights (uint8, 1-D) as decode_step.cpp reads them (its Int4 panels): panels of `panel_rows`
    rows (the last filled up with rows of zeros), each a record per group: the codes of the group's 32 columns, word
    w (4 bytes) of row r at (w * panel_rows + r) * 4 holding the code of column 8w + k in its bits 4k .. 4k + 3, then
    the rows' float16 scales, then their minimums."""
    codes, scale, minimum = product.codes(), product.scale, product.minimum
    rows, groups = scale.shape
    panels = -(-rows // panel_rows)

    def whole_panels(tensor: torch.Tensor) -> torch.Tensor:
        filler = tensor.new_zeros(panels * panel_rows - rows, *tensor.shape[1:])
        return torch.cat((tensor, filler)).view(panels, panel_rows, *tensor.shape[1:])

    # (panel, row, group, word, byte, nibble): byte b of a word (little-endian) holds the codes of places 2b and 2b + 1
    nibbles = whole_panels(codes).view(panels, panel_rows, groups, 4, 4, 2)
    words = (nibbles[..., 0] | (nibbles[..., 1] << 4)).permute(0, 2, 3, 1, 4)  # (panel, group, word, row, byte)
    by_group = [words.reshape(panels, groups, -1)]
    for halves in (scale, minimum):  # (panel, group, row) float16, as bytes
        by_group.append(whole_panels(halves).transpose(1, 2).contiguous().view(torch.uint8))
    return torch.cat(by_group, dim=2).reshape(-1)


def packed(
    tensors: Iterable[torch.Tensor | None], sizes: Sequence[int], dtype: torch.dtype, blocks: Sequence[int] = ()
) -> torch.Tensor:
    """One contiguous buffer (on huge pages where it is large enough) holding `tensors` back to back, each flattened
    from its logical (row-major) order, or matrices in blocks of (rows, chunk) (copy_in_blocks) where `blocks` says
    so, then a block's rows of zeros (decode_step.cpp reads a last block of fewer rows a whole block's column at a
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


# The most prompt tokens (filled in one pass) the engine gives the native prefill, by weights; longer ones take the eager
# pass, whose GEMM libraries (MKL; fbgemm's int8 products with 7-bit activations, against the native pass's 16-bit
# ones) pass the native pass's products as prompts grow. bfloat16 prompts of any length: PyTorch's
# eager bfloat16 products were 2-4x slower than its float32 ones on a CPU without bfloat16 instructions. Measured on
# a Zen 3 EPYC (docs/benchmarks.md); float32 in AVX-512's 32-row panels on a Xeon, where the native pass was the
# faster up to 256 tokens (PREFILL_LIMITS_AVX512). int4 prompts of any length: the eager pass dequantizes every
# weight at each call.
PREFILL_LIMITS = {"float32": 64, "bfloat16": None, "int8": 32, "int4": None}
PREFILL_LIMITS_AVX512 = {**PREFILL_LIMITS, "float32": 256}

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
        # the products' weights: int8, int4, or the compute dtype's
        self.weights = (
            "int8" if int8_weights(model) else "int4" if int4_weights(model) else str(dtype).removeprefix("torch.")
        )
        self.panel_rows = 0  # float32 matrices' panels: 32 rows with AVX-512, 16 with AVX2 (none without vectors)
        if self.weights == "int4":
            self.matrices, self.scales = self._int4_matrices(products), torch.empty(0)
        else:
            matrices, scales = zip(*map(weight_and_scale, products))
            int8 = self.weights == "int8"
            # float32 matrices in the panels decode_step.cpp reads (float32_blocks; none in a build without vectors)
            blocks = [] if int8 or dtype != torch.float32 else extension().float32_blocks()
            self.panel_rows = blocks[0] if blocks else 0
            self.matrices = packed(matrices, [m.numel() for m in matrices], torch.int8 if int8 else dtype, blocks)
            self.scales = packed(scales, [m.shape[0] for m in matrices], torch.float32) if int8 else torch.empty(0)
        self.vectors = packed(vectors, vector_sizes(config), torch.float32)
        # a tied head's rows are the token embeddings, unless panels interleave them: then the model's own table (an
        # int8 or int4 head has weights of its own: the quantizers untie it)
        head = getattr(model.lm_head, "weight", None)
        self.embedding = (
            self.matrices[-head.numel() :].view_as(head)
            if transformer.wte.weight is head and not self.panel_rows
            else transformer.wte.weight.detach().to(dtype).contiguous()
        )
        self.positions = self._position_table(model)
        flags = [config.norm == "rmsnorm", config.qk_norm, config.pos_encoding == "rope", config.embed_norm]
        self.shapes = [config.n_embd, config.mlp_hidden, config.vocab_size, config.n_layer, config.n_head]
        self.shapes += [config.n_kv_head, config.head_dim, *map(int, flags)]
        self.activation = ACTIVATIONS[config.activation]
        # the norms' epsilon, QK-norm's and the soft cap of the logits (0: none). An RMSNorm without an epsilon
        # takes float32's machine epsilon, bfloat16 inputs too (torch computes the norm in float32).
        q_norm = getattr(model.transformer.h[0].attn, "q_norm", None)
        qk_eps = q_norm.eps if q_norm is not None and q_norm.eps is not None else torch.finfo(torch.float32).eps
        self.constants = [transformer.ln_f.eps, qk_eps, config.logit_softcap or 0.0]
        self.versions = self._versions(model)
        self.kernel = extension().decode_step
        self.rows_kernel = extension().decode_rows
        self.prefill_kernel = extension().prefill

    @staticmethod
    def _int4_matrices(products: Sequence[Int4Linear]) -> torch.Tensor:
        """The int4 products' weights in decode_step.cpp's panels (int4_panels), back to back, each made as it is
        copied (never every product's panels at once besides the buffer)."""
        rows = extension().int4_panel_rows()
        sizes = [int4_panel_bytes(product, rows) for product in products]
        return packed((int4_panels(product, rows) for product in products), sizes, torch.uint8)

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

    @staticmethod
    def _versions(model: nn.Module) -> tuple[int, ...]:
        """The parameters' and buffers' (int8 weights') in-place version counters: they change when an optimizer or
        a load writes a weight."""
        return tuple(t._version for t in (*model.parameters(), *model.buffers()))

    @classmethod
    def for_model(cls, model: nn.Module, dtype: torch.dtype) -> NativeStep:
        """The step for `model` in `dtype`: packed once, and again only after its weights changed."""
        steps = PACKED_STEPS.setdefault(model, {})
        if dtype in steps and steps[dtype].versions == cls._versions(model):
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
        return self.kernel(
            self.matrices,
            self.scales,
            self.vectors,
            self.embedding,
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
        return self.rows_kernel(
            self.matrices,
            self.scales,
            self.vectors,
            self.embedding,
            self.positions[list(positions)],
            list(keys),
            list(values),
            self.shapes,
            list(tokens),
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
        self.prefill_kernel(
            self.matrices,
            self.scales,
            self.vectors,
            self.embedding,
            self.positions[start : start + length].repeat(len(contexts), 1),
            list(keys),
            list(values),
            self.shapes,
            [token for context in contexts for token in context],
            start,
            len(contexts),
            self.activation,
            self.constants,
        )


def main(argv: Sequence[str]) -> int:
    """`python -m gptkit.infer.native --build`: build the step for this CPU now (the set-up runs it); a machine
    without a compiler gets a note, not a failure: decode=auto then takes the other paths."""
    if list(argv) != ["--build"]:
        print("usage: python -m gptkit.infer.native --build", file=sys.stderr)
        return 2
    problem = build_problem(build=True)
    print(
        f"note: {problem}; decoding takes the other paths"
        if problem
        else f"native decoding step built in {build_directory()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
