"""What every reader of parquet files shares: pyarrow, imported only when a parquet file is read (it is optional),
and the share of a file's bytes a group of its rows stands for in the progress bar."""

from __future__ import annotations

from typing import Any

from gptkit.core.errors import UserError


def import_parquet() -> Any:
    """pyarrow.parquet, or a UserError saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading parquet files needs pyarrow, which is not installed: pip install pyarrow") from None
    return pq


def covered_bytes(disk_bytes: int, first_row: int, end_row: int, rows_total: int) -> int:
    """The file's bytes in proportion to rows first_row..end_row of rows_total, so that a file's groups add up to
    its size exactly (the last group takes what rounding left)."""
    if end_row >= rows_total:
        return disk_bytes - disk_bytes * first_row // rows_total
    return disk_bytes * end_row // rows_total - disk_bytes * first_row // rows_total
