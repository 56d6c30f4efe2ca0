"""benchmarks/bench_gguf_memory.py at its smallest: a one-layer file of SmolLM2-135M's width, written tensor by tensor,
read back as that model, and sampled from by sample.py in a process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_gguf_memory
from gptkit.weights import load
from gptkit.weights.quantization import FileEmbedding, FileInt4Embedding, FileInt4Linear, FileLinear, Int8GroupedLinear
from helpers import assert_one_line_error, run_main

# (shape, --qtype, --quantize): the file's own 4-bit and 8-bit blocks, Q4_K's codes under int4 and Q6_K's quantized to
# int4 as they are read (K-quants need rows of whole 256-weight blocks: SmolLM2-1.7B's width)
RUNS = [("smollm2-135m", "q4_0", "none"), ("smollm2-135m", "q8_0", "none")]
RUNS += [("smollm2-1.7b", "q4_k", "int4"), ("smollm2-1.7b", "q6_k", "int4")]
# 32 weights of Q4_0 take 18 bytes (a float16 scale, 16 bytes of 4-bit codes), of Q8_0 34 (the scale, 32 int8 codes),
# 256 of Q4_K 144 (float16 d and dmin, 12 bytes of 6-bit scales and mins, 128 of 4-bit codes), of Q6_K 210 (6-bit
# codes, 16 int8 scales and the float16 scale)
BYTES_A_WEIGHT = {"q4_0": 18 / 32, "q8_0": 34 / 32, "q4_k": 144 / 256, "q6_k": 210 / 256}


def weights_of(width: int, kv: int, hidden: int) -> int:
    """A one-layer Llama-family model's weights: the tied 49152-row embedding, q, k, v, o and the SwiGLU MLP."""
    return 49152 * width + width * width * 2 + width * kv * 2 + 3 * width * hidden


@pytest.mark.parametrize(("shape", "qtype", "quantize"), RUNS)
def test_smoke_run_writes_the_file_and_reports_the_sample_s_memory_and_speed(
    tmp_path: Path, capsys, shape, qtype, quantize
) -> None:
    out, file = tmp_path / "gguf_memory.json", tmp_path / "model.gguf"
    # Enough tokens that they reach the reader over a span of time even on a busy machine (tokens/s needs two reads)
    args = [f"--shape={shape}", "--n_layer=1", "--new_tokens=64", f"--file={file}", f"--json_out={out}"]
    code, _, err = run_main(bench_gguf_memory.main, [*args, f"--qtype={qtype}", f"--quantize={quantize}"], capsys)
    assert code == 0, err
    (row,) = json.loads(out.read_text())["results"]
    # SmolLM2-135M: 576 wide, 9 heads (3 for keys and values) of 64, SwiGLU 1536; 1.7B: 2048, 32 heads of 64, 8192
    weights = weights_of(576, 192, 1536) if shape == "smollm2-135m" else weights_of(2048, 2048, 8192)
    size = int(weights * BYTES_A_WEIGHT[qtype])
    assert size < row["file_mb"] * 1e6 < size + 2e6  # plus metadata and the tokenizer
    assert row["n_layer"] == 1 and row["new_tokens"] == 64 and (row["qtype"], row["quantize"]) == (qtype, quantize)
    assert row["peak_rss_mb"] > row["file_mb"] and row["tokens_per_s"] > 0
    model = load(str(file), tokenizer=False, keep_int4=True).model
    assert (model.config.n_layer, model.config.vocab_size) == (1, 49152)
    kinds = {"q4_0": (FileInt4Embedding, FileInt4Linear), "q8_0": (FileEmbedding, Int8GroupedLinear)}
    embedding, product = kinds.get(qtype, (FileEmbedding, FileLinear))
    assert isinstance(model.transformer.wte, embedding) and isinstance(model.transformer.h[0].mlp.c_proj, product)


def test_a_width_that_is_not_whole_blocks_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    args = ["--shape=smollm2-135m", "--qtype=q6_k", f"--json_out={tmp_path / 'x.json'}"]
    code, _, err = run_main(bench_gguf_memory.main, args, capsys)
    assert_one_line_error(code, err, "multiple of 256")
    assert not (tmp_path / "x.json").exists()
