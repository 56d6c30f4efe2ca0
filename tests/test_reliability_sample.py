"""sample.py given hostile or broken input: prompts, prompt files, tokenizer records, checkpoint locations.

Already covered in tests/test_sample.py and not repeated: characters outside the vocabulary in --start, an empty
--start, max_new_tokens=0, top_p outside (0, 1], top_k=0, temperature<0, a checkpoint without a tokenizer record.
Bad setting values are in tests/test_reliability_config.py, damaged and malicious checkpoints in
tests/test_reliability_train.py. Every failure: exit code 2, one line on stderr starting with "error:", no
traceback, nothing written.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import eval as eval_script
import sample
from gptkit.core.errors import UserError, run_cli
from gptkit.data.hf_tokenizer import HFTokenizer, make_record
from gptkit.data.meta import write_meta
from gptkit.data.tokenizer import CharTokenizer
from gptkit.infer.native import build as native_build
from gptkit.model import GPT, GPTConfig, config_to_dict
from gptkit.weights.checkpoint import save_checkpoint, tokenizer_record
from helpers import overflowing_model, run_main

TEXT = "To be, or not to be, that is the question:\n"


def char_checkpoint(out_dir: Path, tokenizer: dict | None, vocab_size: int) -> Path:
    """A tiny untrained model saved as out_dir/ckpt.pt, with `tokenizer` as its tokenizer record."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=vocab_size, n_layer=1, n_head=2, n_embd=16))
    state = {"model": model.state_dict(), "model_args": config_to_dict(model.config)}
    if tokenizer is not None:
        state["tokenizer"] = tokenizer
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(out_dir / "ckpt.pt", state)
    return out_dir


@pytest.fixture
def out_dir(tmp_path: Path) -> Path:
    tokenizer = CharTokenizer.from_text(TEXT)
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": None}
    return char_checkpoint(tmp_path / "out", tokenizer_record(meta), tokenizer.vocab_size)


def cli(args: list[str], capsys: pytest.CaptureFixture, stdin: str | None = None) -> tuple[int, str, str]:
    """sample.main through errors.run_cli, in this process; (exit code, stdout, stderr)."""
    capsys.readouterr()
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        with pytest.raises(SystemExit) as exit_info:
            run_cli(sample.main, ["--device=cpu", *args])
    finally:
        sys.stdin = sys.__stdin__
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def assert_one_line_error(code: int, stderr: str, fragment: str) -> None:
    assert code == 2 and "Traceback" not in stderr
    assert stderr.count("\n") == 1 and stderr.startswith("error: ") and fragment in stderr, stderr


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_tiny_checkpoint_samples(out_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code, stdout, stderr = cli([f"--out_dir={out_dir}", "--start=To be", "--max_new_tokens=7"], capsys)
    assert code == 0, stderr
    assert stdout.startswith("To be") and len(stdout) == len("To be") + 7 + 1


@pytest.mark.parametrize(
    ("prompt_file", "fragment"),
    [
        (b"", "the prompt is empty"),
        ("Zürich ☃".encode(), "4 character(s) not in the character vocabulary: 'Z', 'c', 'ü', '☃'"),
        (b"To be\nor \xff not", "prompt.txt:2: not UTF-8 text (byte 0xff); save the file as UTF-8"),
        (None, "error: prompt file {path} does not exist"),
    ],
    ids=["empty", "out_of_vocabulary", "not_utf8", "missing"],
)
def test_bad_prompt_files(
    prompt_file: bytes | None, fragment: str, out_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "prompt.txt"
    if prompt_file is not None:
        path.write_bytes(prompt_file)
    before = tree(tmp_path)
    code, stdout, stderr = cli([f"--out_dir={out_dir}", f"--start=FILE:{path}"], capsys)
    assert_one_line_error(code, stderr, fragment.format(path=path))
    assert stdout == "" and tree(tmp_path) == before


def test_a_prompt_the_tokenizer_makes_no_tokens_of_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A word-level tokenizer.json splits on whitespace and keeps none: a prompt of spaces leaves nothing to start
    from."""
    words = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "to": 1, "be": 2}, "unk_token": "[UNK]"},
    }
    tokenizer = HFTokenizer(make_record("words", json.dumps(words), {}, None, []))
    assert tokenizer.encode("to   be") == [1, 2] and tokenizer.encode("   ") == []
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": 3, "eot_token": None}
    out = char_checkpoint(tmp_path / "out", tokenizer_record(meta), 3)
    code, stdout, stderr = cli([f"--out_dir={out}", "--start=   ", "--max_new_tokens=2"], capsys)
    assert_one_line_error(code, stderr, "gives no tokens")
    assert stdout == ""


def test_prompt_file_that_is_a_directory(out_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, stderr = cli([f"--out_dir={out_dir}", f"--start=FILE:{tmp_path}"], capsys)
    assert_one_line_error(code, stderr, f"Is a directory ({tmp_path})")


def test_interactive_skips_empty_lines_and_goes_on_after_an_unknown_character(
    out_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    code, stdout, stderr = cli([f"--out_dir={out_dir}", "--interactive", "--max_new_tokens=3"], capsys, "To\n\n€\nbe\n")
    assert code == 0
    assert stderr.count("\n") == 1 and "not in the character vocabulary: '€'" in stderr, stderr
    assert (
        stderr.startswith("error: ") and stderr.rstrip().endswith("type another prompt") and "Traceback" not in stderr
    )
    answers = stdout.split(sample.SEPARATOR)
    assert len(answers) == 3 and answers[0].startswith("To") and answers[1].startswith("be") and answers[2] == ""


def test_crlf_lines_and_a_byte_order_mark_are_no_prompt_text(
    out_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--interactive lines ended by CRLF (a Windows file piped in) and a --start=FILE: with a byte-order mark: the
    character model's prompts are the text alone, neither '\\r' nor U+FEFF, which it has never seen."""
    code, stdout, stderr = cli([f"--out_dir={out_dir}", "--interactive", "--max_new_tokens=3"], capsys, "To\r\nbe\r\n")
    assert code == 0 and stderr == "", stderr
    answers = stdout.split(sample.SEPARATOR)
    assert answers[0].startswith("To") and answers[1].startswith("be")
    path = tmp_path / "prompt.txt"
    path.write_bytes(b"\xef\xbb\xbfTo be")
    code, stdout, stderr = cli([f"--out_dir={out_dir}", f"--start=FILE:{path}", "--max_new_tokens=3"], capsys)
    assert code == 0 and stdout.startswith("To be"), stderr


def test_a_block_size_past_the_models_context_is_one_line(out_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """--block_size crops a model's context; one past it would be ignored without a word."""
    code, stdout, stderr = cli([f"--out_dir={out_dir}", "--block_size=100000", "--max_new_tokens=2"], capsys)
    assert_one_line_error(code, stderr, "--block_size=100000 is past the model's context of")
    assert stdout == ""


@pytest.fixture
def overflowing_dir(tmp_path: Path) -> Path:
    """A checkpoint with finite weights whose logits overflow to infinity after a ',' (helpers.overflowing_model)."""
    tokenizer = CharTokenizer.from_text(TEXT)
    model = overflowing_model(tokenizer.vocab_size, tokenizer.encode(",")[0])
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": None}
    state = {
        "model": model.state_dict(),
        "model_args": config_to_dict(model.config),
        "tokenizer": tokenizer_record(meta),
    }
    save_checkpoint(tmp_path / "out" / "ckpt.pt", state)
    return tmp_path / "out"


@pytest.mark.parametrize("decode", ["auto", "eager"])
def test_logits_that_overflow_while_decoding_end_the_sample_in_one_line(
    overflowing_dir: Path, decode: str, capsys: pytest.CaptureFixture
) -> None:
    """No token is chosen from them (the streamed text stops at the prompt); interactive, the answer is ended and the
    next prompt answered."""
    args = [f"--out_dir={overflowing_dir}", f"--decode={decode}", "--temperature=0", "--max_new_tokens=7"]
    code, stdout, stderr = cli([*args, "--start=To be,"], capsys)
    assert_one_line_error(code, stderr, "error: the model's logits for new token 1 are NaN or infinite")
    assert stdout == "To be,"
    code, stdout, stderr = cli([*args, "--interactive"], capsys, "To be,\nTo be\n")
    assert code == 0 and stderr.count("\n") == 1 and stderr.rstrip().endswith("type another prompt"), stderr
    assert stdout.split(sample.SEPARATOR) == ["To be,", "To berTuurrT", ""]


@pytest.mark.parametrize(
    ("record", "fragment"),
    [
        ({"kind": "char", "chars": "abc", "vocab_size": 3}, "a char tokenizer needs 'chars', a list of single"),
        (
            {"kind": "sentencepiece", "vocab_size": 3},
            "'tokenizer' must be an object with kind 'char', 'tiktoken', 'bpe' or 'hf'",
        ),
        (["a", "b", "c"], "'tokenizer' must be an object"),
        ({"kind": "tiktoken", "encoding": "gpt-9", "vocab_size": 3}, "unknown tokenizer 'gpt-9'"),
    ],
    ids=["chars_not_a_list", "unknown_kind", "not_an_object", "unknown_encoding"],
)
def test_damaged_tokenizer_record_names_the_checkpoint(
    record: object, fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = char_checkpoint(tmp_path / "out", record, 3)
    code, _, stderr = cli([f"--out_dir={out_dir}"], capsys)
    assert_one_line_error(code, stderr, fragment)
    assert stderr.startswith(f"error: checkpoint {out_dir / 'ckpt.pt'}: ")


def char_data_dir(data_dir: Path, tokenizer: CharTokenizer) -> Path:
    """A data directory whose meta.json names `tokenizer`, with one small train split."""
    data_dir.mkdir()
    ids = np.asarray(tokenizer.encode(TEXT * 4), dtype=np.uint16)
    ids.tofile(data_dir / "train.bin")
    split = {"files": ["train.bin"], "tokens": len(ids), "text_bytes": len(ids), "documents": 1}
    write_meta(
        data_dir,
        {
            "format": "gpt-tokens",
            "version": 1,
            "tokenizer": tokenizer.to_meta(),
            "vocab_size": tokenizer.vocab_size,
            "dtype": "uint16",
            "eot_token": None,
            "splits": {"train": split},
            "source": {},
        },
    )
    return data_dir


def test_tokenizer_larger_than_the_model(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out_dir = char_checkpoint(tmp_path / "out", None, CharTokenizer.from_text(TEXT).vocab_size)  # records none
    tokenizer = CharTokenizer.from_text(TEXT + "XYZ0123456789")
    data_dir = char_data_dir(tmp_path / "data", tokenizer)
    code, _, stderr = cli([f"--out_dir={out_dir}", f"--data_dir={data_dir}"], capsys)
    assert_one_line_error(code, stderr, f"{data_dir}'s tokenizer has {tokenizer.vocab_size} tokens but the model only")


@pytest.mark.parametrize("script", [sample, eval_script], ids=["sample", "eval"])
def test_a_data_dir_with_another_tokenizer_than_the_checkpoints_is_refused(
    script, out_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # The same number of characters in another order: the model would read every id as another character.
    other = CharTokenizer(list(reversed(CharTokenizer.from_text(TEXT).chars)))
    data_dir = char_data_dir(tmp_path / "data", other)
    args = ["--device=cpu", f"--out_dir={out_dir}", f"--data_dir={data_dir}"]
    code, stdout, stderr = run_main(script.main, args, capsys)
    assert_one_line_error(code, stderr, f"--data_dir={data_dir} holds another tokenizer than")
    assert "leave --data_dir out" in stderr and stdout == ""


def test_a_data_dir_with_the_checkpoints_own_tokenizer_is_accepted(
    out_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    data_dir = char_data_dir(tmp_path / "data", CharTokenizer.from_text(TEXT))
    args = ["--start=To be", "--max_new_tokens=5", "--temperature=0"]
    code, with_data_dir, _ = cli([f"--out_dir={out_dir}", f"--data_dir={data_dir}", *args], capsys)
    assert code == 0
    assert cli([f"--out_dir={out_dir}", *args], capsys)[:2] == (0, with_data_dir)


def test_data_dir_without_meta(out_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, _, stderr = cli([f"--out_dir={out_dir}", f"--data_dir={tmp_path}"], capsys)
    assert_one_line_error(code, stderr, f"no meta.json in {tmp_path}: prepare the data first")


def test_checkpoint_locations(out_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / ".ckpt.pt.x1y2.tmp").write_bytes((out_dir / "ckpt.pt").read_bytes())  # a temporary is not a checkpoint
    code, _, stderr = cli([f"--out_dir={empty}"], capsys)
    assert_one_line_error(code, stderr, f"no checkpoint in {empty} (looked for best.pt, ckpt.pt); train a model")

    (out_dir / "ckpt.pt").rename(out_dir / "best.pt")
    code, _, stderr = cli([f"--out_dir={out_dir}", "--checkpoint=latest"], capsys)
    assert_one_line_error(code, stderr, "(looked for ckpt.pt)")

    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a checkpoint\n")
    code, _, stderr = cli([f"--out_dir={text_file}"], capsys)
    assert_one_line_error(code, stderr, f"cannot load checkpoint {text_file}: the file is truncated, damaged")

    code, _, stderr = cli([f"--out_dir={out_dir}", "--init_from=gpt-5"], capsys)
    assert_one_line_error(
        code, stderr, "--init_from='gpt-5': use resume, a Hugging Face directory or hub name (owner/name), or gpt2"
    )

    missing = tmp_path / "SmolLM2-135M-Instruct-Q8_0.gguf"
    code, _, stderr = cli([f"--init_from={missing}"], capsys)
    assert_one_line_error(code, stderr, f"--init_from='{missing}': {missing}: no such file or directory")


def test_init_from_a_training_run_says_to_load_it_with_out_dir(out_dir: Path, capsys: pytest.CaptureFixture) -> None:
    """train.py takes a run's directory as --init_from; sample.py, serve.py and eval.py load one with --out_dir."""
    code, stdout, stderr = cli([f"--init_from={out_dir}", "--max_new_tokens=3"], capsys)
    assert_one_line_error(code, stderr, f"is a training run's directory; load it with --out_dir={out_dir}")
    assert stdout == ""


def test_init_from_a_directory_without_config_json_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    code, _, stderr = cli([f"--init_from={tmp_path}", "--max_new_tokens=3"], capsys)
    assert_one_line_error(code, stderr, f"{tmp_path} holds no config.json")


def no_compiler() -> None:
    raise UserError("no C++ compiler here (apt-get install g++)")


def test_a_decoding_backend_that_cannot_run_the_model_fails_before_any_text(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--decode=native where the native step cannot be built (a machine without a C++ compiler): one line, and
    stdout stays empty, not the prompt followed by an error."""
    tokenizer = CharTokenizer.from_text(TEXT)
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": None}
    torch.manual_seed(0)
    config = GPTConfig(
        block_size=16, vocab_size=tokenizer.vocab_size, n_layer=1, n_head=2, n_embd=16, pos_encoding="rope"
    )
    model = GPT(config)
    state = {"model": model.state_dict(), "model_args": config_to_dict(config), "tokenizer": tokenizer_record(meta)}
    (tmp_path / "out").mkdir()
    save_checkpoint(tmp_path / "out" / "ckpt.pt", state)
    monkeypatch.setattr(native_build, "extension", no_compiler)
    flags = ["--decode=native", "--start=To be"]
    code, stdout, stderr = cli([f"--out_dir={tmp_path / 'out'}", *flags], capsys)
    assert_one_line_error(code, stderr, "--decode=native: no C++ compiler here (apt-get install g++)")
    assert stdout == ""
