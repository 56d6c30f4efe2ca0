"""End-to-end tests of prepare_data/corpus.py: outputs, meta.json, bad input, crashes.

The runs whose process is under test (offline BPE files, a crash, a stop signal, kill -9) start the script as a
process; the others call its main in this process (helpers.run_in_process), the same code without starting Python
and torch again."""

from __future__ import annotations

import gzip
import json
import os
import py_compile
import shutil
import signal
import subprocess
import sys
import textwrap
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from gptkit.data import tokenizer as tok
from gptkit.data.meta import read_meta
from gptkit.data.prepare import discover
from gptkit.data.prepare.items import is_val_document
from helpers import (
    REPO,
    SHAKESPEARE,
    alive,
    assert_script_error,
    clean_env,
    copy_gpt2_bpe_files,
    run_in_process,
    run_script,
    signal_mid_run,
)
from prepare_data import corpus

CORPUS = "prepare_data/corpus.py"


@pytest.fixture
def run_corpus(capsys: pytest.CaptureFixture) -> Callable[..., subprocess.CompletedProcess]:
    """corpus.py's main in this process, called with the flags a user types, as a finished process."""
    return lambda *args: run_in_process(corpus.main, list(args), capsys)


def assert_nothing_written(out_dir: Path) -> None:
    assert not out_dir.exists() or list(out_dir.iterdir()) == []


@pytest.fixture(scope="module")
def paragraphs() -> list[str]:
    return [p for p in SHAKESPEARE.read_text(encoding="utf-8").split("\n\n") if p.strip()]


@pytest.fixture
def mixed_corpus(tmp_path: Path, paragraphs: list[str]) -> Path:
    """A directory with a JSONL file, a gzipped JSONL file and a few text files."""
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    with open(root / "a.jsonl", "w") as handle:
        for text in paragraphs[:150]:
            handle.write(json.dumps({"body": text}) + "\n")
    with gzip.open(root / "sub" / "b.jsonl.gz", "wt") as handle:
        for text in paragraphs[150:300]:
            handle.write(json.dumps({"body": text}) + "\n")
    for i in range(6):
        (root / "sub" / f"t{i}.md").write_text("\n\n".join(paragraphs[300 + 20 * i : 320 + 20 * i]))
    return root


@pytest.mark.gpt2_bpe
def test_mixed_corpus_meta_and_tokens(
    run_corpus: Callable, tmp_path: Path, mixed_corpus: Path, paragraphs: list[str]
) -> None:
    out = tmp_path / "out"
    result = run_corpus(
        f"--input={mixed_corpus}", f"--out_dir={out}", "--text_field=body", "--block_size=16", "--seed=3"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote 3 files to {out}") and "documents" in result.stdout
    meta = read_meta(out, check_files=True)
    assert meta["tokenizer"] == {"kind": "tiktoken", "encoding": "gpt2"}
    assert (meta["vocab_size"], meta["dtype"], meta["eot_token"]) == (50257, "uint16", 50256)
    assert meta["source"]["split"] == "by document (keyed hash)" and meta["source"]["seed"] == 3
    # Rebuild the expected streams: files in sorted order, each JSONL line / text file one document.
    enc = tok.TiktokenTokenizer("gpt2")
    documents = [(0, i + 1, p) for i, p in enumerate(paragraphs[:150])]
    documents += [(1, i + 1, p) for i, p in enumerate(paragraphs[150:300])]
    documents += [(2 + i, 0, "\n\n".join(paragraphs[300 + 20 * i : 320 + 20 * i])) for i in range(6)]
    expected: dict[str, list[int]] = {"train": [], "val": []}
    text_bytes = {"train": 0, "val": 0}
    for file_index, key, text in documents:
        split = "val" if is_val_document(3, 0.05, file_index, key) else "train"
        expected[split] += [50256, *enc.encode(text)]
        text_bytes[split] += len(text.encode())
    for split in ("train", "val"):
        info = meta["splits"][split]
        assert np.fromfile(out / f"{split}.bin", dtype=np.uint16).tolist() == expected[split]
        assert info["documents"] == expected[split].count(50256) and info["text_bytes"] == text_bytes[split]
    assert meta["splits"]["val"]["documents"] > 0


@pytest.mark.gpt2_bpe
def test_same_seed_same_split_other_seed_differs(run_corpus: Callable, tmp_path: Path, mixed_corpus: Path) -> None:
    common = [f"--input={mixed_corpus}", "--text_field=body", "--block_size=16", "--num_workers=2"]
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        assert run_corpus(*common, f"--out_dir={tmp_path / name}", f"--seed={seed}").returncode == 0
    assert (tmp_path / "a" / "val.bin").read_bytes() == (tmp_path / "b" / "val.bin").read_bytes()
    assert (tmp_path / "a" / "train.bin").read_bytes() == (tmp_path / "b" / "train.bin").read_bytes()
    assert (tmp_path / "a" / "val.bin").read_bytes() != (tmp_path / "c" / "val.bin").read_bytes()


def test_char_tokenizer_and_shards(run_corpus: Callable, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_corpus(
        f"--input={SHAKESPEARE}",
        f"--out_dir={out}",
        "--tokenizer=char",
        "--shard_tokens=50000",
        "--val_fraction=0.1",
    )
    assert result.returncode == 0, result.stderr
    meta = read_meta(out, check_files=True)
    chars = sorted(set(SHAKESPEARE.read_text(encoding="utf-8")))
    assert meta["tokenizer"] == {"kind": "char", "chars": chars, "eot": True}
    assert meta["vocab_size"] == 63 and meta["eot_token"] == 62  # the corpus' 62 characters and the end-of-text
    train_tokens = meta["splits"]["train"]["tokens"]
    assert 0.89 < train_tokens / (1 + SHAKESPEARE.stat().st_size) < 0.91
    assert meta["splits"]["train"]["files"] == [f"train_{i:06d}.bin" for i in range(-(-train_tokens // 50000))]
    stream = np.concatenate(
        [np.fromfile(out / n, dtype=np.uint16) for s in ("train", "val") for n in meta["splits"][s]["files"]]
    )
    assert stream.size == 1 + SHAKESPEARE.stat().st_size
    assert tok.tokenizer_from_meta(meta["tokenizer"]).decode(stream[1:].tolist()) == SHAKESPEARE.read_text()


@pytest.mark.gpt2_bpe
def test_bpe_dir_offline(run_corpus: Callable, tmp_path: Path) -> None:
    """A process: this one has GPT-2's encoding loaded already, the process starts with tiktoken's cache out of
    reach. The damaged files are refused before any encoding is loaded, here in this process."""
    bpe = copy_gpt2_bpe_files(tmp_path / "bpe")
    offline = clean_env(TIKTOKEN_CACHE_DIR=str(tmp_path / "empty-cache"))
    ok = run_script(CORPUS, f"--input={SHAKESPEARE}", f"--out_dir={tmp_path / 'o'}", f"--bpe_dir={bpe}", env=offline)
    assert ok.returncode == 0, ok.stderr
    splits = read_meta(tmp_path / "o")["splits"]
    gpt2_tokens = len(tiktoken.get_encoding("gpt2").encode_ordinary(SHAKESPEARE.read_text(encoding="utf-8")))
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == gpt2_tokens + 1  # the text plus one end-of-text
    (bpe / "encoder.json").write_text("{}")
    bad = run_corpus(f"--input={SHAKESPEARE}", f"--out_dir={tmp_path / 'o2'}", f"--bpe_dir={bpe}")
    assert_script_error(bad, "encoder.json has sha256")
    assert_nothing_written(tmp_path / "o2")


BAD_UTF8 = b"good line\nanother line \xff\xfe broken\nmore\n"


@pytest.mark.parametrize(
    "setup, args, fragments",
    [
        ("bad_text", [], ["bad.txt is not valid UTF-8 at byte offset 23", "--on_decode_error"]),
        ("bad_jsonl", [], ["bad.jsonl is not valid UTF-8 at byte offset", "(line 2)"]),
        ("bad_json", [], ["bad.jsonl:2: not valid JSON"]),
        ("bad_json", ["--text_field=body"], ["bad.jsonl:1: no string field 'body'"]),
        ("bad_gzip", [], ["not a valid gzip file"]),
        ("missing", [], ["input", "does not exist"]),
        ("empty", [], ["the corpus is empty"]),
        ("small", [], ["split has", "fewer than one training block (block_size 8 + 1)"]),
        ("good", ["--tokenizer=gpt5"], ["unknown tokenizer 'gpt5'"]),
        ("good", ["--val_fraction=1.5"], ["--val_fraction must be between 0 and 1"]),
        ("good", ["--on_decode_error=ignore"], ["on_decode_error='ignore' is not one of error, replace, skip"]),
        ("good", ["--shards=2"], ["unknown setting 'shards'"]),
    ],
)
@pytest.mark.gpt2_bpe
def test_bad_input_is_one_line_and_writes_nothing(
    run_corpus: Callable, tmp_path: Path, setup: str, args: list[str], fragments: list[str]
) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "good.txt").write_text("a perfectly fine document\n" * 50)
    if setup == "bad_text":
        (inputs / "bad.txt").write_bytes(b"x" * 0 + BAD_UTF8)
    elif setup == "bad_jsonl":
        (inputs / "bad.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    elif setup == "bad_json":
        (inputs / "bad.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    elif setup == "bad_gzip":
        (inputs / "c.jsonl.gz").write_bytes(gzip.compress(b'{"text": "x"}\n' * 100)[:-20])
    elif setup == "missing":
        inputs = tmp_path / "nowhere"
    elif setup == "empty":
        (inputs / "good.txt").write_text("")
    elif setup == "small":
        (inputs / "good.txt").write_text("only a few words here\n")
    out = tmp_path / "out"
    result = run_corpus(f"--input={inputs}", f"--out_dir={out}", "--block_size=8", "--val_fraction=0.5", *args)
    assert_script_error(result, *fragments)
    assert_nothing_written(out)


@pytest.mark.gpt2_bpe
def test_decode_error_replace_and_skip(run_corpus: Callable, tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "bad.txt").write_bytes(BAD_UTF8)
    (inputs / "good.txt").write_text("a perfectly fine document\n" * 50)
    (inputs / "lines.jsonl").write_bytes(
        b'{"text": "a fine line of several words"}\n{"text": "caf\xe9"}\n{"text": "\\ud800 lone"}\n'
    )
    # A seed that puts the two documents valid in every mode (good.txt, the first JSONL line) in different splits.
    seed = next(s for s in range(100) if is_val_document(s, 0.5, 1, 0) != is_val_document(s, 0.5, 2, 1))
    common = [f"--input={inputs}", "--block_size=4", "--val_fraction=0.5", f"--seed={seed}"]
    replaced = run_corpus(*common, f"--out_dir={tmp_path / 'r'}", "--on_decode_error=replace")
    skipped = run_corpus(*common, f"--out_dir={tmp_path / 's'}", "--on_decode_error=skip")
    assert replaced.returncode == 0 and skipped.returncode == 0, replaced.stderr + skipped.stderr
    r, s = read_meta(tmp_path / "r"), read_meta(tmp_path / "s")
    docs = lambda meta: meta["splits"]["train"]["documents"] + meta["splits"]["val"]["documents"]  # noqa: E731
    assert docs(r) == 5 and docs(s) == 2  # skip drops bad.txt, the non-UTF-8 line and the lone surrogate
    assert s["source"]["skipped_documents"] == 3 and "3 documents skipped" in skipped.stdout
    enc = tok.TiktokenTokenizer("gpt2")
    replaced_text = enc.decode(
        np.concatenate([np.fromfile(tmp_path / "r" / f"{x}.bin", dtype=np.uint16) for x in ("train", "val")]).tolist()
    )
    assert "another line \ufffd\ufffd broken" in replaced_text and "caf\ufffd" in replaced_text


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, runpy, sys
    from gptkit.data.prepare import writer
    corpus_main = runpy.run_path({corpus!r})["main"]
    where = sys.argv[1]
    if where == "write":
        real_write, calls = writer.TokenFileWriter.write, []
        def write(self, ids):
            real_write(self, ids)
            calls.append(1)
            if len(calls) == 3:
                os._exit(137)  # the process dies as with kill -9 or a power cut: no cleanup runs
        writer.TokenFileWriter.write = write
    else:
        real_replace = os.replace
        def replace(src, dst):
            if str(dst).endswith(".bin"):
                os._exit(137)
            real_replace(src, dst)
        os.replace = replace
    corpus_main(sys.argv[2:])
    """
)


@pytest.mark.gpt2_bpe
@pytest.mark.parametrize("where", ["write", "commit"])
def test_killed_run_leaves_nothing_that_looks_complete(run_corpus: Callable, tmp_path: Path, where: str) -> None:
    """The crash is a process; the runs before and after it call corpus.py's main in this process."""
    out = tmp_path / "out"
    args = [f"--input={SHAKESPEARE}", f"--out_dir={out}", "--num_workers=1", "--chunk_bytes=20000"]
    if where == "commit":  # an earlier complete dataset is there: the crash must not leave it looking current
        assert run_corpus(*args, "--tokenizer=char").returncode == 0
    script = CRASH_SCRIPT.format(corpus=str(REPO / "prepare_data" / "corpus.py"))
    crashed = subprocess.run(
        [sys.executable, "-c", script, where, *args, "--overwrite=True"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=clean_env(),
    )
    assert crashed.returncode == 137, crashed.stderr
    assert not (out / "meta.json").exists()
    if where == "write":
        assert not (out / "train.bin").exists() and not (out / "val.bin").exists()
        assert any(p.name.endswith(".tmp") for p in out.iterdir())
    rerun = run_corpus(*args)  # token files without meta.json: a run cut short, replaced without --overwrite
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert read_meta(out, check_files=True)["tokenizer"]["kind"] == "tiktoken"


def test_help_lists_settings(run_corpus: Callable) -> None:
    result = run_corpus("--help")
    assert result.returncode == 0
    for key in ("--input", "--tokenizer", "--shard_tokens", "--on_decode_error", "--num_workers", "--block_size"):
        assert key in result.stdout


# ----------------------------------------------------------------------------- stopped by a signal mid-run


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~31 MB of text in 28 files: tens of seconds of tokenising on 2 cores, so a signal lands mid-run."""
    root = tmp_path_factory.mktemp("big_corpus")
    text = SHAKESPEARE.read_text(encoding="utf-8")
    for index in range(28):
        (root / f"part{index:02d}.txt").write_text(f"Part {index}.\n{text}", encoding="utf-8")
    return root


@pytest.mark.parametrize(
    ("signum", "group", "code", "message"),
    [
        (signal.SIGTERM, False, 143, "terminated by SIGTERM"),  # docker stop, kill PID: the main process only
        (signal.SIGTERM, True, 143, "terminated by SIGTERM"),  # timeout, batch schedulers: the process group
        (signal.SIGINT, True, 130, "interrupted"),  # Ctrl-C in a terminal: the process group
    ],
    ids=["sigterm", "sigterm_group", "ctrl_c"],
)
@pytest.mark.gpt2_bpe
def test_a_stop_signal_mid_run_ends_the_workers_and_leaves_nothing(
    tmp_path: Path, big_corpus: Path, signum: int, group: bool, code: int, message: str
) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / CORPUS), f"--input={big_corpus}", f"--out_dir={out}", "--num_workers=2"]
    result, workers = signal_mid_run(command, out, signum, workers=2, group=group)
    assert len(workers) == 2
    assert (result.returncode, result.stderr, result.stdout) == (code, message + "\n", "")
    assert alive(workers) == []  # no tokenising worker left behind with parent 1
    assert not out.exists()  # the run created it: no *.tmp, no train.bin / val.bin / meta.json


@pytest.mark.gpt2_bpe
def test_two_quick_ctrl_cs_end_the_run_as_one_does(tmp_path: Path, big_corpus: Path) -> None:
    """The second Ctrl-C arrives while the workers are being stopped, where it waits until they have left (cut
    short, the stop left them waiting for work and the exit waiting on them forever), or on the way out, where it
    ends the process at once (as the signal's own action: -2 here, 130 in a shell)."""
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / CORPUS), f"--input={big_corpus}", f"--out_dir={out}", "--num_workers=2"]
    result, workers = signal_mid_run(command, out, signal.SIGINT, workers=2, group=True, timeout=60, times=2)
    assert result.returncode in (130, -signal.SIGINT)
    assert (result.stderr, result.stdout) == ("interrupted\n", "")
    assert alive(workers) == [] and not out.exists()


@pytest.mark.gpt2_bpe
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers end with a killed parent only on Linux")
def test_kill_9_mid_run_still_ends_the_workers(tmp_path: Path, big_corpus: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / CORPUS), f"--input={big_corpus}", f"--out_dir={out}", "--num_workers=2"]
    result, workers = signal_mid_run(command, out, signal.SIGKILL, workers=2)
    assert result.returncode == -signal.SIGKILL and len(workers) == 2
    assert alive(workers) == []  # the kernel ends them (no cleanup can run in a killed process)
    assert not (out / "meta.json").exists()  # what is left is *.tmp, removed by the next run


# ----------------------------------------------------------------------------- directory corpora: what is left out

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10\x00\x00\x00\x10\x08\x06\x00\x00\x00" + bytes(range(256)) * 4
TEXT_FILES = [  # what a walk of messy_tree reads, in its order
    "README.md",
    "data/rows.jsonl",
    "docs/guide.txt",
    "docs/notes.txt.gz",
    "docs/deep/er/leaf.md",
    "src/pkg/__init__.py",
    "src/pkg/mod.py",
    "src/pkg/util.py",
]
SKIPPED = {"binary": 3, "__pycache__": 2, "version control": 3, "hidden": 1, "model files": 0, "excluded": 0}
SKIPPED["not a regular file"] = 0


@pytest.fixture
def messy_tree(tmp_path: Path, paragraphs: list[str]) -> Path:
    """A source tree as people have them: text, compiled .pyc files, a .git folder, images, one posing as .txt."""
    root = tmp_path / "tree"
    for index, name in enumerate(TEXT_FILES):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(paragraphs[index * 12 : index * 12 + 12]) + "\n"
        if name.endswith(".py"):
            path.write_text(f"# {name}\nTEXT = {paragraphs[index]!r}\n\n\ndef f{index}(x):\n    return x + {index}\n")
        elif name.endswith(".jsonl"):
            path.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs[200:260]))
        elif name.endswith(".gz"):
            path.write_bytes(gzip.compress(text.encode()))
        else:
            path.write_text(text)
    for name in ("mod.py", "util.py"):
        py_compile.compile(str(root / "src/pkg" / name), doraise=True)  # into src/pkg/__pycache__/
    (root / ".git/objects/ab").mkdir(parents=True)
    (root / ".git/HEAD").write_text("ref: refs/heads/main\n")  # text, but version control
    (root / ".git/index").write_bytes(b"DIRC\x00\x00\x00\x02\x00\x00\x00\x01" + bytes(64))
    (root / ".git/objects/ab/cdef0123456789").write_bytes(zlib.compress(b"blob 12\x00hello world\n"))
    (root / "assets").mkdir()
    (root / "assets/logo.png").write_bytes(PNG)
    (root / "assets/photo.txt").write_bytes(PNG)  # an image renamed .txt
    (root / "assets/bundle.txt.gz").write_bytes(gzip.compress(b"bundle/\x00\x00\x00\x00" + PNG))  # binary inside
    (root / "docs/.guide.txt.swp").write_bytes(b"b0VIM 9.0\n")  # hidden
    return root


def pycache_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("__pycache__/*.pyc"))


def copy_only(root: Path, names: list[str], destination: Path) -> Path:
    """A tree holding only `names` of `root`: what the run on `root` must equal when it reads exactly those."""
    for name in names:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / name, destination / name)
    return destination


def seed_for(documents: int) -> int:
    """A seed that puts some of `documents` text files in each split (val_fraction 0.5)."""
    return next(s for s in range(100) if len({is_val_document(s, 0.5, i, 0) for i in range(documents)}) == 2)


def prepared(
    run_corpus: Callable, out: Path, *flags: str
) -> tuple[subprocess.CompletedProcess, dict, dict[str, bytes]]:
    result = run_corpus(f"--out_dir={out}", "--block_size=8", "--val_fraction=0.5", *flags)
    assert result.returncode == 0, result.stderr
    return result, read_meta(out, check_files=True), {p.name: p.read_bytes() for p in out.glob("*.bin")}


@pytest.mark.gpt2_bpe
def test_a_directory_walk_reads_only_the_text_files(run_corpus: Callable, tmp_path: Path, messy_tree: Path) -> None:
    assert len(pycache_files(messy_tree)) == 2
    seed = f"--seed={seed_for(len(TEXT_FILES))}"
    result, meta, bins = prepared(run_corpus, tmp_path / "out", f"--input={messy_tree}", seed)
    expected_tree = copy_only(messy_tree, TEXT_FILES, tmp_path / "text_only")
    _, expected_meta, expected_bins = prepared(run_corpus, tmp_path / "expected", f"--input={expected_tree}", seed)
    assert bins == expected_bins and meta["splits"] == expected_meta["splits"]  # the same tokens, exactly
    assert meta["source"]["files"] == len(TEXT_FILES) and meta["source"]["skipped_files"] == SKIPPED
    assert expected_meta["source"]["skipped_files"] == dict.fromkeys(SKIPPED, 0)
    assert "; 9 files left out (3 binary, 2 __pycache__, 3 version control, 1 hidden);" in result.stdout


@pytest.mark.parametrize(
    ("flags", "read", "changed"),
    [
        # Exclusion is decided before a file is opened: the binary files it matches count as excluded.
        (["--include=*.py"], TEXT_FILES[5:], {"excluded": 8, "binary": 0}),
        # A folder is left out whole, hidden files in it included.
        (["--exclude=docs", "--exclude=*.md"], ["data/rows.jsonl", *TEXT_FILES[5:]], {"excluded": 5, "hidden": 0}),
        (["--exclude=src/pkg/*", "--exclude=data/"], ["README.md", *TEXT_FILES[2:5]], {"excluded": 4}),
    ],
    ids=["include_py", "exclude_folder_and_name", "exclude_relative_path"],
)
@pytest.mark.gpt2_bpe
def test_include_and_exclude_choose_what_a_walk_reads(
    run_corpus: Callable, tmp_path: Path, messy_tree: Path, flags: list[str], read: list[str], changed: dict[str, int]
) -> None:
    seed = f"--seed={seed_for(len(read))}"
    result, meta, bins = prepared(run_corpus, tmp_path / "out", f"--input={messy_tree}", seed, *flags)
    expected_tree = copy_only(messy_tree, read, tmp_path / "selected")
    _, expected_meta, expected_bins = prepared(run_corpus, tmp_path / "expected", f"--input={expected_tree}", seed)
    assert bins == expected_bins and meta["splits"] == expected_meta["splits"]
    assert meta["source"]["files"] == len(read) and meta["source"]["skipped_files"] == {**SKIPPED, **changed}
    assert meta["source"]["include"] + meta["source"]["exclude"] == [f.split("=", 1)[1] for f in flags]
    assert f"{changed['excluded']} excluded" in result.stdout


@pytest.mark.gpt2_bpe
def test_a_walk_of_a_project_leaves_out_prepared_data_runs_and_model_folders(
    run_corpus: Callable, tmp_path: Path, paragraphs: list[str]
) -> None:
    project = tmp_path / "project"
    (project / "notes").mkdir(parents=True)
    (project / "notes/story.txt").write_text("\n\n".join(paragraphs[:40]) + "\n")
    chat_log = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs[40:60])
    (project / "chatlogs").mkdir()
    (project / "chatlogs/log.jsonl").write_text(chat_log)  # a corpus that a run's log.jsonl is named like
    folders = {  # what this toolkit and the model hubs write: JSON and logs beside the weights or tokens
        "data/char": {"meta.json": '{"vocab_size": 65}', "train.bin": "tokens"},
        "out/run": {"ckpt.pt": "weights", "log.jsonl": '{"iter": 0}\n', "config.json": "{}"},
        "exports/tiny": {"config.json": "{}", "tokenizer.json": '{"model": {}}', "model.safetensors": "weights"},
        "exports/tiny/nested": {"notes.txt": "under a model's folder: left out with it"},
        "exports/old": {"config.json": "{}", "pytorch_model.bin": "weights"},
    }
    for folder, files in folders.items():
        (project / folder).mkdir(parents=True)
        for name, text in files.items():
            (project / folder / name).write_text(text)
    result, meta, bins = prepared(run_corpus, tmp_path / "fresh", f"--input={project}")
    expected = copy_only(project, ["chatlogs/log.jsonl", "notes/story.txt"], tmp_path / "text_only")
    _, _, expected_bins = prepared(run_corpus, tmp_path / "expected", f"--input={expected}")
    assert bins == expected_bins
    assert meta["source"]["files"] == 2 and meta["source"]["skipped_files"]["model files"] == 11
    assert "; 11 files left out (11 model files);" in result.stdout
    # A folder named on its own is read, whatever it holds; one a glob matches is a walk's.
    named = discover.find_inputs([str(project / "out/run")])
    assert sorted(file.path.name for file in named.files) == ["ckpt.pt", "config.json", "log.jsonl"]
    globbed = discover.find_inputs([str(project / "*")])
    assert sorted(file.path.name for file in globbed.files) == ["log.jsonl", "story.txt"]


def test_a_binary_file_named_on_its_own_is_an_error_not_skipped(
    run_corpus: Callable, tmp_path: Path, messy_tree: Path
) -> None:
    pyc = next((messy_tree / "src/pkg/__pycache__").iterdir())
    result = run_corpus(f"--input={pyc}", f"--input={messy_tree / 'README.md'}", f"--out_dir={tmp_path / 'o'}")
    assert_script_error(result, f"--input={pyc} is a binary file, not text or JSONL")
    tokens = tmp_path / "train.bin"  # a token file: NUL bytes, the rest valid UTF-8 (it was read as text)
    np.arange(300, dtype=np.uint16).tofile(tokens)
    result = run_corpus(f"--input={tokens}", f"--out_dir={tmp_path / 'o'}", "--tokenizer=char")
    assert_script_error(result, f"--input={tokens} is a binary file")
    assert_nothing_written(tmp_path / "o")


@pytest.mark.gpt2_bpe
def test_a_latin1_text_file_in_a_tree_is_an_error_naming_file_and_offset(
    run_corpus: Callable, tmp_path: Path, messy_tree: Path
) -> None:
    latin1 = messy_tree / "docs" / "deep" / "legacy.txt"
    latin1.write_bytes("Caf\u00e9 cr\u00e8me, na\u00efve fa\u00e7ade.\n".encode("latin-1"))
    out = tmp_path / "out"
    result = run_corpus(f"--input={messy_tree}", f"--out_dir={out}", "--block_size=8", "--val_fraction=0.5")
    line = assert_script_error(result, f"{latin1} is not valid UTF-8 at byte offset 3;")
    assert line.index("--on_decode_error=skip") < line.index("--on_decode_error=replace")  # skip: a stray file
    assert_nothing_written(out)
    seed = f"--seed={seed_for(len(TEXT_FILES) + 1)}"
    result, meta, _ = prepared(run_corpus, out, f"--input={messy_tree}", "--on_decode_error=skip", seed)
    assert meta["source"]["skipped_documents"] == 1 and meta["source"]["skipped_files"] == SKIPPED
    assert "; 1 document skipped; 9 files left out (" in result.stdout


def python_test_tree() -> tuple[Path, list[str]]:
    """A real tree nobody here wrote: this Python's Lib/test/test_importlib (zip, wheel, egg and UTF-16 data files,
    compiled __pycache__), or where the test package is not installed, the json package with --include=*.py."""
    try:
        import test

        root = Path(test.__file__).parent / "test_importlib"
        if root.is_dir():
            return root, []
    except ImportError:
        pass
    return Path(os.path.dirname(json.__file__)), ["--include=*.py"]


@pytest.mark.gpt2_bpe
def test_a_real_tree_python_lib_test(run_corpus: Callable, tmp_path: Path) -> None:
    root, flags = python_test_tree()
    binary = pycache = 0  # counted here independently of gptkit
    for folder, _, files in os.walk(root):
        if Path(folder).name == "__pycache__":
            pycache += len(files)
            continue
        for name in files:
            with open(os.path.join(folder, name), "rb") as handle:
                binary += b"\0" in handle.read(8192) and not flags
    out = tmp_path / "out"
    result = run_corpus(
        f"--input={root}",
        f"--out_dir={out}",
        "--block_size=8",
        "--on_decode_error=skip",
        "--num_workers=2",
        *flags,
    )
    assert result.returncode == 0, result.stderr
    meta = read_meta(out, check_files=True)
    skipped = meta["source"]["skipped_files"]
    assert (skipped["binary"], skipped["__pycache__"]) == (binary, pycache)
    assert skipped["binary"] > 0 or flags  # test_importlib holds zip, wheel and egg files
    assert meta["splits"]["train"]["tokens"] > 0 and meta["splits"]["val"]["tokens"] > 0
    assert "files left out (" in result.stdout or not (binary or pycache)


def test_earlier_data_a_run_and_other_files_are_never_replaced_silently(run_corpus: Callable, tmp_path: Path) -> None:
    out = tmp_path / "data"
    args = [f"--input={SHAKESPEARE}", f"--out_dir={out}", "--num_workers=1", "--tokenizer=char"]
    assert run_corpus(*args).returncode == 0
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    again = run_corpus(*args, "--val_fraction=0.2")
    assert_script_error(again, f"--out_dir={out} already holds prepared data (meta.json); pass --overwrite=True")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    assert run_corpus(*args, "--val_fraction=0.2", "--overwrite=True").returncode == 0
    assert read_meta(out)["splits"]["val"]["tokens"] > json.loads(before["meta.json"])["splits"]["val"]["tokens"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "ckpt.pt").write_bytes(b"weights")
    refused = run_corpus(f"--input={SHAKESPEARE}", f"--out_dir={run}", "--overwrite=True")
    assert_script_error(refused, "is a training run's directory")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    refused = run_corpus(f"--input={SHAKESPEARE}", f"--out_dir={tmp_path / 'notes'}")
    assert_script_error(refused, "holds other files than prepared data")
    assert sorted(path.name for path in (tmp_path / "notes").iterdir()) == ["todo.txt"]


def tokens_of(out: Path) -> list[int]:
    meta = read_meta(out, check_files=True)
    dtype = np.dtype(meta["dtype"])
    files = [out / name for split in ("train", "val") for name in meta["splits"][split]["files"]]
    return np.concatenate([np.fromfile(path, dtype=dtype) for path in files]).tolist()


def test_a_long_document_cut_into_pieces_has_a_sentencepiece_tokenizers_whole_document_ids(
    run_corpus: Callable, tmp_path: Path
) -> None:
    """Llama 2's tokenizer puts a space before a text's start: a piece after a cut continues its document and gets
    none, so the pieces' ids are transformers' AutoTokenizer's for the whole document (one end-of-text before it)."""
    from transformers import AutoTokenizer

    from hf_tokenizer_dirs import write_sentencepiece

    directory = write_sentencepiece(tmp_path / "llama2", prepend_scheme="first")
    text = SHAKESPEARE.read_text(encoding="utf-8")[:60_000]
    (tmp_path / "play.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    args = [f"--input={tmp_path / 'play.txt'}", f"--tokenizer={directory}", f"--out_dir={out}", "--chunk_bytes=4096"]
    result = run_corpus(*args, "--val_fraction=0.5")
    assert result.returncode == 0, result.stderr
    expected = AutoTokenizer.from_pretrained(str(directory)).encode(text, add_special_tokens=False)
    assert tokens_of(out)[1:] == expected  # train's pieces, then val's, cut in the middle of the document


@pytest.mark.gpt2_bpe
def test_a_byte_order_mark_opening_a_file_is_no_text(run_corpus: Callable, tmp_path: Path) -> None:
    """A UTF-8 byte-order mark opening a text or JSONL file is left out (as Python's utf-8-sig reads it): the ids are
    tiktoken's of the texts alone."""
    encoding = tiktoken.get_encoding("gpt2")
    body = "hear me\u00a0\nspeak, " * 800
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbf" + body.encode())
    result = run_corpus(
        f"--input={tmp_path / 'a.txt'}", f"--out_dir={tmp_path / 'a'}", "--chunk_bytes=512", "--block_size=8"
    )
    assert result.returncode == 0, result.stderr
    assert tokens_of(tmp_path / "a") == [encoding.eot_token, *encoding.encode_ordinary(body)]
    records = [f"Record {i}: hear me speak." for i in range(60)]
    lines = "".join(json.dumps({"text": record}) + "\n" for record in records)
    (tmp_path / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    result = run_corpus(f"--input={tmp_path / 'b.jsonl'}", f"--out_dir={tmp_path / 'b'}", "--block_size=8")
    assert result.returncode == 0, result.stderr
    expected = [token for record in records for token in [encoding.eot_token, *encoding.encode_ordinary(record)]]
    assert sorted(tokens_of(tmp_path / "b")) == sorted(expected)
