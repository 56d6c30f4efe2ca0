"""benchmarks/bench_gguf_memory.py at its smallest: a one-layer file of SmolLM2-135M's width, written tensor by tensor,
read back as that model, and sampled from by sample.py in a process of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_gguf_memory
from gptkit.weights import load
from gptkit.weights.quantization import FileEmbedding, FileInt4Embedding, FileInt4Linear, Int8GroupedLinear
from helpers import run_main


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_smoke_run_writes_the_file_and_reports_the_sample_s_memory_and_speed(tmp_path: Path, capsys, qtype) -> None:
    out, file = tmp_path / "gguf_memory.json", tmp_path / "model.gguf"
    # Enough tokens that they reach the reader over a span of time even on a busy machine (tokens/s needs two reads)
    args = ["--shape=smollm2-135m", "--n_layer=1", "--new_tokens=64", f"--file={file}", f"--json_out={out}"]
    code, _, err = run_main(bench_gguf_memory.main, [*args, f"--qtype={qtype}"], capsys)
    assert code == 0, err
    (row,) = json.loads(out.read_text())["results"]
    # 576 wide, 9 heads (3 for keys and values) of 64, SwiGLU 1536, 49152 rows: 18 bytes a 32 weights (Q4_0's: a
    # float16 scale and 16 bytes of 4-bit codes), 34 (Q8_0's: the scale and 32 int8 codes)
    weights = 49152 * 576 + 576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536
    size = weights * (18 if qtype == "q4_0" else 34) // 32
    assert size < row["file_mb"] * 1e6 < size + 2e6  # plus metadata and the tokenizer
    assert row["n_layer"] == 1 and row["new_tokens"] == 64 and row["qtype"] == qtype
    assert row["peak_rss_mb"] > row["file_mb"] and row["tokens_per_s"] > 0
    model = load(str(file), tokenizer=False, keep_int4=True).model
    assert (model.config.n_layer, model.config.n_embd, model.config.vocab_size) == (1, 576, 49152)
    embedding, head = (FileInt4Embedding, FileInt4Linear) if qtype == "q4_0" else (FileEmbedding, Int8GroupedLinear)
    assert isinstance(model.transformer.wte, embedding) and isinstance(model.lm_head, head)
