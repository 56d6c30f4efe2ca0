"""End-to-end tests of prepare_data/fineweb.py against a loopback HTTP server serving small parquet files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa  # in requirements-test.txt: the optional dependency of fineweb.py
import pyarrow.parquet as pq
import pytest
from helpers import serving_directory

from gptkit import tokenizer as tok
from gptkit.prepare import pipeline

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def documents(file_index: int) -> list[str | None]:
    paragraphs = [p for p in SHAKESPEARE.read_text(encoding="utf-8").split("\n\n") if p]
    rows: list[str | None] = paragraphs[file_index * 120 : file_index * 120 + 120]
    rows[5] = None  # missing text and empty text are skipped, not errors
    rows[6] = ""
    return rows


@pytest.fixture
def parquet_server(tmp_path: Path) -> Iterator[tuple[str, list[str]]]:
    """Two parquet files (row groups of 25 rows) under /sample/10BT/ on 127.0.0.1; yields (base URL, requests)."""
    folder = tmp_path / "served" / "sample" / "10BT"
    folder.mkdir(parents=True)
    for index in range(2):
        texts = documents(index)
        table = pa.table({"id": [f"doc{index}-{i}" for i in range(len(texts))], "text": texts})
        pq.write_table(table, folder / f"{index:03d}_00000.parquet", row_group_size=25)
    with serving_directory(tmp_path / "served") as (base, requested):
        yield f"{base}/sample/10BT", requested


def run_fineweb(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
    script = textwrap.dedent(
        f"""
        import runpy, sys
        {prelude}
        sys.argv = ["prepare_data/fineweb.py", *sys.argv[1:]]
        runpy.run_path("prepare_data/fineweb.py", run_name="__main__")
        """
    )
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ),
        timeout=120,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr


def test_download_and_tokenise_into_shards(tmp_path: Path, parquet_server: tuple[str, list[str]]) -> None:
    base, requested = parquet_server
    out = tmp_path / "out"
    args = [
        "--shards=2",
        f"--base_url={base}",
        f"--cache_dir={tmp_path / 'cache'}",
        f"--out_dir={out}",
        "--shard_tokens=3000",
        "--block_size=16",
        "--val_fraction=0.2",
        "--num_workers=2",
        "--chunk_bytes=2000",
    ]
    result = run_fineweb(*args)
    assert result.returncode == 0, result.stderr
    assert sorted(requested) == ["/sample/10BT/000_00000.parquet", "/sample/10BT/001_00000.parquet"]
    meta = tok.read_meta(out, check_files=True)
    assert meta["tokenizer"] == {"kind": "tiktoken", "encoding": "gpt2"} and meta["dtype"] == "uint16"
    assert meta["source"]["parquet_files"] == ["000_00000.parquet", "001_00000.parquet"]
    enc = tok.TiktokenTokenizer("gpt2")
    expected: dict[str, list[int]] = {"train": [], "val": []}
    for file_index in range(2):
        for row, text in enumerate(documents(file_index)):
            if text:
                split = "val" if pipeline.is_val_document(1337, 0.2, file_index, row) else "train"
                expected[split] += [enc.eot_token, *enc.encode(text)]
    for split in ("train", "val"):
        files = meta["splits"][split]["files"]
        assert files == [f"{split}_{i:06d}.bin" for i in range(len(files))]
        stream = np.concatenate([np.fromfile(out / name, dtype="<u2") for name in files])
        assert stream.tolist() == expected[split]
        assert meta["splits"][split]["documents"] == expected[split].count(enc.eot_token)
    assert len(meta["splits"]["train"]["files"]) > 1
    # A second run finds both parquet files complete in the cache and downloads nothing.
    again = run_fineweb(*args)
    assert again.returncode == 0, again.stderr
    assert len(requested) == 2


def test_missing_shard_is_one_line_error(tmp_path: Path, parquet_server: tuple[str, list[str]]) -> None:
    base, _ = parquet_server
    out = tmp_path / "out"
    result = run_fineweb("--shards=3", f"--base_url={base}", f"--cache_dir={tmp_path / 'c'}", f"--out_dir={out}")
    assert_one_line_error(result, "HTTP 404")
    assert not out.exists()
    assert sorted(p.name for p in (tmp_path / "c" / "fineweb-edu-sample-10BT").iterdir()) == [
        "000_00000.parquet",
        "001_00000.parquet",
    ]


def test_damaged_cached_parquet_is_removed(tmp_path: Path) -> None:
    cached = tmp_path / "c" / "fineweb-edu-sample-10BT" / "000_00000.parquet"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"PAR1 not really parquet")
    result = run_fineweb(
        "--base_url=http://127.0.0.1:9/none", f"--cache_dir={tmp_path / 'c'}", f"--out_dir={tmp_path}/o"
    )
    assert_one_line_error(result, "not a readable parquet file")
    assert not cached.exists()


def test_missing_pyarrow_is_a_clear_error(tmp_path: Path) -> None:
    blocked = "sys.modules['pyarrow'] = None; sys.modules['pyarrow.parquet'] = None"
    result = run_fineweb(f"--out_dir={tmp_path / 'o'}", prelude=blocked)
    assert_one_line_error(result, "pip install pyarrow")
