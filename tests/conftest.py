"""Shared test set-up: offline tokenizers, no hubs or trackers, deterministic seeds, one thread."""

from __future__ import annotations

import gc
import multiprocessing.process
import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gptkit.core.errors import freeze_what_the_imports_made

if TYPE_CHECKING:
    import torch

# Tiny test models gain nothing from a second thread, and OpenMP threads that spin while other processes hold the
# cores make each small op wait for a time slice; one thread per process (subprocesses inherit it) avoids both.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Never reach out to a hub or tracker from tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
# The compiled step's max-autotune compiles and times every candidate kernel of each product shape (tens of seconds a
# model on a machine without inductor's cache) and keeps the fastest, so which kernel a test checks changed with the
# load. The tests check tokens and weights, not speed: inductor's own C++ GEMM templates only, the kernels that pack
# frozen weights into constants (where one model once ran another's weights), with nothing to time.
os.environ.setdefault("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS", "CPP")
# Before its first compile on a machine, inductor builds a probe library for each vector instruction set the CPU
# reports and loads it in a new process (seconds of g++); the tests trust the CPU's flags instead: a compiler that
# could not build them would fail the compiled tests' own kernels anyway.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")
# Inductor compiles its kernels in a pool of worker processes, one per core: the suite already runs a process per
# core, so the pool's workers only compete with it, and each process would pay their start-up. Each process
# compiling its own kernels takes less CPU and less time here.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# A shell starts background jobs (`make test &`, nohup) with SIGINT ignored, and every child inherits that; the
# tests that press Ctrl-C on a script would then see it ignored. Tests run with the default, as in a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# `make test-fast` (GPTKIT_FAST_TESTS=1) is the daily tier: every test function once (a parametrized one runs its first
# case; `make test` runs them all), and a test that starts a process, a server or a compile is skipped at that moment,
# so the tier stays in-process without a list of such tests to keep up to date.
FAST_TIER = os.environ.get("GPTKIT_FAST_TESTS") == "1"


def skipped_in_fast_tier(what: str) -> Callable[..., None]:
    def refuse(*args, **kwargs):
        pytest.skip(f"the fast tier skips tests that {what}; make test runs it")

    return refuse


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the imports made is frozen, as a script's run_cli does (a process's exit then skips it, not only the
    collections in between), before any test's objects exist. In the fast tier, from here on (the tests, not pytest's
    own set-up) starting a process or a server skips."""
    freeze_what_the_imports_made()
    if FAST_TIER:
        subprocess.Popen.__init__ = skipped_in_fast_tier("start a process")
        multiprocessing.process.BaseProcess.start = skipped_in_fast_tier("start a process")
        socket.socket.listen = skipped_in_fast_tier("serve on a socket")


@pytest.fixture(autouse=True)
def _no_compile_in_fast_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    if FAST_TIER:
        import torch

        monkeypatch.setattr(torch, "compile", skipped_in_fast_tier("compile with torch.compile"))


def shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a module- or class-scoped fixture (a trained run, a server, a converted model)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(defs[-1].scope in ("module", "class") for defs in info.name2fixturedefs.values())


# The longest units of `make test`'s work (a module's tests that share a fixture, or a single test), longest first:
# they are handed out first, so that neither of the two processes is left running a long one alone at the end
# (--durations shows the figures; torchrun launches, inductor compiles and trained fixtures make the long ones).
LONGEST_FIRST = (
    "tests/weights/test_quantization.py",
    "tests/infer/test_engine.py",
    "tests/test_train_ddp.py",
    "tests/eval/test_hellaswag.py",
    "tests/weights/test_gguf_q4.py",
    "tests/test_reliability_train.py",
    "tests/test_train_posttrain.py",
    "tests/benchmarks/test_bench_cpu_threads.py",
    "tests/test_serve.py",
    "tests/benchmarks/test_bench_step.py",
    "tests/test_export.py",
    "tests/test_chat_end_to_end.py",
    "tests/weights/test_export_gguf.py",
    "tests/benchmarks/test_bench_gguf_memory.py",
    "tests/test_train.py",
    "tests/test_train_lora.py",
    "tests/weights/test_gguf_read.py",
)


def longest_first(item: pytest.Item) -> int:
    return next((rank for rank, path in enumerate(LONGEST_FIRST) if item.nodeid.startswith(path)), len(LONGEST_FIRST))


def first_cases(config: pytest.Config, items: list[pytest.Item]) -> list[pytest.Item]:
    """Each test function's first case (the others deselected, as -m deselects)."""
    kept, left_out, functions = [], [], set()
    for item in items:
        function = item.nodeid.split("[")[0]
        (left_out if function in functions else kept).append(item)
        functions.add(function)
    config.hook.pytest_deselected(items=left_out)
    return kept


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist hands out the units in collection order (pytest_collection_modifyitems sets it), not by their
    # number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_unconfigure(config: pytest.Config) -> None:
    """The tests are over: the process's exit would collect every object they left (the suite waits for it), only
    to free memory that the exit frees anyway."""
    gc.freeze()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests of a module that share a module-scoped fixture run in one xdist process (`make test` distributes
    with --dist=loadgroup), so that the fixture's run or server is made once, not once per process; the other tests
    are spread one by one. The modules of LONGEST_FIRST come first, in its order. Tests marked `slow` skip unless
    asked for (-m slow or GPTKIT_SLOW_TESTS=1). Tests marked `gpt2_bpe` skip, saying why, where GPT-2's BPE files
    can be neither read nor downloaded.

    Tests marked `cuda` run where torch sees a CUDA GPU (or where GPU_TESTS_DEVICE names a device to run their
    bodies on instead); elsewhere they are skipped, saying why."""
    import torch

    items.sort(key=longest_first)  # stable: each module keeps its own order
    if FAST_TIER:
        items[:] = first_cases(config, items)
    slow_requested = "slow" in (config.getoption("-m") or "") or os.environ.get("GPTKIT_SLOW_TESTS") == "1"
    if not slow_requested:  # skipped before their fixtures are made (a trained run) only to be skipped in the body
        slow = pytest.mark.skip(reason="slow: runs on demand; ask with -m slow or GPTKIT_SLOW_TESTS=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    grouping = config.getoption("loadgroup", default=False)  # set in the xdist processes by --dist=loadgroup
    for item in items:
        if grouping and shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    skip_where_unavailable(items, "gpt2_bpe", gpt2_bpe_missing)
    if torch.cuda.is_available() or os.environ.get("GPU_TESTS_DEVICE"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def skip_where_unavailable(items: list[pytest.Item], marker: str, missing: Callable[[], str]) -> None:
    """Skip the tests marked `marker` where `missing()` names what they lack (asked only if some are collected)."""
    marked = [item for item in items if marker in item.keywords]
    reason = missing() if marked else ""
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def gpt2_bpe_missing() -> str:
    """Why GPT-2's BPE cannot be had here (the toolkit's own one line), or "": offline, tiktoken reads it only from
    $TIKTOKEN_CACHE_DIR."""
    from gptkit.core.errors import UserError
    from gptkit.data.tokenizer import TiktokenTokenizer

    try:
        TiktokenTokenizer("gpt2")
    except UserError as exc:
        return f"needs GPT-2's BPE: {exc}"
    return ""


@pytest.fixture
def gpu_device() -> torch.device:
    """The device of the `cuda` tests: cuda, or GPU_TESTS_DEVICE (e.g. cpu, to check the tests themselves)."""
    import torch

    return torch.device(os.environ.get("GPU_TESTS_DEVICE", "cuda"))


@pytest.fixture(autouse=True)
def _seed_everything_one_thread():
    """Seeded generators, and one torch thread in-process even where OMP_NUM_THREADS says otherwise."""
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)
    # Without CUDA, the CPU's generator alone: torch.manual_seed also queues a seed for each accelerator absent here,
    # formatting the caller's stack each time (about a millisecond under pytest's deep stacks, every test).
    if torch.cuda.is_available():
        torch.manual_seed(0)
    else:
        torch.default_generator.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def char_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A char-level data directory of tiny Shakespeare's first 20,000 characters, shared by the whole test run
    (tests that change their data make their own with helpers.make_char_data)."""
    from helpers import make_char_data, sample_text

    directory = tmp_path_factory.mktemp("char_data")
    make_char_data(directory, text=sample_text(20_000))
    return directory


# ----------------------------------------------------------------------------- a real browser (the playground)


def find_chromium() -> tuple[str, str] | None:
    """(browser, driver) paths of Debian's chromium and chromium-driver (or Chrome's), or None."""
    browser = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture
def browser():
    found = find_chromium()
    if found is None:
        pytest.skip(
            "the playground test needs chromium and chromedriver (Debian: apt-get install chromium "
            "chromium-driver; `make test` installs them where it can)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=found[1]), options=options)  # no driver download
    try:
        yield driver
    finally:
        driver.quit()
