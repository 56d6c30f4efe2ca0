"""LoRA layers: the product against a float64 reference, what trains, merging, stored-base precision, and interop
with Hugging Face PEFT (the real package, loading our adapter files into transformers' GPT2LMHeadModel)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.model import GPT, GPTConfig
from gptkit.weights.hf import write_hf
from gptkit.weights.lora import (
    LoraConfig,
    LoraLinear,
    adapter_state,
    add_lora,
    load_adapter_state,
    merge_lora,
    write_peft_adapter,
)

TINY = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 50, "dropout": 0.0}


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**TINY))


def randomise_adapters(model: torch.nn.Module, seed: int = 1) -> None:
    """Adapters as after some training: B is no longer zero."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith((".lora_A", ".lora_B")):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def test_layer_is_the_base_product_plus_the_scaled_low_rank_update() -> None:
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5)
    layer = LoraLinear(base, LoraConfig(rank=2, alpha=6.0))
    randomise_adapters(layer)
    x = torch.randn(3, 6)
    w, b = base.weight.double(), base.bias.double()
    a, bb = layer.lora_A.double(), layer.lora_B.double()
    expected = x.double() @ w.T + b + 3.0 * (x.double() @ a.T @ bb.T)  # alpha / rank = 6 / 2
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-6)


def test_a_fresh_adapter_leaves_the_model_unchanged_and_only_adapters_train() -> None:
    model = tiny_model()
    x = torch.randint(0, 50, (2, 12))
    before = model(x, x)[0]
    add_lora(model, LoraConfig(rank=4, targets="attention"))
    torch.testing.assert_close(model(x, x)[0], before)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    # 2 blocks x (c_attn, c_proj) x (A, B); nothing else, not even the embedding or the LayerNorms
    assert len(trainable) == 8 and all(name.endswith((".lora_A", ".lora_B")) for name in trainable)
    assert all(".attn." in name for name in trainable)
    # rank 4: c_attn A (4, 32) + B (96, 4), c_proj A (4, 32) + B (32, 4), per block
    assert sum(model.get_parameter(name).numel() for name in trainable) == 2 * (4 * 32 + 96 * 4 + 4 * 32 + 32 * 4)


def test_gradients_reach_only_the_adapters() -> None:
    model = add_lora(tiny_model(), LoraConfig(rank=2, targets="all"))
    randomise_adapters(model)
    x = torch.randint(0, 50, (2, 12))
    model(x, x)[1].backward()
    for name, param in model.named_parameters():
        assert (param.grad is not None) == name.endswith((".lora_A", ".lora_B")), name


def test_merged_weights_give_the_unmerged_outputs() -> None:
    model = add_lora(tiny_model(), LoraConfig(rank=4, alpha=8.0, targets="all"))
    randomise_adapters(model)
    x = torch.randint(0, 50, (2, 12))
    unmerged = model(x, x)[0]
    merged = merge_lora(model)
    assert not any(isinstance(module, LoraLinear) for module in merged.modules())
    torch.testing.assert_close(merged(x, x)[0], unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("base_weights", "tolerance"), [("bfloat16", 2e-2), ("int8", 2e-2), ("int4", 2e-2)])
def test_a_base_held_in_less_precision_stays_close(base_weights: str, tolerance: float) -> None:
    x = torch.randint(0, 50, (2, 12))
    exact = add_lora(tiny_model(), LoraConfig(rank=4, targets="all"))
    randomise_adapters(exact)
    small = add_lora(tiny_model(), LoraConfig(rank=4, targets="all"), base_weights=base_weights)
    randomise_adapters(small)
    torch.testing.assert_close(small(x, x)[0], exact(x, x)[0], rtol=0, atol=tolerance)
    assert not any(param.requires_grad for name, param in small.named_parameters() if "lora_" not in name)


def test_the_products_no_adapter_targets_are_held_as_the_base_is() -> None:
    """--lora_base_weights holds the whole base: under int8 with adapters on the attention, the MLP's products hold
    int8 weights too (a scale a row: the largest magnitude over 127, rounded to the nearest), frozen; the model
    computes with those values, and merging gives them back as plain weights."""
    original = tiny_model()
    adapted = add_lora(tiny_model(), LoraConfig(rank=2, targets="attention"), base_weights="int8")
    x = torch.randint(0, 50, (2, 12))
    for layer in range(TINY["n_layer"]):
        for product in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            name = f"transformer.h.{layer}.{product}"
            held = adapted.get_submodule(name)
            assert held.weight is None and held.weight_int8.dtype == torch.int8, name
            assert hasattr(held, "lora_A") == product.startswith("attn"), name
            weight = original.get_submodule(name).weight.detach().double()
            scale = weight.abs().amax(dim=1, keepdim=True) / 127
            with torch.no_grad():
                original.get_submodule(name).weight.copy_(torch.round(weight / scale) * scale)
    assert not any(param.requires_grad for name, param in adapted.named_parameters() if "lora_" not in name)
    torch.testing.assert_close(adapted(x, x)[0], original(x, x)[0], rtol=0, atol=1e-5)  # B = 0: the base
    merged = merge_lora(adapted).state_dict()
    for name, value in original.state_dict().items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6, msg=name)


def test_an_int4_base_computes_from_q4_1_blocks_and_merges_to_their_values_plus_the_update() -> None:
    """QLoRA: the base held as GGUF's Q4_1 blocks (no float weight); its product and the merged weight use the
    values gguf-py's own Q4_1 quantizer and dequantizer give the weight."""
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(0)
    base = torch.nn.Linear(64, 5)
    layer = LoraLinear(base, LoraConfig(rank=2, alpha=6.0), base_weights="int4")
    randomise_adapters(layer)
    assert layer.weight is None and layer.weight_int4.shape == (5, 2, 16)
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    blocks = gguf.quants.quantize(base.weight.detach().numpy(), q4_1)
    w = torch.from_numpy(gguf.quants.dequantize(blocks, q4_1).reshape(5, 64)).double()
    a, b = layer.lora_A.double(), layer.lora_B.double()
    x = torch.randn(3, 64)
    expected = x.double() @ w.T + base.bias.double() + 3.0 * (x.double() @ a.T @ b.T)  # alpha / rank = 6 / 2
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.merged().weight.double(), w + 3.0 * (b @ a), rtol=0, atol=1e-6)


@pytest.mark.parametrize("base_weights", ["float32", "bfloat16", "int8", "int4"])
def test_the_input_gradient_is_the_output_gradient_times_the_weight_it_computes_with(base_weights: str) -> None:
    """What reaches the adapters below a layer: dy (W + scale B A), W the stored base's values."""
    torch.manual_seed(0)
    layer = LoraLinear(torch.nn.Linear(64, 5), LoraConfig(rank=2, alpha=6.0), base_weights=base_weights)
    randomise_adapters(layer)
    x = torch.randn(3, 64, requires_grad=True)
    output_grad = torch.randn(3, 5)
    layer(x).backward(output_grad)
    weight = layer.base_weight(torch.float64) + 3.0 * (layer.lora_B.double() @ layer.lora_A.double())
    torch.testing.assert_close(x.grad.double(), output_grad.double() @ weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base_weights", ["bfloat16", "int8", "int4"])
def test_a_step_keeps_no_widened_copy_of_a_compact_base(base_weights: str) -> None:
    """What autograd keeps from the forward pass for the backward one holds each base as the layer stores it: a
    float32 copy of every product's weight would cost more than a float32 base itself."""
    model = add_lora(tiny_model(), LoraConfig(rank=2, targets="all"), base_weights=base_weights)
    randomise_adapters(model)  # B no longer zero: every A has a gradient
    held = {tensor.untyped_storage().data_ptr() for tensor in [*model.parameters(), *model.buffers()]}
    weight_sizes = {m.in_features * m.out_features for m in model.modules() if isinstance(m, LoraLinear)}
    kept = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor)
        return tensor

    x = torch.randint(0, 50, (1, 5))  # no activation has a weight's size (1024, 3072 or 4096 numbers)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss = model(x, x)[1]
    copies = [t.shape for t in kept if t.numel() in weight_sizes and t.untyped_storage().data_ptr() not in held]
    assert kept and copies == []
    loss.backward()
    assert all(model.get_parameter(name).grad.abs().sum() > 0 for name in adapter_state(model) if "lora_A" in name)


def test_adapters_round_trip_and_refuse_another_shape() -> None:
    model = add_lora(tiny_model(), LoraConfig(rank=4, targets="mlp"))
    randomise_adapters(model)
    state = adapter_state(model)
    other = add_lora(tiny_model(), LoraConfig(rank=4, targets="mlp"))
    load_adapter_state(other, state, "adapters")
    x = torch.randint(0, 50, (1, 8))
    torch.testing.assert_close(other(x, x)[0], model(x, x)[0])
    with pytest.raises(UserError, match="do not fit"):
        load_adapter_state(add_lora(tiny_model(), LoraConfig(rank=4, targets="attention")), state, "adapters")
    with pytest.raises(UserError, match="shape"):
        load_adapter_state(add_lora(tiny_model(), LoraConfig(rank=2, targets="mlp")), state, "adapters")


@pytest.mark.parametrize("bad", [{"rank": 0}, {"alpha": 0.0}, {"dropout": 1.0}, {"targets": "head"}])
def test_impossible_settings_are_one_line_errors(bad: dict) -> None:
    with pytest.raises(UserError):
        LoraConfig(**bad)


@pytest.mark.parametrize("targets", ["attention", "mlp", "all"])
def test_peft_loads_the_adapter_into_gpt2_and_gives_our_logits(tmp_path: Path, targets: str) -> None:
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = tiny_model()
    write_hf(model, tmp_path / "base")
    config = LoraConfig(rank=4, alpha=8.0, targets=targets)
    add_lora(model, config)
    randomise_adapters(model)
    write_peft_adapter(tmp_path / "adapter", adapter_state(model), config, str(tmp_path / "base"))
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, model(x, x)[0], rtol=1e-4, atol=1e-5)


def test_new_token_rows_train_and_the_rest_of_the_vocabulary_stays_frozen() -> None:
    model = tiny_model()
    x = torch.tensor([[1, 47, 3, 49, 48, 2]])  # ids 46..49 stand for tokens a chat template added
    before = model(x, x)[0]
    add_lora(model, LoraConfig(rank=2), first_new_row=46)
    torch.testing.assert_close(model(x, x)[0], before)  # the same function, split into frozen and new rows
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert "transformer.wte.extra" in trainable and model.get_parameter("transformer.wte.extra").shape == (4, 32)
    model(x, x)[1].backward()
    assert model.get_parameter("transformer.wte.base").grad is None
    randomise_adapters(model)
    with torch.no_grad():
        model.get_parameter("transformer.wte.extra").add_(0.5)
    grown = model(x, x)[0]
    merged = merge_lora(model)
    assert merged.transformer.wte.weight is merged.lm_head.weight  # tied again
    torch.testing.assert_close(merged(x, x)[0], grown, rtol=1e-5, atol=1e-5)


def test_an_untied_head_trains_its_own_new_rows_and_merges_untied() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, tie_embeddings=False))
    x = torch.tensor([[1, 47, 3, 49, 48, 2]])  # ids 46..49 stand for tokens a chat template added
    before = model(x, x)[0]
    add_lora(model, LoraConfig(rank=2), first_new_row=46)
    torch.testing.assert_close(model(x, x)[0], before)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert {"transformer.wte.extra", "lm_head.extra"} <= trainable
    with torch.no_grad():
        model.get_parameter("transformer.wte.extra").add_(0.5)
        model.get_parameter("lm_head.extra").sub_(0.5)
    grown = model(x, x)[0]
    merged = merge_lora(model)
    assert merged.transformer.wte.weight is not merged.lm_head.weight
    assert not torch.equal(merged.transformer.wte.weight[46:], merged.lm_head.weight[46:])
    torch.testing.assert_close(merged(x, x)[0], grown, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False], ids=["tied head", "untied head"])
def test_peft_carries_trained_token_rows_and_gives_our_logits(tmp_path: Path, tied: bool) -> None:
    """A chat run's new rows (ids 46..49, added to a 46-token base) reach PEFT as trainable_token_indices (an
    untied head's rows too): on the base with those rows at their starting values, PEFT gives the logits of our
    adapted model, markers included."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, "vocab_size": 46}, tie_embeddings=tied))
    model.grow_vocabulary(50)
    write_hf(model, tmp_path / "base")  # the base as the run starts it: the new rows at the mean row
    config = LoraConfig(rank=4, alpha=8.0, targets="all")
    add_lora(model, config, first_new_row=46)
    randomise_adapters(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".extra"):
                param.copy_(torch.randn(4, 32, generator=generator))
    write_peft_adapter(tmp_path / "adapter", adapter_state(model), config, str(tmp_path / "base"), first_new_row=46)
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = torch.tensor([[1, 47, 3, 49, 48, 2, 46, 5]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(x).logits, model(x, x)[0], rtol=1e-4, atol=1e-5)
        with theirs.disable_adapter():  # the rows matter: without them the markers read and score otherwise
            assert (theirs(x).logits[..., 46:] - model(x, x)[0][..., 46:]).abs().max() > 1e-2
