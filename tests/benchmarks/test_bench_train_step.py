"""bench_train_step.py: a training step's kernels grouped into the table's parts, and the script's smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench_train_step
from helpers import run_main

SMOKE = ["--device=cpu", "--smoke=True", "--compile=False", "--dtype=float32", "--warmup=1", "--steps=2"]


@pytest.mark.parametrize(
    "name, group",
    [  # kernel names as torch.profiler reported them for GPT-2 124M on an H200 (torch 2.11, cuDNN SDPA)
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matrix products"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("triton_red_fused__log_softmax__to_copy__unsafe_view_18", "fused by inductor (norms, GELU, adds, loss)"),
        (
            "void at::native::vectorized_elementwise_kernel<8, at::native::FillFunctor<c10::BFloat16>>",
            "other kernels (copies, casts, reductions)",
        ),
        ("aten::addmm", "matrix products"),  # the CPU's operators, in the smoke run
    ],
)
def test_kernels_fall_into_their_groups(name: str, group: str) -> None:
    assert bench_train_step.kernel_group(name) == group


def test_rows_give_each_group_and_the_idle_time_per_step() -> None:
    kernels = {  # name: (calls, self ms) over 2 profiled steps of 40 ms each (measured without the profiler)
        "nvjet_sm90_gemm_a": (10, 32.0),
        "cutlass_gemm_b": (2, 8.0),
        "cudnn_sdpa_flash_fprop": (4, 8.0),
        "triton_poi_fused_gelu_0": (20, 10.0),
        "multi_tensor_apply_kernel": (2, 2.0),
        "void at::native::vectorized_elementwise_kernel<FillFunctor>": (4, 4.0),
    }
    rows = bench_train_step.step_rows(kernels, steps=2, step_ms=40.0)
    groups = {row["part"]: row for row in rows if not row["part"].startswith("  ")}
    assert next(iter(groups)) == "matrix products"  # the largest first
    assert groups["matrix products"] == {"part": "matrix products", "calls": 6, "ms": 20.0, "share": 0.5}
    assert groups["attention"]["ms"] == 4.0 and groups["attention"]["share"] == 0.1
    assert groups["fused by inductor (norms, GELU, adds, loss)"]["calls"] == 10
    assert groups["optimizer"]["ms"] == 1.0 and groups["other kernels (copies, casts, reductions)"]["ms"] == 2.0
    idle = groups["device idle (no kernel running)"]  # 40 ms a step less 32 ms of kernels
    assert idle["ms"] == 8.0 and idle["share"] == 0.2
    top = [row for row in rows if row["part"].startswith("  ")]
    assert [row["part"].strip() for row in top[:2]] == ["nvjet_sm90_gemm_a", "triton_poi_fused_gelu_0"]
    assert top[0]["calls"] == 5 and top[0]["ms"] == 16.0 and top[0]["group"] == "matrix products"


def test_kernels_longer_than_the_step_leave_no_negative_idle_time() -> None:
    rows = bench_train_step.step_rows({"nvjet_gemm": (1, 12.0)}, steps=1, step_ms=10.0)
    assert rows[1] == {"part": "device idle (no kernel running)", "ms": 0.0, "share": 0.0}


def test_smoke_run_profiles_a_training_step(tmp_path: Path, capsys) -> None:
    out = tmp_path / "train_step.json"
    code, printed, err = run_main(bench_train_step.main, [*SMOKE, f"--json_out={out}"], capsys)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert report["benchmark"] == "train_step" and report["settings"]["steps"] == 2
    whole, *rows = report["results"]
    assert whole["part"] == "whole step (not profiled)" and whole["ms"] > 0
    assert whole["tokens_per_s"] == pytest.approx(2 * 64 / (whole["ms"] / 1e3), abs=1)  # 2 rows of 64 tokens a step
    groups = {row["part"]: row for row in rows if not row["part"].startswith("  ")}
    assert groups["matrix products"]["ms"] > 0 and groups["attention"]["ms"] > 0 and groups["optimizer"]["ms"] > 0
    assert any(row["part"].strip() == "aten::mm" for row in rows)  # the backward's products, by name
    assert "tokens/s" in printed and whole["mfu_datasheet"] is None  # no datasheet peak for a CPU


def test_refuses_a_cpu_without_smoke(capsys) -> None:
    code, _, err = run_main(bench_train_step.main, ["--device=cpu"], capsys)
    assert code == 2 and "not a CUDA GPU; use --smoke=True" in err
