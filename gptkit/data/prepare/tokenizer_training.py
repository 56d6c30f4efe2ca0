"""Training a byte-level BPE on a corpus with Hugging Face `tokenizers` (Rust, all cores), for tiktoken to encode.

The corpus is read as corpus.py reads it: gptkit.data.prepare.discover finds the files (leaving out binary ones and
__pycache__), gptkit.data.prepare.inputs cuts them into bounded pieces, and the workers' decoding turns each into
documents (`Worker.texts`). The pieces stream into the trainer, which pre-tokenises and counts them on every core
and then computes the merges. Memory grows with the distinct pre-tokenised words seen, not with the corpus size;
`max_chars` trains on the corpus's first characters (a sample) instead of all of it.

The documents that corpus.py with the same val_fraction and seed puts in val are left out of training, so a
model's val bits per byte are measured on text the tokenizer never saw; up to CHECK_CHARS of them check that
tiktoken, given the trained ranks, encodes exactly as the trainer itself does.

Hugging Face's ByteLevel step writes each byte as a printable character (GPT-2's table); the ranks handed to
tiktoken are the tokens' bytes, with rank = the trainer's id (the 256 single bytes first, then one token per merge
in merge order), and the end-of-text token after them. The training runs in a child process: the Rust trainer
cannot be interrupted, a child can be killed, so Ctrl-C and SIGTERM end the run at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gptkit.core.errors import UserError
from gptkit.core.progress import byte_progress_bar
from gptkit.data import bpe
from gptkit.data import tokenizer as tok
from gptkit.data.prepare.discover import InputFile
from gptkit.data.prepare.inputs import corpus_items
from gptkit.data.prepare.settings import PrepareSettings
from gptkit.data.prepare.workers import Job, Worker, end_with_parent

CHECK_CHARS = 500_000  # held-out characters on which tiktoken's encoding is compared with the trainer's
MIN_VOCAB_SIZE = 257  # the 256 single bytes and the end-of-text token
# The trainer allocates for the vocabulary asked before it reads a byte (2^32 asked for hundreds of GB); the largest
# vocabularies in use hold a few hundred thousand tokens.
MAX_VOCAB_SIZE = 2**24
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


@dataclass(frozen=True, kw_only=True)
class TrainingJob:
    """What to train on and how: `read` carries corpus.py's reading settings (chunk_bytes, text_field,
    on_decode_error) and its split (val_fraction, seed); `vocab_size` counts the end-of-text token."""

    files: list[InputFile]
    read: PrepareSettings
    vocab_size: int
    min_frequency: int = 2
    max_chars: int | None = None
    pattern: str = bpe.GPT4_PATTERN


@dataclass(kw_only=True)
class TrainingResult:
    """The trained ranks (token bytes -> rank) and what the training saw."""

    ranks: dict[bytes, int] = field(default_factory=dict)
    chars: int = 0  # characters trained on
    text_bytes: int = 0  # their UTF-8 bytes
    pieces: int = 0  # texts handed to the trainer (documents, or pieces of long ones)
    input_bytes: int = 0  # on-disk bytes of the input read
    val_chars_left_out: int = 0
    check_chars: int = 0  # characters on which tiktoken was compared with the trainer
    check_source: str = "held-out"  # or "training" when the corpus has no val documents within reach
    check_mismatches: int = 0  # texts on which the two encodings differ (0 expected)
    seconds: float = 0.0


def import_tokenizers() -> Any:
    """The `tokenizers` package, or a UserError saying how to install it."""
    try:
        import tokenizers
    except ImportError:
        raise UserError("training a tokenizer needs Hugging Face tokenizers: pip install 'tokenizers>=0.19'") from None
    return tokenizers


def new_trainer(job: TrainingJob) -> tuple[Any, Any]:
    """An untrained byte-level BPE tokenizer (GPT-4 split, then bytes as GPT-2's printable characters, no
    normaliser) and its trainer, whose alphabet is all 256 bytes so any text round-trips."""
    tokenizers = import_tokenizers()
    from tokenizers import Regex, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=Regex(job.pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=job.vocab_size - 1,  # the end-of-text token is added after the trained ranks
        min_frequency=job.min_frequency,
        show_progress=False,  # its bars would cross ours; ours shows the reading
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],  # '<|endoftext|>' in the text stays text, as tiktoken's encode_ordinary treats it
    )
    return hf, trainer


def ranks_of(hf: Any) -> dict[bytes, int]:
    """A trained tokenizer's vocabulary as tiktoken ranks: token bytes -> the trainer's id."""
    to_byte = tok.gpt2_unicode_to_byte()
    ranks = {bytes(to_byte[char] for char in token): token_id for token, token_id in hf.get_vocab().items()}
    if sorted(ranks.values()) != list(range(len(ranks))):  # a programming error, never the user's
        raise RuntimeError("the trainer's token ids are not 0..n-1 for distinct byte strings")
    return ranks


class _Reader:
    """The texts fed to the trainer (train documents, up to max_chars), a progress bar, and held-out samples."""

    def __init__(self, job: TrainingJob, result: TrainingResult) -> None:
        self.job, self.result = job, result
        self.held_out: list[str] = []
        self.first_train: list[str] = []
        self._sampled = {"held-out": 0, "training": 0}

    def _sample(self, text: str, kind: str, into: list[str]) -> None:
        if self._sampled[kind] < CHECK_CHARS:
            into.append(text[: CHECK_CHARS - self._sampled[kind]])
            self._sampled[kind] += len(into[-1])

    def texts(self) -> Iterator[str]:
        job, result = self.job, self.result
        read = job.read
        worker = Worker(
            Job(
                tokenizer=None,
                dtype="uint32",
                seed=read.seed,
                val_fraction=read.val_fraction,
                on_decode_error=read.on_decode_error,
                text_field=read.text_field,
            )
        )
        bar = byte_progress_bar("reading", sum(file.size for file in job.files) or None, smoothing=0.1)
        try:
            for item in corpus_items(job.files, read):
                for split, text in worker.texts(item):
                    if split == "val":
                        result.val_chars_left_out += len(text)
                        self._sample(text, "held-out", self.held_out)
                        continue
                    if job.max_chars is not None and result.chars + len(text) >= job.max_chars:
                        text = text[: job.max_chars - result.chars]
                    result.chars += len(text)
                    result.text_bytes += len(text.encode("utf-8"))
                    result.pieces += 1
                    self._sample(text, "training", self.first_train)
                    yield text
                    if job.max_chars is not None and result.chars >= job.max_chars:
                        return
                result.input_bytes += item.input_bytes
                if bar is not None:
                    bar.update(item.input_bytes)
        finally:
            if bar is not None:
                bar.close()


def check_against_trainer(hf: Any, tokenizer: tok.BpeTokenizer, texts: list[str]) -> int:
    """How many of `texts` tiktoken (through `tokenizer`) encodes differently from the trainer `hf`."""
    encoded = hf.encode_batch(texts, add_special_tokens=False)
    return sum(1 for text, theirs in zip(texts, encoded) if tokenizer.encode(text) != theirs.ids)


def train_bpe(job: TrainingJob) -> tuple[TrainingResult, Any]:
    """Train in this process (see `train_in_child` for a run that signals can stop): the result and the trained
    Hugging Face tokenizer. UserError when the corpus gives no text to train on."""
    if job.vocab_size < MIN_VOCAB_SIZE:
        raise UserError(f"--vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + end-of-text)")
    started = time.perf_counter()
    result = TrainingResult()
    hf, trainer = new_trainer(job)
    reader = _Reader(job, result)
    hf.train_from_iterator(reader.texts(), trainer=trainer)
    if result.chars == 0:
        raise UserError("no text to train on: the inputs hold no training documents (all empty, skipped or val)")
    result.ranks = ranks_of(hf)
    sample = reader.held_out or reader.first_train
    result.check_source = "held-out" if reader.held_out else "training"
    result.check_chars = sum(len(text) for text in sample)
    trained = tok.BpeTokenizer(
        bpe.make_record("check", job.pattern, {tok.END_OF_TEXT: len(result.ranks)}, bpe.ranks_to_text(result.ranks))
    )
    result.check_mismatches = check_against_trainer(hf, trained, sample)
    result.seconds = time.perf_counter() - started
    return result, hf


def _child(job: TrainingJob, connection: Any, parent_pid: int | None) -> None:
    """The training process: stop signals are the parent's to handle (it kills this process), errors go back as
    one message."""
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # blocked by the parent while it forked us: discarded now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    end_with_parent(parent_pid)
    try:
        message: tuple[str, Any] = ("ok", train_bpe(job)[0])
    except UserError as exc:
        message = ("error", str(exc))
    except Exception as exc:  # a bug: reported by the parent as one line
        message = ("bug", f"{type(exc).__name__}: {exc}")
    connection.send(message)
    connection.close()


def train_in_child(job: TrainingJob) -> TrainingResult:
    """`train_bpe` in a child process, so Ctrl-C and SIGTERM stop the run at once (the child is killed)."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else methods[0])
    parent_pid = os.getpid() if context.get_start_method() == "fork" else None
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(job, sender, parent_pid), daemon=True)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS) if hasattr(signal, "pthread_sigmask") else None
    try:
        child.start()
    finally:
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    sender.close()
    try:
        status, payload = receiver.recv()
    except EOFError:
        child.join()
        raise UserError(
            f"the tokenizer training process died (exit code {child.exitcode}; out of memory?): train on a sample "
            "with --max_chars"
        ) from None
    except BaseException:  # Ctrl-C, SIGTERM: the Rust trainer cannot be interrupted, its process can
        child.kill()
        child.join()
        raise
    child.join()
    if status == "error":
        raise UserError(payload)
    if status == "bug":
        raise RuntimeError(payload)
    return payload
