"""new_directory: an export written beside its destination and moved in, replacing only when asked."""

from __future__ import annotations

from pathlib import Path

import pytest

from gptkit.weights.export_common import new_directory


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def tree(root: Path) -> dict[str, str]:
    return {str(path.relative_to(root)): path.read_text() for path in sorted(root.rglob("*")) if path.is_file()}


def test_overwrite_replaces_a_folder_whole_and_leaves_other_files(tmp_path):
    """As --format=peft writes base/ beside the adapters: an export over an earlier one replaces base/ whole (a
    file only the old base had goes with it) and the adapter files, and keeps the user's own files."""
    destination = tmp_path / "adapter"
    write_tree(destination, {"adapter_config.json": "old", "base/config.json": "old", "base/stale.txt": "old"})
    write_tree(destination, {"notes.txt": "mine", "swap": "a file where a folder goes"})
    with new_directory(destination, overwrite=True) as staging:
        write_tree(staging, {"adapter_config.json": "new", "base/config.json": "new", "swap/inner.txt": "new"})
    assert tree(destination) == {
        "adapter_config.json": "new",
        "base/config.json": "new",
        "notes.txt": "mine",
        "swap/inner.txt": "new",
    }
    assert sorted(path.name for path in tmp_path.iterdir()) == ["adapter"]  # no staging or old copy left
    assert sorted(path.name for path in destination.iterdir()) == ["adapter_config.json", "base", "notes.txt", "swap"]


def test_a_failed_export_leaves_the_earlier_one_as_it_was(tmp_path):
    destination = tmp_path / "adapter"
    write_tree(destination, {"adapter_config.json": "old", "base/config.json": "old"})
    with pytest.raises(RuntimeError, match="conversion failed"), new_directory(destination, True) as staging:
        write_tree(staging, {"base/config.json": "half"})
        raise RuntimeError("conversion failed")
    assert tree(destination) == {"adapter_config.json": "old", "base/config.json": "old"}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["adapter"]
