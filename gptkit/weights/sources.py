"""Every way to get a model, through one door: `load(source)` reads a training run (its best or latest checkpoint), a
checkpoint file, a LoRA run (its base with the adapters, merged or kept apart), a Hugging Face directory, a hub name
(owner/name, or gpt2 ... gpt2-xl), a GGUF file (or a directory holding one) or a hub repository's GGUF file
(owner/name:TAG), and gives the model with its tokenizer. `source_kind` is the one place that decides which of these a
source is.

The formats themselves live beside it: checkpoint.py (our files), lora.py (the adapters), hf.py (Hugging Face's
files and the hub), gguf_read.py (llama.cpp's).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from gptkit.core.errors import UserError
from gptkit.core.fileio import sha256_file
from gptkit.data.gguf_tokenizer import find_gguf, gguf_tokenizer_record
from gptkit.data.hf_tokenizer import HFTokenizer, is_gpt2_bpe, is_hf_tokenizer_dir, read_hf_record
from gptkit.data.meta import read_meta
from gptkit.data.prepare import chat_prepare
from gptkit.data.tokenizer import Tokenizer, make_tokenizer, tokenizer_from_meta
from gptkit.model import GPT, GPTConfig, config_from_dict
from gptkit.weights.checkpoint import (
    check_base_tokenizer,
    checked_weights,
    is_checkpoint_source,
    load_checkpoint,
    model_args_of,
    model_for_weights,
    resolve_checkpoint,
)
from gptkit.weights.gguf_read import read_gguf
from gptkit.weights.hf import (
    GPT2_HUB_NAMES,
    hub_gguf_file,
    hub_gguf_name,
    hub_snapshot,
    is_gpt2_directory,
    is_hub_name,
    read_hf_model,
    read_torch_bin,
    weight_files,
)
from gptkit.weights.lora import BASE_WEIGHTS, LoraConfig, add_lora, load_adapter_state, merge_lora
from gptkit.weights.quantization import int4_block_products

SOURCE_KINDS = ("checkpoint", "gguf", "hf", "hub")  # what source_kind answers
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, kw_only=True)
class Loaded:
    """A model read from a source (on CPU, eval mode), its tokenizer, and what a caller needs to know of the
    source: its kind, the file or directory read (a hub name's snapshot directory) and, for our checkpoints, the
    checkpoint itself (its LoRA record, its tokenizer record, a run's training state)."""

    model: GPT
    tokenizer: Tokenizer | None  # None when load(..., tokenizer=False)
    source: str
    kind: str  # one of SOURCE_KINDS
    path: Path
    checkpoint: dict[str, Any] | None = None
    gguf_tokenizer: dict[str, Any] | None = None  # a GGUF file's tokenizer record, read with its model

    @property
    def lora(self) -> dict[str, Any] | None:
        """A LoRA run's record (its settings and its base); None for whole weights."""
        return None if self.checkpoint is None else self.checkpoint.get("lora")

    @property
    def tokenizer_record(self) -> dict[str, Any] | None:
        """The tokenizer a checkpoint of ours records (checkpoint.tokenizer_record's form); None for open weights."""
        return None if self.checkpoint is None else self.checkpoint.get("tokenizer")


def source_kind(source: str) -> str | None:
    """Which kind of source `source` is (SOURCE_KINDS), None when it names no model: a file (not a .gguf) or a
    directory with best.pt or ckpt.pt is one of our "checkpoint"s; a directory with config.json is "hf"; a .gguf file,
    or a directory holding one, is "gguf", as is owner/name:TAG (a hub repository's GGUF file); a name that is no
    path, owner/name or gpt2*, is "hub"."""
    path = Path(source)
    if is_checkpoint_source(source):
        return "checkpoint"
    if (path / "config.json").is_file():
        return "hf"
    if find_gguf(path) is not None:
        return "gguf"
    if path.exists():
        return None
    if hub_gguf_name(source) is not None:
        return "gguf"
    return "hub" if source in GPT2_HUB_NAMES or is_hub_name(source) else None


def names_a_path(source: str) -> bool:
    """Whether `source` can only be a path: a .gguf file's name, or a name with a separator that no hub name
    (owner/name) reads as."""
    if hub_gguf_name(source) is not None:
        return False
    return source.endswith(".gguf") or (("/" in source or os.sep in source) and not is_hub_name(source))


def unknown_source(source: str) -> UserError:
    """The mistake of a source that names no model, said for what it does name."""
    if Path(source).is_dir():
        return UserError(
            f"{source} holds no config.json, so it is no Hugging Face model directory (nor a training run: no "
            "best.pt or ckpt.pt; nor a GGUF file's: no *.gguf)"
        )
    if names_a_path(source) and not Path(source).exists():
        return UserError(f"{source}: no such file or directory")
    return UserError(f"{source} is neither a directory, a hub name (owner/name) nor one of {', '.join(GPT2_HUB_NAMES)}")


def load(
    source: str,
    *,
    checkpoint: str = "best",
    data_dir: str = "",
    merge: bool = True,
    overrides: dict[str, Any] | None = None,
    dtype: str = "float32",
    tokenizer: bool = True,
    keep_int4: bool = False,
    int4_products: bool = False,
) -> Loaded:
    """The model of `source` (any of the module docstring's) and its tokenizer.

    checkpoint: which checkpoint of a run directory, best (best.pt, else ckpt.pt) or latest (ckpt.pt).
    data_dir: take the tokenizer from this data directory's meta.json, for a model that carries none (a
      checkpoint's own or a model's tokenizer.json wins, and a data directory with another one is refused).
    merge: a LoRA run's adapters folded into plain weights (False: kept apart, to train on).
    overrides: model settings that do not change shapes, e.g. {"dropout": 0.1}; block_size crops the context, or
      lengthens it where positions are computed (rope, sinusoidal).
    dtype: the weights' dtype, float32 or bfloat16. tokenizer: False reads the model only.
    keep_int4: a GGUF file's Q4_0 and Q4_1 matrices stay in the file, read as they are needed, never float32
      (gguf_read.keep_in_file): for decoding on the CPU, not for training.
    int4_products: the products of its blocks read as int4 blocks for add_lora to hold so (QLoRA's base), never
      float32: a GGUF file's Q4_0 and Q4_1 ones stay in the file, a checkpoint's or Hugging Face directory's are
      quantized as they are put in place.
    UserError (one line) for every problem.
    """
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r}: models load as {' or '.join(DTYPES)}")
    check_overrides(overrides)
    context = (overrides or {}).get("block_size")  # set on the model made, whose positions the file fixes
    overrides = {key: value for key, value in (overrides or {}).items() if key != "block_size"}
    kind = source_kind(source)
    if kind is None:
        raise unknown_source(source)
    state = gguf_tokenizer = None
    if kind == "checkpoint":
        path = resolve_checkpoint(source, checkpoint)
        state = load_checkpoint(path)
        model = model_of_checkpoint(state, str(path), overrides=overrides, merge=merge, int4_products=int4_products)
    elif kind == "gguf":
        path = open_weights_path(source, kind)
        model, gguf_tokenizer = read_gguf(path, overrides, keep_int4, products_in_file=int4_products)
    else:
        path = open_weights_path(source, kind)
        model = read_hf_model(path, overrides, int4_products)
    if context is not None:
        fit_context(model, context, str(path))
    read = Loaded(
        model=model,
        tokenizer=None,
        source=source,
        kind=kind,
        path=path,
        checkpoint=state,
        gguf_tokenizer=gguf_tokenizer,
    )
    text_tokenizer = source_tokenizer(read, data_dir) if tokenizer else None
    if text_tokenizer is not None:
        check_vocabulary_fits(text_tokenizer.vocab_size, model.config.vocab_size, source, data_dir)
    if dtype != "float32":  # every reader gives float32 weights; a cast to it would also widen int4 blocks' scales
        model = model.to(DTYPES[dtype])
    return replace(read, model=model.eval(), tokenizer=text_tokenizer)


# The model settings that fix the weights' shapes or meaning: an override of one would not fit the file's weights.
SHAPE_SETTINGS = frozenset(
    [
        "vocab_size",
        "n_layer",
        "n_head",
        "n_kv_head",
        "n_embd",
        "head_dim",
        "mlp_hidden",
        "bias",
        "qkv_bias",
        "tie_embeddings",
        "norm",
        "norm_weight",
        "qk_norm",
        "qk_norm_weight",
        "activation",
        "pos_encoding",
        "embed_norm",
    ]
)


def check_overrides(overrides: Any) -> None:
    """UserError, naming the override, for one a model cannot take: not a dict, a key no model setting has, a
    setting the weights' shapes follow, or a value the model refuses (dropout 2)."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise UserError(f"overrides is a dict of model settings, e.g. {{'dropout': 0.1}}, not {type(overrides)}")
    unknown = sorted(set(overrides) - {field.name for field in fields(GPTConfig)})
    if unknown:
        raise UserError(f"overrides: {', '.join(map(str, unknown))} is no model setting (GPTConfig's fields)")
    fixed = sorted(set(overrides) & SHAPE_SETTINGS)
    if fixed:
        raise UserError(f"overrides: {', '.join(fixed)} follows the weights' shapes; only settings that keep them")
    try:
        GPTConfig(**overrides)
    except (ValueError, TypeError) as exc:
        raise UserError(f"overrides: {exc}") from None


def fit_context(model: GPT, block_size: int, source: str) -> None:
    """The model's context set to `block_size` positions: cropped, or lengthened where its positions are computed;
    UserError past the rows of learned positions."""
    held = model.config.block_size
    if block_size <= held:
        model.crop_block_size(block_size)
    elif model.config.pos_encoding == "learned":
        raise UserError(
            f"overrides: block_size {block_size} is past the {held} positions {source} learned (its position "
            f"embedding's rows); give at most {held}"
        )
    else:
        model.grow_block_size(block_size)


def check_vocabulary_fits(tokens: int, rows: int, source: str, data_dir: str) -> None:
    """UserError when the tokenizer has more tokens than the model has embedding rows."""
    if tokens <= rows:
        return
    if data_dir:
        raise UserError(
            f"{data_dir}'s tokenizer has {tokens} tokens but the model only {rows}; pass the --data_dir the model was "
            "trained on"
        )
    raise UserError(
        f"{source}: its tokenizer has {tokens} tokens but its model only {rows}: the two do not belong together"
    )


def open_weights_path(source: str, kind: str) -> Path:
    """The GGUF file, or the Hugging Face directory (a hub name's, or owner/name:TAG's file, fetched into the
    cache), of a source."""
    if kind == "gguf":
        return find_gguf(source) or hub_gguf_file(source)
    return hub_snapshot(source) if kind == "hub" else Path(source)


# ----------------------------------------------------------------------------- our checkpoints and LoRA runs


def model_of_checkpoint(
    checkpoint: dict[str, Any],
    where: str,
    *,
    overrides: dict[str, Any] | None = None,
    merge: bool = True,
    int4_products: bool = False,
) -> GPT:
    """The GPT a checkpoint of ours holds (on CPU): its weights, or a LoRA run's base with the adapters, merged into
    plain weights unless `merge` is False. `overrides` replaces model_args entries that do not change shapes;
    int4_products as load's (a plain checkpoint's products). UserError naming `where` when model_args are invalid
    or do not match the weights."""
    if "lora" in checkpoint:
        model = model_with_adapters(checkpoint, where, overrides)
        return merge_lora(model) if merge else model
    try:
        config = config_from_dict({**model_args_of(checkpoint), **(overrides or {})})
    except (TypeError, ValueError) as exc:  # ValueError: GPTConfig refuses the values
        raise UserError(f"checkpoint {where} has invalid model_args ({exc}); the file is damaged") from exc
    model = model_for_weights(config, checkpoint["model"], f"checkpoint {where}", "model_args", "the file is damaged")
    state = checked_weights(model, checkpoint["model"], where)
    if int4_products:
        int4_block_products(model, state.pop)
    model.take_weights(state)
    return model


# A LoRA run's checkpoint stores only what trained ("model": adapter_state) and, under "lora", how to rebuild the
# rest: the settings, and the base it started from by path (or hub name) and the sha256 of its weights files.


def model_with_adapters(checkpoint: dict[str, Any], where: str, overrides: dict[str, Any] | None) -> GPT:
    """A LoRA checkpoint's base (checked), cropped and grown to the run's shape, with the adapters in place."""
    record = checked_lora_record(checkpoint["lora"], where)
    config = LoraConfig.from_dict(record.get("config"), where)
    model = lora_base(record["base"], where, overrides, int4_products=record["base_weights"] == "int4")
    shape = checkpoint["model_args"]
    if shape["block_size"] < model.config.block_size:
        model.crop_block_size(shape["block_size"])
    if shape["vocab_size"] > model.config.vocab_size:
        model.grow_vocabulary(shape["vocab_size"])
    add_lora(model, config, record["base_weights"], record.get("first_new_row"))
    load_adapter_state(model, checkpoint["model"], where)
    return model


def checked_lora_record(record: Any, where: str) -> dict[str, Any]:
    """A LoRA checkpoint's record (lora.lora_record's), else UserError: a damaged file's would fail far from here."""
    problem = lora_record_problem(record)
    if problem:
        raise UserError(f"checkpoint {where}: its LoRA record is damaged ({problem}); train the adapters again")
    return record


def lora_record_problem(record: Any) -> str | None:
    """What is wrong with a LoRA checkpoint's record (None: nothing)."""
    if not isinstance(record, dict):
        return "it is no dict"
    base = record.get("base")
    if not (isinstance(base, dict) and all(isinstance(base.get(key), str) for key in ("source", "sha256"))):
        return "its base is not {source, sha256} text"
    if record.get("base_weights") not in BASE_WEIGHTS:
        return f"its base_weights {record.get('base_weights')!r} are none of {', '.join(BASE_WEIGHTS)}"
    row = record.get("first_new_row")
    if not (row is None or (type(row) is int and row >= 0)):
        return f"its first_new_row {row!r} is no row"
    return None


def lora_base(
    reference: dict[str, str], where: str, overrides: dict[str, Any] | None = None, int4_products: bool = False
) -> GPT:
    """The base model a LoRA checkpoint names (a LoRA base merged), after checking that its weights are the ones
    the adapters were trained on; int4_products as load's (an int4 base's products)."""
    remedy = "put the base they were trained on back there"
    source = unchanged_source(reference, f"{where}: its base", "the adapters were trained", remedy)
    return load(source, overrides=overrides, tokenizer=False, int4_products=int4_products).model


def unchanged_source(reference: dict[str, str], whose: str, since: str, remedy: str) -> str:
    """The source a base_reference record names, after checking that it is there with the weights (and config.json)
    it had; else UserError: "{whose} {source} is missing" or "has changed since {since}", then `remedy`."""
    source = reference["source"]
    if source_kind(source) is None:
        raise UserError(f"{whose} {source} is missing; {remedy}")
    found = base_reference(source)
    for key in ("sha256", "config_sha256"):  # config_sha256: only in records written since it was added
        if key in reference and found.get(key) != reference[key]:
            what = "weights" if key == "sha256" else "config.json"
            raise UserError(
                f"{whose} {source} has changed since {since} (its {what}: sha256 {str(found.get(key))[:12]}..., "
                f"expected {reference[key][:12]}...); {remedy}"
            )
    return source


def base_reference(source: str) -> dict[str, str]:
    """{"source", "sha256"} of the base a LoRA run starts from: the checkpoint file (a run's best), the GGUF file, or
    the Hugging Face weights files (a hub name stays a name), and for the last "config_sha256", its config.json's
    (rope base, norm epsilon, ... that the weights' digest does not cover)."""
    kind = source_kind(source)
    if kind is None:
        raise unknown_source(source)
    if kind == "checkpoint":
        path = resolve_checkpoint(source, "best").resolve()
        return {"source": str(path), "sha256": sha256_file(path)}
    path = open_weights_path(source, kind)
    if kind == "gguf":  # a hub file stays a name (the cache's own path is a blob's)
        return {"source": source if find_gguf(source) is None else str(path.resolve()), "sha256": sha256_file(path)}
    files = weight_files(path)
    if files[0].suffix == ".bin":
        read_torch_bin(files[0])  # refused here, at the start, if it cannot be read safely
    digest = ",".join(sha256_file(file) for file in files)
    reference = {"source": source if kind == "hub" else str(path.resolve()), "sha256": digest}
    return {**reference, "config_sha256": sha256_file(path / "config.json")}


# ----------------------------------------------------------------------------- tokenizers


def source_tokenizer(loaded: Loaded, data_dir: str) -> Tokenizer:
    """The tokenizer of what load read: a checkpoint's record, else open weights' own (see open_weights_tokenizer)."""
    if loaded.checkpoint is not None:
        return checkpoint_tokenizer(loaded.checkpoint, loaded.path, data_dir)
    return open_weights_tokenizer(loaded, data_dir)


def checkpoint_tokenizer(state: dict[str, Any], path: Path, data_dir: str) -> Tokenizer:
    """The tokenizer the checkpoint at `path` records, or data_dir's (which must be the same when it records one)."""
    record = state.get("tokenizer")
    if data_dir:
        record = data_dir_tokenizer(data_dir, record, path)
    if not record:
        raise UserError(
            f"checkpoint {path} records no tokenizer; pass --data_dir=DIR with the meta.json it was trained on"
        )
    try:
        return tokenizer_from_meta(record)
    except UserError as exc:  # say where the tokenizer description came from
        raise UserError(f"{data_dir or f'checkpoint {path}'}: {exc}") from exc


def data_dir_tokenizer(data_dir: str, recorded: dict | None, path: Path) -> dict:
    """The tokenizer object of data_dir's meta.json, which must be the one the checkpoint at `path` records (when it
    records one): sampling a model through another tokenizer gives garbage."""
    tokenizer_meta = read_meta(data_dir)["tokenizer"]
    # A checkpoint's record is meta.json's tokenizer object plus vocab_size and eot_token (checkpoint.tokenizer_record)
    own = None if recorded is None else {k: v for k, v in recorded.items() if k not in ("vocab_size", "eot_token")}
    if own is not None and own != tokenizer_meta:
        raise UserError(
            f"--data_dir={data_dir} holds another tokenizer than the one checkpoint {path} records; leave --data_dir "
            "out (the checkpoint's own tokenizer is used)"
        )
    return tokenizer_meta


def own_tokenizer_record(loaded: Loaded) -> dict[str, Any] | None:
    """The HFTokenizer record of open weights' own tokenizer (tokenizer_record_at), a GGUF file's as read with the
    model."""
    if loaded.kind == "gguf" and loaded.gguf_tokenizer:
        return loaded.gguf_tokenizer
    return tokenizer_record_at(loaded.kind, loaded.path)


def tokenizer_record_at(kind: str, path: Path) -> dict[str, Any] | None:
    """The HFTokenizer record of the tokenizer open weights of `kind` at `path` hold: a GGUF file's, or the Llama
    family's tokenizer.json, a GPT-2 directory's of another vocabulary than GPT-2's; None for GPT-2's own (its BPE is
    tiktoken's, which data prepared with --tokenizer=gpt2 holds) and for a directory without one."""
    if kind == "gguf":
        return gguf_tokenizer_record(path)
    if not is_hf_tokenizer_dir(path):
        return None
    record = read_hf_record(path)
    return None if is_gpt2_directory(path) and is_gpt2_bpe(record) else record


def open_weights_meta(source: str) -> dict[str, Any]:
    """meta.json's tokenizer entries for open weights' own tokenizer, read without their weights: what a run that
    starts from them with no data directory of its own (GRPO's prompts) tokenizes with. GPT-2's is its BPE."""
    kind = source_kind(source)
    if kind is None or kind == "checkpoint":
        raise unknown_source(source)
    path = open_weights_path(source, kind)
    record = tokenizer_record_at(kind, path)
    if record is not None:
        tokenizer: Tokenizer = HFTokenizer(record, where=str(path))
    elif is_gpt2_directory(path):
        tokenizer = make_tokenizer("gpt2")
    else:
        raise UserError(f"{path} has no tokenizer.json to tokenize prompts with")
    return {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token}


def open_weights_tokenizer(loaded: Loaded, data_dir: str) -> Tokenizer:
    """The tokenizer of open weights: their own (a data_dir must hold the same one), else data_dir's; GPT-2's is
    data_dir's, else GPT-2's BPE."""
    kind, path, source = loaded.kind, loaded.path, loaded.source
    own = own_tokenizer_record(loaded)
    data = read_meta(data_dir)["tokenizer"] if data_dir else None
    if own is not None and data is not None and data.get("tokenizer_json_sha256") != own["tokenizer_json_sha256"]:
        raise UserError(f"{data_dir} was not tokenized with {source}'s own tokenizer; leave out --data_dir")
    if own is not None:
        return HFTokenizer(own, where=str(path))
    if data is not None:
        return tokenizer_from_meta(data)
    if kind != "gguf" and is_gpt2_directory(path):
        return make_tokenizer("gpt2")
    raise UserError(f"{path} has no tokenizer.json; pass --data_dir=DIR whose meta.json holds the model's tokenizer")


def check_data_tokenizer(loaded: Loaded, meta: dict[str, Any]) -> None:
    """UserError unless data (its meta.json) for training on from `loaded` was tokenized as the model reads text:
    with a checkpoint's recorded tokenizer (checkpoint.check_base_tokenizer), else as check_open_weights_tokenizer
    says."""
    if loaded.checkpoint is not None:
        check_base_tokenizer(loaded.checkpoint, meta, loaded.path)
    else:
        check_open_weights_tokenizer(meta, loaded)


def check_open_weights_tokenizer(meta: dict[str, Any], loaded: Loaded) -> None:
    """UserError unless data for open weights was tokenized with their own tokenizer (the record prepare_data
    --tokenizer=DIR writes), or, chat data on GPT-2, with GPT-2's BPE."""
    tokenizer, source, kind, path = meta["tokenizer"], loaded.source, loaded.kind, loaded.path
    own = own_tokenizer_record(loaded)
    if own is not None and tokenizer.get("tokenizer_json_sha256") != own["tokenizer_json_sha256"]:
        raise UserError(f"init_from={source} needs data in its own tokenizer; prepare it with --tokenizer={path}")
    gpt2 = own is None and kind != "gguf" and is_gpt2_directory(path)
    if gpt2 and "chat" in tokenizer and (tokenizer["kind"] != "tiktoken" or tokenizer.get("encoding") != "gpt2"):
        raise UserError(
            f"init_from={source} needs data in GPT-2's BPE; prepare it with prepare_data/chat.py --tokenizer=gpt2"
        )


# ----------------------------------------------------------------------------- preparation scripts' --tokenizer


def named_tokenizer(name: str, bpe_dir: str | None) -> Tokenizer | None:
    """The tokenizer a preparation script's --tokenizer names: None for 'char' (built from the data), a tiktoken
    encoding, a checkpoint file's or training out_dir's recorded tokenizer (so fine-tuning data has exactly the
    model's ids), a data directory's, a trained BPE directory's, a Hugging Face model directory's or GGUF file's
    own, or a hub model's own (owner/name, owner/name:TAG), fetched as --init_from fetches it."""
    name = fetched_tokenizer_source(name)
    if not Path(name).exists() and not is_encoding_name(name):
        raise UserError(
            f"--tokenizer={name}: no such directory or file, and no tokenizer of that name; use 'char', a tiktoken "
            f"encoding ({', '.join(encoding_names())}), a training run's out_dir, a Hugging Face model directory "
            "(tokenizer.json) or hub name (owner/name), a GGUF file (or owner/name:TAG), a data directory or one "
            "written by prepare_data/train_tokenizer.py"
        )
    if not is_checkpoint_source(name):
        return chat_prepare.base_tokenizer(name, bpe_dir)
    checkpoint_path = resolve_checkpoint(name, "best")
    record = load_checkpoint(checkpoint_path, required_keys=()).get("tokenizer")
    if not isinstance(record, dict):
        raise UserError(f"{checkpoint_path} records no tokenizer; pass the data directory it was trained on instead")
    return tokenizer_from_meta(record, bpe_dir=bpe_dir)


def fetched_tokenizer_source(name: str) -> str:
    """--tokenizer=`name` with a hub model's name (owner/name, or owner/name:TAG for a GGUF file) replaced by the
    directory or file fetched for it, as --init_from fetches it; any other name as it is."""
    if Path(name).exists() or is_encoding_name(name):
        return name
    kind = source_kind(name)
    return str(open_weights_path(name, kind)) if kind in ("hub", "gguf") else name


def encoding_names() -> list[str]:
    """tiktoken's encodings (gpt2, cl100k_base, ...)."""
    import tiktoken

    return tiktoken.list_encoding_names()


def is_encoding_name(name: str) -> bool:
    """Whether --tokenizer=`name` is 'char' or a tiktoken encoding (gpt2 is tiktoken's, not the hub's)."""
    return name == "char" or name in encoding_names()
