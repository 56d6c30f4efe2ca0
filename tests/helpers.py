"""The tests' shared helpers: tiny data and models, running scripts, asserting one-line errors, loopback HTTP.

Everything here builds its inputs on the fly (never downloaded) and talks only to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from functools import cache, partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from gptkit.data.meta import write_meta
from gptkit.data.tokenizer import CharTokenizer, ChatTokenizer, TiktokenTokenizer

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The tests' corpus: tiny Shakespeare's first 200 KB, carried with the tests so that a clone needs nothing beside it.
SHAKESPEARE = FIXTURES / "shakespeare.txt"

# ----------------------------------------------------------------------------- running scripts and their errors


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a child: one thread, no variables that point scripts at other data or caches, and this
    checkout first on the path: a script under prepare_data/ or benchmarks/ would otherwise import an installed
    gptkit, which may be another checkout's."""
    env = {k: v for k, v in os.environ.items() if k not in ("TINYSHAKESPEARE", "GPT_TOOLKIT_CACHE")}
    path = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": path, **extra}


def run_script(
    script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300, **popen: Any
) -> subprocess.CompletedProcess:
    """Run a script of the repository (e.g. "train.py", "prepare_data/corpus.py") as a user would, from the
    repository root; returns the finished process with text stdout and stderr."""
    return subprocess.run(
        [sys.executable, str(REPO / script), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env if env is not None else clean_env(),
        timeout=timeout,
        **popen,
    )


def assert_one_line_error(code: int, stderr: str, *fragments: str) -> str:
    """A user error as every script reports it: exit code 2, one line `error: ...` holding each fragment, no
    traceback. Returns that line."""
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: "), stderr
    for fragment in fragments:
        assert fragment in stderr, stderr
    return stderr.strip()


def assert_script_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """assert_one_line_error for a finished script."""
    return assert_one_line_error(result.returncode, result.stderr, *fragments)


def cli_args(**settings: object) -> list[str]:
    """`--key=value` flags, as a user types them."""
    return [f"--{key}={value}" for key, value in settings.items()]


# ----------------------------------------------------------------------------- tiny models and training runs

# A 2-layer, 32-wide model: a few milliseconds per step on one core.
TINY_MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}


def tiny_train_args(data_dir: Path, out_dir: Path, **overrides: object) -> list[str]:
    """train.py flags for a seconds-long CPU run of a 1-layer, 16-wide model on 16-token windows."""
    settings = {
        "data_dir": data_dir,
        "out_dir": out_dir,
        "device": "cpu",
        "compile": False,
        "n_layer": 1,
        "n_head": 2,
        "n_embd": 16,
        "block_size": 16,
        "batch_size": 2,
        "gradient_accumulation_steps": 1,
        "max_iters": 4,
        "eval_interval": 2,
        "eval_iters": 1,
        "log_interval": 2,
        "curves": False,
    }
    settings.update(overrides)
    return cli_args(**settings)


def dequantized_weight(layer: Any) -> Any:
    """The (out, in) float64 weight an Int8Linear stands for: its stored int8 weights times their row scales."""
    return layer.weight_int8.double() * layer.scale.double()[:, None]


def int8_reference(layer: Any, x: Any) -> Any:
    """gptkit.weights.quantization.Int8Linear's product computed by hand in float64 (dequantized_weight), returned as
    float32."""
    return (x.double() @ dequantized_weight(layer).T + layer.bias.double()).float()


# ----------------------------------------------------------------------------- tiny data directories


def canonical_shakespeare() -> Path:
    """The whole tiny Shakespeare corpus from $TINYSHAKESPEARE (as `make demo` takes it), for the tests of its
    known token counts; they skip where the variable names no local file."""
    import pytest

    path = Path(os.environ.get("TINYSHAKESPEARE", ""))
    if not os.environ.get("TINYSHAKESPEARE") or not path.is_file():
        pytest.skip("needs the whole tiny Shakespeare corpus: set TINYSHAKESPEARE to its path")
    return path


def sample_text(chars: int = 60_000) -> str:
    """The first `chars` characters of the tests' Shakespeare corpus."""
    return SHAKESPEARE.read_text(encoding="utf-8")[:chars]


def write_split_files(directory: Path, split: str, ids: np.ndarray, shards: int, dtype: str) -> list[str]:
    """Write `ids` as `shards` raw token files of the split; returns their names in order."""
    if shards == 1:
        names = [f"{split}.bin"]
        pieces = [ids]
    else:
        names = [f"{split}_{i:06d}.bin" for i in range(shards)]
        pieces = np.array_split(ids, shards)
    for name, piece in zip(names, pieces):
        piece.astype(dtype).tofile(directory / name)
    return names


def make_char_data(directory: Path, text: str | None = None, shards: int = 1, dtype: str = "uint16") -> dict:
    """A char-level data directory (train 90% / val 10% of `text`); returns its meta dict."""
    text = sample_text() if text is None else text
    directory.mkdir(parents=True, exist_ok=True)
    tok = CharTokenizer.from_text(text)
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    cut = int(len(ids) * 0.9)
    splits = {}
    for split, part, part_text in (("train", ids[:cut], text[:cut]), ("val", ids[cut:], text[cut:])):
        files = write_split_files(directory, split, part, shards, dtype)
        splits[split] = {
            "files": files,
            "tokens": len(part),
            "text_bytes": len(part_text.encode("utf-8")),
            "documents": 1,
        }
    meta = {
        "format": "gpt-tokens",
        "version": 1,
        "tokenizer": tok.to_meta(),
        "vocab_size": tok.vocab_size,
        "dtype": dtype,
        "eot_token": None,
        "splits": splits,
        "source": {"test": "tests/datadirs.py"},
    }
    write_meta(directory, meta)
    return meta


# ----------------------------------------------------------------------------- real text nobody here wrote


def stdlib_sources(every: int = 2, offset: int = 0, max_bytes: int | None = None) -> list[Path]:
    """Python's own standard library modules (the top-level *.py files beside os.py, in sorted order): every
    `every`-th one from `offset`, up to about `max_bytes` in all. Disjoint offsets give disjoint sets (e.g. 0 to
    train on, 1 held out); the same arguments give the same files on every run."""
    files = sorted(Path(os.__file__).parent.glob("*.py"))[offset::every]
    chosen: list[Path] = []
    total = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        chosen.append(path)
        total += path.stat().st_size
    return chosen


# ----------------------------------------------------------------------------- loopback HTTP servers


class ScriptedServer(ThreadingHTTPServer):
    """127.0.0.1 only, on a port the OS picks. `log` records (path, Range header) of every request, `hits`
    counts requests per path, and `release` ends responses that stall on purpose when the test is over."""

    daemon_threads = True

    def __init__(self, handler: Callable[..., BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)
        self.log: list[tuple[str, str | None]] = []
        self.hits: dict[str, int] = {}
        self.release = threading.Event()
        self.lock = threading.Lock()

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps the test output clean."""

    server: ScriptedServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass


@contextlib.contextmanager
def serving(handler: Callable[..., BaseHTTPRequestHandler]) -> Iterator[ScriptedServer]:
    """Run a ScriptedServer with `handler` in a thread for the duration of the block."""
    httpd = ScriptedServer(handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield httpd
    finally:
        httpd.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@contextlib.contextmanager
def serving_directory(directory: str | Path) -> Iterator[tuple[str, list[str]]]:
    """Serve the files under `directory` on 127.0.0.1; yields (base URL, the paths requested so far)."""
    requested: list[str] = []

    class FileHandler(SimpleHTTPRequestHandler, QuietHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            super().do_GET()

    with serving(partial(FileHandler, directory=str(directory))) as httpd:
        yield httpd.base, requested


HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@contextlib.contextmanager
def serving_hub(repositories: dict[str, Path]) -> Iterator[tuple[str, list[str]]]:
    """A stand-in for the Hugging Face Hub on 127.0.0.1 (point HF_ENDPOINT at it) serving each repository (its id ->
    a directory of its files) at HUB_COMMIT: what huggingface_hub's snapshot_download asks, a revision's commit
    (/api/models/ID/revision/REV), the file tree (/api/models/ID/tree/COMMIT) and each file's headers and bytes
    (/ID/resolve/COMMIT/FILE); anything else is a 404. Yields (base URL, "METHOD path" of every request)."""
    requested: list[str] = []

    class HubHandler(QuietHandler):
        def do_GET(self) -> None:
            self.answer(with_body=True)

        def do_HEAD(self) -> None:
            self.answer(with_body=False)

        def answer(self, with_body: bool) -> None:
            path = self.path.split("?")[0]
            requested.append(f"{self.command} {path}")
            body = self.body(path)
            self.send_response(404 if body is None else 200)
            self.send_header("Content-Length", str(len(body or b"")))
            if body is not None:
                self.send_header("X-Repo-Commit", HUB_COMMIT)
                self.send_header("ETag", f'"{hashlib.sha1(body).hexdigest()}"')
            self.end_headers()
            if with_body and body:
                self.wfile.write(body)

        def body(self, path: str) -> bytes | None:
            for repository, directory in repositories.items():
                files = {entry.name: entry for entry in sorted(directory.iterdir()) if entry.is_file()}
                if path.startswith(f"/api/models/{repository}/revision/"):
                    return json.dumps({"id": repository, "sha": HUB_COMMIT}).encode()
                if path == f"/api/models/{repository}/tree/{HUB_COMMIT}":
                    tree = [entry(name, file.read_bytes()) for name, file in files.items()]
                    return json.dumps(tree).encode()
                name = path.removeprefix(f"/{repository}/resolve/{HUB_COMMIT}/")
                if name in files:
                    return files[name].read_bytes()
            return None

    def entry(name: str, data: bytes) -> dict[str, Any]:
        return {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}

    with serving(HubHandler) as httpd:
        yield httpd.base, requested


def offline_hub_cache(monkeypatch: Any, cache: Path, repositories: dict[str, Path]) -> None:
    """huggingface_hub offline (HF_HUB_OFFLINE=1) over a cache at `cache` (HF_HUB_CACHE) holding each repository
    (its id -> a directory of its files) as a download leaves it: a snapshot named by its commit and refs/main."""
    import shutil

    import huggingface_hub.constants

    for repository, directory in repositories.items():
        stored = cache / f"models--{repository.replace('/', '--')}"
        shutil.copytree(directory, stored / "snapshots" / HUB_COMMIT)
        (stored / "refs").mkdir()
        (stored / "refs" / "main").write_text(HUB_COMMIT)
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # huggingface_hub reads its environment once, on import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


# ----------------------------------------------------------------------------- entry points run in-process


def run_main(main: Callable[[list[str]], int | None], args: list[str], capsys: Any) -> tuple[int, str, str]:
    """Run a script's `main(args)` in this process through errors.run_cli, as its `__main__` does; returns (exit
    code, stdout, stderr) of that call alone (`capsys` is pytest's capture fixture)."""
    import pytest

    from gptkit.core.errors import run_cli

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(main, args)
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def run_in_process(
    main: Callable[[list[str]], int | None], args: list[object], capsys: Any
) -> subprocess.CompletedProcess:
    """run_main's call as a finished process (exit code, stdout, stderr), so that the assertions written for
    run_script hold as they are: a script's `main` in this process saves starting Python and torch (about 2 s of
    CPU) where the process itself is not what a test checks. Each script keeps tests that run it as a process."""
    code, out, err = run_main(main, [str(arg) for arg in args], capsys)
    return subprocess.CompletedProcess(args, code, out, err)


def script_main(script: str | Path) -> Callable[[list[str]], int | None]:
    """The `main` of a repository script ("train.py", "prepare_data/chat.py", or its absolute path), imported as
    the tests import it (train, prepare_data.chat)."""
    import importlib

    relative = (REPO / script).resolve().relative_to(REPO).with_suffix("")
    return importlib.import_module(".".join(relative.parts)).main


def scripts_in_process(monkeypatch: Any, module: Any) -> None:
    """Make `module` (a benchmark) run the repository scripts it starts with subprocess.run ([sys.executable,
    a .py under the repository, args...]) in this process: their `main` through errors.run_cli, in the working
    directory asked for, with stdout and stderr captured apart into the CompletedProcess it returns. Other commands
    (and calls given an `env`) still start processes. For the benchmarks' smoke tests: what they check is the
    report, and each script keeps tests that start it as a process."""
    import io

    from gptkit.core.errors import run_cli

    def run(command: list, *args: Any, cwd: Any = None, check: bool = False, **options: Any) -> Any:
        command = [str(part) for part in command]
        script = Path(cwd or os.getcwd(), command[1]) if len(command) > 1 else None
        if command[0] != sys.executable or script is None or script.suffix != ".py" or "env" in options or args:
            return subprocess.run(command, *args, cwd=cwd, check=check, **options)
        if not script.resolve().is_relative_to(REPO):
            return subprocess.run(command, *args, cwd=cwd, check=check, **options)
        out, err = io.StringIO(), io.StringIO()
        with contextlib.chdir(cwd or os.getcwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run_cli(script_main(script), command[2:])
            except SystemExit as exit_info:
                code = exit_info.code or 0
        result = subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())
        if check:
            result.check_returncode()
        return result

    in_process = type(sys)("subprocess")  # the module's own name for subprocess, with run replaced
    in_process.__dict__.update(vars(subprocess))
    in_process.run = run
    monkeypatch.setattr(module, "subprocess", in_process)


def assert_one_line_message(error: BaseException | str, *fragments: str) -> str:
    """A UserError's message (or the text itself) is one line and holds each fragment; returns it."""
    message = str(error)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ----------------------------------------------------------------------------- GPT-2 BPE files, offline

GPT2_BPE_URLS = {
    "vocab.bpe": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "encoder.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
}


@cache
def gpt2_chat_tokenizer() -> ChatTokenizer:
    """GPT-2's BPE with the chat markers, made when a test first asks for it, not while the tests are collected:
    offline, tiktoken finds its files only in $TIKTOKEN_CACHE_DIR, and a module that failed to load would take its
    other tests down with it."""
    return ChatTokenizer.extending(TiktokenTokenizer("gpt2"))


def copy_gpt2_bpe_files(destination: Path) -> Path:
    """A --bpe_dir: GPT-2's vocab.bpe and encoder.json copied out of tiktoken's cache ($TIKTOKEN_CACHE_DIR, or
    the temporary directory's data-gym-cache that tiktoken downloads into), where each file is named by the sha1 of
    its URL. Returns `destination`."""
    import hashlib
    import shutil
    import tempfile

    import tiktoken

    tiktoken.get_encoding("gpt2")  # fills the cache where it is empty (a machine online, no TIKTOKEN_CACHE_DIR)
    cache = Path(
        os.environ.get("TIKTOKEN_CACHE_DIR")
        or os.environ.get("DATA_GYM_CACHE_DIR")
        or Path(tempfile.gettempdir()) / "data-gym-cache"
    )
    destination.mkdir(parents=True, exist_ok=True)
    for name, url in GPT2_BPE_URLS.items():
        shutil.copyfile(cache / hashlib.sha1(url.encode()).hexdigest(), destination / name)
    return destination


# ----------------------------------------------------------------------------- signals sent to a running script


def signal_mid_run(
    command: list[str],
    out_dir: Path,
    signum: int,
    workers: int,
    group: bool = False,
    timeout: float = 120,
    times: int = 1,
) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Start `command` (a data preparation run writing to `out_dir`) from the repository root, wait until it has
    started `workers` processes and writes a token file (a non-empty *.tmp in out_dir), then send it `signum`: to
    the process alone, or with `group` to its whole process group as a terminal's Ctrl-C and `timeout` do; `times`
    signals 20 ms apart, as an impatient user's Ctrl-Cs. Returns the finished process (text stdout and stderr) and the pids of the processes it had started."""
    import signal
    import time

    import psutil

    def writing() -> bool:
        sizes = []
        for path in out_dir.glob("*.tmp"):
            with contextlib.suppress(OSError):  # renamed or removed meanwhile
                sizes.append(path.stat().st_size)
        return any(sizes)

    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + timeout
        while not (len(children) >= workers and writing()):
            assert process.poll() is None, f"the run ended before the signal: {process.communicate()}"
            assert time.monotonic() < deadline, "the run never got going"
            time.sleep(0.05)
            children = psutil.Process(process.pid).children(recursive=True)
        for _ in range(times):
            if group:
                os.killpg(process.pid, signum)
            else:
                process.send_signal(signum)
            time.sleep(0.02)
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:  # the test failed: leave nothing running
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), [c.pid for c in children]


def alive(pids: list[int], wait: float = 5.0) -> list[int]:
    """The processes among `pids` still running (zombies count as ended) after up to `wait` seconds."""
    import time

    import psutil

    deadline = time.monotonic() + wait
    while True:
        running = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


# ----------------------------------------------------------------------------- tiny models for decoding


def lively_weights(model: Any) -> Any:
    """`model` (a GPT, in place) with random weights large enough that greedy decoding keeps changing tokens
    (GPT-2's small init makes a random model repeat one token, which would hide a wrong window, row or cache)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 1.0 if ".wte" in name or ".wpe" in name else 2.0 / param.shape[-1] ** 0.5)
    return model


def lively_model(vocab_size: int = 37, seed: int = 0, **overrides: Any) -> Any:
    """A tiny GPT in eval mode (2 layers, 32 wide, 16-token context, untied head unless `overrides` say otherwise)
    with lively_weights."""
    import torch

    from gptkit.model import GPT, GPTConfig

    settings = dict(block_size=16, vocab_size=vocab_size, n_layer=2, n_head=2, n_embd=32, tie_embeddings=False)
    torch.manual_seed(seed)
    return lively_weights(GPT(GPTConfig(**{**settings, **overrides})).eval())


def overflowing_model(vocab_size: int = 37, token: int = 5, seed: int = 0) -> Any:
    """A lively model (RMSNorm, rotary positions, no biases) with finite weights whose logit of token 0 overflows
    float32 to infinity exactly at the steps that feed `token`, and is 0 at every other step: channel 0 of the
    residual stream holds `token`'s own embedding (1000) and nothing else writes to it, so after the final RMSNorm
    it is about sqrt(n_embd) there and 0 elsewhere, and the head reads it with a weight of 1e38."""
    import torch

    model = lively_model(vocab_size, seed, norm="rmsnorm", pos_encoding="rope", bias=False)
    with torch.no_grad():
        model.transformer.wte.weight[:, 0] = 0.0
        model.transformer.wte.weight[token, 0] = 1e3
        for block in model.transformer.h:
            block.attn.c_proj.weight[0] = 0.0
            block.mlp.c_proj.weight[0] = 0.0
        model.lm_head.weight[0, 0] = 1e38
    return model


def count_calls(monkeypatch: Any, owner: type, name: str) -> list[int]:
    """A list that gets one entry for each call of the method owner.name while the test lasts (the calls still
    run)."""
    calls: list[int] = []
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda self, *args: calls.append(1) or original(self, *args))
    return calls


def count_native_steps(monkeypatch: Any) -> list[int]:
    """A list that gets one entry for each native decoding step run while the test lasts (the steps still run)."""
    from gptkit.infer.native import NativeStep

    return count_calls(monkeypatch, NativeStep, "__call__")


def plain_copy(model: Any) -> Any:
    """The same weights in a model no engine has touched (no fast path, no packed copy)."""
    from gptkit.model import GPT

    copy = GPT(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def dequantized_model(quantized: Any, original: Any) -> Any:
    """A plain float32 copy of `original` whose Linear weights are those `quantized` (its int8 version, made by
    gptkit.weights.quantization.quantize_int8) stands for (dequantized_weight)."""
    import torch

    reference = plain_copy(original)
    int8_layers = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight = torch.nn.Parameter(dequantized_weight(int8_layers[name]).float())
    return reference


def with_16_bit_inputs(model: Any) -> Any:
    """`model` (in place) with each Linear's input rounded as the native int8 step rounds it: every row (one token's
    values) to integers of magnitude at most 32767, times one scale, the row's largest |x| / 32767 (the limit for
    rows up to 4128 wide; tests use narrower ones)."""
    import torch

    def round_rows(module: Any, inputs: tuple) -> tuple:
        x = inputs[0]
        largest = x.abs().amax(dim=-1, keepdim=True)
        integers = torch.where(largest > 0, torch.round(x * (32767 / largest)), torch.zeros_like(x))
        return (integers * (largest / 32767),)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_rows)
    return model


def with_16_bit_group_inputs(model: Any) -> Any:
    """A copy of `model` (its products Int4Linear, its head maybe an Int8GroupedLinear) with each product's input
    rounded as the native int4 step rounds it: every group of 32 values (of one token's) to integers of magnitude at
    most 32639 (127 * 256 + 127: the step splits each into two signed bytes), times one scale, the group's largest
    |x| / 32639."""
    import copy

    import torch
    import torch.nn.functional as F

    from gptkit.weights.quantization import GROUP, Int4Linear, Int8GroupedLinear

    def round_groups(module: Any, inputs: tuple) -> tuple:
        x = inputs[0]
        groups = F.pad(x, (0, -x.shape[-1] % GROUP)).unflatten(-1, (-1, GROUP))
        largest = groups.abs().amax(dim=-1, keepdim=True)
        integers = torch.where(largest > 0, torch.round(groups * (32639 / largest)), torch.zeros_like(groups))
        return ((integers * (largest / 32639)).flatten(-2)[..., : x.shape[-1]],)

    reference = copy.deepcopy(model)
    for module in reference.modules():
        if isinstance(module, (Int4Linear, Int8GroupedLinear)):
            module.register_forward_pre_hook(round_groups)
    return reference


def q8_0_linear(product: Any) -> Any:
    """An Int8GroupedLinear of the Q8_0 blocks of `product`'s weight (a Linear's or an Int4Linear's; its rows whole
    groups of 32), quantized here as ggml's reference quantizer does: per group, d = largest |w| / 127 and
    code = round(w / d), d stored as float16; its bias kept."""
    import torch

    from gptkit.weights.quantization import Int8Blocks, Int8GroupedLinear

    linear = isinstance(product, torch.nn.Linear)
    weight = (product.weight if linear else product.dequantized_weight()).detach().double()
    groups = weight.view(weight.shape[0], -1, 32)
    d = groups.abs().amax(dim=-1) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    blocks = Int8Blocks(torch.round(groups * inverse[..., None]).to(torch.int8), d.half())
    bias = None if product.bias is None else product.bias.detach().float().clone()
    return Int8GroupedLinear(lambda start, stop: blocks.rows(lambda part: part[start:stop]), *weight.shape, bias)


def with_q8_0_head(model: Any) -> Any:
    """`model` (in place, returned) with its head the Int8GroupedLinear of its Q8_0 blocks (q8_0_linear)."""
    model.lm_head = q8_0_linear(model.lm_head)
    return model


def as_q8_0(model: Any) -> Any:
    """`model` (in place, returned) with every product, the head's too, the Int8GroupedLinear of its Q8_0 blocks
    (q8_0_linear): a Q8_0 file's model."""
    import torch

    from gptkit.weights.quantization import Int4Linear

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, (torch.nn.Linear, Int4Linear)):
                setattr(module, name, q8_0_linear(child))
    return model


def as_q4_0(model: Any) -> Any:
    """`model` (in place, returned; its products Int4Linear) with every minimum -8 times its scale, the codes kept:
    Q4_0's blocks, weight = scale * (code - 8)."""
    from gptkit.weights.quantization import Int4Linear

    for module in model.modules():
        if isinstance(module, Int4Linear):
            module.minimum = -8 * module.scale
    return model


def step_with_dynamos_eager_backend(monkeypatch: Any) -> None:
    """The compiled decoding step through dynamo with its eager backend (no inductor): dynamo's graphs, the step's
    own guards (its guard filter) and limits in milliseconds where inductor would take many seconds a graph. For tests
    of what is around the step (the engine's rows, which graph serves which model, a benchmark's arithmetic), not of
    inductor's kernels."""
    import functools

    import torch

    from gptkit.infer import compiled

    options = {"guard_filter_fn": compiled.model_identity_guards}
    eager_step = functools.cache(
        lambda device: torch.compile(compiled._step, fullgraph=True, backend="eager", options=dict(options))
    )
    monkeypatch.setattr(compiled, "compiled_step", eager_step)


def reference_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of model.py's plain `generate` (a full forward pass per token, no cache) after `prompt`."""
    import torch

    return model.generate(torch.tensor([prompt]), steps, temperature=0)[0, len(prompt) :].tolist()


def greedy_llama_cpp(llm: Any, prompt: list[int], count: int) -> list[int]:
    """`count` greedy tokens after `prompt` from llama.cpp (a llama_cpp.Llama), no repetition penalty."""
    tokens = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(token)
        if len(tokens) == count:
            return tokens
    return tokens


# ----------------------------------------------------------------------------- a served model (serve.py)

SERVE_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\nROMEO: Juliet?\n"


def lively_char_checkpoint(
    out_dir: Path, text: str = SERVE_TEXT, seed: int = 0, chat: bool = False, **shape: int
) -> CharTokenizer | ChatTokenizer:
    """A random char-level GPT (2 layers, 32 wide, 32-token context unless `shape` says otherwise) whose weights are
    large enough that greedy decoding keeps changing characters (GPT-2's small init repeats one), saved with its
    tokenizer as out_dir/ckpt.pt; with `chat`, the tokenizer has an end-of-text token and the chat template.
    Returns the tokenizer."""
    import torch

    from gptkit.model import GPT, GPTConfig, config_to_dict
    from gptkit.weights.checkpoint import save_checkpoint

    tokenizer = CharTokenizer.from_text(text)
    if chat:
        tokenizer = ChatTokenizer.extending(CharTokenizer.from_text(text, eot=True))
    torch.manual_seed(seed)
    settings = {"block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "tie_embeddings": False, **shape}
    model = lively_weights(GPT(GPTConfig(vocab_size=tokenizer.vocab_size, **settings)))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(
        out_dir / "ckpt.pt",
        {"model": model.state_dict(), "model_args": config_to_dict(model.config), "tokenizer": tokenizer.to_meta()},
    )
    return tokenizer


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# The tests' requests to the servers they start: one client, one connection pool (a client per request, as httpx.post
# makes, builds an SSL context each time: more CPU than a request to a local server).
HTTP = httpx.Client(timeout=60)


def get_json(url: str, timeout: float = 5) -> Any:
    """GET `url` and parse its JSON answer (urllib: no client library needed)."""
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


@contextlib.contextmanager
def serve_process(*args: str, log: Path, timeout: float = 120) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `serve.py ARGS --port=P` (P a free loopback port) until the block ends; yields (base URL, process) once
    /health answers. Its output goes to `log` (never a pipe nobody reads, which would stall the server)."""
    import time

    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, str(REPO / "serve.py"), *args, f"--port={port}"],
            cwd=REPO,
            env=clean_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, f"serve.py exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"serve.py never answered: {log.read_text()}"
            try:
                get_json(f"{base}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        yield base, process
    finally:
        process.terminate()
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# ----------------------------------------------------------------------------- evaluation items


def write_items(path: Path, items: list[Any]) -> Path:
    """HellaSwag-format JSONL (ctx, endings, label) of gptkit.eval.hellaswag items, as the real file is laid out."""
    lines = [json.dumps({"ctx": i.context, "endings": list(i.endings), "label": i.label}) for i in items]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@contextlib.contextmanager
def running_app(model: Any, tokenizer: Any, **settings: Any) -> Iterator[str]:
    """The app for `model` served by uvicorn in a thread on a free loopback port; yields the base URL."""
    from gptkit.serve.app import ServeSettings, create_app, listen

    cfg = ServeSettings(model_name="m", access_log=False, **settings)
    app = create_app(model, tokenizer, cfg)
    sock = listen("127.0.0.1", 0)
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def items_from_text(
    text: str, count: int, context_chars: int = 200, ending_chars: int = 40, choices: int = 4, seed: int = 0
) -> list[Any]:
    """HellaSwag-format items cut from `text` (held-out text a model never trained on): the context ends before a
    space, the right ending is the text's real continuation after it, the wrong endings are spans of the same
    length that also start a word after a space, from elsewhere in the text; the right one's place is random. So
    the endings look alike one by one, and only a model that has learnt how the text goes on picks the real
    continuation far above chance (1/choices); an untrained one stays near chance."""
    import random

    from gptkit.core.errors import UserError
    from gptkit.eval.hellaswag import Item

    rng = random.Random(seed)
    starts = [
        i + 1
        for i, c in enumerate(text[: len(text) - ending_chars - 1])
        if c == " " and i >= context_chars and not text[i + 1].isspace()
    ]
    if len(starts) < max(count, 2 * choices):
        raise UserError(f"the text is too short for {count} items of {context_chars}+{ending_chars} characters")
    items = []
    for start in rng.sample(starts, count):
        others = [s for s in rng.sample(starts, 3 * choices) if abs(s - start) > ending_chars][: choices - 1]
        endings = [text[s : s + ending_chars] for s in [start, *others]]
        label = rng.randrange(len(endings))
        endings[0], endings[label] = endings[label], endings[0]
        items.append(Item(context=text[start - 1 - context_chars : start - 1], endings=tuple(endings), label=label))
    return items


# ------------------------------------------------------------------------------------------ memory


def reset_peak_memory() -> None:
    """The process's peak resident memory reset to what is resident (Linux: /proc/self/clear_refs); elsewhere the
    test is skipped."""
    import pytest

    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("this system cannot reset the process's peak resident memory")


def peak_rise(action: Callable[[], Any]) -> tuple[Any, int]:
    """action()'s result and how far the process's peak resident memory rose above its resident memory before it
    (Linux: /proc/self/clear_refs resets the peak to what is resident; elsewhere the test is skipped). Memory that
    earlier tests in this process freed is handed back to the system first, or the action would reuse it unseen."""
    gc.collect()
    release_freed_memory()
    reset_peak_memory()
    before = process_memory("VmRSS")
    result = action()
    return result, process_memory("VmHWM") - before


# QLoRA's set-up, measured in a Python process of its own as train.py runs it at the start of its process: in a test
# worker the allocator's state that earlier tests leave moves the peak (once by 0.7 of the products' float32 bytes).
QLORA_SET_UP_PEAKS = """
import json, sys
import torch
from gptkit.weights import load
from gptkit.weights.lora import LoraConfig, add_lora
from helpers import peak_rise

torch.set_num_threads(1)


def qlora(int4_products):
    model = load(sys.argv[1], tokenizer=False, int4_products=int4_products).model
    return add_lora(model, LoraConfig(rank=4, targets="all"), base_weights="int4")


qlora(True)  # once unmeasured: what the first read imports or caches is not the set-up's cost
model, float32_rise = peak_rise(lambda: qlora(False))
del model
_, int4_rise = peak_rise(lambda: qlora(True))
print(json.dumps([float32_rise, int4_rise]))
"""


def qlora_set_up_peaks(source: Path) -> tuple[int, int]:
    """How far QLoRA's set-up from `source` (load, then add_lora over every product on int4 base weights) raises the
    peak resident memory of a fresh process: with the products read in float32 first, and read as int4 blocks.
    Skipped where the peak cannot be reset (checked here: in the process below the skip would be a failure)."""
    reset_peak_memory()
    env = clean_env(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))
    command = [sys.executable, "-c", QLORA_SET_UP_PEAKS, str(source)]
    measured = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert measured.returncode == 0, measured.stderr[-3000:]
    float32_rise, int4_rise = json.loads(measured.stdout.splitlines()[-1])
    return float32_rise, int4_rise


def release_freed_memory() -> None:
    """glibc's malloc_trim: freed heap memory back to the system (elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def process_memory(field: str) -> int:
    """A /proc/self/status memory figure, in bytes."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field))
    return int(line.split()[1]) * 1024
