"""The memory and speed of sampling from a quantized GGUF file: sample.py in a process of its own, on a file of
random Q4_0 (or Q8_0, Q4_K, Q6_K) blocks of a model's shape.

    python benchmarks/bench_gguf_memory.py [--shape=smollm2-1.7b --qtype=q4_0 --quantize=none --new_tokens=32]
        [--json_out=bench_results/gguf_memory.json]

The file holds every product and the token embedding (the head, when tied) in Q4_0 (or Q8_0, Q4_K, Q6_K), its norms in
F32, with export.py's metadata and a byte-level tokenizer (gptkit.weights.export_gguf). It is written tensor by tensor
with llama.cpp's gguf package, so a model of this shape never exists in float32 here; the blocks hold random codes,
with scales that give weights of about GPT-2's initial spread. Then `sample.py --init_from=FILE --max_new_tokens=N
--quantize=Q` runs as a child process (none: Q4_0's and Q8_0's own blocks, decoded by the native step where it is
built, the K-quants' float32 values; int4: Q4_K's products with their own codes, Q6_K's quantized to int4 as they are
read). Reported: the child's peak resident memory (os.wait4's ru_maxrss: the whole process, runtime and tokenizer
included), the seconds until the prompt is echoed (the load) and until the first new token (the packing of the weights
and the prompt), and tokens per second from the first new token to the last, as the child streams them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data import bpe
from gptkit.data import tokenizer as tok
from gptkit.model import GPTConfig
from gptkit.weights.export_common import vocabulary_of
from gptkit.weights.export_gguf import add_hyperparameters, add_tokenizer, architecture_of, gguf_vocabulary, tensor_name
from measure import MODEL_SHAPES, print_table, run_benchmark

REPO = Path(__file__).resolve().parent.parent
SHAPES = {name: shape for name, shape in MODEL_SHAPES.items() if shape.get("pos_encoding") == "rope"}  # Llama family
# A block's weights and bytes: Q4_0's 32 a float16 scale d, then 16 bytes of 4-bit codes (weight = d * (code - 8));
# Q8_0's 32 int8 codes after d (weight = d * code); Q6_K's 256 their 6-bit codes, an int8 scale per 16 and d last
# (weight = d * scale * (code - 32)).
BLOCK_WEIGHTS = {"q4_0": 32, "q8_0": 32, "q4_k": 256, "q6_k": 256}
BLOCK_BYTES = {"q4_0": 18, "q8_0": 34, "q4_k": 144, "q6_k": 210}
# d: random codes (and the K-quants' random scales) give weights a spread of about 0.02, GPT-2's initial one
SCALES = {"q4_0": 0.02 / 4.6, "q8_0": 0.02 / 73.3, "q4_k": 0.02 / 170, "q6_k": 0.02 / 1370}
FILE_TYPES = {"q4_k": "MOSTLY_Q4_K_S"}  # general.file_type where it is not MOSTLY_ and the type (all Q4_K: Q4_K_S's)


@dataclass(kw_only=True)
class GGUFMemoryBench:
    shape: str = setting("smollm2-1.7b", "the model's shape (random blocks)", choices=tuple(SHAPES))
    qtype: str = setting("q4_0", "the matrices' GGUF type", choices=tuple(BLOCK_BYTES))
    quantize: str = setting("none", "sample.py's --quantize", choices=("none", "int4"))
    n_layer: int | None = setting(None, "layers, instead of the shape's (a smaller file of the same width)")
    new_tokens: int = setting(32, "tokens sample.py generates (--max_new_tokens)", rule="positive")
    prompt: str = setting("Once upon a time", "the prompt (--start)")
    decode: str = setting("auto", "sample.py's --decode")
    threads: int = setting(0, "threads of the sampling process (OMP_NUM_THREADS; 0: torch's default)")
    file: str = setting(
        "", "where to write the GGUF file, kept ('' = a temporary one); an existing one is read as it is"
    )
    json_out: str = setting("bench_results/gguf_memory.json", "where to write the JSON results ('' = nowhere)")


def byte_tokenizer() -> tok.BpeTokenizer:
    """A byte-level BPE of the 256 bytes and <|endoftext|> (the file's other rows are unused tokens)."""
    ranks = {bytes([b]): b for b in range(256)}
    record = bpe.make_record("bytes", bpe.GPT4_PATTERN, {tok.END_OF_TEXT: 256}, bpe.ranks_to_text(ranks))
    return tok.BpeTokenizer(record)


def file_tensors(config: GPTConfig, architecture: str) -> dict[str, tuple[int, ...]]:
    """llama.cpp's tensors of a Llama-family model: name -> shape, (rows, columns) for a matrix."""
    import gguf

    T, C, D = gguf.MODEL_TENSOR, config.n_embd, config.head_dim
    q, kv = config.n_head * D, config.n_kv_head * D
    tensors = {tensor_name(T.TOKEN_EMBD): (config.vocab_size, C), tensor_name(T.OUTPUT_NORM): (C,)}
    if not config.tie_embeddings:
        tensors[tensor_name(T.OUTPUT)] = (config.vocab_size, C)
    for layer in range(config.n_layer):
        matrices = {T.ATTN_Q: (q, C), T.ATTN_K: (kv, C), T.ATTN_V: (kv, C), T.ATTN_OUT: (C, q)}
        matrices |= {T.FFN_GATE: (config.mlp_hidden, C), T.FFN_UP: (config.mlp_hidden, C)}
        matrices |= {T.FFN_DOWN: (C, config.mlp_hidden), T.ATTN_NORM: (C,), T.FFN_NORM: (C,)}
        if architecture == "qwen3":
            matrices |= {T.ATTN_Q_NORM: (D,), T.ATTN_K_NORM: (D,)}
        tensors |= {tensor_name(kind, block=layer): shape for kind, shape in matrices.items()}
    return tensors


def random_blocks(qtype: str, rows: int, columns: int, generator: np.random.Generator) -> np.ndarray:
    """(rows, bytes a row) uint8: blocks of random codes of `qtype`, each with the scale SCALES[qtype]."""
    shape = (rows, columns // BLOCK_WEIGHTS[qtype], BLOCK_BYTES[qtype])
    if qtype == "q8_0":  # int8 codes in -127 .. 127, as ggml's quantizer makes them
        blocks = generator.integers(-127, 128, size=shape, dtype=np.int8).view(np.uint8)
    else:
        blocks = generator.integers(0, 256, size=shape, dtype=np.uint8)
    scale = np.array([SCALES[qtype]], np.float16).view(np.uint8)
    if qtype == "q6_k":
        blocks[..., -2:] = scale  # Q6_K's d closes the block
    else:
        blocks[..., :2] = scale
    if qtype == "q4_k":
        blocks[..., 2:4] = scale  # Q4_K's dmin, beside d
    return blocks.reshape(rows, -1)


def write_blocks_file(path: Path, config: GPTConfig, qtype: str) -> None:
    """A GGUF file of `config`'s shape, its matrices random Q4_0 or Q8_0 blocks and its norms ones, written a tensor
    at a time (llama.cpp's gguf package: the tensors' table first, then each tensor's data as it is made)."""
    import gguf

    architecture = architecture_of(config)
    block = BLOCK_WEIGHTS[qtype]
    if config.n_embd % block or config.mlp_hidden % block or config.n_head * config.head_dim % block:
        raise UserError(f"{qtype} needs rows of whole {block}-weight blocks: every width a multiple of {block}")
    ggml_type = gguf.GGMLQuantizationType[qtype.upper()]
    tensors = file_tensors(config, architecture)
    partial_path = path.with_name(path.name + ".partial")  # renamed when whole
    writer = gguf.GGUFWriter(str(partial_path), arch=architecture)
    writer.add_name(path.stem)
    add_hyperparameters(writer, config, architecture)
    writer.add_file_type(gguf.LlamaFileType[FILE_TYPES.get(qtype, f"MOSTLY_{qtype.upper()}")])
    add_tokenizer(writer, gguf_vocabulary(vocabulary_of(byte_tokenizer())), config.vocab_size)
    for name, shape in tensors.items():
        if len(shape) == 2:
            row_bytes = shape[1] // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]
            writer.add_tensor_info(name, (shape[0], row_bytes), np.uint8, shape[0] * row_bytes, ggml_type)
        else:
            writer.add_tensor_info(name, shape, np.float32, shape[0] * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    generator = np.random.default_rng(0)
    for shape in tensors.values():
        matrix = len(shape) == 2
        writer.write_tensor_data(random_blocks(qtype, *shape, generator) if matrix else np.ones(shape, np.float32))
    writer.close()
    os.replace(partial_path, path)


def sample_in_child(cfg: GGUFMemoryBench, path: Path) -> dict:
    """Run sample.py on the file in a child process: its peak resident memory and the times of what it streams."""
    command = [sys.executable, str(REPO / "sample.py"), f"--init_from={path}", f"--start={cfg.prompt}"]
    command += [f"--max_new_tokens={cfg.new_tokens}", "--stop_at_eot=False", "--device=cpu", f"--decode={cfg.decode}"]
    command.append(f"--quantize={cfg.quantize}")
    environment = {**os.environ, **({"OMP_NUM_THREADS": str(cfg.threads)} if cfg.threads else {})}
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    prompt_bytes, received, times = len(cfg.prompt.encode("utf-8")), 0, []
    while chunk := os.read(child.stdout.fileno(), 1 << 16):
        received += len(chunk)
        times.append((received, time.perf_counter() - start))
    error = child.stderr.read().decode("utf-8", "replace")
    _, status, usage = os.wait4(child.pid, 0)  # this child's own peak, not another's
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise UserError(f"sample.py failed (exit code {child.returncode}): {error.strip().splitlines()[-1:]}")
    echoed = next(seconds for count, seconds in times if count >= prompt_bytes)
    generated = [seconds for count, seconds in times if count > prompt_bytes]
    first, last = (generated[0], generated[-1]) if generated else (echoed, echoed)
    return {
        "peak_rss_mb": round(usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024) / 1e6, 1),
        "load_s": round(echoed, 2),
        "first_token_s": round(first - echoed, 2),
        "tokens_per_s": round((cfg.new_tokens - 1) / (last - first), 2) if last > first else None,
        "total_s": round(time.perf_counter() - start, 2),
    }


def bench_gguf_memory(cfg: GGUFMemoryBench) -> list[dict]:
    """Peak resident memory and tokens/s of sample.py on a random Q4_0 (or Q8_0) file of the shape."""
    shape = {**SHAPES[cfg.shape], **({"n_layer": cfg.n_layer} if cfg.n_layer else {})}
    config = GPTConfig(**shape)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(cfg.file or Path(directory) / f"{cfg.shape}-{cfg.qtype}.gguf")
        if not path.exists():
            begin = time.perf_counter()
            write_blocks_file(path, config, cfg.qtype)
            print(f"wrote {path} in {time.perf_counter() - begin:.1f} s", flush=True)
        row = {"shape": cfg.shape, "qtype": cfg.qtype, "quantize": cfg.quantize, "n_layer": config.n_layer}
        row["file_mb"] = round(path.stat().st_size / 1e6, 1)
        row |= {"new_tokens": cfg.new_tokens, **sample_in_child(cfg, path)}
    row["x_file"] = round(row["peak_rss_mb"] / row["file_mb"], 2)
    columns = ["shape", "qtype", "quantize", "n_layer", "file_mb", "peak_rss_mb", "x_file", "load_s", "first_token_s"]
    columns.append("tokens_per_s")
    print_table([row], columns)
    return [row]


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        GGUFMemoryBench, argv, prog="bench_gguf_memory.py", description=bench_gguf_memory.__doc__ or ""
    )
    return run_benchmark(cfg, bench_gguf_memory, "gguf_memory")


if __name__ == "__main__":
    run_cli(main)
