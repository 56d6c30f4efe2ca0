"""Prepare conversations for fine-tuning: JSONL or parquet chats -> tokens, loss masks and meta.json.

    python prepare_data/chat.py --input=chats.jsonl --out_dir=data/chat
    python prepare_data/chat.py --input='exports/*.parquet' --tokenizer=out-base --block_size=256

A record (JSONL line or parquet row) is {"messages": [{"role", "content"}, ...]} or {"prompt", "completion"},
as text (a user turn and the reply) or as message lists (TRL's conversational form: only the completion is
trained on). Each conversation is rendered with the chat template (gptkit.data.chat): the loss mask covers every
assistant turn. Conversations go wholly to train or val (keyed hash of --seed and their turns: a conversation
given twice goes to one split).

--tokenizer may name the base model's data directory, checkpoint or training out_dir, so the chat data has
exactly the base's ids; --tokenizer=char builds a character table from the conversations; a Hugging Face model's
directory brings its own tokenizer and chat template (gptkit.data.hf_tokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.prepare import chat_inputs, chat_prepare, discover
from gptkit.data.prepare.settings import PrepareSettings, exclude_setting, include_setting, input_setting


@dataclass(kw_only=True)
class ChatSettings(PrepareSettings):
    """The shared preparation settings, where chat data needs other defaults, plus the inputs and policies."""

    # Shared settings re-declared for another default or help text (they keep their place in --help).
    out_dir: str = setting("data/chat", "output directory for the tokens, loss masks, offsets and meta.json")
    tokenizer: str = setting(
        "gpt2",
        "gpt2, char, a tiktoken encoding, a train_tokenizer.py dir, a Hugging Face model dir (its tokenizer.json and "
        "chat template) or hub name (owner/name), a .gguf file (or owner/name:TAG), or a base model's data dir, "
        "checkpoint or training out_dir (its tokenizer is reused, so the ids match the base's)",
    )
    text_field: str = setting(
        "messages", "field (parquet column) holding each conversation's messages; else 'prompt' and 'completion'"
    )
    val_fraction: float = setting(0.05, "fraction of conversations for val")
    block_size: int = setting(1024, "the context the data is for: longer conversations are cut or dropped (--too_long)")
    # This script's own.
    input: list[str] = input_setting()
    include: list[str] = include_setting()
    exclude: list[str] = exclude_setting()
    too_long: str = setting(
        "cut",
        "a conversation over block_size + 1 tokens: cut (keep its start; dropped if no assistant token is left) "
        "or drop",
        choices=chat_prepare.TOO_LONG_POLICIES,
    )
    on_bad: str = setting(
        "error",
        "a bad record (malformed JSON, wrong role, empty content, no assistant turn, unknown character): error "
        "(stop, naming file:line) or skip (count by reason)",
        choices=chat_prepare.ON_BAD_POLICIES,
    )

    def validate(self) -> None:
        super().validate()
        if not self.input:
            raise UserError("no input given: pass --input=FILE, a directory or a glob (repeat for more)")


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        ChatSettings,
        argv,
        prog="prepare_data/chat.py",
        description="Render conversations (JSONL or parquet) into tokens and loss masks for chat fine-tuning.",
    )
    found = discover.find_inputs(
        cfg.input,
        out_dir=cfg.out_dir,
        include=cfg.include,
        exclude=cfg.exclude,
        binary_suffixes=(chat_inputs.PARQUET_SUFFIX,),
    )
    files = found.files
    for file in files:
        chat_inputs.file_format(file)  # refuses other files before any work
    # Imported here: it imports torch (seconds), which a Ctrl-C then stops as run_cli has it stop, in one line.
    from gptkit.weights.sources import named_tokenizer

    base = named_tokenizer(cfg.tokenizer, cfg.bpe_dir)
    source = discover.source_record(cfg, found, split="by conversation (keyed hash of its turns)")
    source.update(block_size=cfg.block_size, too_long=cfg.too_long, on_bad=cfg.on_bad)
    total_bytes = sum(file.size for file in files)
    make_items = partial(chat_inputs.chat_items, files, cfg.chunk_bytes, cfg.text_field)
    meta, seconds = chat_prepare.prepare_chat(make_items, cfg, base, source, total_bytes, what=", ".join(cfg.input))
    print(chat_prepare.summary_line(meta, cfg.out_dir, seconds, total_bytes))
    return 0


if __name__ == "__main__":
    run_cli(main)
