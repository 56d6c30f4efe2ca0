"""A complete Hugging Face directory: what transformers, vLLM and TGI load with `from_pretrained`.

config.json and model.safetensors (float32, as the transformers class that computes the model: gptkit.weights.hf.write_hf), tokenizer.json (Hugging Face
tokenizers: our byte-level BPE as merges with GPT-2's or the trained pattern, or a character table as a word-level
model over single characters), tokenizer_config.json (special tokens, and the chat template as Jinja) and
generation_config.json (which ids end a generation).

config.json's vocab_size is the model's row count, which may exceed the tokenizer's (a vocabulary padded to a
multiple of 64): the extra rows load and never come out of the tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptkit.core.errors import UserError
from gptkit.core.fileio import atomic_write_bytes, atomic_write_json
from gptkit.data.chat import END_OF_TURN
from gptkit.data.hf_tokenizer import HFTokenizer
from gptkit.data.tokenizer import Tokenizer
from gptkit.model import GPT
from gptkit.weights.export_common import Vocabulary, vocabulary_chat_template, vocabulary_of
from gptkit.weights.hf import write_hf


def export_hf(model: GPT, tokenizer: Tokenizer, directory: Path) -> list[str]:
    """Write the Hugging Face files of `model` and `tokenizer` into `directory`; returns the file names."""
    config = model.config
    if isinstance(tokenizer, HFTokenizer):
        return export_with_own_tokenizer(model, tokenizer, directory)
    vocabulary = vocabulary_of(tokenizer)
    if vocabulary.size > config.vocab_size:
        raise UserError(f"the tokenizer has {vocabulary.size} tokens but the model only {config.vocab_size} rows")
    write_hf(model, directory, bos=vocabulary.eot_token, eos=vocabulary.eot_token)
    build_tokenizer(vocabulary).save(str(directory / "tokenizer.json"))
    atomic_write_json(directory / "tokenizer_config.json", tokenizer_config(vocabulary, config.block_size))
    generation = {"bos_token_id": vocabulary.eot_token, "eos_token_id": end_ids(vocabulary) or None}
    atomic_write_json(directory / "generation_config.json", generation)
    return sorted(path.name for path in directory.iterdir())


def export_with_own_tokenizer(model: GPT, tokenizer: HFTokenizer, directory: Path) -> list[str]:
    """A model whose tokenizer came from a Hugging Face directory: that tokenizer.json, its special tokens and chat
    template written back as they were read."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}")
    record = tokenizer.to_meta()
    write_hf(model, directory, bos=tokenizer.named_token_id("bos_token"), eos=tokenizer.eot_token)
    atomic_write_bytes(directory / "tokenizer.json", record["tokenizer_json"].encode("utf-8"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model.config.block_size,
        "clean_up_tokenization_spaces": False,
        **record["special_tokens_map"],
    }
    if tokenizer.chat is not None:
        config["chat_template"] = tokenizer.chat.source
    atomic_write_json(directory / "tokenizer_config.json", config)
    stops = list(tokenizer.chat.reply_stops) if tokenizer.chat is not None else [tokenizer.eot_token]
    generation = {"eos_token_id": [stop for stop in stops if stop is not None] or None}
    atomic_write_json(directory / "generation_config.json", generation)
    return sorted(path.name for path in directory.iterdir())


def build_tokenizer(vocabulary: Vocabulary) -> Any:
    """A Hugging Face `tokenizers.Tokenizer` that encodes ordinary text to our ids and splits special tokens out."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {text: token_id for token_id, text in enumerate(vocabulary.tokens)}
    if vocabulary.is_char:  # one token per character; an unknown character is an error, as it is ours
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=None))
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tokenizer.decoder = decoders.Fuse()
    else:
        # ignore_merges: a pre-token that is itself a token is taken whole, as tiktoken does.
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=vocabulary.merges, ignore_merges=True))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=vocabulary.pattern is None)
        if vocabulary.pattern is not None:
            split = pre_tokenizers.Split(Regex(vocabulary.pattern), behavior="isolated")
            byte_level = pre_tokenizers.Sequence([split, byte_level])
        tokenizer.pre_tokenizer = byte_level
        tokenizer.decoder = decoders.ByteLevel()
    specials = sorted(vocabulary.special, key=vocabulary.special.get)
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in specials])
    return tokenizer


def end_ids(vocabulary: Vocabulary) -> list[int]:
    """The ids that end a generation: the end of a turn for a chat model, and the end of text."""
    ends = [vocabulary.chat.end_of_turn] if vocabulary.chat else []
    return ends + ([vocabulary.eot_token] if vocabulary.eot_token is not None else [])


def tokenizer_config(vocabulary: Vocabulary, block_size: int) -> dict[str, Any]:
    """tokenizer_config.json: the class that reads tokenizer.json, the special tokens' roles, the chat template."""
    eot = None if vocabulary.eot_token is None else vocabulary.tokens[vocabulary.eot_token]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": block_size,
        "bos_token": eot,
        "eos_token": END_OF_TURN if vocabulary.chat else eot,  # a chat reply ends at the end of its turn
        "clean_up_tokenization_spaces": False,
    }
    if vocabulary.chat:
        config["chat_template"] = vocabulary_chat_template(vocabulary)
    return config
