"""new_directory: an export written in or beside its destination and moved in, replacing only when asked."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from gptkit.core.errors import UserError
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


SHARED_MEMORY = Path("/dev/shm")


@pytest.mark.skipif(
    not SHARED_MEMORY.is_dir() or SHARED_MEMORY.stat().st_dev == Path(__file__).stat().st_dev,
    reason="needs a second file system (/dev/shm) to export onto",
)
def test_an_export_into_a_folder_of_another_file_system_moves_in(tmp_path):
    """A mount point (a container's volume, a mounted disk) as the export directory: its parent is another file
    system, so the files are written inside it, where renaming works, and nothing else is left there."""
    with tempfile.TemporaryDirectory(dir=SHARED_MEMORY) as mounted:
        destination = tmp_path / "volume"
        destination.symlink_to(mounted, target_is_directory=True)
        with new_directory(destination, overwrite=False) as staging:
            write_tree(staging, {"config.json": "{}", "base/model.safetensors": "weights"})
        assert tree(Path(mounted)) == {"config.json": "{}", "base/model.safetensors": "weights"}
        assert sorted(path.name for path in Path(mounted).iterdir()) == ["base", "config.json"]


def test_what_a_killed_export_left_does_not_count_as_the_users_files(tmp_path):
    destination = tmp_path / "out"
    write_tree(destination, {".out.k3j2.partial/config.json": "half"})
    with new_directory(destination, overwrite=False) as staging:
        write_tree(staging, {"config.json": "{}"})
    assert tree(destination)["config.json"] == "{}"


def test_a_link_to_nothing_is_one_line_before_any_work(tmp_path):
    destination = tmp_path / "out"
    destination.symlink_to(tmp_path / "gone")
    refused = pytest.raises(UserError, match=r"out is a link to nothing \(.*gone\); choose another --export_dir$")
    with refused, new_directory(destination, overwrite=False):
        raise AssertionError("the export ran")
