"""Building the native step's C++ (csrc/) for this CPU, once per source and machine, and loading the build.

The C++ is two translation units: csrc/decode_step.cpp, the step, which includes the other files of csrc/ (one file
a concern: vector lanes, products, attention, sampling, the step) so that the compiler sees the whole step at once,
and csrc/bindings.cpp, its Python entry points, the one file that includes torch's headers; they compile at once. It is
compiled at set-up (`python -m gptkit.infer.native --build`, which `make demo` and `make test` run: a C++ compiler
and ninja) for this machine's instruction set: AVX-512 and its bfloat16 products where the CPU has them, else AVX2
with FMA, else what the compiler makes of plain loops. Each build lies in a directory of its own under torch's
extensions directory, named by a hash of what it is built from (build_directory): checkouts, worktrees and virtual
environments share a build only where it would be the same build, and each finds its own again after another has
built. decode=auto uses the step only once it is built (build_problem); decode=native builds it when needed.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import platform
import shutil
import sys
import sysconfig
from pathlib import Path

import torch

from gptkit.core.errors import UserError
from gptkit.core.fileio import atomic_write_bytes

CSRC = Path(__file__).parent / "csrc"  # every C++ file of the step
UNITS = ("decode_step.cpp", "bindings.cpp")  # the files compiled: each includes the headers it needs
MODULE = "gptkit_decode_step"  # the extension's name: its build is MODULE.so
# Tuples: torch's build appends its own flags to the lists it is given.
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp")  # -march=native: this CPU's instruction set
LINK_FLAGS = ("-fopenmp",)


def source_files(sources: Path = CSRC) -> list[Path]:
    """The C++ files in `sources` (the translation units and the headers they include), by name."""
    return sorted(path for path in sources.iterdir() if path.suffix in (".cpp", ".h"))


def cpu_flags() -> str:
    """This CPU's architecture and instruction-set flags (from /proc/cpuinfo where there is one)."""
    flags = platform.machine()
    with contextlib.suppress(OSError):
        flags += next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    return flags


def build_directory(sources: Path = CSRC) -> Path:
    """Where the extension built from the C++ files in `sources` lies: under torch's extensions directory
    (TORCH_EXTENSIONS_DIR, else torch's default), named by a hash of all the build is made of: every C++ file's name
    and text, the flags and the compiler (CXX), torch's version and place (its headers), Python's headers and this
    CPU's instruction set (a home directory may be shared by machines of other CPUs). Why: torch remakes a build
    whenever one of these differs from the last build in its directory, so checkouts, worktrees or venvs that shared a
    directory would rebuild on every switch; keyed so, they share a build only where it is the same build. Builds of
    older sources stay (delete them freely)."""
    from torch.utils import cpp_extension

    parts = [
        *COMPILE_FLAGS,
        *LINK_FLAGS,
        os.environ.get("CXX", "c++"),  # the compiler torch's build runs
        torch.__version__,
        str(Path(torch.__file__).parent),  # its headers and libraries, named in the build's commands
        sysconfig.get_path("include", scheme="posix_prefix") or "",
        cpu_flags(),
        ninja_binary() or "",  # ninjas of other versions log commands apart: each would rebuild the other's build
    ]
    digest = hashlib.sha256()
    for path in source_files(sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in parts:
        digest.update(b"\0" + part.encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / f"{MODULE}_torch{torch.__version__}_{python}_{digest.hexdigest()[:16]}"


def ninja_binary() -> str | None:
    """The ninja that builds: the pip package's (a requirement) wherever PATH points, else the system's. Why the
    package's first: `make` and an unactivated venv find the system's on PATH, an activated one the package's, and
    each would rebuild what the other built."""
    try:
        import ninja

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        return shutil.which("ninja")


def library_in(directory: Path) -> Path:
    """The extension's library in a build directory: the build links it last."""
    return directory / f"{MODULE}.so"


def built_in(directory: Path) -> bool:
    """Whether `directory` holds a finished build (its library)."""
    return library_in(directory).is_file()


def is_built(sources: Path = CSRC) -> bool:
    """Whether this machine has a build of the C++ files in `sources` as they read now, with this torch, Python and
    CPU (decode=auto uses the step only then)."""
    return built_in(build_directory(sources))


def build_problem(build: bool) -> str | None:
    """Why the native step cannot run here (None: it can): not built (when `build` is False), or a failed build."""
    if not build and not is_built():
        return "the native step is not built (python -m gptkit.infer.native --build)"
    try:
        extension()
    except UserError as error:
        return str(error)
    return None


@contextlib.contextmanager
def builder_lock(directory: Path):
    """Hold this build directory's lock (one process builds or loads at a time) and remove a `lock` file that
    torch's build left behind. Why: torch waits, forever, while its `lock` file exists, and a build killed midway (a
    Ctrl-C, a test's timeout) leaves it; every process that builds here holds this lock first, and the system frees
    it when its holder dies, so a `lock` file found while holding it is a dead build's. A process that finds the lock
    held while the build is not done says, in one line, that it waits for it (a build takes a while)."""
    with open(directory / "gptkit-build.lock", "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not built_in(directory):  # else the holder only loads the build: a moment
                print(
                    f"waiting for another process's build of the native decoding step in {directory}",
                    file=sys.stderr,
                    flush=True,
                )
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def copy_sources(directory: Path) -> list[Path]:
    """The build directory's own copy of the C++ files, each written once; returns the translation units'. Why:
    torch's build names the source by its path, and ninja rebuilds when that path changes; compiling the copy (which
    includes the copied headers beside it), every checkout of the same source finds the build done."""
    for source in source_files():
        copy = directory / source.name
        if not copy.is_file():
            partial = directory / f"{source.name}.partial"
            shutil.copyfile(source, partial)
            partial.replace(copy)
    return [directory / unit for unit in UNITS]


@functools.cache
def extension():
    """The compiled C++ extension, built when this source has no build yet (build_directory); UserError with what is
    missing when it cannot be built."""
    from torch.utils import cpp_extension

    ninja = ninja_binary()
    if ninja is not None:  # first on PATH, where torch's build looks for it
        os.environ["PATH"] = os.pathsep.join((str(Path(ninja).parent), os.environ.get("PATH", "")))
    directory = build_directory()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with builder_lock(directory):
            if not built_in(directory):
                print(
                    f"building the native decoding step for this CPU in {directory} (once, under half a minute)",
                    file=sys.stderr,
                )
            return cpp_extension.load(
                MODULE,
                sources=[str(path) for path in copy_sources(directory)],
                build_directory=str(directory),
                extra_cflags=list(COMPILE_FLAGS),
                extra_ldflags=list(LINK_FLAGS),
            )
    except (OSError, RuntimeError, ImportError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(
            f"could not build the native decoding step ({first_line}); it needs a C++ compiler (g++) and "
            "ninja (pip install ninja)"
        ) from error


def main(argv: list[str]) -> int:
    """`python -m gptkit.infer.native --build [--record=FILE]`: build the step for this CPU now (the set-up runs it); a
    machine without a compiler gets a note, not a failure: decode=auto then takes the other paths. --record writes
    the built library's path to FILE ("none" where nothing was built): the set-up's stamp, which the Makefile checks
    against the build itself, since the build lies outside the checkout (a cleared cache takes it away)."""
    record = [arg.removeprefix("--record=") for arg in argv if arg.startswith("--record=")]
    if argv[:1] != ["--build"] or len(argv) != 1 + len(record) or "" in record:
        print("usage: python -m gptkit.infer.native --build [--record=FILE]", file=sys.stderr)
        return 2
    problem, directory = build_problem(build=True), build_directory()
    print(
        f"note: {problem}; decoding takes the other paths" if problem else f"native decoding step built in {directory}"
    )
    for path in record:
        atomic_write_bytes(path, f"{'none' if problem else library_in(directory)}\n".encode())
    return 0
