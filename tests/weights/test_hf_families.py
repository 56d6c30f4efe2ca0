"""The Llama family (Llama, Qwen2, Qwen3, nanochat) against Hugging Face transformers, the reference: a small random
model saved with save_pretrained loads with transformers' logits and greedy tokens, and writes back to its class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import sample
from gptkit.core.errors import UserError
from gptkit.data.tokenizer import CharTokenizer
from gptkit.model import GPT, GPTConfig
from gptkit.weights import load
from gptkit.weights.hf import export_architecture, write_hf
from gptkit.weights.lora import LoraConfig, adapter_state, add_lora, write_peft_adapter
from gptkit.weights.source_settings import ModelSource, for_inference
from helpers import assert_one_line_message, cli_args, lively_model, make_char_data, run_in_process
from hf_tokenizer_dirs import write_byte_level

transformers = pytest.importorskip("transformers")

VOCAB = 128
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# Each family's config and model classes by name: transformers loads a model class's module when it is first asked
# for, so naming them here (not fetching them) keeps that out of every test process's collection.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3-scaled": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3_SCALING)),
    "llama-bias": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),  # 4 * 32 != 64
    "nanochat": ("NanoChatConfig", "NanoChatForCausalLM", dict(num_key_value_heads=4, final_logit_softcapping=15.0)),
}


def random_hf_model(family: str, seed: int = 0) -> object:
    """A transformers model of `family`, every tensor random (norm gains and biases too, so any mix-up shows)."""
    config_name, model_name, extra = FAMILIES[family]
    config_class, model_class = getattr(transformers, config_name), getattr(transformers, model_name)
    torch.manual_seed(seed)
    hf = model_class(config_class(**{**SMALL, **extra})).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() == 1:
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
            else:
                param.normal_(0.0, 0.08)  # larger than the default init, so the logits differ token to token
    return hf


def save(hf, directory: Path, **options) -> Path:
    hf.save_pretrained(directory, **options)
    return directory


def all_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(idx, targets=torch.zeros_like(idx))[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loads_with_transformers_logits_and_greedy_tokens(tmp_path, family):
    hf = random_hf_model(family)
    ours = load(str(save(hf, tmp_path / family)), tokenizer=False).model
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(idx).logits
    torch.testing.assert_close(all_logits(ours, idx), expected, rtol=0, atol=1e-4)
    prompt = idx[:, :5]
    greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert torch.equal(ours.generate(prompt, max_new_tokens=12, temperature=0), greedy)


def test_sharded_directory_loads_the_same(tmp_path):
    hf = random_hf_model("qwen3", seed=2)
    directory = save(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert (
        len(list(directory.glob("model-*.safetensors"))) > 1 and (directory / "model.safetensors.index.json").exists()
    )
    ours = load(str(directory), tokenizer=False).model
    idx = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(all_logits(ours, idx), hf(idx).logits, rtol=0, atol=1e-4)


def test_bfloat16_weights_load_as_float32_or_bfloat16(tmp_path):
    hf = random_hf_model("llama", seed=3)
    directory = save(hf.to(torch.bfloat16), tmp_path / "bf16")
    exact = load(str(directory), tokenizer=False).model
    assert next(exact.parameters()).dtype == torch.float32
    for (name, ours), (_, theirs) in zip(exact.state_dict().items(), hf.state_dict().items()):
        if name == "transformer.wte.weight":
            assert torch.equal(ours, theirs.float())
    half = load(str(directory), dtype="bfloat16", tokenizer=False).model
    assert next(half.parameters()).dtype == torch.bfloat16
    with pytest.raises(UserError, match="float32 or bfloat16"):
        load(str(directory), dtype="float16", tokenizer=False)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "nanochat"])
def test_export_writes_the_same_class_back(tmp_path, family):
    hf = random_hf_model(family, seed=4)
    ours = load(str(save(hf, tmp_path / "in")), tokenizer=False).model
    architecture = write_hf(ours, tmp_path / "out")
    assert architecture == type(hf).__name__
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(hf)
    idx = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(again(idx).logits, all_logits(ours, idx), rtol=0, atol=1e-4)


def test_a_llama_shaped_model_trained_here_exports_as_llama(tmp_path):
    torch.manual_seed(5)
    config = GPTConfig(
        block_size=32,
        vocab_size=VOCAB,
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        bias=False,
        pos_encoding="rope",
        norm="rmsnorm",
        activation="swiglu",
        tie_embeddings=False,
    )
    ours = GPT(config).eval()
    assert write_hf(ours, tmp_path / "out") == "LlamaForCausalLM"
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out").eval()
    idx = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, all_logits(ours, idx), rtol=0, atol=1e-5)


# Norms without a learned scale: the demo's QK-norm (config/train_shakespeare_char_cpu.py), and every norm.
WEIGHTLESS = {
    "qwen3, qk_norm without a scale, tied (the demo's)": (dict(qk_norm=True), "Qwen3ForCausalLM"),
    "qwen3, no norm has a scale": (dict(qk_norm=True, norm_weight=False, head_dim=24), "Qwen3ForCausalLM"),
    "llama, norms without a scale": (dict(norm_weight=False, n_kv_head=2, tie_embeddings=False), "LlamaForCausalLM"),
}


@pytest.mark.parametrize(("settings", "architecture"), WEIGHTLESS.values(), ids=WEIGHTLESS.keys())
def test_norms_without_a_scale_export_as_scales_of_ones_with_our_logits_and_greedy_tokens(
    tmp_path, settings, architecture
):
    shape = dict(n_head=4, n_embd=64, mlp_hidden=96, bias=False, block_size=32, tie_embeddings=True)
    family = dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu")
    ours = lively_model(VOCAB, seed=6, **{**shape, **family, **settings})
    with torch.no_grad():  # the learned scales random, so a scale of ones written in their place shows
        for param in (param for param in ours.parameters() if param.dim() == 1):
            param.normal_(1.0, 0.1)
    assert write_hf(ours, tmp_path / "out") == architecture
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(hf).__name__ == architecture
    config = ours.config
    stored = load_file(tmp_path / "out" / "model.safetensors")  # every tensor the class has, none left to its init
    assert sorted(stored) == sorted(set(hf.state_dict()) - ({"lm_head.weight"} if config.tie_embeddings else set()))
    unit = [name for name, value in stored.items() if torch.equal(value, torch.ones_like(value))]
    n_layer = config.n_layer
    assert len(unit) == 2 * n_layer * (config.qk_norm and not config.qk_norm_weight) + (2 * n_layer + 1) * (
        not config.norm_weight
    )
    idx = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, all_logits(ours, idx), rtol=0, atol=1e-4)
        prompt = [3, 1, 4, 1, 5]
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(ours(torch.tensor([ids]))[0][0, -1].argmax()))
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    assert generated[0].tolist() == ids and len(set(ids[5:])) > 1


def test_models_no_class_computes_are_refused_in_one_line(tmp_path):
    rope_layernorm = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=16, pos_encoding="rope")
    with pytest.raises(UserError, match=r"no Hugging Face class computes this model exactly.*norm=rmsnorm") as error:
        export_architecture(rope_layernorm)
    assert "\n" not in str(error.value)
    qk_norm_biases = GPTConfig(**{**vars(rope_layernorm), "norm": "rmsnorm", "activation": "swiglu", "qk_norm": True})
    with pytest.raises(UserError, match=r"bias=False with qk_norm \(Qwen3's MLP has no biases\)"):
        write_hf(GPT(qk_norm_biases), tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    )
    with pytest.raises(UserError, match=r"MistralForCausalLM is not supported; supported: GPT2LMHeadModel, Llama"):
        load(str(tmp_path), tokenizer=False)


def test_missing_shard_and_unholdable_dtype_are_one_line(tmp_path):
    hf = random_hf_model("llama", seed=6)
    directory = save(hf, tmp_path / "sharded", max_shard_size="100KB")
    shard = sorted(directory.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(UserError, match=f"shard {shard.name} named by model.safetensors.index.json is missing"):
        load(str(directory), tokenizer=False)
    int8 = save(hf, tmp_path / "int8")
    from safetensors.torch import save_file

    tensors = load_file(int8 / "model.safetensors")
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int8)
    save_file(tensors, int8 / "model.safetensors")
    with pytest.raises(UserError, match=r"model\.embed_tokens\.weight is stored as int8"):
        load(str(int8), tokenizer=False)
    twice = save(hf, tmp_path / "twice", max_shard_size="100KB")
    first, second = sorted(twice.glob("model-*.safetensors"))[:2]
    extra, earlier = load_file(second), load_file(first)
    some = next(iter(earlier))
    extra[some] = torch.zeros_like(earlier[some])  # a second, different copy of one of the first shard's tensors
    save_file(extra, second)
    with pytest.raises(UserError, match=f"tensor {some} is in both {first.name} and {second.name}"):
        load(str(twice), tokenizer=False)


@pytest.mark.parametrize(
    "family, name",
    [("llama", "model.layers.0.self_attn.k_proj.weight"), ("qwen3", "model.layers.1.mlp.up_proj.weight")],
)
@pytest.mark.parametrize("form", ["columns", "three dimensions"])
def test_a_product_part_of_another_shape_is_one_line(tmp_path, family, name, form):
    """A fused product's part is checked before the parts are joined (or GPT-2's Conv1D transposed)."""
    from safetensors.torch import save_file

    directory = save(random_hf_model(family, seed=7), tmp_path / family)
    tensors = load_file(directory / "model.safetensors")
    part = tensors[name]
    tensors[name] = part[:, : part.shape[1] // 2].contiguous() if form == "columns" else part[None].contiguous()
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(UserError) as error:
        load(str(directory), tokenizer=False)
    assert_one_line_message(error.value, str(directory), "has shape")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_hidden_layers": 2.0}, "n_layer must be a whole number, got 2.0"),
        ({"tie_word_embeddings": "false"}, "tie_embeddings must be true or false, got 'false'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "factor must be a positive number"),
        ({"hidden_size": 2**62}, "which no machine holds"),
    ],
)
def test_config_values_of_the_wrong_type_or_size_are_one_line(tmp_path, change, message):
    directory = save(random_hf_model("llama", seed=8), tmp_path / "llama")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError) as error:
        load(str(directory), tokenizer=False)
    assert_one_line_message(error.value, "config.json", message)


def test_a_config_that_ties_a_head_its_weights_hold_apart_loads_it_apart_as_transformers_does(tmp_path):
    """config.json says tie_word_embeddings, yet model.safetensors holds an lm_head of its own: transformers keeps
    the two apart (with a warning), so the logits are those of the stored head."""
    hf = random_hf_model("llama", seed=9)
    hf.config.tie_word_embeddings = False
    untied = transformers.LlamaForCausalLM(hf.config).eval()
    untied.load_state_dict({**hf.state_dict(), "lm_head.weight": torch.randn_like(hf.lm_head.weight) * 0.08})
    directory = save(untied, tmp_path / "llama")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    theirs = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
    ours = load(str(directory), tokenizer=False).model.eval()
    idx = torch.randint(0, SMALL["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = theirs(idx).logits
    assert not ours.config.tie_embeddings
    assert torch.allclose(all_logits(ours, idx), expected, atol=1e-4)


def test_hub_names_come_from_the_local_cache_offline(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1: a hub name resolves from huggingface_hub's cache, and a name not cached is one line."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hf = random_hf_model("qwen2", seed=7)
    snapshot = tmp_path / "hub" / "models--someone--tiny-qwen" / "snapshots" / ("0" * 40)
    save(hf, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ours = load("someone/tiny-qwen", tokenizer=False).model
    idx = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(all_logits(ours, idx), hf(idx).logits, rtol=0, atol=1e-4)
    with pytest.raises(UserError, match="no such directory, and no hub repository of that name in the cache"):
        load("someone/not-cached", tokenizer=False)


def test_old_model_args_without_the_new_keys_build_gpt2():
    old = {"block_size": 16, "vocab_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 16, "dropout": 0.0, "bias": True}
    model = GPT(GPTConfig(**old))
    names = {name for name, _ in model.named_parameters()}
    assert "transformer.h.0.ln_1.bias" in names and "transformer.wpe.weight" in names
    assert model.transformer.h[0].attn.c_attn.weight.shape == (48, 16)
    assert model.transformer.h[0].mlp.c_fc.weight.shape == (64, 16)


def test_sample_py_greedy_text_is_transformers_greedy_text(tmp_path, capsys):
    """sample.py --init_from=DIR (the tokenizer here from a char data dir) prints transformers' greedy tokens
    (ids beyond the char table print as U+FFFD)."""
    hf = random_hf_model("qwen3", seed=8)
    directory = save(hf, tmp_path / "qwen3")
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    make_char_data(tmp_path / "data", text)
    tokenizer = CharTokenizer.from_text(text)
    prompt = torch.tensor([tokenizer.encode("First")])
    greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16, do_sample=False)
    args = cli_args(init_from=directory, data_dir=tmp_path / "data", start="First", max_new_tokens=16, temperature=0)
    result = run_in_process(sample.main, [*args, "--stream=False", "--device=cpu"], capsys)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "First" + tokenizer.decode(greedy[0, 5:].tolist()) + "\n"


def test_sample_py_takes_the_directory_s_own_tokenizer(tmp_path, capsys):
    """A Qwen2 directory with its tokenizer.json: sample.py --init_from=DIR (no data dir) prints what transformers'
    tokenizer and greedy generate give."""
    directory = write_byte_level(tmp_path / "qwen2")
    torch.manual_seed(9)
    config = transformers.Qwen2Config(**{**SMALL, "vocab_size": 704})
    hf = transformers.Qwen2ForCausalLM(config).eval()
    hf.save_pretrained(directory)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    start = "def square(x):"
    prompt = torch.tensor([tokenizer.encode(start, add_special_tokens=False)])
    greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    expected = start + tokenizer.decode(greedy[0, prompt.shape[1] :]) + "\n"
    args = cli_args(init_from=directory, start=start, max_new_tokens=12, temperature=0, stop_at_eot=False)
    result = run_in_process(sample.main, [*args, "--stream=False", "--device=cpu"], capsys)
    assert result.returncode == 0, result.stderr
    # Random weights pick bytes that split characters: transformers shows each broken token as U+FFFD, sample.py
    # joins a character's bytes across tokens first; the text apart from those marks is the same.
    assert result.stdout.replace("\ufffd", "") == expected.replace("\ufffd", "")
    assert len(result.stdout.replace("\ufffd", "")) > len(start) + 6


def test_inference_crops_a_long_context_to_block_size(tmp_path):
    """--block_size crops the context (and so the KV cache) of a model whose own is long; the logits stay HF's."""
    hf = random_hf_model("llama3-scaled", seed=10)
    make_char_data(tmp_path / "data", "abcdefgh ")
    source = ModelSource(init_from=str(save(hf, tmp_path / "long")), data_dir=str(tmp_path / "data"), block_size=16)
    model = for_inference(
        load(source.source(), data_dir=source.data_dir).model, source, torch.device("cpu"), torch.float32
    )
    assert model.config.block_size == 16 and model.rope_cos.shape[0] == 16
    idx = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(all_logits(model, idx), hf(idx).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "nanochat"])
def test_peft_adapters_on_the_family_give_our_logits(tmp_path, family):
    """Adapters on every fused product (q, k, v; gate and up) written for PEFT: PeftModel over the transformers
    class gives the logits of our model with the same adapters."""
    peft = pytest.importorskip("peft")
    hf = random_hf_model(family, seed=11)
    base = save(hf, tmp_path / "base")
    ours = load(str(base), tokenizer=False).model
    config = LoraConfig(rank=4, alpha=8.0, targets="all")
    add_lora(ours, config)
    torch.manual_seed(12)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05)  # B starts at zero: give the adapters something to say
    write_peft_adapter(tmp_path / "adapter", adapter_state(ours), config, str(base), model_config=ours.config)
    adapted = peft.PeftModel.from_pretrained(type(hf).from_pretrained(base), tmp_path / "adapter").eval()
    idx = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        expected = all_logits(ours.eval(), idx)
        torch.testing.assert_close(adapted(idx).logits, expected, rtol=0, atol=1e-4)
        assert (hf(idx).logits - expected).abs().max() > 1e-2  # the adapters do change the logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "nanochat"])
def test_peft_carries_new_token_rows_on_the_family(tmp_path, family):
    """A chat run's new token rows (4 added to the base's vocabulary) on a base transformers grew and saved: PEFT
    puts the trained rows in model.embed_tokens (and in an untied lm_head: qwen3's and nanochat's here) and gives
    the logits of our model with the same adapters and rows."""
    peft = pytest.importorskip("peft")
    hf = random_hf_model(family, seed=13)
    hf.resize_token_embeddings(VOCAB + 4, mean_resizing=False)
    base = save(hf, tmp_path / "base")
    ours = load(str(base), tokenizer=False).model
    config = LoraConfig(rank=4, alpha=8.0, targets="all")
    add_lora(ours, config, first_new_row=VOCAB)
    torch.manual_seed(14)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "lora_B" in name or name.endswith(".extra"):
                param.normal_(0.0, 0.5 if name.endswith(".extra") else 0.05)
    adapters = adapter_state(ours)
    write_peft_adapter(tmp_path / "adapter", adapters, config, str(base), VOCAB, model_config=ours.config)
    rows = list(range(VOCAB, VOCAB + 4))
    tied = hf.config.tie_word_embeddings
    indices = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["trainable_token_indices"]
    assert indices == (rows if tied else {"embed_tokens": rows, "lm_head": rows})
    adapted = peft.PeftModel.from_pretrained(type(hf).from_pretrained(base), tmp_path / "adapter").eval()
    idx = torch.tensor([[3, VOCAB + 1, 7, VOCAB + 3, VOCAB, 9, VOCAB + 2, 5]])
    with torch.no_grad():
        expected = all_logits(ours.eval(), idx)
        torch.testing.assert_close(adapted(idx).logits, expected, rtol=0, atol=1e-4)
        with adapted.disable_adapter():  # the new rows matter, where they are read and where they score
            assert (adapted(idx).logits[..., VOCAB:] - expected[..., VOCAB:]).abs().max() > 1e-2
