"""Progress bars on stderr, shared by downloads and data preparation.

Progress is a nicety, never a requirement: without tqdm there is no bar, and a bar draws only on a terminal, so
logs and error output stay clean.
"""

from __future__ import annotations

import sys
from typing import Any


def byte_progress_bar(description: str, total: int | None = None, **options: Any) -> Any:
    """A tqdm bar counting bytes on stderr (`options` go to tqdm), or None when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: draw only when stderr is a terminal.
    return tqdm(
        total=total,
        desc=description,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=None,
        leave=False,
        **options,
    )
