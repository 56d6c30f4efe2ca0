"""gptkit.weights.load, the one door to every model: the kind each form of source is, the model each kind gives (its
logits against the model written there, or against transformers'), the tokenizer that comes with it, and every
mistake in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.data.hf_tokenizer import load_hf_tokenizer
from gptkit.data.tokenizer import CharTokenizer
from gptkit.model import config_to_dict
from gptkit.weights import load, source_kind
from gptkit.weights.checkpoint import save_checkpoint
from gptkit.weights.export_gguf import export_gguf
from gptkit.weights.hf import write_hf
from gptkit.weights.lora import LoraConfig, LoraLinear, adapter_state, add_lora, lora_record
from gptkit.weights.quantization import Int4Linear
from gptkit.weights.source_settings import ModelLocation, ModelSource, for_inference
from gptkit.weights.sources import base_reference, check_data_tokenizer, lora_base, named_tokenizer
from helpers import (
    HUB_COMMIT,
    assert_one_line_message,
    copy_gpt2_bpe_files,
    gpt2_chat_tokenizer,
    lively_model,
    make_char_data,
    offline_hub_cache,
    qlora_set_up_peaks,
)
from hf_tokenizer_dirs import write_byte_level

transformers = pytest.importorskip("transformers")

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
CHARS = CharTokenizer.from_text(TEXT)
IDX = torch.randint(0, CHARS.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model: torch.nn.Module, idx: torch.Tensor = IDX) -> torch.Tensor:
    with torch.no_grad():
        return model(idx, targets=torch.zeros_like(idx))[0]


def save_run(path: Path, model: torch.nn.Module, tokenizer=CHARS, **extra) -> Path:
    """`model` saved as a checkpoint of ours at `path`, recording `tokenizer` (None: no record)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {} if tokenizer is None else {"tokenizer": tokenizer.to_meta()}
    checkpoint = {"model": model.state_dict(), "model_args": config_to_dict(model.config), **record, **extra}
    save_checkpoint(path, checkpoint)
    return path


def lora_run(tmp_path: Path, base_dir: Path) -> tuple[Path, torch.nn.Module]:
    """A LoRA run on the run at `base_dir` (its adapters random, B too, so they change the logits) and the adapted
    model it stands for."""
    base = load(str(base_dir)).model
    config = LoraConfig(rank=2, alpha=4.0, targets="all")
    adapted = add_lora(copy.deepcopy(base), config)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.2)
    record = lora_record(config, "float32", base_reference(str(base_dir)), None)
    path = tmp_path / "lora" / "ckpt.pt"
    save_checkpoint(
        path,
        {
            "model": adapter_state(adapted),
            "model_args": config_to_dict(adapted.config),
            "lora": record,
            "tokenizer": CHARS.to_meta(),
        },
    )
    return path.parent, adapted.eval()


def qwen2_directory(directory: Path) -> tuple[object, Path]:
    """A random transformers Qwen2 saved with its byte-level tokenizer.json (and ChatML template)."""
    write_byte_level(directory)
    torch.manual_seed(9)
    config = transformers.Qwen2Config(
        vocab_size=704,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    hf = transformers.Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(directory)
    return hf, directory


# ----------------------------------------------------------------------------- the kind of each form of source


def make_forms(root: Path) -> None:
    """Each form of source, as files that only need to be there for their kind to show."""
    for name in ("run/best.pt", "latest_only/ckpt.pt", "file.pt", "notes.txt", "model.gguf", "MODEL.GGUF"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    for name in ("gguf_dir/tiny.gguf", "hf/config.json", "hf_and_gguf/config.json", "hf_and_gguf/tiny.gguf"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")
    (root / "run/config.json").write_bytes(b"{}")  # a run's checkpoint wins over a config.json beside it
    (root / "empty").mkdir()


FORMS = {
    "run": "checkpoint",
    "latest_only": "checkpoint",
    "file.pt": "checkpoint",
    "notes.txt": "checkpoint",  # any file but a .gguf is read as a checkpoint, which refuses it in one line
    "model.gguf": "gguf",
    "MODEL.GGUF": "gguf",
    "gguf_dir": "gguf",
    "hf": "hf",
    "hf_and_gguf": "hf",
    "empty": None,
}
NAMES = {
    "gpt2": "hub",
    "gpt2-xl": "hub",
    "owner/name": "hub",
    "Qwen/Qwen2.5-0.5B-Instruct": "hub",
    "gpt-5": None,
    "./owner/name": None,
    "one/two/three": None,
    "/no/such/place": None,
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_kind_of_each_local_form(tmp_path, form):
    make_forms(tmp_path)
    assert source_kind(str(tmp_path / form)) == FORMS[form]


@pytest.mark.parametrize("name", sorted(NAMES))
def test_the_kind_of_each_name(tmp_path, name, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no directory of these names
    assert source_kind(name) == NAMES[name]


# ----------------------------------------------------------------------------- the model each kind gives


def test_a_run_gives_its_best_or_latest_checkpoint_and_its_tokenizer(tmp_path):
    best, latest = lively_model(CHARS.vocab_size, seed=1), lively_model(CHARS.vocab_size, seed=2)
    save_run(tmp_path / "run" / "best.pt", best)
    save_run(tmp_path / "run" / "ckpt.pt", latest)
    loaded = load(str(tmp_path / "run"))
    assert (loaded.kind, loaded.path, loaded.model.training) == ("checkpoint", tmp_path / "run" / "best.pt", False)
    torch.testing.assert_close(logits(loaded.model), logits(best), rtol=0, atol=0)
    assert loaded.tokenizer.encode(TEXT) == CHARS.encode(TEXT) and loaded.tokenizer_record == CHARS.to_meta()
    assert loaded.lora is None
    torch.testing.assert_close(logits(load(str(tmp_path / "run"), checkpoint="latest").model), logits(latest))
    file = load(str(tmp_path / "run" / "ckpt.pt"))
    assert file.kind == "checkpoint" and file.path == tmp_path / "run" / "ckpt.pt"
    torch.testing.assert_close(logits(file.model), logits(latest), rtol=0, atol=0)


def test_a_lora_run_comes_merged_or_with_its_adapters_apart(tmp_path):
    save_run(tmp_path / "base" / "ckpt.pt", lively_model(CHARS.vocab_size, seed=4, block_size=32))
    directory, adapted = lora_run(tmp_path, tmp_path / "base")
    expected = logits(adapted)
    assert (expected - logits(load(str(tmp_path / "base")).model)).abs().max() > 1e-2  # the adapters matter

    merged = load(str(directory))
    assert not any(isinstance(module, LoraLinear) for module in merged.model.modules())
    assert merged.lora["base"]["source"] == str((tmp_path / "base" / "ckpt.pt").resolve())
    torch.testing.assert_close(logits(merged.model), expected, rtol=0, atol=1e-5)
    apart = load(str(directory), merge=False)
    assert sum(isinstance(module, LoraLinear) for module in apart.model.modules()) == 8  # 4 products x 2 layers
    torch.testing.assert_close(logits(apart.model), expected, rtol=0, atol=1e-6)
    assert apart.tokenizer.encode(TEXT) == CHARS.encode(TEXT)


@pytest.mark.parametrize("quantize", ["int4", "int8"])
def test_a_lora_run_readied_to_decode_quantized_is_its_merged_model_quantized(tmp_path, quantize):
    """The scripts read a LoRA run with its adapters apart and for_inference merges them, quantizing each product as
    it is merged (so a large run never holds its float32 model): the model the merged read quantized as a whole
    gives, tensor for tensor, with the same logits."""
    save_run(tmp_path / "base" / "ckpt.pt", lively_model(CHARS.vocab_size, seed=4, block_size=32))
    directory, _ = lora_run(tmp_path, tmp_path / "base")
    settings = ModelSource(init_from=str(directory), quantize=quantize)
    cpu = torch.device("cpu")
    whole = for_inference(load(str(directory)).model, settings, cpu, torch.float32)
    apart = load(str(directory), merge=False).model
    assert any(isinstance(module, LoraLinear) for module in apart.modules())
    merged_one_by_one = for_inference(apart, settings, cpu, torch.float32)
    assert not any(isinstance(module, LoraLinear) for module in merged_one_by_one.modules())
    expected, got = whole.state_dict(), merged_one_by_one.state_dict()
    assert expected.keys() == got.keys()
    assert all(expected[key].dtype == got[key].dtype and torch.equal(expected[key], got[key]) for key in expected)
    torch.testing.assert_close(logits(merged_one_by_one), logits(whole), rtol=0, atol=0)


def test_a_lora_run_whose_base_changed_or_went_is_one_line(tmp_path):
    save_run(tmp_path / "base" / "ckpt.pt", lively_model(CHARS.vocab_size, seed=4))
    directory, _ = lora_run(tmp_path, tmp_path / "base")
    save_run(tmp_path / "base" / "ckpt.pt", lively_model(CHARS.vocab_size, seed=5))
    with pytest.raises(UserError) as error:
        load(str(directory))
    assert_one_line_message(error.value, f"its base {(tmp_path / 'base' / 'ckpt.pt').resolve()} has changed")
    (tmp_path / "base" / "ckpt.pt").unlink()
    with pytest.raises(UserError) as error:
        load(str(directory))
    assert_one_line_message(error.value, "is missing; put the base they were trained on back there")


def test_a_lora_base_directory_whose_config_changed_is_one_line(tmp_path):
    """A Hugging Face base's config.json (its rope base, norm epsilon) changes the model as its weights do."""
    _, directory = qwen2_directory(tmp_path / "qwen2")
    reference = base_reference(str(directory))
    config = json.loads((directory / "config.json").read_text())
    assert lora_base(reference, "run").config.norm_eps == config["rms_norm_eps"] != 0.5
    (directory / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    with pytest.raises(UserError) as error:
        lora_base(reference, "run")
    assert_one_line_message(error.value, f"run: its base {directory} has changed", "its config.json")
    del reference["config_sha256"]  # a record written before config.json was recorded: its weights alone checked
    assert lora_base(reference, "run").config.norm_eps == 0.5


def test_a_tied_head_loads_as_the_embedding_s_own_matrix(tmp_path):
    """The loaders put the weights in place without making random ones first; a tied model's head is then the
    embedding's very matrix again (training one trains the other), not a copy."""
    tied = lively_model(CHARS.vocab_size, seed=3, tie_embeddings=True)
    save_run(tmp_path / "run" / "ckpt.pt", tied)
    model = load(str(tmp_path / "run")).model
    assert model.lm_head.weight is model.transformer.wte.weight
    torch.testing.assert_close(logits(model), logits(tied), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["checkpoint", "hf", "hf-gpt2"])
def test_qlora_s_base_read_as_int4_blocks_is_the_model_of_a_float32_read(tmp_path, kind):
    """load's int4_products (train.py's QLoRA set-up) from a checkpoint of ours (biases on every product) or a
    Hugging Face directory (Qwen2; GPT-2, whose Conv1D weights are stored transposed): each product of the blocks is
    int4 blocks as it is read, and add_lora over them gives the model a float32 read and add_lora give, tensor for
    tensor and dtype for dtype, with the same logits."""
    if kind == "hf":
        source = qwen2_directory(tmp_path / "qwen2")[1]
    elif kind == "hf-gpt2":
        source = tmp_path / "gpt2"
        assert write_hf(lively_model(CHARS.vocab_size, seed=6, bias=True), source) == "GPT2LMHeadModel"
    else:
        source = save_run(tmp_path / "run" / "ckpt.pt", lively_model(CHARS.vocab_size, seed=6, bias=True))
    models = []
    for int4_products in (False, True):
        model = load(str(source), tokenizer=False, int4_products=int4_products).model
        products = [module for module in model.modules() if isinstance(module, (torch.nn.Linear, Int4Linear))][:-1]
        assert len(products) == 8 and all(isinstance(p, Int4Linear) == int4_products for p in products)  # not the head
        torch.manual_seed(0)
        models.append(add_lora(model, LoraConfig(rank=4, targets="attention"), base_weights="int4"))
    read, quantized = (model.state_dict() for model in models)
    assert read.keys() == quantized.keys()
    assert all(read[key].dtype == quantized[key].dtype and torch.equal(read[key], quantized[key]) for key in read)
    torch.testing.assert_close(logits(models[1]), logits(models[0]), rtol=0, atol=0)


@pytest.mark.parametrize("int4_products", [False, True])
def test_a_directory_whose_weights_do_not_fit_its_config_is_one_line(tmp_path, int4_products):
    """The config says a wider MLP than the weights hold: one line naming the directory and the tensor, whether the
    products are read with the rest or one at a time as they are quantized."""
    _, directory = qwen2_directory(tmp_path / "qwen2")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(UserError) as error:
        load(str(directory), tokenizer=False, int4_products=int4_products)
    assert_one_line_message(error.value, f"{directory}: transformer.h.0.mlp.c_fc.weight has shape (96, 32), expected")


def test_qlora_s_base_from_a_hugging_face_directory_makes_no_float32_copy_of_its_products(tmp_path):
    """Measured: QLoRA's set-up from a Hugging Face directory in bfloat16 (load with int4_products, then add_lora over
    every product) raises the process's peak resident memory by at least half the products' float32 bytes less than
    a float32 read and add_lora do, which put a float32 copy of every product in place first. (Many narrow layers: a
    product is quantized a slice of rows at a time, whose float32 temporaries do not grow with the model.)"""
    config = transformers.Qwen2Config(
        vocab_size=640,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=24,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "qwen2")
    products = 4 * sum(m.weight.numel() for m in hf.model.layers.modules() if isinstance(m, torch.nn.Linear))
    del hf
    float32_rise, int4_rise = qlora_set_up_peaks(tmp_path / "qwen2")
    assert int4_rise < float32_rise - products / 2, (int4_rise / products, float32_rise / products)


def test_a_hugging_face_directory_and_its_hub_name_give_transformers_logits(tmp_path, monkeypatch):
    hf, directory = qwen2_directory(tmp_path / "qwen2")
    idx = torch.randint(0, 704, (2, 12), generator=torch.Generator().manual_seed(2))
    auto = transformers.AutoTokenizer.from_pretrained(directory)
    local = load(str(directory))
    assert (local.kind, local.path, local.checkpoint) == ("hf", directory, None)
    torch.testing.assert_close(logits(local.model, idx), hf(idx).logits, rtol=0, atol=1e-4)
    assert local.tokenizer.encode("def square(x):") == auto.encode("def square(x):", add_special_tokens=False)

    offline_hub_cache(monkeypatch, tmp_path / "cache", {"someone/tiny-qwen": directory})
    hub = load("someone/tiny-qwen")
    assert hub.kind == "hub" and hub.path.name == HUB_COMMIT
    torch.testing.assert_close(logits(hub.model, idx), hf(idx).logits, rtol=0, atol=1e-4)
    assert hub.tokenizer.encode("def square(x):") == local.tokenizer.encode("def square(x):")


@pytest.mark.parametrize("where", ["file", "directory"])
def test_a_gguf_file_gives_the_model_written_into_it(tmp_path, where):
    model = lively_model(CHARS.vocab_size, seed=6, block_size=32, tie_embeddings=True)
    directory = tmp_path / "gguf"
    directory.mkdir()
    (name,) = [name for name in export_gguf(model, CHARS, directory, "f32", "tiny") if name.endswith(".gguf")]
    loaded = load(str(directory / name if where == "file" else directory))
    assert (loaded.kind, loaded.path) == ("gguf", directory / name)
    torch.testing.assert_close(logits(loaded.model), logits(model), rtol=0, atol=1e-5)
    assert loaded.tokenizer.encode(TEXT) == CHARS.encode(TEXT)


def test_overrides_dtype_and_no_tokenizer_apply_to_every_kind(tmp_path):
    save_run(tmp_path / "run" / "ckpt.pt", lively_model(CHARS.vocab_size))
    _, hf_dir = qwen2_directory(tmp_path / "qwen2")
    for source in (tmp_path / "run", hf_dir):
        loaded = load(str(source), overrides={"dropout": 0.25}, dtype="bfloat16", tokenizer=False)
        assert loaded.model.config.dropout == 0.25 and loaded.tokenizer is None
        assert {param.dtype for param in loaded.model.parameters()} == {torch.bfloat16}


def test_a_block_size_override_crops_every_kind_and_lengthens_only_computed_positions(tmp_path):
    model = lively_model(CHARS.vocab_size, seed=3)  # learned positions, 16 of them
    save_run(tmp_path / "run" / "ckpt.pt", model)
    gguf_dir = tmp_path / "gguf"
    gguf_dir.mkdir()
    export_gguf(model, CHARS, gguf_dir, "f32", "tiny")
    for source in (tmp_path / "run", gguf_dir):
        cropped = load(str(source), overrides={"block_size": 12}, tokenizer=False).model
        assert cropped.config.block_size == 12 and cropped.transformer.wpe.weight.shape == (12, 32)
        torch.testing.assert_close(logits(cropped), logits(model), rtol=0, atol=1e-5)  # IDX: 12 positions
        with pytest.raises(UserError) as error:
            load(str(source), overrides={"block_size": 17}, tokenizer=False)
        assert_one_line_message(error.value, "overrides: block_size 17 is past the 16 positions")
        assert "give at most 16" in str(error.value)
    hf, directory = qwen2_directory(tmp_path / "qwen2")  # rotary positions, 32 in its config
    longer = load(str(directory), overrides={"block_size": 48}, tokenizer=False).model
    idx = torch.randint(0, 704, (1, 40), generator=torch.Generator().manual_seed(4))
    assert longer.config.block_size == 48
    torch.testing.assert_close(logits(longer, idx), hf(idx).logits, rtol=0, atol=1e-4)


def test_a_data_dir_gives_the_tokenizer_a_checkpoint_does_not_record(tmp_path):
    save_run(tmp_path / "run" / "ckpt.pt", lively_model(CHARS.vocab_size), tokenizer=None)
    make_char_data(tmp_path / "data", TEXT)
    assert load(str(tmp_path / "run"), data_dir=str(tmp_path / "data")).tokenizer.encode(TEXT) == CHARS.encode(TEXT)
    with pytest.raises(UserError) as error:
        load(str(tmp_path / "run"))
    assert_one_line_message(error.value, "records no tokenizer; pass --data_dir=DIR")


def test_a_gpt2_directory_of_another_vocabulary_reads_its_own_tokenizer_and_template(tmp_path):
    """A GPT-2-architecture model with a vocabulary of its own (a GPT-2 trained for another language) is tokenized
    with its tokenizer.json, as transformers' AutoTokenizer reads it, and chats in its own template."""
    from tokenizers import Tokenizer

    directory = write_byte_level(tmp_path / "gpt2-other")
    vocab_size = Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()
    assert write_hf(lively_model(vocab_size, seed=2, bias=True), directory) == "GPT2LMHeadModel"
    text = "Hello, world: ünïcode and 12345\n"
    loaded = load(str(directory))
    expected = transformers.AutoTokenizer.from_pretrained(str(directory)).encode(text, add_special_tokens=False)
    assert loaded.tokenizer.encode(text) == expected
    assert loaded.tokenizer.chat is not None and loaded.tokenizer.to_meta()["kind"] == "hf"


@pytest.mark.gpt2_bpe
def test_a_gpt2_directory_holding_gpt2_s_own_tokenizer_json_reads_gpt2_s_bpe(tmp_path):
    """transformers' GPT-2 tokenizer.json, written from OpenAI's encoder.json and vocab.bpe, is GPT-2's vocabulary:
    the directory is tokenized with tiktoken's GPT-2 BPE (what data prepared with --tokenizer=gpt2 holds); one token
    spelled otherwise makes it another vocabulary."""
    import tiktoken

    from gptkit.data.hf_tokenizer import is_gpt2_bpe, read_hf_record

    files = copy_gpt2_bpe_files(tmp_path / "bpe")
    fast = transformers.GPT2TokenizerFast(vocab=str(files / "encoder.json"), merges=str(files / "vocab.bpe"))
    directory = tmp_path / "gpt2"
    fast.save_pretrained(str(directory))
    assert write_hf(lively_model(50257, seed=3, bias=True, n_embd=16), directory) == "GPT2LMHeadModel"
    loaded = load(str(directory))
    text = "Hello, world: ünïcode and 12345\n"
    assert loaded.tokenizer.to_meta() == {"kind": "tiktoken", "encoding": "gpt2"}
    assert loaded.tokenizer.encode(text) == tiktoken.get_encoding("gpt2").encode_ordinary(text)
    record = read_hf_record(directory)
    assert is_gpt2_bpe(record)
    parsed = json.loads(record["tokenizer_json"])
    parsed["model"]["vocab"]["Ġworld!"] = parsed["model"]["vocab"].pop("Ġworld")
    assert not is_gpt2_bpe({**record, "tokenizer_json": json.dumps(parsed)})  # one token spelled otherwise
    assert not is_gpt2_bpe({**record, "template_source": "{{ messages[0]['content'] }}"})  # a chat fine-tune's


@pytest.mark.gpt2_bpe
def test_a_gpt2_chat_runs_hugging_face_export_reads_back_with_its_markers_and_template(tmp_path):
    """A GPT-2-shaped run on chat data in GPT-2's BPE, exported with --format=hf and read back from the directory:
    the tokenizer is the run's own (GPT-2's vocabulary and the chat markers), the conversation's ids the run's."""
    from gptkit.weights.export_hf import export_hf

    chat = gpt2_chat_tokenizer()
    (tmp_path / "hf").mkdir()
    export_hf(lively_model(chat.vocab_size, seed=4, bias=True), chat, tmp_path / "hf")
    ours = load(str(tmp_path / "hf")).tokenizer
    conversation = [{"role": "user", "content": "Hello there"}]
    assert ours.chat is not None
    assert ours.chat.render_prompt(conversation, ours) == chat.chat.render_prompt(conversation, chat)


# ----------------------------------------------------------------------------- mistakes


def bad_sources(root: Path) -> dict[str, tuple[dict, str]]:
    """Each mistake: load's arguments and what its one line says."""
    return {
        "unknown name": ({"source": "gpt-5"}, "gpt-5 is neither a directory, a hub name (owner/name) nor one of gpt2"),
        "missing file": ({"source": str(root / "model.gguf")}, f"{root / 'model.gguf'}: no such file or directory"),
        "missing path": ({"source": str(root / "runs" / "x")}, f"{root / 'runs' / 'x'}: no such file or directory"),
        "empty directory": ({"source": str(root / "empty")}, "holds no config.json, so it is no Hugging Face model"),
        "which checkpoint": ({"source": str(root / "run"), "checkpoint": "worst"}, "must be 'best' or 'latest'"),
        "no latest": ({"source": str(root / "best_only"), "checkpoint": "latest"}, "(looked for ckpt.pt)"),
        "dtype": ({"source": str(root / "run"), "dtype": "float16"}, "models load as float32 or bfloat16"),
        "not a checkpoint": ({"source": str(root / "notes.txt")}, "cannot load checkpoint"),
        "not cached": ({"source": "someone/not-cached"}, "no hub repository of that name in the cache (offline?)"),
        "override of a shape": (
            {"source": str(root / "run"), "overrides": {"n_layer": 3}},
            "overrides: n_layer follows the weights' shapes",
        ),
        "unknown override": ({"source": str(root / "run"), "overrides": {"bogus": 1}}, "overrides: bogus is no model"),
        "bad override": ({"source": str(root / "run"), "overrides": {"dropout": 2.0}}, "overrides: dropout must be in"),
        "overrides not a dict": ({"source": str(root / "run"), "overrides": ["dropout"]}, "overrides is a dict"),
        "vocabulary": (
            {"source": str(root / "small")},
            f"{root / 'small'}: its tokenizer has {CHARS.vocab_size} tokens but its model only 10",
        ),
    }


def test_a_checkpoint_whose_layer_count_outruns_its_weights_is_one_line(tmp_path):
    """Said from the weights' names before a model of the recorded size is made (a million layers: minutes)."""
    model = lively_model(CHARS.vocab_size)
    args = {**config_to_dict(model.config), "n_layer": 1_000_000}
    path = save_run(tmp_path / "run" / "ckpt.pt", model, model_args=args)
    with pytest.raises(UserError) as error:
        load(str(tmp_path / "run"))
    assert str(error.value) == (
        f"checkpoint {path}: 1000000 layers in its model_args, but its weights hold layers 0 to 1 (2); the file is "
        "damaged"
    )


@pytest.mark.parametrize("mistake", sorted(bad_sources(Path())))
def test_each_mistake_is_one_line(tmp_path, mistake, monkeypatch):
    offline_hub_cache(monkeypatch, tmp_path / "cache", {})
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    save_run(tmp_path / "run" / "ckpt.pt", lively_model(CHARS.vocab_size))
    save_run(tmp_path / "best_only" / "best.pt", lively_model(CHARS.vocab_size))
    save_run(tmp_path / "small" / "ckpt.pt", lively_model(10))
    arguments, message = bad_sources(tmp_path)[mistake]
    with pytest.raises(UserError) as error:
        load(**arguments)
    assert_one_line_message(error.value, message)


@pytest.mark.parametrize("kind", ["checkpoint", "lora", "hf", "gguf"])
def test_every_kind_of_source_refuses_weights_holding_nan(tmp_path, kind):
    """A NaN in one weight is refused in one line naming the file and the tensor, whichever kind holds it."""
    model = lively_model(CHARS.vocab_size, seed=7, block_size=32, tie_embeddings=True)
    if kind == "checkpoint":
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight[2, 3] = float("nan")
        source, tensor = save_run(tmp_path / "run" / "ckpt.pt", model), "transformer.h.1.mlp.c_fc.weight"
    elif kind == "lora":
        save_run(tmp_path / "base" / "ckpt.pt", model)
        directory, _ = lora_run(tmp_path, tmp_path / "base")
        checkpoint = torch.load(directory / "ckpt.pt", weights_only=True)
        checkpoint["model"]["transformer.h.0.attn.c_attn.lora_A"][0, 1] = float("nan")
        source, tensor = save_run(directory / "ckpt.pt", model), "transformer.h.0.attn.c_attn.lora_A"
        save_checkpoint(source, checkpoint)
    elif kind == "hf":
        hf, source = qwen2_directory(tmp_path / "qwen2")
        with torch.no_grad():
            hf.model.layers[1].mlp.up_proj.weight[4, 5] = float("nan")
        hf.save_pretrained(source)
        tensor = "model.layers.1.mlp.up_proj.weight"
    else:
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight[2, 3] = float("nan")
        (tmp_path / "gguf").mkdir()
        names = export_gguf(model, CHARS, tmp_path / "gguf", "f32", "tiny")
        source, tensor = tmp_path / "gguf" / next(n for n in names if n.endswith(".gguf")), "blk.1.ffn_up.weight"
    with pytest.raises(UserError) as error:
        load(str(source))
    assert_one_line_message(error.value, f"{source}: weight {tensor} holds NaN in 1 of its")


# ----------------------------------------------------------------------------- the scripts' settings, train.py's check


def test_the_scripts_settings_name_one_source(tmp_path, monkeypatch):
    """--out_dir names a run (init_from=resume), --init_from open weights; each the other way round is one line."""
    monkeypatch.chdir(tmp_path)
    save_run(tmp_path / "run" / "ckpt.pt", lively_model(CHARS.vocab_size))
    (tmp_path / "empty").mkdir()
    assert ModelLocation(out_dir="run").source() == "run"
    assert ModelLocation(init_from="gpt2").source() == "gpt2"
    mistakes = [
        (ModelLocation(init_from="run"), "--init_from='run' is a training run's directory; load it with --out_dir=run"),
        (ModelLocation(out_dir="empty"), "no checkpoint in empty (looked for best.pt, ckpt.pt)"),
        (ModelLocation(init_from="empty"), "--init_from='empty': empty holds no config.json"),
        (ModelLocation(init_from="gpt-5"), "--init_from='gpt-5': use resume, a Hugging Face directory or hub name"),
        (ModelLocation(init_from="model.gguf"), "--init_from='model.gguf': model.gguf: no such file or directory"),
        (ModelLocation(init_from="./hf/x"), "--init_from='./hf/x': ./hf/x: no such file or directory"),
    ]
    for location, message in mistakes:
        with pytest.raises(UserError) as error:
            location.source()
        assert_one_line_message(error.value, message)


def test_data_for_training_must_be_tokenized_as_the_source_reads_text(tmp_path):
    """check_data_tokenizer, train.py's check of its data against the model it starts from: a checkpoint's recorded
    tokenizer, open weights' own tokenizer.json."""
    save_run(tmp_path / "run" / "ckpt.pt", lively_model(CHARS.vocab_size))
    run = load(str(tmp_path / "run"), tokenizer=False)
    char_meta = {"tokenizer": CHARS.to_meta(), "vocab_size": CHARS.vocab_size, "eot_token": None}
    check_data_tokenizer(run, char_meta)
    other = CharTokenizer.from_text(TEXT + "xyz")
    with pytest.raises(UserError) as error:
        check_data_tokenizer(run, {**char_meta, "tokenizer": other.to_meta()})
    assert_one_line_message(error.value, "was trained with another tokenizer than this data's")

    _, directory = qwen2_directory(tmp_path / "qwen2")
    qwen = load(str(directory), tokenizer=False)
    own = load_hf_tokenizer(directory)
    check_data_tokenizer(qwen, {"tokenizer": own.to_meta(), "vocab_size": own.vocab_size, "eot_token": None})
    with pytest.raises(UserError) as error:
        check_data_tokenizer(qwen, char_meta)
    assert_one_line_message(error.value, f"needs data in its own tokenizer; prepare it with --tokenizer={directory}")


@pytest.mark.parametrize("name", ["out-chatt", "out-base.gguf"])
def test_a_tokenizer_source_that_names_nothing_lists_every_kind_it_may_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """prepare_data/chat.py --tokenizer=out-chatt (a mistyped run directory): the line says no such path exists and
    names the run directories, Hugging Face directories and hub names the script also takes, not tiktoken's names
    alone."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as raised:
        named_tokenizer(name, None)
    message = str(raised.value)
    assert f"--tokenizer={name}: no such directory or file" in message
    assert "a training run's out_dir" in message and "a Hugging Face model directory" in message
    assert "hub name (owner/name)" in message and "owner/name:TAG" in message
    assert "gpt2" in message and "char" in message
