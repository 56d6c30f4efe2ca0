"""gptkit/infer/native/build.py's build of the C++ step: one build directory per source text (every C++ file's) and
flags (so checkouts, worktrees and venvs find their own build again after another's), what is_built means, and the
line a process prints while it waits for another's build. Fake build directories stand in for builds, except in the
test that loads the real build (the one `python -m gptkit.infer.native --build` makes) from a second checkout."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gptkit.infer.native import build as native
from helpers import REPO, clean_env


@pytest.fixture
def extensions_root(tmp_path, monkeypatch) -> Path:
    """An empty torch extensions directory for the test."""
    root = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def source_at(directory: Path, changed: str | None = None) -> Path:
    """A copy of the step's C++ files in `directory` (another checkout's), with the middle byte of the file named
    `changed` changed."""
    shutil.copytree(native.CSRC, directory)
    if changed is not None:
        text = bytearray((directory / changed).read_bytes())
        middle = len(text) // 2
        text[middle] = ord("x") if text[middle] != ord("x") else ord("y")
        (directory / changed).write_bytes(bytes(text))
    return directory


def fake_build(sources: Path) -> None:
    """What a finished build of the C++ files in `sources` leaves in its directory (the library, never loaded)."""
    directory = native.build_directory(sources)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "gptkit_decode_step.so").write_bytes(b"")


def wait_until(condition, what: str, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_the_same_source_has_one_build_directory_from_any_checkout_and_a_changed_byte_of_any_file_another(
    tmp_path, extensions_root
):
    """A byte changed in a translation unit, or in any header they include, is another build."""
    here = native.build_directory()
    other_checkout = native.build_directory(source_at(tmp_path / "clone"))
    names = [path.name for path in native.source_files()]
    assert "decode_step.cpp" in names and "step.h" in names and len(names) > 2
    changed = [native.build_directory(source_at(tmp_path / name, changed=name)) for name in names]
    assert here == other_checkout
    assert len({here, *changed}) == len(names) + 1
    assert {directory.parent for directory in changed} == {extensions_root}


def test_other_compile_flags_or_another_compiler_have_another_build_directory(extensions_root, monkeypatch):
    here = native.build_directory()
    monkeypatch.setenv("CXX", "clang++")
    other_compiler = native.build_directory()
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(native, "COMPILE_FLAGS", (*native.COMPILE_FLAGS, "-DNDEBUG"))
    other_flags = native.build_directory()
    assert len({here, other_flags, other_compiler}) == 3


def test_the_pip_packages_ninja_builds_wherever_path_points_and_another_ninja_has_another_directory(
    extensions_root, monkeypatch
):
    """`make` (no venv on PATH) and an activated venv found different ninjas, which log commands apart: each rebuilt
    the other's build. The pip package's ninja (a requirement) is taken whatever PATH holds first."""
    ninja = pytest.importorskip("ninja")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert native.ninja_binary() == str(Path(ninja.BIN_DIR) / "ninja")
    here = native.build_directory()
    monkeypatch.setattr(native, "ninja_binary", lambda: "/usr/bin/ninja")
    assert native.build_directory() != here


def test_is_built_means_a_build_of_this_source_and_each_source_finds_its_own_again(tmp_path, extensions_root):
    """Two checkouts of different sources: each one's build is found by it alone, and building the second leaves the
    first's in place (switching back finds it)."""
    first, second = source_at(tmp_path / "first"), source_at(tmp_path / "second", changed="step.h")
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
            fake_build(native.CSRC)  # the other process's build is done
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
    for source in native.source_files():  # what the build compiles: the unit and the headers beside it
        assert (directory / source.name).read_bytes() == source.read_bytes()
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
    stamp = tmp_path / "stamp"
    script = (
        "import sys; from gptkit.infer.native import build; print(build.CSRC); "
        f"sys.exit(build.main(['--build', '--record={stamp}']))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=clone, capture_output=True, text=True, env=clean_env(), timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        str(clone / "gptkit" / "infer" / "native" / "csrc"),  # the clone's own source
        f"native decoding step built in {directory}",
    ]
    assert "building" not in result.stderr, result.stderr
    assert {name: (directory / name).stat().st_mtime_ns for name in built} == built
    assert stamp.read_text() == f"{directory / 'gptkit_decode_step.so'}\n"  # the set-up's stamp: the library


def test_where_nothing_is_built_the_record_says_none_and_bad_arguments_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(native, "build_problem", lambda build: "no C++ compiler here")
    stamp = tmp_path / "stamp"
    assert native.main(["--build", f"--record={stamp}"]) == 0
    assert stamp.read_text() == "none\n"
    assert capsys.readouterr().out == "note: no C++ compiler here; decoding takes the other paths\n"
    for argv in (["--record=x"], ["--build", "--record="], ["--build", "--now"], []):
        assert native.main(argv) == 2
        assert capsys.readouterr().err == "usage: python -m gptkit.infer.native --build [--record=FILE]\n"


def make_checkout_stamped(root: Path, stamp: str) -> None:
    """The Makefile in `root` beside what its native step's target depends on, each made after what it depends on,
    and the native step's stamp made last, holding `stamp`."""
    root.mkdir()
    shutil.copy(REPO / "Makefile", root / "Makefile")
    files = ["requirements.txt", ".venv/.torch", ".venv/.deps", "gptkit/infer/native/csrc/step.h"]
    files += ["gptkit/infer/native/build.py", ".venv/.native"]
    for age, name in enumerate(reversed(files)):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stamp + "\n" if name == ".venv/.native" else "")
        os.utime(path, (time.time() - 100 * (age + 1),) * 2)


@pytest.mark.parametrize("stamp, remade", [("library", False), ("none", False), ("gone", True), ("", True)], ids=str)
def test_make_builds_again_when_the_stamped_library_is_gone(tmp_path, stamp, remade):
    """The set-up's stamp of the native build holds its library's path: make remakes it when that file is gone (a
    cleared cache) or the stamp says nothing (an older set-up's), not where it is there or nothing could be built."""
    library = tmp_path / "extensions" / "gptkit_decode_step.so"
    library.parent.mkdir()
    library.write_bytes(b"")
    named = {"library": str(library), "gone": str(tmp_path / "extensions" / "elsewhere.so")}.get(stamp, stamp)
    make_checkout_stamped(tmp_path / "checkout", named)
    # a make of its own, not a sub-make of the one that runs the suite (whose level and flags it would inherit)
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    result = subprocess.run(
        ["make", "-n", ".venv/.native"], cwd=tmp_path / "checkout", env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    build = ".venv/bin/python -m gptkit.infer.native --build --record=.venv/.native"
    assert result.stdout.splitlines() == ([build] if remade else ["make: '.venv/.native' is up to date."])
