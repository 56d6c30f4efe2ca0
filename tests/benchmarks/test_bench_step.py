"""bench_step.py: a compiled step's time split by kernel, each product's weight speed, and the rest of the step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_step
from helpers import run_main

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=64", "--vocab_size=500", "--tokens=8", "--bandwidth_mb=64"]


def test_rows_split_a_token_into_products_and_the_rest():
    """Events as torch.profiler reports them for 4 tokens of a 2-layer float32 model; expected values by hand."""
    events = {  # name: (calls, self ms, total ms)
        "graph_0_gemm_m1n192k64_cpp_fused_addmm_0": (8, 2.0, 2.0),  # c_attn, 2 layers x 4 tokens
        "graph_0_gemm_m1n500k64_cpp_fused_mm_1": (4, 1.0, 1.0),  # the head
        "graph_0_cpp_fused__softmax_2": (8, 0.4, 0.4),
        "## Call CompiledFxGraph abc ##": (4, 0.6, 4.0),  # 4.0 = 3.4 ms of kernels + 0.6 between them
        "Torch-Compiled Region: 0/0": (4, 0.1, 4.4),
        "TorchDynamo Cache Lookup": (4, 0.2, 0.2),
        "aten::topk": (4, 0.8, 0.8),
    }
    cfg = bench_step.StepBench(dtype="float32", tokens=4)
    rows = bench_step.step_rows(events, 0.0056, cfg, read_speed=2e9)  # 5.6 ms for the 4 tokens
    by_part = {row["part"]: row for row in rows}
    attn = by_part["product 64x192"]  # 192 x 64 float32 weights twice a token in 0.5 ms
    assert attn["calls"] == 2 and attn["ms"] == 0.5
    assert attn["gb_s"] == round(192 * 64 * 4 * 2 / 0.5e-3 / 1e9, 1) and attn["of_read_speed"] == round(0.19661 / 2, 3)
    head = by_part["product 64x500"]
    assert head["calls"] == 1 and head["ms"] == 0.25 and head["gb_s"] == round(500 * 64 * 4 / 0.25e-3 / 1e9, 1)
    assert by_part["other kernels (attention, norms)"]["ms"] == 0.1
    assert by_part["graph wrapper (between kernels)"]["ms"] == pytest.approx(0.15)
    assert by_part["entering the graph (guards, call)"]["ms"] == pytest.approx((4.4 - 4.0 + 0.2) / 4)
    assert by_part["outside the graph (inputs, sampling, engine)"]["ms"] == pytest.approx((5.6 - 4.4 - 0.2) / 4)
    assert sum(row["ms"] for row in rows) == pytest.approx(1.4)  # the parts make up the whole token
    assert sum(row["share"] for row in rows) == pytest.approx(1.0, abs=0.01)


def test_int8_block_products_fused_into_unnamed_kernels_get_one_row():
    events = {  # 2 tokens of a 2-layer int8 model of width 768: its 8 block products in two fused kernels
        "graph_0_cpp_fused__to_copy__weight_int8pack_mm_add_gelu_view_6": (8, 0.6, 0.6),
        "graph_0_cpp_fused__to_copy__weight_int8pack_mm_transpose_view_3": (8, 0.2, 0.2),
        "graph_0_gemm_m1n50257k768_cpp_fused_add_1": (2, 4.0, 4.0),
        "## Call CompiledFxGraph x ##": (2, 0.2, 5.0),
        "Torch-Compiled Region: 0/0": (2, 0.0, 5.0),
        "TorchDynamo Cache Lookup": (2, 0.0, 0.0),
    }
    cfg = bench_step.StepBench(dtype="int8", tokens=2, n_layer=2, n_embd=768)
    rows = {row["part"]: row for row in bench_step.step_rows(events, 0.006, cfg, read_speed=None)}
    blocks = rows["block products (int8 kernels)"]  # 12 n_embd^2 int8 weights a layer, 2 layers, in 0.4 ms a token
    assert blocks["calls"] == 8 and blocks["ms"] == 0.4 and blocks["gb_s"] == round(12 * 768**2 * 2 / 0.4e-3 / 1e9, 1)
    assert rows["product 768x50257"]["gb_s"] == round(50257 * 768 / 2e-3 / 1e9, 1) and "of_read_speed" not in blocks


def test_a_missing_profiler_event_is_one_clear_error():
    cfg = bench_step.StepBench(tokens=1)
    with pytest.raises(bench_step.UserError, match="no '## Call CompiledFxGraph' event"):
        bench_step.step_rows({"graph_0_cpp_fused_0": (1, 1.0, 1.0)}, 0.01, cfg, read_speed=None)


@pytest.mark.heavy  # an inductor compile (the fast tier would make the model, then skip)
def test_a_compiled_step_is_measured_kernel_by_kernel(tmp_path: Path, capsys):
    out = tmp_path / "step.json"
    code, printed, _ = run_main(bench_step.main, [*TINY, f"--json_out={out}"], capsys)
    assert code == 0 and "memory read speed:" in printed
    report = json.loads(out.read_text())
    assert report["benchmark"] == "step" and report["settings"]["tokens"] == 8
    rows = {row["part"]: row for row in report["results"]}
    # the layer's four products (in x out) and the head, each once a token (more layers: tests above)
    products = {"product 64x192": 1, "product 64x64": 1, "product 64x256": 1, "product 256x64": 1, "product 64x500": 1}
    for part, calls in products.items():
        row = rows[part]
        in_features, out_features = map(int, part.split()[1].split("x"))
        assert row["calls"] == calls and row["ms"] >= 0  # a fast product can round to 0.000 ms
        megabytes = in_features * out_features * 4 * calls / 1e6  # a token's float32 weights; ms is rounded to 3 places
        assert megabytes / (row["ms"] + 5e-4) - 0.05 <= row["gb_s"] <= megabytes / max(row["ms"] - 5e-4, 1e-9) + 0.05
    parts = [row for row in report["results"] if not row["part"].startswith("whole token")]
    assert len(parts) == len(products) + 4 and all(row["ms"] >= 0 for row in parts)
    whole = rows["whole token (profiled)"]
    assert sum(row["ms"] for row in parts) == pytest.approx(whole["ms"], abs=0.01)
    assert rows["whole token (not profiled)"]["ms"] > 0 and 0 < whole["of_bound"] < 1


def test_an_unknown_dtype_is_a_one_line_error(tmp_path: Path, capsys):
    code, _, err = run_main(bench_step.main, ["--dtype=float16", f"--json_out={tmp_path / 'x.json'}"], capsys)
    assert code == 2 and "dtype='float16' is not one of float32, bfloat16, int8" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "x.json").exists()
