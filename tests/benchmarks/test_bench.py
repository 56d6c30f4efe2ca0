"""bench.py: each benchmark runs its paths, derives its ratios from the measured rows and writes JSON."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
from gptkit.infer import generate
from gptkit.infer.native import PACKED_STEPS, extension
from gptkit.infer.onednn import onednn_linear_available
from gptkit.model import GPT, GPTConfig
from gptkit.weights.quantization import quantize_int8
from helpers import int8_reference, make_char_data, run_main, scripts_in_process, step_with_dynamos_eager_backend

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "benchmarks/bench.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


def printed_read_speed(out: str) -> float:
    """The GB/s of the benchmark's "memory read speed: ... GB/s" line."""
    return float(out.split("memory read speed: ")[1].split(" GB/s")[0])


@pytest.mark.heavy
def test_linear_bench_measures_every_decoding_weight(tmp_path: Path, capsys):
    out = tmp_path / "linear.json"
    assert (
        bench.main(
            [
                "linear",
                "--batch_sizes=1",
                "--batch_sizes=2",
                "--repeats=1",
                "--weight_mb=2",
                "--bandwidth_mb=64",
                f"--json_out={out}",
            ]
        )
        == 0
    )
    read_speed = printed_read_speed(capsys.readouterr().out)
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["weight"], r["batch"]) for r in rows] == [(w, b) for w in bench.GPT2_DECODING_WEIGHTS for b in (1, 2)]
    for row in rows:
        assert row["F.linear"] > 0 and row["transposed"] > 0 and row["int8"] > 0
        assert (row["optimized"] > 0) if onednn_linear_available() else row["optimized"] is None
        fastest = max(row[v] or 0 for v in ("F.linear", "transposed", "optimized"))
        assert row["compiled"] is None and row["float32_of_read"] == pytest.approx(fastest / read_speed, abs=1e-3)
    assert report["settings"]["weight_mb"] == 2 and report["machine"]["cpu_count"] >= 1


def test_linear_bench_measures_the_chosen_weights_and_refuses_unknown_ones(tmp_path: Path, capsys) -> None:
    out = tmp_path / "linear.json"
    args = ["linear", "--batch_sizes=1", "--repeats=1", "--weight_mb=1", "--weights=attn.c_proj", "--bandwidth_mb=0"]
    code, _, err = run_main(bench.main, [*args, f"--json_out={out}"], capsys)
    assert code == 0, err
    (row,) = json.loads(out.read_text())["results"]
    assert row["weight"] == "attn.c_proj" and row["compiled"] is None and row["float32_of_read"] is None
    assert row["int8_compiled"] is None and row["int8"] > 0
    code, _, err = run_main(bench.main, ["linear", "--weights=attn.c_qkv", "--json_out="], capsys)
    assert code == 2 and "unknown --weights ['attn.c_qkv']" in err


def test_compiled_gb_s_counts_every_copy_s_weight_bytes(monkeypatch) -> None:
    """int8 layers through inductor, as `bench.py linear --compiled=True` measures them: GB/s is the bytes of all
    the copies over one pass's time (the timing is fixed here, so the figure is exact), and the compiled pass gives
    every copy's own product. (Inductor's float32 kernels under the same options: tests/infer/test_engine.py.)"""
    torch.manual_seed(0)
    layers = list(quantize_int8(torch.nn.Sequential(*(torch.nn.Linear(64, 32) for _ in range(3)))))
    timed = []
    monkeypatch.setattr(bench, "median_pass_seconds", lambda fns, *args: timed.append((fns, args)) or 0.002)
    assert bench.compiled_gb_s(layers, 2, 64 * 32, repeats=4) == round(3 * 64 * 32 / 0.002 / 1e9, 1)
    ((compiled,), (batch, in_features, repeats)) = timed[0]
    assert (batch, in_features, repeats) == (2, 64, 4)
    x = torch.randn(2, 1, 64)
    with torch.inference_mode():
        outputs = compiled(x)
    assert len(outputs) == len(layers) == 3
    for got, layer in zip(outputs, layers):
        torch.testing.assert_close(got, int8_reference(layer, x), rtol=0.02, atol=0.02)


@pytest.mark.heavy
def test_sample_bench_compares_every_path_in_one_run(tmp_path: Path):
    out = tmp_path / "sample.json"
    assert (
        bench.main(
            [
                "sample",
                "--model=tiny",
                "--batch_sizes=2",
                "--repeats=1",
                "--new_tokens=3",
                "--uncached_new_tokens=2",
                "--bandwidth_mb=0",
                "--paths=auto",
                "--paths=onednn",
                "--paths=eager",
                "--paths=uncached",
                "--paths=hf",
                f"--json_out={out}",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    rows = {row["path"]: row for row in report["results"]}
    assert set(rows) == {"auto", "onednn", "eager", "uncached", "hf"} and report["settings"]["model"] == "tiny"
    assert rows["uncached"]["new_tokens"] == 2 and rows["eager"]["new_tokens"] == 3
    for row in rows.values():  # tokens/s of the measured seconds; the JSON rounds both (to 1 ms and 0.1 tokens/s)
        tokens, fastest, slowest = 2 * row["new_tokens"], max(row["seconds"] - 5e-4, 1e-6), row["seconds"] + 5e-4
        assert row["batch"] == 2 and tokens / slowest - 0.05 <= row["tokens_per_s"] <= tokens / fastest + 0.05
    eager = rows["eager"]
    assert eager["x_hf"] == pytest.approx(eager["tokens_per_s"] / rows["hf"]["tokens_per_s"], abs=0.01)
    assert eager["x_uncached"] == pytest.approx(eager["tokens_per_s"] / rows["uncached"]["tokens_per_s"], abs=0.01)
    assert eager["x_auto"] == pytest.approx(eager["tokens_per_s"] / rows["auto"]["tokens_per_s"], abs=0.01)
    assert rows["auto"]["x_hf"] == pytest.approx(rows["auto"]["tokens_per_s"] / rows["hf"]["tokens_per_s"], abs=0.01)
    assert "x_hf" not in rows["hf"] and "x_uncached" not in rows["uncached"] and "x_auto" not in rows["auto"]


def test_sample_bench_puts_batch_one_against_the_memory_bound(capsys, monkeypatch):
    # The read speed is measured before each round and after every run: a run is set against the mean of the two
    # measures around it (round r, path i: measures 8r + i and 8r + i + 1 with seven paths), of_bound is the median
    # of the runs' fractions of their own bound. The compiled paths' step goes through dynamo without inductor: the
    # arithmetic is what is tested here, and inductor's kernels are tested in tests/infer and tests/weights.
    step_with_dynamos_eager_backend(monkeypatch)
    measures = [20e9 + 1e9 * k for k in range(24)]
    remaining = iter(measures)
    monkeypatch.setattr(bench, "read_bandwidth", lambda device, megabytes: next(remaining))
    monkeypatch.setattr(bench, "matmul_flop_s", lambda config, batch: 1e15)  # a compute leg far below the memory's
    paths = ["auto", "eager_bf16", "compiled_bf16", "native_bf16", "int8", "int8_compiled", "no_products"]
    settings = bench.SampleBench(batch_sizes=[1], repeats=3, new_tokens=3, bandwidth_mb=64, json_out="", paths=paths)
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 1000, "bias": True}
    rows = {row["path"]: row for row in bench.bench_sample(settings, GPTConfig(**shape))}
    assert next(remaining, None) is None
    speeds = {
        path: [(measures[8 * r + i] + measures[8 * r + i + 1]) / 2 for r in range(3)] for i, path in enumerate(paths)
    }
    every_run = [speed for runs in speeds.values() for speed in runs]
    assert printed_read_speed(capsys.readouterr().out) == pytest.approx(statistics.median(every_run) / 1e9, abs=1e-3)
    # Read per step: 2 blocks (qkv, proj, fc, proj with biases, two layer norms), the final norm, the tied head.
    block = 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64 + 4 * 64
    weights = 2 * block + 2 * 64 + 1000 * 64
    weight_bytes_of = {
        "auto": 4,
        "eager_bf16": 2,
        "compiled_bf16": 2,
        "native_bf16": 2,
        "int8": 1,
        "int8_compiled": 1,
    }
    for path, weight_bytes in weight_bytes_of.items():
        assert [run["read_gb_s"] for run in rows[path]["runs"]] == pytest.approx([s / 1e9 for s in speeds[path]])
        median_speed = sorted(speeds[path])[1]
        assert rows[path]["bound_tokens_per_s"] == pytest.approx(median_speed / (weights * weight_bytes), rel=0.01)
        fractions = sorted(
            3 / run["seconds"] / (speed / (weights * weight_bytes))
            for run, speed in zip(rows[path]["runs"], speeds[path])
        )
        assert rows[path]["of_bound"] == pytest.approx(fractions[1], rel=0.01, abs=6e-4)
        if path in ("auto", "compiled_bf16", "native_bf16", "int8_compiled"):  # a fused step: no products' share
            assert "products_ms" not in rows[path]
            continue
        # the products' share of a step: the path's time per token less the step without products
        products = 1 / rows[path]["tokens_per_s"] - 1 / rows["no_products"]["tokens_per_s"]
        if products > 0:  # a tiny model's products can cost less than timing noise
            assert rows[path]["products_ms"] == pytest.approx(products * 1e3, rel=0.02, abs=0.01)
            assert rows[path]["products_gb_s"] == pytest.approx(
                weights * weight_bytes / products / 1e9, rel=0.05, abs=0.1
            )
        else:
            assert "products_ms" not in rows[path]
    assert "bound_tokens_per_s" not in rows["no_products"]


def test_each_batch_is_set_against_the_roofline_of_its_step(monkeypatch):
    """A step of B rows reads every weight once and multiplies it with B rows: its bound is B over the longer of the
    read (weight bytes / read speed) and the products (2 B weights FLOPs / the matmul rate measured for B rows)."""
    monkeypatch.setattr(bench, "read_bandwidth", lambda device, megabytes: 10e9)
    rates = {1: 1e12, 4: 1e11, 16: 1e9}  # FLOP/s: batch 1 and 4 are bound by the memory, 16 by the products
    monkeypatch.setattr(bench, "matmul_flop_s", lambda config, batch: rates[batch])
    settings = bench.SampleBench(
        batch_sizes=[1, 4, 16], repeats=2, new_tokens=3, bandwidth_mb=64, json_out="", paths=["auto", "native_int8"]
    )
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 1000, "bias": True}
    rows = {(row["path"], row["batch"]): row for row in bench.bench_sample(settings, GPTConfig(**shape))}
    weights = GPT(GPTConfig(**shape)).get_num_params(non_embedding=True)
    for (path, batch), row in rows.items():
        read_s = weights * (1 if path == "native_int8" else 4) / 10e9
        compute_s = 2 * batch * weights / rates[batch]
        assert row["bound_tokens_per_s"] == pytest.approx(batch / max(read_s, compute_s), rel=0.01)
        assert row["bound_by"] == ("memory" if read_s >= compute_s else "compute")
        fractions = sorted(3 * batch / run["seconds"] * max(read_s, compute_s) / batch for run in row["runs"])
        assert row["of_bound"] == pytest.approx(statistics.median(fractions), rel=0.01, abs=6e-4)
    assert [rows[("auto", batch)]["bound_by"] for batch in (1, 4, 16)] == ["memory", "memory", "compute"]


LLAMA_SHAPE = dict(
    n_embd=32,
    n_head=4,
    n_kv_head=2,
    head_dim=16,
    activation="swiglu",
    mlp_hidden=48,
    pos_encoding="rope",
    norm="rmsnorm",
)


def test_a_steps_matrix_shapes_are_the_weights_it_reads():
    for shape in ({"n_embd": 32, "n_head": 2}, {"n_embd": 48, "n_head": 3}, LLAMA_SHAPE):
        model = GPT(GPTConfig(n_layer=3, block_size=16, vocab_size=50, **shape))
        shapes = bench.step_matrix_shapes(model.config)
        assert sum(out * columns for out, columns in shapes) == sum(w.numel() for w in bench.step_weights(model))
        assert len(shapes) == 3 * 4 + 1


def test_the_hf_path_of_a_llama_shaped_model_is_transformers_class_with_our_logits():
    """--paths=hf on a rotary model: the transformers class that holds it (here Llama: RMSNorm, SwiGLU, grouped-query
    attention, heads wider than n_embd / n_head) with our weights, giving our logits."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, block_size=16, vocab_size=50, bias=False, **LLAMA_SHAPE)).eval()
    hf = bench.hf_model_of(model)
    assert type(hf).__name__ == "LlamaForCausalLM"
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx, idx)[0], rtol=1e-4, atol=1e-5)


def test_the_matmul_rate_is_positive_and_grows_with_the_rows():
    """More rows a product do more work per weight loaded from the caches: 16 rows multiply faster than one."""
    config = GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16, vocab_size=200)
    one, sixteen = bench.matmul_flop_s(config, 1), bench.matmul_flop_s(config, 16)
    assert 0 < one < sixteen


def test_step_weights_are_the_matrices_a_step_reads_and_a_read_pass_sums_each_once(monkeypatch):
    for encoding in ("learned", "rope"):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50, pos_encoding=encoding))
        weights = bench.step_weights(model)
        # 2 blocks' qkv, proj, fc and proj matrices, and the head (tied to the token table) once
        assert len(weights) == 2 * 4 + 1
        assert sum(w.numel() for w in weights) == 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32) + 50 * 32
    summed = []
    monkeypatch.setattr(torch, "sum", lambda tensor: summed.append(id(tensor)))
    weights = [torch.ones(3), torch.ones(2, 2)]
    bench.read_every_weight(weights, passes=3)
    assert summed == [id(weights[0]), id(weights[1])] * 3


def test_weights_read_paths_are_set_against_the_bound_without_products(monkeypatch):
    monkeypatch.setattr(bench, "read_bandwidth", lambda device, megabytes: 10e9)
    monkeypatch.setattr(bench, "matmul_flop_s", lambda config, batch: 1e15)
    paths = ["weights_read", "weights_read_bf16", "native_read", "auto", "no_products"]
    settings = bench.SampleBench(batch_sizes=[1], repeats=2, new_tokens=5, bandwidth_mb=64, json_out="", paths=paths)
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 64, "vocab_size": 1000, "bias": True}
    rows = {row["path"]: row for row in bench.bench_sample(settings, GPTConfig(**shape))}
    weights = GPT(GPTConfig(**shape)).get_num_params(non_embedding=True)
    for path, weight_bytes in (("weights_read", 4), ("weights_read_bf16", 2), ("native_read", 4)):
        fractions = sorted(5 / run["seconds"] / (10e9 / (weights * weight_bytes)) for run in rows[path]["runs"])
        assert rows[path]["of_bound"] == pytest.approx(statistics.median(fractions), rel=0.01, abs=6e-4)
        assert rows[path]["bound_tokens_per_s"] == pytest.approx(10e9 / (weights * weight_bytes), rel=0.01)
        assert "products_ms" not in rows[path] and "x_auto" not in rows[path]
    assert "x_auto" not in rows["auto"] and rows["auto"]["of_bound"] > 0


def test_native_read_sums_the_buffer_the_native_path_reads(monkeypatch):
    shape = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 50}
    prompt = torch.zeros(1, 4, dtype=torch.long)
    models = bench.sample_models(GPTConfig(**shape), ["native", "native_read"], torch.device("cpu"))
    bench.run_sample_path("native", models, prompt, top_k=10, new_tokens=3)  # the engine packs the native step
    packed = PACKED_STEPS[models["native"]][torch.float32].matrices
    # every block's qkv, proj, fc and fc_proj matrices and the head, in float32, then a panel's rows of padding
    padding = (extension().float32_blocks() or [0])[0]
    weights = 2 * (32 * 96 + 32 * 32 + 32 * 128 + 128 * 32) + 50 * 32
    assert packed.dtype == torch.float32 and packed.numel() == weights + padding
    summed = []
    monkeypatch.setattr(torch, "sum", lambda tensor: summed.append(tensor.data_ptr()))
    bench.run_sample_path("native_read", models, prompt, top_k=10, new_tokens=3)
    assert summed == [packed.data_ptr()] * 3
    alone = bench.sample_models(GPTConfig(**shape), ["native_read"], torch.device("cpu"))["native_read"]
    assert alone is not models["native"] and next(alone.parameters()).dtype == torch.float32


def test_no_products_path_skips_every_product_but_keeps_the_step():
    model = bench.without_products(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50)))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert sum(isinstance(m, bench.SkippedProduct) for m in model.modules()) == 2 * 4 + 1  # qkv, proj, fc, proj; head
    with torch.inference_mode():
        logits, _ = model(torch.zeros(1, 5, dtype=torch.long))
        out = generate(model, torch.zeros(1, 3, dtype=torch.long), 4, top_k=10, decode="eager")
    assert logits.shape == (1, 1, 50) and not logits.any() and out.shape == (1, 7)


def fake_nanogpt(directory: Path) -> Path:
    """A stand-in for a nanoGPT checkout: its train.py records the arguments it got and prints nanoGPT's lines."""
    directory.mkdir()
    (directory / "train.py").write_text(
        "import json, sys, time\n"
        "open('argv.json', 'w').write(json.dumps(sys.argv[1:]))\n"
        "time.sleep(0.2)\n"
        "print('step 0: train loss 4.1773, val loss 4.1804')\n"
        "print('iter 0: loss 4.1858, time 120.00ms, mfu -100.00%')\n"
        "print('step 2000: train loss 1.7648, val loss 1.8857')\n"
    )
    return directory


@pytest.mark.heavy
def test_quality_bench_reports_the_whole_split_loss_of_each_run_and_the_nanogpt_ratio(
    tmp_path: Path, capsys, monkeypatch
):
    """bench.py's main and its train.py runs in this process (the stand-in nanoGPT is a process: the benchmark runs
    it from its own directory); bench.py runs as a process in the refusal test below."""
    monkeypatch.chdir(REPO)  # the recipe is named relative to the repository, as a user in it names it
    scripts_in_process(monkeypatch, bench)
    data_dir = tmp_path / "data"
    make_char_data(data_dir, text="to be or not to be, that is the question. " * 200)
    nanogpt = fake_nanogpt(tmp_path / "nanoGPT")
    out = tmp_path / "quality.json"
    args = [
        "quality",
        "--config=config/train_shakespeare_char_cpu.py",
        "--runs=2",
        "--extra=--max_iters=4",
        "--extra=--eval_iters=1",
        "--extra=--n_layer=1",
        "--extra=--n_embd=32",
        "--extra=--mlp_hidden=64",
        "--extra=--block_size=16",
        f"--extra=--data_dir={data_dir}",
        "--extra=--device=cpu",
        "--extra=--curves=False",
        f"--work_dir={tmp_path / 'runs'}",
        f"--json_out={out}",
        f"--nanogpt_dir={nanogpt}",
    ]
    code, _, err = run_main(bench.main, args, capsys)
    assert code == 0, err
    reference, row = json.loads(out.read_text())["results"]
    assert json.loads((nanogpt / "argv.json").read_text()) == bench.NANOGPT_CPU_RECIPE
    assert reference["val_loss_estimate"] == 1.8857 and reference["median_wall_s"] >= 0.2
    assert row["x_nanogpt_time"] == pytest.approx(row["median_wall_s"] / reference["median_wall_s"], abs=1e-3)
    assert len(row["all"]) == 2 and row["runs"] == 2
    for run, out_dir in zip(row["all"], sorted((tmp_path / "runs").iterdir())):
        summary = json.loads((out_dir / "summary.json").read_text())
        assert run["val_loss_full"] == summary["val_loss_full"] > 0
        assert run["ms_per_step"] == pytest.approx(1e3 * summary["train_seconds"] / 4, abs=0.06)
    assert row["all"][0]["val_loss_full"] == row["all"][1]["val_loss_full"]  # same seed, same CPU: same loss


@pytest.mark.parametrize(
    "args, message",
    [
        (["sample", "--paths=fast"], "unknown --paths ['fast']"),
        (["quality", "--config=config/missing.py", "--runs=1"], "train.py"),
        (["quality", "--nanogpt_dir=/nonexistent/nanoGPT"], "no train.py in --nanogpt_dir=/nonexistent/nanoGPT"),
    ],
)
def test_bad_requests_fail_in_one_line(args, message, tmp_path: Path, capsys, monkeypatch):
    """bench.py's main in this process, and the train.py it starts too (the test below runs bench.py as a
    process)."""
    scripts_in_process(monkeypatch, bench)
    code, _, err = run_main(bench.main, [*args, f"--json_out={tmp_path / 'x.json'}"], capsys)
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_a_request_without_a_benchmark_fails_in_one_line(tmp_path: Path):
    result = run_bench(f"--json_out={tmp_path / 'x.json'}")
    assert result.returncode == 2
    assert "name a benchmark first" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x.json").exists()


def test_help_names_every_benchmark(capsys) -> None:
    code, out, _ = run_main(bench.main, ["--help"], capsys)
    assert code == 0 and all(f"  {name} " in out for name in ("sample", "linear", "train", "quality"))
