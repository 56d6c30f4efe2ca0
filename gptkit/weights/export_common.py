"""What every export format shares: the model as GPT-2 tensors where GPT-2 computes it, the tokenizer as a
vocabulary with merges, the chat template as Jinja, and writing a new output directory.

A model leaves the toolkit as the class that computes it exactly: GPT-2 (learned positions, LayerNorm with biases,
GELU, one fused QKV projection, a head tied or not), or else one of the Llama family (Llama, Qwen2, Qwen3,
nanochat: gptkit.weights.hf.export_architecture). What GPT-2 can express exactly is converted here (no biases become
zero biases, fixed sinusoidal positions become a learned table with the same values); anything that no class
computes is refused with a line naming the setting.

A base model plus an adapter would be merged into plain weights before it reaches these functions: the writers only
ever see a GPT and its tokenizer."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gptkit.core.errors import UserError
from gptkit.core.fileio import existing_ancestor, named_os_error
from gptkit.data import bpe
from gptkit.data.chat import ChatTemplate
from gptkit.data.tokenizer import (
    END_OF_TEXT,
    BpeTokenizer,
    CharTokenizer,
    ChatTokenizer,
    TiktokenTokenizer,
    Tokenizer,
    gpt2_unicode_to_byte,
)
from gptkit.model import GPT, GPTConfig, sinusoidal_table

# -------------------------------------------------------------------------------------------- weights


def gpt2_problem(config: GPTConfig, exact_gelu: bool) -> str | None:
    """Why `config` cannot be written as GPT-2, naming the setting; None when it can. `exact_gelu`: whether the
    target runs the exact (erf) GELU as well as the tanh approximation."""
    if config.pos_encoding == "rope":
        return "pos_encoding=rope: GPT-2 has learned absolute positions, not rotary ones"
    if config.activation == "relu2":
        return "activation=relu2: GPT-2's MLP uses GELU"
    if config.activation == "gelu" and not exact_gelu:
        return "activation=gelu (exact): llama.cpp's GPT-2 runs only the tanh approximation (gelu_tanh)"
    if config.qk_norm:
        return "qk_norm=True: GPT-2 has no normalisation of queries and keys"
    if config.norm != "layernorm" or not config.norm_weight or config.embed_norm:
        return (
            f"norm={config.norm}, norm_weight={config.norm_weight}, embed_norm={config.embed_norm}: GPT-2 has LayerNorm"
        )
    if config.activation == "swiglu" or config.mlp_hidden != 4 * config.n_embd:
        return f"activation={config.activation}, mlp_hidden={config.mlp_hidden}: GPT-2's MLP is 4 * n_embd wide, GELU"
    if config.n_kv_head != config.n_head or config.head_dim * config.n_head != config.n_embd:
        return (
            f"n_kv_head={config.n_kv_head}, head_dim={config.head_dim}: GPT-2 has one KV head per head of n_embd/n_head"
        )
    if config.qkv_bias not in (None, config.bias) or config.logit_softcap is not None:
        return "qkv_bias or logit_softcap: GPT-2 has neither"
    return None


def gpt2_tensors(model: GPT, exact_gelu: bool = True) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The model as GPT-2: its config (learned positions, biases) and float32 tensors under our names in nn.Linear's
    (out, in) layout, `lm_head.weight` always present (the same values as the embedding when tied).

    UserError naming the setting when GPT-2 cannot express the model exactly.
    """
    config = model.config
    problem = gpt2_problem(config, exact_gelu)
    if problem:
        raise UserError(f"cannot export as GPT-2: {problem}")
    gpt2 = replace(config, pos_encoding="learned", bias=True, dropout=0.0)
    with torch.device("meta"):  # names and shapes only
        expected = GPT(gpt2).state_dict()
    ours = {key: value.detach().float().cpu() for key, value in model.state_dict().items()}
    tensors = {}
    for key, shape in ((key, value.shape) for key, value in expected.items()):
        if key in ours:
            tensors[key] = ours[key]
        elif key == "transformer.wpe.weight":  # sinusoidal: the fixed table is a learned one that never trained
            tensors[key] = sinusoidal_table(config.block_size, config.n_embd)
        elif key.endswith(".bias"):  # bias=False: adding zero changes nothing
            tensors[key] = torch.zeros(shape)
        elif key.rsplit(".", 2)[-2].startswith("ln_"):  # a norm without a learned scale: a scale of ones
            tensors[key] = torch.ones(shape)
        else:
            raise UserError(f"cannot export as GPT-2: the model has no {key}")
    tensors.setdefault("lm_head.weight", tensors["transformer.wte.weight"])
    return gpt2, tensors


# -------------------------------------------------------------------------------------------- tokenizer


@dataclass(frozen=True, kw_only=True)
class Vocabulary:
    """A tokenizer as the export formats describe one.

    tokens: the text of each id below `size` (byte-level BPE: GPT-2's printable form of the token's bytes; char:
    the character; special tokens: their text). merges: BPE's ordered merge rules, None for a character table.
    pattern: the pre-tokenisation regex of a trained BPE, None for GPT-2's own. special: special token text -> id.
    """

    tokens: list[str]
    merges: list[tuple[str, str]] | None
    pattern: str | None
    special: dict[str, int]
    eot_token: int | None
    chat: ChatTemplate | None

    @property
    def size(self) -> int:
        return len(self.tokens)

    @property
    def is_char(self) -> bool:
        return self.merges is None


def vocabulary_of(tokenizer: Tokenizer) -> Vocabulary:
    """The export description of one of our tokenizers; UserError for one no format can express."""
    base, chat = (tokenizer.base, tokenizer.chat) if isinstance(tokenizer, ChatTokenizer) else (tokenizer, None)
    special = dict(chat.special_tokens) if chat else {}
    if isinstance(base, CharTokenizer):
        tokens, merges, pattern = list(base.chars), None, None
        if base.eot:
            special[END_OF_TEXT] = base.eot_token
    else:
        ranks, pattern, base_special = _bpe_of(base)
        tokens, merges = byte_level_tokens(ranks), bpe_merges(ranks)
        special.update(base_special)
    tokens += [""] * (max([len(tokens) - 1, *special.values()]) + 1 - len(tokens))
    for text, token_id in special.items():
        tokens[token_id] = text
    if "" in tokens:
        raise UserError(f"the tokenizer has no token for id {tokens.index('')}; export needs every id to have one")
    if len(set(tokens)) != len(tokens):  # the formats look tokens up by their text
        raise UserError(
            "two of the tokenizer's tokens have the same text (a special token's?); export cannot tell them apart"
        )
    return Vocabulary(
        tokens=tokens, merges=merges, pattern=pattern, special=special, eot_token=base.eot_token, chat=chat
    )


def _bpe_of(base: TiktokenTokenizer) -> tuple[dict[bytes, int], str | None, dict[str, int]]:
    """(ranks, pattern or None for GPT-2's, special tokens) of a byte-level BPE."""
    if isinstance(base, BpeTokenizer):
        record = base.to_meta()
        return bpe.ranks_of_record(record, "tokenizer"), record["pattern"], dict(record["special_tokens"])
    if base.name != "gpt2":  # other tiktoken encodings' patterns use regex features the formats read differently
        raise UserError(
            f"cannot export the tiktoken encoding {base.name!r}: export supports gpt2 and BPEs trained here"
        )
    encoding = base._encoding  # tiktoken's public API: the token bytes (sorted) and the rank of each
    ranks = {token: encoding.encode_single_token(token) for token in encoding.token_byte_values()}
    return ranks, None, {END_OF_TEXT: base.eot_token}


def byte_level_tokens(ranks: dict[bytes, int]) -> list[str]:
    """Each rank's token in GPT-2's byte-level form (every byte a printable character), as tokenizer.json and GGUF
    store byte-level BPE vocabularies."""
    to_char = {byte: char for char, byte in gpt2_unicode_to_byte().items()}
    tokens = [""] * len(ranks)
    for token, rank in ranks.items():
        tokens[rank] = "".join(to_char[b] for b in token)
    return tokens


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """Merge rules that make a merge-based BPE encode as tiktoken does from ranks alone.

    tiktoken joins, at each step, the adjacent pair whose concatenation has the lowest rank. So every split of a
    token into two tokens is a merge with that token's priority: ordered by the token's rank, then by the parts'.
    """
    to_char = {byte: char for char, byte in gpt2_unicode_to_byte().items()}
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(left, right) for left, right in splits if left in ranks and right in ranks]
        merges += [(rank, ranks[left], ranks[right], left, right) for left, right in splits]
    merges.sort()

    def text(piece: bytes) -> str:
        return "".join(to_char[b] for b in piece)

    return [(text(left), text(right)) for *_, left, right in merges]


# -------------------------------------------------------------------------------------------- chat template


def vocabulary_chat_template(vocabulary: Vocabulary) -> str:
    """The vocabulary's chat template as Jinja (see ChatTemplate.to_jinja)."""
    chat = vocabulary.chat
    return chat.to_jinja("" if chat.begin is None else vocabulary.tokens[chat.begin])


# -------------------------------------------------------------------------------------------- output directory


@contextmanager
def new_directory(destination: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """A temporary directory in or beside `destination` to write into; on success its files move into `destination`.

    Never overwrites unasked: a `destination` that holds anything is a UserError unless `overwrite`, which replaces
    the files and folders of the same names (a folder whole, as PEFT's base/) and leaves the others. A failure
    leaves `destination` as it was.
    """
    destination = Path(destination)
    if destination.is_symlink() and not destination.exists():
        raise UserError(f"{destination} is a link to nothing ({os.readlink(destination)}); choose another --export_dir")
    if destination.exists() and not destination.is_dir():
        raise UserError(f"{destination} exists and is not a directory; choose another --export_dir")
    prefix, suffix = f".{destination.name}.", ".partial"  # the staging folder's name, around mkdtemp's letters
    left_by_a_killed_export = re.compile(f"{re.escape(prefix)}.*{re.escape(suffix)}")
    held = (
        [path for path in destination.iterdir() if not left_by_a_killed_export.fullmatch(path.name)]
        if destination.is_dir()
        else []
    )
    if held and not overwrite:
        raise UserError(f"{destination} already holds files; choose a new --export_dir or pass --overwrite")
    above = existing_ancestor(destination)
    if not above.is_dir():
        raise UserError(f"{above} is a file, not a directory; choose another --export_dir")
    destination.parent.mkdir(parents=True, exist_ok=True)
    # A name of its own: never a folder of the user's, nor another export's to the same place at the same time.
    # Inside an existing destination (which may be a mount point: another file system than its parent's) or beside
    # a new one, so that the files move in by renaming.
    place = destination if destination.is_dir() else destination.parent
    try:
        staging = Path(tempfile.mkdtemp(dir=place, prefix=prefix, suffix=suffix))
    except OSError as exc:  # said of the folder the user named, not of a temporary name
        raise named_os_error(exc, place) from exc
    try:
        yield staging
        destination.mkdir(exist_ok=True)
        for path in sorted(staging.iterdir()):
            replace_entry(path, destination / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def replace_entry(source: Path, target: Path) -> None:
    """Move `source` (a file or folder) to `target`, replacing what is there. os.replace cannot put anything over a
    folder that holds files, so an old folder (or anything where a folder goes) first moves aside and is deleted
    once the new one is in place; it moves back if that fails, so `target` is never half old and half new."""
    if not (target.is_dir() or (source.is_dir() and target.exists())):
        os.replace(source, target)
        return
    aside = target.with_name(f".{target.name}.old")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(target, aside)
    try:
        os.replace(source, target)
    except BaseException:
        os.replace(aside, target)
        raise
    if aside.is_dir():
        shutil.rmtree(aside)
    else:
        aside.unlink()
