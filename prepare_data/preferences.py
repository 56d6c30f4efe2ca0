"""Prepare preference pairs for DPO: TRL's preference records (JSONL or parquet) -> tokens, loss masks and meta.json.

    python prepare_data/preferences.py --input=pairs.jsonl --tokenizer=out-sft --out_dir=data/prefs
    python train.py --objective=dpo --data_dir=data/prefs --init_from=out-sft --dpo_beta=0.1

A record is {"prompt", "chosen", "rejected"} as text (a user turn and two replies) or as message lists, or
{"chosen", "rejected"} as whole conversations (their shared first messages are the prompt). Both candidates are
rendered with the chat template (gptkit.data.chat); the loss mask covers the candidate replies only. A pair goes
wholly to train or val with every pair of the same prompt (keyed hash of --seed and the prompt's turns).
--tokenizer names the model's data directory, checkpoint or training out_dir, so the ids are the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import fixed, parse_settings, setting
from gptkit.data.preferences import PreferenceWorker, preference_columns
from gptkit.data.prepare import chat_inputs, chat_prepare, discover
from gptkit.data.prepare.settings import PrepareSettings, exclude_setting, include_setting, input_setting


@dataclass(kw_only=True)
class PreferenceSettings(PrepareSettings):
    """The shared preparation settings with the defaults preference data needs, plus the inputs and policies."""

    out_dir: str = setting("data/preferences", "output directory for the tokens, loss masks, offsets and meta.json")
    tokenizer: str = setting(
        "gpt2",
        "gpt2, char, a tiktoken encoding, a train_tokenizer.py dir, a Hugging Face model dir or hub name "
        "(owner/name), a .gguf file (or owner/name:TAG), or the model's data dir, checkpoint or training out_dir (its "
        "tokenizer is reused, so the ids match the model's)",
    )
    text_field: str | None = fixed(None, "preference records name their fields: prompt, chosen, rejected")
    val_fraction: float = setting(0.05, "fraction of pairs for val")
    block_size: int = setting(1024, "the context the data is for: longer pairs are cut or dropped (--too_long)")
    input: list[str] = input_setting()
    include: list[str] = include_setting()
    exclude: list[str] = exclude_setting()
    too_long: str = setting(
        "cut",
        "a candidate over block_size + 1 tokens: cut both (the pair is dropped if a reply is cut away) or drop",
        choices=chat_prepare.TOO_LONG_POLICIES,
    )
    on_bad: str = setting(
        "error",
        "a bad record (malformed JSON, no chosen or rejected, wrong role, empty content): error (stop, naming "
        "file:line) or skip (count by reason)",
        choices=chat_prepare.ON_BAD_POLICIES,
    )

    def validate(self) -> None:
        super().validate()
        if not self.input:
            raise UserError("no input given: pass --input=FILE, a directory or a glob (repeat for more)")


def summary_line(meta: dict, out_dir: str) -> str:
    """One line: pairs and scored tokens per split, and what was cut, dropped or skipped."""
    parts = []
    for split in ("train", "val"):
        info = meta["splits"][split]
        parts.append(f"{split} {info['documents'] // 2:,} pairs ({info['assistant_tokens']:,} scored tokens)")
    source = meta["source"]
    line = f"wrote preference pairs to {out_dir} (vocab {meta['vocab_size']:,}): {'; '.join(parts)}"
    if source["cut"]:
        line += f"; {source['cut']:,} cut to block_size + 1"
    for what in ("dropped", "skipped"):
        if any(source[what].values()):
            reasons = ", ".join(f"{count:,} {reason}" for reason, count in sorted(source[what].items()))
            line += f"; {sum(source[what].values()):,} {what} ({reasons})"
    return line


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        PreferenceSettings,
        argv,
        prog="prepare_data/preferences.py",
        description="Render preference pairs (JSONL or parquet) into tokens and loss masks for DPO.",
    )
    found = discover.find_inputs(
        cfg.input,
        out_dir=cfg.out_dir,
        include=cfg.include,
        exclude=cfg.exclude,
        binary_suffixes=(chat_inputs.PARQUET_SUFFIX,),
    )
    for file in found.files:
        chat_inputs.file_format(file)  # refuses other files before any work
    # Imported here: it imports torch (seconds), which a Ctrl-C then stops as run_cli has it stop, in one line.
    from gptkit.weights.sources import named_tokenizer

    base = named_tokenizer(cfg.tokenizer, cfg.bpe_dir)
    source = discover.source_record(cfg, found, split="by prompt (keyed hash of its turns)")
    source.update(block_size=cfg.block_size, too_long=cfg.too_long, on_bad=cfg.on_bad, pairs=True)
    total_bytes = sum(file.size for file in found.files)
    make_items = partial(chat_inputs.chat_items, found.files, cfg.chunk_bytes, cfg.text_field, preference_columns)
    what = ", ".join(cfg.input)
    meta, _ = chat_prepare.prepare_chat(make_items, cfg, base, source, total_bytes, what, worker=PreferenceWorker)
    print(summary_line(meta, cfg.out_dir))
    return 0


if __name__ == "__main__":
    run_cli(main)
