"""End-to-end tests of prepare_data/fineweb.py against a loopback HTTP server serving small parquet files."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa  # in requirements-test.txt: the optional dependency of fineweb.py
import pyarrow.parquet as pq
import pytest

from gptkit.data import tokenizer as tok
from gptkit.data.meta import read_meta
from gptkit.data.prepare.items import is_val_document
from helpers import (
    REPO,
    SHAKESPEARE,
    QuietHandler,
    alive,
    assert_script_error,
    clean_env,
    run_in_process,
    serving,
    serving_directory,
    signal_mid_run,
)
from prepare_data import fineweb


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


@pytest.fixture
def fineweb_here(capsys: pytest.CaptureFixture) -> Callable[..., subprocess.CompletedProcess]:
    """fineweb.py's main in this process, as a finished process: the process itself is what the SIGTERM tests
    check, and they start it."""
    return lambda *args: run_in_process(fineweb.main, list(args), capsys)


@pytest.mark.gpt2_bpe
def test_download_and_tokenise_into_shards(
    tmp_path: Path, parquet_server: tuple[str, list[str]], fineweb_here: Callable[..., subprocess.CompletedProcess]
) -> None:
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
    result = fineweb_here(*args)
    assert result.returncode == 0, result.stderr
    assert sorted(requested) == ["/sample/10BT/000_00000.parquet", "/sample/10BT/001_00000.parquet"]
    meta = read_meta(out, check_files=True)
    assert meta["tokenizer"] == {"kind": "tiktoken", "encoding": "gpt2"} and meta["dtype"] == "uint16"
    assert meta["source"]["parquet_files"] == ["000_00000.parquet", "001_00000.parquet"]
    enc = tok.TiktokenTokenizer("gpt2")
    expected: dict[str, list[int]] = {"train": [], "val": []}
    for file_index in range(2):
        for row, text in enumerate(documents(file_index)):
            if text:
                split = "val" if is_val_document(1337, 0.2, file_index, row) else "train"
                expected[split] += [enc.eot_token, *enc.encode(text)]
    for split in ("train", "val"):
        files = meta["splits"][split]["files"]
        assert files == [f"{split}_{i:06d}.bin" for i in range(len(files))]
        stream = np.concatenate([np.fromfile(out / name, dtype="<u2") for name in files])
        assert stream.tolist() == expected[split]
        assert meta["splits"][split]["documents"] == expected[split].count(enc.eot_token)
    assert len(meta["splits"]["train"]["files"]) > 1
    # A second run finds both parquet files complete in the cache and downloads nothing.
    again = fineweb_here(*args, "--overwrite=True")
    assert again.returncode == 0, again.stderr
    assert len(requested) == 2


def test_missing_shard_is_one_line_error(
    tmp_path: Path, parquet_server: tuple[str, list[str]], fineweb_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    base, _ = parquet_server
    out = tmp_path / "out"
    result = fineweb_here("--shards=3", f"--base_url={base}", f"--cache_dir={tmp_path / 'c'}", f"--out_dir={out}")
    assert_script_error(result, "HTTP 404")
    assert not out.exists()
    assert sorted(p.name for p in (tmp_path / "c" / "fineweb-edu-sample-10BT").iterdir()) == [
        "000_00000.parquet",
        "001_00000.parquet",
    ]


def test_damaged_cached_parquet_is_removed(
    tmp_path: Path, fineweb_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    cached = tmp_path / "c" / "fineweb-edu-sample-10BT" / "000_00000.parquet"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"PAR1 not really parquet")
    result = fineweb_here(
        "--base_url=http://127.0.0.1:9/none", f"--cache_dir={tmp_path / 'c'}", f"--out_dir={tmp_path}/o"
    )
    assert_script_error(result, "not a readable parquet file")
    assert not cached.exists()


def test_missing_pyarrow_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fineweb_here: Callable[..., subprocess.CompletedProcess]
) -> None:
    for name in ("pyarrow", "pyarrow.parquet"):  # as where it is not installed: importing it raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    result = fineweb_here(f"--out_dir={tmp_path / 'o'}")
    assert_script_error(result, "pip install pyarrow")


# ----------------------------------------------------------------------------- SIGTERM mid-run


class StallingHandler(QuietHandler):
    """Sends the first 64 KiB of a parquet file, then nothing until the test ends."""

    def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
        self.send_response(200)
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        self.wfile.write(b"PAR1" + b"\0" * ((1 << 16) - 4))
        self.wfile.flush()
        self.server.release.wait(60)


def test_sigterm_during_the_download_keeps_only_the_resumable_part_file(tmp_path: Path) -> None:
    out, cache = tmp_path / "out", tmp_path / "cache"
    with serving(StallingHandler) as server:
        script = str(REPO / "prepare_data" / "fineweb.py")
        flags = [f"--base_url={server.base}", f"--cache_dir={cache}", f"--out_dir={out}", "--read_timeout=60"]
        process = subprocess.Popen(
            [sys.executable, script, *flags],
            cwd=REPO,
            env=clean_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size for p in cache.rglob("*.part")) and time.monotonic() < deadline:
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=60)
    assert (process.returncode, stderr, stdout) == (143, "terminated by SIGTERM\n", "")
    assert not out.exists()
    cached = [p for p in cache.rglob("*") if p.is_file()]
    assert [p.name for p in cached] == ["000_00000.parquet.part"]  # what the next run resumes from
    assert cached[0].read_bytes() == b"PAR1" + b"\0" * ((1 << 16) - 4)


@pytest.mark.gpt2_bpe
def test_sigterm_while_tokenising_ends_the_workers_and_leaves_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "served" / "sample" / "10BT"
    folder.mkdir(parents=True)
    paragraphs = [p for p in SHAKESPEARE.read_text(encoding="utf-8").split("\n\n") if p]
    texts = [f"{i}: {p}" for i in range(40) for p in paragraphs]  # ~43 MB: far longer to tokenise than to signal
    pq.write_table(pa.table({"text": texts}), folder / "000_00000.parquet", row_group_size=5000)
    out, cache = tmp_path / "out", tmp_path / "cache"
    with serving_directory(tmp_path / "served") as (base, _):
        flags = [f"--base_url={base}/sample/10BT", f"--cache_dir={cache}", f"--out_dir={out}", "--num_workers=2"]
        command = [sys.executable, str(REPO / "prepare_data" / "fineweb.py"), *flags]
        result, workers = signal_mid_run(command, out, signal.SIGTERM, workers=2)
    assert (result.returncode, result.stderr, result.stdout) == (143, "terminated by SIGTERM\n", "")
    assert len(workers) == 2 and alive(workers) == []
    assert not out.exists()  # no train_000000.bin.tmp, no meta.json
    assert [p.name for p in cache.rglob("*") if p.is_file()] == ["000_00000.parquet"]  # the download is complete
