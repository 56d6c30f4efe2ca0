"""End-to-end tests of prepare_data/corpus.py run as a subprocess: outputs, meta.json, bad input, crashes."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gptkit import tokenizer as tok
from gptkit.prepare import pipeline

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"


def run_corpus(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "prepare_data" / "corpus.py"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def assert_user_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


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


def test_mixed_corpus_meta_and_tokens(tmp_path: Path, mixed_corpus: Path, paragraphs: list[str]) -> None:
    out = tmp_path / "out"
    result = run_corpus(
        f"--input={mixed_corpus}", f"--out_dir={out}", "--text_field=body", "--block_size=16", "--seed=3"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"wrote 3 files to {out}") and "documents" in result.stdout
    meta = tok.read_meta(out, check_files=True)
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
        split = "val" if pipeline.is_val_document(3, 0.05, file_index, key) else "train"
        expected[split] += [50256, *enc.encode(text)]
        text_bytes[split] += len(text.encode())
    for split in ("train", "val"):
        info = meta["splits"][split]
        assert np.fromfile(out / f"{split}.bin", dtype=np.uint16).tolist() == expected[split]
        assert info["documents"] == expected[split].count(50256) and info["text_bytes"] == text_bytes[split]
    assert meta["splits"]["val"]["documents"] > 0


def test_same_seed_same_split_other_seed_differs(tmp_path: Path, mixed_corpus: Path) -> None:
    common = [f"--input={mixed_corpus}", "--text_field=body", "--block_size=16", "--num_workers=2"]
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        assert run_corpus(*common, f"--out_dir={tmp_path / name}", f"--seed={seed}").returncode == 0
    assert (tmp_path / "a" / "val.bin").read_bytes() == (tmp_path / "b" / "val.bin").read_bytes()
    assert (tmp_path / "a" / "train.bin").read_bytes() == (tmp_path / "b" / "train.bin").read_bytes()
    assert (tmp_path / "a" / "val.bin").read_bytes() != (tmp_path / "c" / "val.bin").read_bytes()


def test_char_tokenizer_and_shards(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_corpus(
        f"--input={SHAKESPEARE}", f"--out_dir={out}", "--tokenizer=char", "--shard_tokens=300000", "--val_fraction=0.1"
    )
    assert result.returncode == 0, result.stderr
    meta = tok.read_meta(out, check_files=True)
    chars = sorted(set(SHAKESPEARE.read_text(encoding="utf-8")))
    assert meta["tokenizer"] == {"kind": "char", "chars": chars, "eot": True}
    assert meta["vocab_size"] == 66 and meta["eot_token"] == 65
    assert meta["splits"]["train"]["files"] == [f"train_{i:06d}.bin" for i in range(4)]
    stream = np.concatenate(
        [np.fromfile(out / n, dtype=np.uint16) for s in ("train", "val") for n in meta["splits"][s]["files"]]
    )
    assert stream.size == 1 + SHAKESPEARE.stat().st_size
    assert tok.tokenizer_from_meta(meta["tokenizer"]).decode(stream[1:].tolist()) == SHAKESPEARE.read_text()


def test_bpe_dir_offline(tmp_path: Path) -> None:
    import hashlib
    import shutil

    cache = Path(os.environ["TIKTOKEN_CACHE_DIR"])
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    for name in ("vocab.bpe", "encoder.json"):
        url = f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}"
        shutil.copyfile(cache / hashlib.sha1(url.encode()).hexdigest(), bpe / name)
    offline = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache")}  # tiktoken's own cache is out of reach
    ok = run_corpus(f"--input={SHAKESPEARE}", f"--out_dir={tmp_path / 'o'}", f"--bpe_dir={bpe}", env=offline)
    assert ok.returncode == 0, ok.stderr
    splits = tok.read_meta(tmp_path / "o")["splits"]
    assert splits["train"]["tokens"] + splits["val"]["tokens"] == 338025 + 1  # the text plus one end-of-text
    (bpe / "encoder.json").write_text("{}")
    bad = run_corpus(f"--input={SHAKESPEARE}", f"--out_dir={tmp_path / 'o2'}", f"--bpe_dir={bpe}", env=offline)
    assert_user_error(bad, "encoder.json has sha256")
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
        ("good", ["--on_decode_error=ignore"], ["--on_decode_error must be one of"]),
        ("good", ["--shards=2"], ["unknown setting 'shards'"]),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    tmp_path: Path, setup: str, args: list[str], fragments: list[str]
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
    assert_user_error(result, *fragments)
    assert_nothing_written(out)


def test_decode_error_replace_and_skip(tmp_path: Path) -> None:
    inputs = tmp_path / "in"
    inputs.mkdir()
    (inputs / "bad.txt").write_bytes(BAD_UTF8)
    (inputs / "good.txt").write_text("a perfectly fine document\n" * 50)
    (inputs / "lines.jsonl").write_bytes(
        b'{"text": "a fine line of several words"}\n{"text": "caf\xe9"}\n{"text": "\\ud800 lone"}\n'
    )
    # A seed that puts the two documents valid in every mode (good.txt, the first JSONL line) in different splits.
    seed = next(
        s for s in range(100) if pipeline.is_val_document(s, 0.5, 1, 0) != pipeline.is_val_document(s, 0.5, 2, 1)
    )
    common = [f"--input={inputs}", "--block_size=4", "--val_fraction=0.5", f"--seed={seed}"]
    replaced = run_corpus(*common, f"--out_dir={tmp_path / 'r'}", "--on_decode_error=replace")
    skipped = run_corpus(*common, f"--out_dir={tmp_path / 's'}", "--on_decode_error=skip")
    assert replaced.returncode == 0 and skipped.returncode == 0, replaced.stderr + skipped.stderr
    r, s = tok.read_meta(tmp_path / "r"), tok.read_meta(tmp_path / "s")
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
    from gptkit.prepare import pipeline
    corpus_main = runpy.run_path({corpus!r})["main"]
    where = sys.argv[1]
    if where == "write":
        real_write, calls = pipeline.TokenFileWriter.write, []
        def write(self, ids):
            real_write(self, ids)
            calls.append(1)
            if len(calls) == 3:
                os._exit(137)  # the process dies as with kill -9 or a power cut: no cleanup runs
        pipeline.TokenFileWriter.write = write
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


@pytest.mark.parametrize("where", ["write", "commit"])
def test_killed_run_leaves_nothing_that_looks_complete(tmp_path: Path, where: str) -> None:
    out = tmp_path / "out"
    args = [f"--input={SHAKESPEARE}", f"--out_dir={out}", "--num_workers=1", "--chunk_bytes=20000"]
    if where == "commit":  # an earlier complete dataset is there: the crash must not leave it looking current
        assert run_corpus(*args, "--tokenizer=char").returncode == 0
    script = CRASH_SCRIPT.format(corpus=str(REPO / "prepare_data" / "corpus.py"))
    crashed = subprocess.run([sys.executable, "-c", script, where, *args], capture_output=True, text=True, cwd=REPO)
    assert crashed.returncode == 137, crashed.stderr
    assert not (out / "meta.json").exists()
    if where == "write":
        assert not (out / "train.bin").exists() and not (out / "val.bin").exists()
        assert any(p.name.endswith(".tmp") for p in out.iterdir())
    rerun = run_corpus(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert tok.read_meta(out, check_files=True)["tokenizer"]["kind"] == "tiktoken"


def test_help_lists_settings() -> None:
    result = run_corpus("--help")
    assert result.returncode == 0
    for key in ("--input", "--tokenizer", "--shard_tokens", "--on_decode_error", "--num_workers", "--block_size"):
        assert key in result.stdout
