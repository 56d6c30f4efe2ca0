"""sample.py end to end on a tiny checkpoint trained in the test, plus the streaming decoder on its own."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
import train
from gptkit.data.meta import write_meta
from gptkit.data.tokenizer import CharTokenizer, TiktokenTokenizer
from gptkit.model import GPT, GPTConfig, config_to_dict
from gptkit.weights.checkpoint import save_checkpoint
from helpers import assert_one_line_error, lively_char_checkpoint, run_in_process
from sample import TextStream

REPO = Path(__file__).resolve().parent.parent
CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 40


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, timeout=300)


def sample_in_process(capsys: pytest.CaptureFixture, *args: str) -> subprocess.CompletedProcess:
    """sample.py's main in this process, as run_script reports it (bytes out, encoded strictly as UTF-8): where the
    test is about the text and the errors, not the process, this saves starting Python and torch. The first sample
    stays a process, sample.py as a user runs it."""
    result = run_in_process(sample.main, list(args), capsys)
    return subprocess.CompletedProcess(args, result.returncode, result.stdout.encode(), result.stderr.encode())


@pytest.fixture(scope="module")
def trained_char_checkpoint(tmp_path_factory) -> Path:
    """A 1-layer char model trained for a few dozen steps by train.py on a tiny corpus."""
    root = tmp_path_factory.mktemp("sample")
    data_dir = root / "data"
    tokenizer = CharTokenizer.from_text(CORPUS)
    ids = np.array(tokenizer.encode(CORPUS), dtype=np.uint16)
    split = int(0.9 * len(ids))
    data_dir.mkdir()
    ids[:split].tofile(data_dir / "train.bin")
    ids[split:].tofile(data_dir / "val.bin")
    write_meta(
        data_dir,
        {
            "format": "gpt-tokens",
            "version": 1,
            "tokenizer": tokenizer.to_meta(),
            "vocab_size": tokenizer.vocab_size,
            "dtype": "uint16",
            "eot_token": None,
            "splits": {
                "train": {"files": ["train.bin"], "tokens": split, "text_bytes": split, "documents": 1},
                "val": {
                    "files": ["val.bin"],
                    "tokens": len(ids) - split,
                    "text_bytes": len(ids) - split,
                    "documents": 1,
                },
            },
            "source": {"test": "tiny corpus"},
        },
    )
    out_dir = root / "out"
    args = [
        f"--data_dir={data_dir}",
        f"--out_dir={out_dir}",
        "--device=cpu",
        "--compile=False",
        "--n_layer=1",
        "--n_head=2",
        "--n_embd=32",
        "--block_size=32",
        "--batch_size=8",
        "--gradient_accumulation_steps=1",  # train.py's default is 40 micro-batches a step
        "--max_iters=60",
        "--eval_interval=30",
        "--eval_iters=2",
        "--learning_rate=3e-3",
        "--warmup_iters=5",
        "--log_interval=30",
        "--curves=False",
    ]
    assert train.main(args) == 0  # in this process: the run is the tests' input, not what they check
    assert (out_dir / "ckpt.pt").exists()
    return out_dir


def test_same_seed_same_text_and_different_seed_different_text(trained_char_checkpoint, capsys):
    common = [f"--out_dir={trained_char_checkpoint}", "--start=First", "--max_new_tokens=60"]
    a = run_script("sample.py", *common, "--seed=7")  # a process, then twice in this one
    b = sample_in_process(capsys, *common, "--seed=7")
    c = sample_in_process(capsys, *common, "--seed=8")
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr.decode()
    assert a.stdout == b.stdout and a.stdout != c.stdout
    assert a.stdout.decode().startswith("First")
    assert len(a.stdout.decode()) == len("First") + 60 + 1  # prompt, 60 characters, final newline


@pytest.mark.parametrize("decode", ["eager", "native"])
def test_every_cpu_backend_prints_the_default_text(trained_char_checkpoint, decode, capsys):
    """--decode=eager (plain PyTorch) and --decode=native (one C++ call a token) print the text of the default
    (auto), greedy and sampled with a seed."""
    common = [f"--out_dir={trained_char_checkpoint}", "--start=First", "--max_new_tokens=60"]
    for settings in (["--temperature=0"], ["--seed=7"]):
        default = sample_in_process(capsys, *common, *settings)
        chosen = sample_in_process(capsys, *common, *settings, f"--decode={decode}")
        assert default.returncode == chosen.returncode == 0, chosen.stderr.decode()
        assert chosen.stdout == default.stdout and len(chosen.stdout.decode()) == len("First") + 60 + 1


def test_the_demos_architecture_decodes_natively_as_eagerly(tmp_path, capsys):
    """make demo's architecture (rotary positions, QK-norm): --decode=native runs it (no refusal) and prints the
    greedy text --decode=eager prints."""
    lively_char_checkpoint(tmp_path, pos_encoding="rope", qk_norm=True)
    common = [f"--out_dir={tmp_path}", "--start=A", "--max_new_tokens=30", "--temperature=0"]
    native = sample_in_process(capsys, *common, "--decode=native")
    eager = sample_in_process(capsys, *common, "--decode=eager")
    assert native.returncode == eager.returncode == 0, native.stderr.decode()
    assert native.stdout == eager.stdout and len(native.stdout.decode()) == len("A") + 30 + 1


def test_stop_string_ends_the_sample_and_is_not_printed(trained_char_checkpoint, capsys):
    free = sample_in_process(
        capsys, f"--out_dir={trained_char_checkpoint}", "--start=A", "--max_new_tokens=80", "--temperature=0"
    )
    text = free.stdout.decode()[1:-1]  # greedy continuation without the prompt and final newline
    stop = text[10:12]
    expected = "A" + text[: text.index(stop)] + "\n"
    stopped = sample_in_process(
        capsys,
        f"--out_dir={trained_char_checkpoint}",
        "--start=A",
        "--max_new_tokens=80",
        "--temperature=0",
        f"--stop={stop}",
    )
    assert stopped.returncode == 0
    assert stopped.stdout.decode() == expected


def test_file_prompt_and_batch(trained_char_checkpoint, tmp_path, capsys):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text("All:\nSpeak")
    result = sample_in_process(
        capsys,
        f"--out_dir={trained_char_checkpoint}",
        f"--start=FILE:{prompt_file}",
        "--num_samples=3",
        "--max_new_tokens=20",
        "--seed=3",
    )
    assert result.returncode == 0, result.stderr.decode()
    printed = result.stdout.decode()
    assert printed.endswith("\n")  # one newline after the last sample, which may itself end with a newline
    samples = printed[:-1].split("\n" + "-" * 40 + "\n")
    assert len(samples) == 3
    assert all(s.startswith("All:\nSpeak") and len(s) == len("All:\nSpeak") + 20 for s in samples)
    assert len(set(samples)) > 1  # one batch, but each row samples its own tokens


def test_interactive_reads_prompts_until_eof(trained_char_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("First\nAll\n"))
    result = sample_in_process(capsys, f"--out_dir={trained_char_checkpoint}", "--interactive", "--max_new_tokens=5")
    assert result.returncode == 0, result.stderr.decode()
    outputs = result.stdout.decode().split("\n" + "-" * 40 + "\n")
    assert outputs[0].startswith("First") and outputs[1].startswith("All")


def test_out_of_vocabulary_characters_are_one_clear_error(trained_char_checkpoint, capsys):
    result = sample_in_process(capsys, f"--out_dir={trained_char_checkpoint}", "--start=Zebra ☃ Q")
    stderr = result.stderr.decode()
    assert result.returncode == 2 and result.stdout == b""
    assert stderr.count("\n") == 1 and stderr.startswith("error:") and "Traceback" not in stderr
    assert "'☃'" in stderr and "'Z'" in stderr and "'Q'" in stderr


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--max_new_tokens=0", "max_new_tokens"),
        ("--top_p=1.5", "top_p"),
        ("--top_p=0", "top_p"),
        ("--start=", "prompt is empty"),
        ("--top_k=0", "top_k"),
        ("--temperature=-1", "temperature"),
        ("--system=Be_brief.", "--system opens a --chat conversation"),
    ],
)
def test_bad_settings_are_one_clear_error(trained_char_checkpoint, flag, message, capsys):
    result = sample_in_process(capsys, f"--out_dir={trained_char_checkpoint}", *flag.split())
    stderr = result.stderr.decode()
    assert result.returncode == 2 and stderr.startswith("error:") and message in stderr and stderr.count("\n") == 1


def test_long_prompt_is_truncated_from_the_left_with_a_warning(trained_char_checkpoint, capsys):
    long_prompt = "speak " * 20  # 120 characters, context is 32
    result = sample_in_process(
        capsys, f"--out_dir={trained_char_checkpoint}", f"--start={long_prompt}", "--max_new_tokens=40"
    )
    assert result.returncode == 0
    assert "warning: the prompt has 120 tokens; keeping the last 32" in result.stderr.decode()
    assert len(result.stdout.decode()) == 120 + 40 + 1  # generation beyond block_size works


@pytest.mark.gpt2_bpe
def test_streamed_bpe_text_is_valid_utf8_across_split_characters():
    tokenizer = TiktokenTokenizer("gpt2")
    text = "naïve café — 日本語のテキスト 🙂🚀 done"
    ids = tokenizer.encode(text)
    assert any(not _is_complete_utf8(tokenizer.decode_bytes([i])) for i in ids)  # some tokens split characters
    stream = TextStream(tokenizer, stops=[], stop_tokens=[tokenizer.eot_token])
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_stream_holds_back_a_partial_stop_string():
    tokenizer = CharTokenizer(list("abcXY"))
    stream = TextStream(tokenizer, stops=["XY"])
    printed = [stream.push(i) for i in tokenizer.encode("abXcXY")]
    assert "".join(printed) + stream.finish() == "abXc"
    # each character waits one token: it could be the start of "XY"; the final X never prints
    assert printed == ["", "a", "b", "X", "c", ""]


@pytest.mark.gpt2_bpe
def test_bpe_checkpoint_streams_valid_utf8_end_to_end(tmp_path, capsys):
    tokenizer = TiktokenTokenizer("gpt2")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=1, n_head=2, n_embd=16))
    record = {**tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token}
    save_checkpoint(
        tmp_path / "ckpt.pt",
        {"model": model.state_dict(), "model_args": config_to_dict(model.config), "tokenizer": record},
    )
    result = sample_in_process(
        capsys,
        f"--out_dir={tmp_path}",
        "--start=日本語 🙂",
        "--max_new_tokens=200",
        "--top_k=None",
        "--stop_at_eot=False",
    )
    assert result.returncode == 0, result.stderr.decode()
    result.stdout.decode("utf-8", errors="strict")  # random byte-level tokens still print as valid UTF-8
    assert result.stdout.decode().startswith("日本語 🙂")


def test_checkpoint_without_tokenizer_is_a_clear_error(tmp_path, capsys):
    model = GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8))
    save_checkpoint(tmp_path / "ckpt.pt", {"model": model.state_dict(), "model_args": config_to_dict(model.config)})
    result = sample_in_process(capsys, f"--out_dir={tmp_path}")
    assert result.returncode == 2 and "records no tokenizer" in result.stderr.decode()
    assert "Traceback" not in result.stderr.decode()


def _is_complete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def hand_rendered_prompt(tokenizer, system: str, user: str) -> list[int]:
    """The chat template written out by hand: begin, each turn as marker + text + end, then the assistant's marker."""
    marker = tokenizer.chat.special_tokens
    turn = [marker["<|system|>"], *tokenizer.encode(system), marker["<|end|>"]]
    turn += [marker["<|user|>"], *tokenizer.encode(user), marker["<|end|>"]]
    return [tokenizer.eot_token, *turn, marker["<|assistant|>"]]


def greedy_reply(out_dir: Path, prompt: list[int], tokenizer, limit: int) -> str:
    """The reply a plain full forward pass makes greedily, up to a stop token or `limit` tokens."""
    from gptkit.weights import load
    from helpers import reference_greedy

    model = load(str(out_dir)).model
    tokens = reference_greedy(model, prompt, limit)
    stops = set(tokenizer.chat.reply_stops)
    cut = next((i for i, token in enumerate(tokens) if token in stops), len(tokens))
    return tokenizer.decode(tokens[:cut])


def test_chat_talks_turn_by_turn_resets_and_survives_a_bad_line(tmp_path, capsys, monkeypatch):
    tokenizer = lively_char_checkpoint(tmp_path / "out", chat=True, block_size=128)
    stdin = io.StringIO("All:\nZebra ☃\n/reset\nROMEO:\n/exit\nnever read\n")
    monkeypatch.setattr("sys.stdin", stdin)
    result = sample_in_process(
        capsys, f"--out_dir={tmp_path / 'out'}", "--chat", "--system=Speak", "--temperature=0", "--max_new_tokens=8"
    )
    assert result.returncode == 0, result.stderr.decode()
    replies = result.stdout.decode().split("\n")
    first = greedy_reply(tmp_path / "out", hand_rendered_prompt(tokenizer, "Speak", "All:"), tokenizer, 8)
    second = greedy_reply(tmp_path / "out", hand_rendered_prompt(tokenizer, "Speak", "ROMEO:"), tokenizer, 8)
    assert replies == [first, second, ""]  # the reset forgot the first exchange; /exit ended the talk
    assert stdin.read() == "never read\n"
    errors = [line for line in result.stderr.decode().splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "not in the character vocabulary" in errors[0]


def test_chat_with_a_model_without_a_template_is_one_clear_error(trained_char_checkpoint, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    result = sample_in_process(capsys, f"--out_dir={trained_char_checkpoint}", "--chat")
    assert_one_line_error(result.returncode, result.stderr.decode(), "no chat template")


def test_a_chat_model_sampled_without_chat_stops_at_a_marker_and_never_prints_one():
    """As the server's /v1/completions: a plain sample of a chat model ends at the first chat marker (here one the
    model is made to pick), and the text holds none."""
    from gptkit.data.tokenizer import ChatTokenizer
    from helpers import SERVE_TEXT, lively_model, reference_greedy

    tokenizer = ChatTokenizer.extending(CharTokenizer.from_text(SERVE_TEXT, eot=True))
    model = lively_model(tokenizer.vocab_size, block_size=64)
    prompt = "All:\nSpeak"
    ids = tokenizer.encode(prompt)
    marker = tokenizer.chat.special_tokens["<|user|>"]
    with torch.no_grad():  # the <|user|> row a scaled copy of greedy's third pick: greedy writes it soon
        model.lm_head.weight[marker] = 1.5 * model.lm_head.weight[reference_greedy(model, ids, 3)[2]]
    tokens = reference_greedy(model, ids, 12)
    stops = {tokenizer.eot_token, *tokenizer.chat.special_tokens.values()}
    cut = next(i for i, token in enumerate(tokens) if token in stops)
    assert tokens[cut] in tokenizer.chat.special_tokens.values() and cut > 0
    cfg = sample.SampleSettings(temperature=0.0, max_new_tokens=12)
    written = io.StringIO()
    texts = sample.generate_samples(model, tokenizer, prompt, cfg, torch.device("cpu"), torch.float32, written.write)
    assert texts == [prompt + tokenizer.decode(tokens[:cut])] == [written.getvalue()]
    assert not any(text in texts[0] for text in tokenizer.chat.special_tokens)
