"""gptkit/infer/native.py's build of the C++ step: one build directory per source text and flags (so checkouts,
worktrees and venvs find their own build again after another's), what is_built means, and the line a process
prints while it waits for another's build. Fake build directories stand in for builds, except in the test that
loads the real build (the one `python -m gptkit.infer.native --build` makes) from a second checkout."""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gptkit.infer import native
from helpers import REPO, clean_env


@pytest.fixture
def extensions_root(tmp_path, monkeypatch) -> Path:
    """An empty torch extensions directory for the test."""
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def source_at(directory: Path, change_byte: bool = False) -> Path:
    """A copy of the step's C++ source in `directory` (another checkout's), with its middle byte changed if asked."""
    directory.mkdir(parents=True)
    text = bytearray(native.SOURCE.read_bytes())
    if change_byte:
        middle = len(text) // 2
        text[middle] = ord("x") if text[middle] != ord("x") else ord("y")
    copy = directory / native.SOURCE.name
    copy.write_bytes(bytes(text))
    return copy


def fake_build(source: Path) -> None:
    """What a finished build of `source` leaves in its directory (the library, never loaded here)."""
    directory = native.build_directory(source)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gptkit_decode_step.so").write_bytes(b"")


def wait_until(condition, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_same_source_has_one_build_directory_from_any_checkout_and_a_changed_byte_another(
    tmp_path, extensions_root
):
    here = native.build_directory()
    other_checkout = native.build_directory(source_at(tmp_path / "clone"))
    changed = native.build_directory(source_at(tmp_path / "changed", change_byte=True))
    assert here == other_checkout
    assert changed != here
    assert here.parent == changed.parent == extensions_root


def test_other_compile_flags_or_another_compiler_have_another_build_directory(extensions_root, monkeypatch):
    here = native.build_directory()
    monkeypatch.setenv("CXX", "clang++")
    other_compiler = native.build_directory()
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(native, "COMPILE_FLAGS", (*native.COMPILE_FLAGS, "-DNDEBUG"))
    other_flags = native.build_directory()
    assert len({here, other_flags, other_compiler}) == 3


def test_is_built_means_a_build_of_this_source_and_each_source_finds_its_own_again(tmp_path, extensions_root):
    """Two checkouts of different sources: each one's build is found by it alone, and building the second leaves the
    first's in place (switching back finds it)."""
    first, second = source_at(tmp_path / "first"), source_at(tmp_path / "second", change_byte=True)
    assert not native.is_built(first) and not native.is_built(second)
    fake_build(first)
    assert native.is_built(first) and not native.is_built(second)
    fake_build(second)
    assert native.is_built(first) and native.is_built(second)
    native.build_directory(second).joinpath("gptkit_decode_step.so").unlink()  # a build without its library
    assert not native.is_built(second) and native.is_built(first)


def held_lock(directory: Path):
    """The build lock of `directory`, held as another process holds it (flock's locks belong to an open file, so a
    second open of the file in this process contends with it as another process would)."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / "gptkit-build.lock", "a+b")  # noqa: SIM115 (released by the test)
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def extension_behind_a_held_lock(capfd, building: bool) -> tuple[list, str]:
    """Call extension() in a thread while its build directory's lock is held, as by another process that builds it
    (building: the lock is released once the waiting line is out and the build is finished) or only loads the
    finished build (released after a moment). Returns what the call returned and what it printed to stderr."""
    directory = native.build_directory()
    holder = held_lock(directory)
    results, errors = [], ""
    native.extension.cache_clear()
    waiter = threading.Thread(target=lambda: results.append(native.extension()))
    try:
        waiter.start()
        if building:

            def said_something() -> bool:
                nonlocal errors
                errors += capfd.readouterr().err
                return bool(errors)

            wait_until(said_something, "the waiting line")
            fake_build(native.SOURCE)  # the other process's build is done
        else:
            time.sleep(0.3)
        assert waiter.is_alive()  # it waits for the lock
    finally:
        holder.close()  # releases the lock
        waiter.join(timeout=20)
        native.extension.cache_clear()  # the next call loads the real build again
    return results, errors + capfd.readouterr().err


def test_a_process_waiting_for_anothers_build_says_so_in_one_line_and_nothing_more(extensions_root, monkeypatch, capfd):
    """While another process builds, extension() prints one line saying it waits for that build and where; once it
    holds the lock the build is done, and it loads it without a word more (no "building" line). Waiting a moment
    while another process only loads the finished build, it says nothing."""
    from torch.utils import cpp_extension

    loaded = object()
    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: loaded)
    directory = native.build_directory()
    results, errors = extension_behind_a_held_lock(capfd, building=True)
    assert results == [loaded]
    assert errors == f"waiting for another process's build of the native decoding step in {directory}\n"
    assert (directory / native.SOURCE.name).read_bytes() == native.SOURCE.read_bytes()  # what the build compiles
    results, errors = extension_behind_a_held_lock(capfd, building=False)
    assert results == [loaded]
    assert errors == ""


def test_a_second_checkout_of_the_same_source_loads_the_build_without_rebuilding(tmp_path):
    """A copy of the package at another path (a clone, a worktree) builds nothing: it finds this checkout's build
    (the one `python -m gptkit.infer.native --build` makes), and leaves it as it was, so switching back rebuilds
    nothing either."""
    native.extension()  # this checkout's build, made now if the set-up has not made it
    directory = native.build_directory()
    built = {path.name: path.stat().st_mtime_ns for path in directory.iterdir() if path.suffix in (".so", ".o")}
    assert "gptkit_decode_step.so" in built
    clone = tmp_path / "clone"
    shutil.copytree(REPO / "gptkit", clone / "gptkit", ignore=shutil.ignore_patterns("__pycache__"))
    script = "import sys; from gptkit.infer import native; print(native.SOURCE); sys.exit(native.main(['--build']))"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=clone, capture_output=True, text=True, env=clean_env(), timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        str(clone / "gptkit" / "infer" / "csrc" / native.SOURCE.name),  # the clone's own source
        f"native decoding step built in {directory}",
    ]
    assert "building" not in result.stderr, result.stderr
    assert {name: (directory / name).stat().st_mtime_ns for name in built} == built
