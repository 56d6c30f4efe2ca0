"""FineWeb-Edu sample-10BT: download parquet shards over HTTP and tokenise them into sharded token files.

    python prepare_data/fineweb.py --shards=2                  # 000_00000.parquet and 001_00000.parquet
    python prepare_data/fineweb.py --shards=14 --num_workers=16 --out_dir=data/fineweb_edu

Downloads go to the cache (--cache_dir, $GPT_TOOLKIT_CACHE or ~/.cache/gpt-toolkit), resume after an interrupted
transfer and skip shards already complete. Each parquet row's "text" is one document; documents go to train or
val by a keyed hash (--val_fraction, --seed). Parquet is read one row group at a time. Needs pyarrow
(pip install pyarrow), which only this script uses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gptkit.core import download
from gptkit.core.download import DownloadSettings
from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.prepare import driver
from gptkit.data.prepare.items import Documents
from gptkit.data.prepare.parquet import covered_bytes, import_parquet
from gptkit.data.prepare.settings import PrepareSettings

DEFAULT_BASE_URL = "https://huggingface.co/datasets/HuggingFaceFW/fineweb-edu/resolve/main/sample/10BT"
ROWS_PER_BATCH = 1024


@dataclass(kw_only=True)
class FinewebSettings(DownloadSettings, PrepareSettings):
    """The shared preparation settings, where FineWeb needs other defaults, plus the download settings."""

    # Shared settings re-declared for another default or help text (they keep their place in --help).
    out_dir: str = setting("data/fineweb_edu", "output directory for the token shards and meta.json")
    text_field: str = setting("text", "parquet column holding each document's text")
    val_fraction: float = setting(0.001, "fraction of documents for val")
    shard_tokens: int | None = setting(100_000_000, "tokens per output shard; None writes one file per split")
    block_size: int = setting(1024, "training context length: each split must hold at least block_size + 1 tokens")
    # This script's own.
    shards: int = setting(1, "how many parquet files of sample-10BT to use (000_00000.parquet, 001_00000.parquet...)")
    base_url: str = setting(DEFAULT_BASE_URL, "URL of the folder holding the parquet files")

    def validate(self) -> None:
        super().validate()
        if self.shards < 1:
            raise UserError("--shards must be at least 1")
        self.download_policy()  # refuses impossible values before any work


def shard_names(count: int) -> list[str]:
    """File names of the first `count` parquet files of sample-10BT."""
    return [f"{index:03d}_00000.parquet" for index in range(count)]


def fetch_shards(cfg: FinewebSettings, pq: Any) -> list[Path]:
    """Download (or find in the cache) each parquet file; a file that does not open as parquet is removed."""
    policy = cfg.download_policy()
    paths = []
    for name in shard_names(cfg.shards):
        url = f"{cfg.base_url.rstrip('/')}/{name}"
        cache_name = f"fineweb-edu-sample-10BT/{name}"
        path = download.fetch(url, cache_dir=cfg.cache_dir, name=cache_name, policy=policy)
        try:
            pq.ParquetFile(path).close()
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError variants for a damaged file
            path.unlink(missing_ok=True)
            raise UserError(f"{path} is not a readable parquet file ({exc}); it was removed, run again") from exc
        paths.append(path)
    return paths


def parquet_items(paths: list[Path], text_field: str, chunk_bytes: int, pq: Any) -> Iterator[Documents]:
    """Work items of about `chunk_bytes` of text each, reading every parquet file one row group at a time."""
    for file_index, path in enumerate(paths):
        with pq.ParquetFile(path) as parquet:
            if text_field not in parquet.schema_arrow.names:
                raise UserError(
                    f"{path} has no column {text_field!r} (columns: {', '.join(parquet.schema_arrow.names)})"
                )
            rows_total = max(parquet.metadata.num_rows, 1)
            disk_bytes = path.stat().st_size
            row = 0
            group: list[str] = []
            group_bytes = 0
            first_row = 0
            for row_group in range(parquet.num_row_groups):
                for batch in parquet.iter_batches(
                    batch_size=ROWS_PER_BATCH, row_groups=[row_group], columns=[text_field]
                ):
                    for text in batch.column(0).to_pylist():
                        if text is not None and not isinstance(text, str):
                            raise UserError(f"{path}: column {text_field!r} does not hold text")
                        group.append(text or "")
                        group_bytes += len(text or "")
                        row += 1
                        if group_bytes >= chunk_bytes:
                            yield _documents(file_index, group, first_row, row, rows_total, disk_bytes)
                            group, group_bytes, first_row = [], 0, row
            if group:
                yield _documents(file_index, group, first_row, row, rows_total, disk_bytes)


def _documents(
    file_index: int, texts: list[str], first_row: int, end_row: int, rows_total: int, disk_bytes: int
) -> Documents:
    covered = covered_bytes(disk_bytes, first_row, end_row, rows_total)
    return Documents(file_index=file_index, texts=texts, first_row=first_row, input_bytes=covered)


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        FinewebSettings,
        argv,
        prog="prepare_data/fineweb.py",
        description="Download FineWeb-Edu sample-10BT parquet shards and tokenise them into sharded token files.",
    )
    pq = import_parquet()
    paths = fetch_shards(cfg, pq)
    source = {
        "dataset": "HuggingFaceFW/fineweb-edu sample/10BT",
        "base_url": cfg.base_url,
        "parquet_files": shard_names(cfg.shards),
        "tokenizer": cfg.tokenizer,
        "bpe_dir": cfg.bpe_dir,
        "split": "by document (keyed hash)",
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "text_field": cfg.text_field,
    }
    total_bytes = sum(path.stat().st_size for path in paths)
    make_items = partial(parquet_items, paths, cfg.text_field, cfg.chunk_bytes, pq)
    meta, seconds = driver.prepare(make_items, cfg, source, total_bytes, what=f"{cfg.shards} parquet file(s)")
    print(driver.summary_line(meta, cfg.out_dir, seconds, total_bytes))
    return 0


if __name__ == "__main__":
    run_cli(main)
