"""One chat data preparation run: render conversations with the chat template in worker processes, write tokens,
loss masks and conversation offsets (prepare_data/chat.py).

Work items come from gptkit.data.prepare.chat_inputs and run on corpus.py's worker pool (at most 2 x num_workers
items in flight, results in item order), so memory stays flat whatever the input size and the output is the same
for any number of workers. A conversation goes wholly to train or val, keyed like corpus.py's documents.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gptkit.core.errors import UserError
from gptkit.data import tokenizer as tok
from gptkit.data.chat import ChatError, check_messages
from gptkit.data.meta import META_FILENAME, dtype_for_vocab, read_meta
from gptkit.data.prepare.chat_inputs import ChatItem, conversation_of, records
from gptkit.data.prepare.discover import describe_skipped
from gptkit.data.prepare.driver import Progress, count_of
from gptkit.data.prepare.items import SPLITS, conversation_key, is_val_document
from gptkit.data.prepare.workers import run_items
from gptkit.data.prepare.writer import DatasetWriter

TOO_LONG_POLICIES = ("cut", "drop")
ON_BAD_POLICIES = ("error", "skip")
NO_ASSISTANT_LEFT = "no assistant token in the first block_size + 1"
LONGER_THAN_BLOCK = "longer than block_size + 1"
# The most text one conversation may hold: about 4 million tokens, past any model's context. Why a bound: the
# tokenizer takes memory in proportion to the text it encodes (a reply of hundreds of MB asks for tens of GB).
MAX_CONVERSATION_BYTES = 16 * 2**20

MakeItems = Callable[[], Iterable[ChatItem]]


@dataclass(frozen=True, kw_only=True)
class ChatJob:
    """What every worker does with its items; `tokenizer` None only collects characters (--tokenizer=char)."""

    tokenizer: tok.ChatTokenizer | tok.HFTokenizer | None
    field: str | None  # the messages field; None where records name their own (preference pairs)
    seed: int
    val_fraction: float
    block_size: int
    too_long: str
    on_bad: str


@dataclass(kw_only=True)
class Rendered:
    """One conversation ready to write."""

    split: str
    ids: np.ndarray
    mask: np.ndarray
    text_bytes: int


@dataclass(kw_only=True)
class ChatResult:
    """What a worker hands back for one item."""

    input_bytes: int
    conversations: list[Rendered] = field(default_factory=list)
    cut: int = 0
    dropped: Counter = field(default_factory=Counter)  # too long, by reason
    skipped: Counter = field(default_factory=Counter)  # bad input (--on_bad=skip), by reason
    chars: set[str] | None = None

    @property
    def tokens(self) -> int:
        return sum(len(c.ids) for c in self.conversations)


def bad_input(where: str, exc: ChatError | UserError) -> UserError:
    """The one line a bad conversation stops the run with."""
    return UserError(f"{where}: {exc}; fix or remove it, or pass --on_bad=skip to leave such conversations out")


class ChatWorker:
    """Turns work items into rendered conversations (or the characters they use); one per worker process."""

    def __init__(self, job: ChatJob) -> None:
        self.job = job

    def run(self, item: ChatItem) -> ChatResult:
        result = ChatResult(input_bytes=item.input_bytes, chars=set() if self.job.tokenizer is None else None)
        for record in records(item):
            try:
                self._add(record.value, result)
            except (ChatError, UserError) as exc:  # UserError: a character outside a reused character table
                if self.job.on_bad == "error":
                    raise bad_input(record.where, exc) from None
                result.skipped[exc.reason if isinstance(exc, ChatError) else "character not in the table"] += 1
        return result

    def _add(self, record: Any, result: ChatResult) -> None:
        job = self.job
        messages, prompt = conversation_of(record, job.field)
        check_conversation(messages)
        text_bytes = _utf8_bytes(messages)
        check_size(text_bytes)
        if job.tokenizer is None:
            for message in messages:
                result.chars.update(message["content"])
            return
        chat = job.tokenizer.chat
        ids, mask = chat.render(messages, job.tokenizer)
        if prompt:  # TRL's prompt/completion: only the completion is trained on
            mask[: len(chat.render_prompt(prompt, job.tokenizer)) - 1] = 0
        limit = job.block_size + 1
        if len(ids) > limit:
            if job.too_long == "drop":
                result.dropped[LONGER_THAN_BLOCK] += 1
                return
            ids, mask = ids[:limit], mask[:limit]
            if not mask.any():
                result.dropped[NO_ASSISTANT_LEFT] += 1
                return
            result.cut += 1
        split = "val" if is_val_document(job.seed, job.val_fraction, conversation_key(messages)) else "train"
        result.conversations.append(Rendered(split=split, ids=ids, mask=mask, text_bytes=text_bytes))


def check_conversation(messages: Any) -> None:
    """What rendering checks, without a tokenizer: ChatError for invalid messages or no assistant turn."""
    check_messages(messages)
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatError(
            "the conversation has no assistant turn: there is nothing to learn from it", reason="no assistant turn"
        )


def check_size(text_bytes: int) -> None:
    """ChatError for a conversation past MAX_CONVERSATION_BYTES (of its turns' text)."""
    if text_bytes > MAX_CONVERSATION_BYTES:
        raise ChatError(
            f"the conversation holds {text_bytes / 2**20:.0f} MiB of text, past the {MAX_CONVERSATION_BYTES // 2**20} "
            "MiB a conversation may hold (millions of tokens more than any context); shorten or leave it out",
            reason="over 16 MiB of text",
        )


def _utf8_bytes(messages: list[dict[str, str]]) -> int:
    try:
        return sum(len(m["content"].encode("utf-8")) for m in messages)
    except UnicodeEncodeError:  # JSON can spell unpaired surrogates (\ud800), which are not text
        message = "a message holds an unpaired surrogate (e.g. \\ud800), which is not text"
        raise ChatError(message, reason="invalid UTF-8") from None


# ------------------------------------------------------------------------------------------- the tokenizer


def base_tokenizer(name: str, bpe_dir: str | None) -> tok.Tokenizer | None:
    """The tokenizer --tokenizer names: None for 'char' (built from the conversations), the tokenizer of a data
    directory (its meta.json), a trained BPE directory, or a tiktoken encoding name. Checkpoints are the
    script's to read (gptkit.weights sits above this layer)."""
    if name == "char":
        if bpe_dir is not None:
            raise UserError("--bpe_dir is for GPT-2 BPE; it makes no sense with --tokenizer=char")
        return None
    if (Path(name) / META_FILENAME).is_file():
        return tok.tokenizer_from_meta(read_meta(name)["tokenizer"], bpe_dir=bpe_dir)
    return tok.make_tokenizer(name, bpe_dir=bpe_dir)


def chat_tokenizer(base: tok.Tokenizer) -> tok.ChatTokenizer | tok.HFTokenizer:
    """`base` with the chat template: a ChatTokenizer stays as it is (its template and ids are the base model's), a
    Hugging Face tokenizer renders with its model's own template."""
    if isinstance(base, tok.HFTokenizer):
        if base.chat is None:
            none = (
                f"the tokenizer {base.name!r} has no chat template (chat_template.jinja, or 'chat_template' in "
                "tokenizer_config.json)"
            )
            reason = tok.no_chat_reason(base, none)
            reason = reason if reason == none else f"the tokenizer {base.name!r}: {reason}"
            raise UserError(
                f"{reason}: use the tokenizer of the model's instruct version, or add (or mend) its template"
            )
        return base
    return base if isinstance(base, tok.ChatTokenizer) else tok.ChatTokenizer.extending(base)


# ------------------------------------------------------------------------------------------- the run


@dataclass(kw_only=True)
class Counts:
    """What the run left out or changed."""

    cut: int = 0
    dropped: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)

    def describe(self) -> str:
        """What was left out, e.g. " (2 dropped: longer than block_size + 1; 1 skipped: malformed JSON)"."""
        parts = [
            f"{sum(counts.values()):,} {what}: {_reasons(counts)}"
            for what, counts in (("dropped", self.dropped), ("skipped", self.skipped))
            if counts
        ]
        return f" ({'; '.join(parts)})" if parts else ""

    def add(self, result: ChatResult) -> None:
        self.cut += result.cut
        self.dropped.update(result.dropped)
        self.skipped.update(result.skipped)


def _job(settings: Any, tokenizer: tok.ChatTokenizer | tok.HFTokenizer | None) -> ChatJob:
    return ChatJob(
        tokenizer=tokenizer,
        field=settings.text_field,
        seed=settings.seed,
        val_fraction=settings.val_fraction,
        block_size=settings.block_size,
        too_long=settings.too_long,
        on_bad=settings.on_bad,
    )


def _results(make_items: MakeItems, job: ChatJob, num_workers: int, worker: type[ChatWorker] = ChatWorker) -> Any:
    # closing(): on any failure the worker pool is shut down at once, not whenever the generator is collected.
    return contextlib.closing(run_items(make_items(), job, num_workers, make_worker=worker))


def build_char_tokenizer(
    make_items: MakeItems, settings: Any, total_bytes: int | None, worker: type[ChatWorker] = ChatWorker
) -> tok.CharTokenizer:
    """First pass for --tokenizer=char: the sorted characters of every conversation's messages, plus end-of-text."""
    chars: set[str] = set()
    progress = Progress(total_bytes, "characters")
    try:
        with _results(make_items, _job(settings, None), settings.num_workers, worker) as results:
            for result in results:
                chars |= result.chars
                progress.update(result.input_bytes, 0)
    finally:
        progress.close()
    if not chars:
        raise UserError("no conversations found in the inputs")
    return tok.CharTokenizer(sorted(chars), eot=True)


def prepare_chat(
    make_items: MakeItems,
    settings: Any,
    base: tok.Tokenizer | None,
    source: dict[str, Any],
    total_bytes: int | None,
    what: str,
    worker: type[ChatWorker] = ChatWorker,
) -> tuple[dict[str, Any], float]:
    """Render every conversation into settings.out_dir; returns (meta, seconds). `base` None: a character
    table built from the conversations. `worker` renders the records (preference pairs: PreferenceWorker). On any
    failure the output directory is left as it was."""
    if base is None:
        base = build_char_tokenizer(make_items, settings, total_bytes, worker)
    tokenizer = chat_tokenizer(base)
    dtype = dtype_for_vocab(tokenizer.vocab_size)
    counts = Counts()
    progress = Progress(total_bytes, "rendering")
    with DatasetWriter(settings.out_dir, dtype, settings.shard_tokens, side_streams=True) as writer:
        try:
            with _results(make_items, _job(settings, tokenizer), settings.num_workers, worker) as results:
                for result in results:
                    for conversation in result.conversations:
                        writer.write_conversation(
                            conversation.split, conversation.ids, conversation.mask, conversation.text_bytes
                        )
                    counts.add(result)
                    progress.update(result.input_bytes, result.tokens)
        finally:
            seconds = progress.close()
        if not any(writer.tokens(split) for split in SPLITS):
            raise UserError(f"no conversation to write from {what}{counts.describe()}")
        for split in SPLITS:  # chat data is read a conversation at a time: one is enough, however short
            if not writer.tokens(split):
                raise UserError(
                    f"the {split} split holds no conversation: add some, or change --val_fraction or --seed"
                )
        source = {**source, "cut": counts.cut, "dropped": dict(counts.dropped), "skipped": dict(counts.skipped)}
        meta = writer.commit(tokenizer, source)
    return meta, seconds


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{count:,} {reason}" for reason, count in sorted(counts.items()) if count)


def summary_line(meta: dict[str, Any], out_dir: str | os.PathLike, seconds: float, input_bytes: int) -> str:
    """One line: conversations, tokens and assistant tokens per split, what was cut, dropped and skipped."""
    parts = []
    for split in SPLITS:
        info = meta["splits"][split]
        parts.append(
            f"{split} {count_of(info['documents'], 'conversation')} / {count_of(info['tokens'], 'token')} "
            f"({info['assistant_tokens']:,} assistant)"
        )
    source = meta["source"]
    files = sum(len(info["files"]) + 2 for info in meta["splits"].values()) + 1
    line = f"wrote {files} files to {out_dir} ({meta['dtype']}, vocab {meta['vocab_size']:,}): {'; '.join(parts)}"
    if source["cut"]:
        line += f"; {count_of(source['cut'], 'conversation')} cut to block_size + 1"
    if any(source["dropped"].values()):
        line += f"; {count_of(sum(source['dropped'].values()), 'conversation')} dropped ({_reasons(source['dropped'])})"
    if any(source["skipped"].values()):
        line += f"; {count_of(sum(source['skipped'].values()), 'conversation')} skipped ({_reasons(source['skipped'])})"
    skipped_files = source.get("skipped_files", {})
    if any(skipped_files.values()):
        line += f"; {count_of(sum(skipped_files.values()), 'file')} left out ({describe_skipped(skipped_files)})"
    if seconds > 0:
        line += f"; {input_bytes / 1e6:.1f} MB in {seconds:.1f} s"
    return line
