"""bench_llamacpp.py against llama.cpp (slow: needs llama-cpp-python, built from source): every path at batch 1 and
several rows, and the refusals of bad settings (these need no llama.cpp)."""

from __future__ import annotations

import json

import pytest

import bench_llamacpp
from helpers import assert_one_line_error, run_main


def test_bad_settings_are_refused_in_one_line(tmp_path, capsys):
    refused = [(["--shapes=gpt3"], "gpt3"), (["--paths=ours_int2"], "ours_int2"), (["--batch_sizes=0"], "0")]
    refused += [(["--bandwidth_mb=-1"], "bandwidth_mb")]
    for argv, named in refused:
        code, _, err = run_main(bench_llamacpp.main, [*argv, f"--json_out={tmp_path / 'x.json'}"], capsys)
        assert_one_line_error(code, err, named)
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_every_path_decodes_one_row_and_several(tmp_path, capsys):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)")
    out = tmp_path / "llamacpp.json"
    argv = ["--shapes=smollm2-135m", "--batch_sizes=1", "--batch_sizes=3", "--new_tokens=4", "--repeats=1"]
    argv += ["--bandwidth_mb=64"]
    code, printed, err = run_main(bench_llamacpp.main, [*argv, f"--json_out={out}"], capsys)
    assert code == 0, err
    rows = json.loads(out.read_text())["results"]
    assert {(row["path"], row["batch"]) for row in rows} == {(p, b) for p in bench_llamacpp.PATHS for b in (1, 3)}
    for row in rows:
        # the seconds the rate implies are the printed ones, to their rounding (1 ms; a run of 4 tokens takes ~20 ms)
        implied = row["batch"] * 4 / row["tokens_per_s"]
        assert implied == pytest.approx(row["seconds"], abs=0.0005 + implied * 0.05 / row["tokens_per_s"] + 1e-9)
        # one round: the generation's seconds are its run's less its run to the first token
        whole, first = row["all_seconds"][0], row["first_token_seconds"][0]
        assert row["generation_seconds"] == pytest.approx(whole - first, abs=0.0011)
        # tokens/s times seconds is the tokens made, to the two figures' rounding (0.1 and 1e-4): a few milliseconds
        # of generation, as here, make the seconds' rounding a large share of the rate
        tokens_per_s, seconds = row["generation_tokens_per_s"], row["generation_seconds"]
        slack = abs(tokens_per_s) * 5e-5 + abs(seconds) * 0.05
        assert tokens_per_s * seconds == pytest.approx(row["batch"] * 3, abs=slack + 1e-9)
        for suffix in ("", "_generation"):
            assert (f"x_llamacpp{suffix}" in row) == (row["path"] in bench_llamacpp.AGAINST)
            on_a_file = ("ours_int4", "ours_q4_0", "ours_q4_1", "ours_q8_0", "ours_q4_k_m")
            assert (f"x_int8{suffix}" in row) == (row["path"] in on_a_file)
        # the read speed around the run: a measure, one a run, of what 2 cores read (far from 0, below 1 TB/s)
        assert len(row["all_read_gb_s"]) == 1 and 1 < row["read_gb_s"] == row["all_read_gb_s"][0] < 1000
    assert all(path in printed for path in bench_llamacpp.PATHS)
