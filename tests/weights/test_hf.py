"""GPT-2 interop with Hugging Face transformers (the reference implementation), entirely offline."""

from __future__ import annotations

import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch

import sample
from gptkit.core.errors import UserError
from gptkit.data.tokenizer import CharTokenizer
from gptkit.infer.engine import Engine, Request, generate
from gptkit.model import GPT, GPTConfig
from gptkit.weights import load
from gptkit.weights.hf import write_hf
from helpers import (
    HUB_COMMIT,
    assert_one_line_message,
    clean_env,
    cli_args,
    make_char_data,
    offline_hub_cache,
    run_in_process,
    run_script,
    serving_hub,
)

transformers = pytest.importorskip("transformers")


def random_hf_gpt2(tmp_path: Path, activation: str = "gelu_new", seed: int = 0) -> tuple[object, Path]:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=101,
        n_positions=32,
        n_embd=32,
        n_layer=2,
        n_head=4,
        activation_function=activation,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # random biases and norm gains too, so a mix-up of any tensor shows
        for name, param in hf.named_parameters():
            if param.dim() == 1:
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    directory = tmp_path / "hf-gpt2"
    hf.save_pretrained(directory)
    return hf, directory


@pytest.mark.parametrize("activation", ["gelu_new", "gelu"])
def test_hf_gpt2_loads_with_same_logits_and_loss(tmp_path, activation):
    hf, directory = random_hf_gpt2(tmp_path, activation)
    assert (directory / "model.safetensors").exists()
    ours = load(str(directory), tokenizer=False).model
    idx = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        expected = hf(idx, labels=idx)
        last_logits, _ = ours(idx)
        _, loss = ours(idx[:, :-1], idx[:, 1:])  # HF shifts labels inside
    torch.testing.assert_close(last_logits[:, -1], expected.logits[:, -1], rtol=0, atol=1e-4)
    assert loss.item() == pytest.approx(expected.loss.item(), abs=1e-5)


def test_greedy_generate_matches_hf_token_for_token(tmp_path):
    hf, directory = random_hf_gpt2(tmp_path, seed=3)
    ours = load(str(directory), tokenizer=False).model
    prompt = torch.randint(0, 101, (2, 5))
    expected = hf.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False, pad_token_id=0
    )
    assert torch.equal(generate(ours, prompt, max_new_tokens=20, temperature=0), expected)


def test_engine_batch_of_different_lengths_matches_hf_alone(tmp_path):
    """Each row of one engine batch (prompts of 3, 8 and 13 tokens) greedily makes what HF makes for it alone."""
    hf, directory = random_hf_gpt2(tmp_path, seed=4)
    ours = load(str(directory), tokenizer=False).model
    prompts = [torch.randint(0, 101, (n,)).tolist() for n in (3, 8, 13)]
    requests = [Request(prompt=prompt, max_new_tokens=15, temperature=0) for prompt in prompts]
    for _ in Engine(ours, slots=3).run(requests):
        pass
    for prompt, request in zip(prompts, requests):
        idx = torch.tensor([prompt])
        expected = hf.generate(
            idx, attention_mask=torch.ones_like(idx), max_new_tokens=15, do_sample=False, pad_token_id=0
        )
        assert request.output == expected[0, len(prompt) :].tolist()


def test_pytorch_model_bin_without_transformer_prefix(tmp_path):
    hf, _ = random_hf_gpt2(tmp_path)
    directory = tmp_path / "bare"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf.config.to_dict()))
    # GPT2Model's keys (no "transformer." prefix, no lm_head: tied) as an old-style .bin with mask buffers
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    state["h.0.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(state, directory / "pytorch_model.bin")
    ours = load(str(directory), tokenizer=False).model
    idx = torch.randint(0, 101, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0][:, -1], hf(idx).logits[:, -1], rtol=0, atol=1e-4)


def test_save_pretrained_round_trips_through_hf_exactly(tmp_path):
    torch.manual_seed(1)
    ours = GPT(GPTConfig(block_size=24, vocab_size=77, n_layer=2, n_head=2, n_embd=16)).eval()
    directory = tmp_path / "export"
    write_hf(ours, directory)
    hf = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    idx = torch.randint(0, 77, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0][:, -1], hf(idx).logits[:, -1], rtol=0, atol=1e-5)
    again = load(str(directory), tokenizer=False).model
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert not list(directory.glob("*.tmp")) and not list(directory.glob(".*"))


def test_save_pretrained_refuses_non_gpt2_shapes(tmp_path):
    model = GPT(GPTConfig(block_size=8, vocab_size=10, n_layer=1, n_head=1, n_embd=8, pos_encoding="rope"))
    with pytest.raises(UserError, match="GPT-2"):
        write_hf(model, tmp_path / "x")
    assert not (tmp_path / "x" / "config.json").exists()


def test_from_pretrained_errors_are_clear(tmp_path):
    with pytest.raises(UserError, match="missing: no such file or directory"):
        load(str(tmp_path / "missing"), tokenizer=False)
    with pytest.raises(UserError, match="neither a directory, a hub name"):
        load("gpt-5", tokenizer=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(
        json.dumps({"n_positions": 8, "vocab_size": 10, "n_layer": 1, "n_head": 1, "n_embd": 8})
    )
    with pytest.raises(UserError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load(str(tmp_path / "empty"), tokenizer=False)


def test_gpt2_names_read_openai_community_repositories_from_the_hub_cache(tmp_path, monkeypatch):
    """Offline, `gpt2` is openai-community/gpt2 in huggingface_hub's cache; a GPT-2 name not cached is one line."""
    hf, directory = random_hf_gpt2(tmp_path)
    offline_hub_cache(monkeypatch, tmp_path / "cache", {"openai-community/gpt2": directory})
    loaded = load("gpt2", tokenizer=False)
    assert (
        loaded.kind == "hub"
        and loaded.path == tmp_path / "cache" / "models--openai-community--gpt2" / "snapshots" / HUB_COMMIT
    )
    idx = torch.randint(0, 101, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(idx)[0][:, -1], hf(idx).logits[:, -1], rtol=0, atol=1e-4)
    with pytest.raises(UserError) as error:
        load("gpt2-medium", tokenizer=False)
    assert_one_line_message(
        error.value, "gpt2-medium: no such directory, and no hub repository of that name in the cache (offline?)"
    )


def test_sample_py_fetches_gpt2_from_hf_endpoint_once(tmp_path, capsys, monkeypatch):
    """sample.py --init_from=gpt2 fetches openai-community/gpt2 from HF_ENDPOINT (a loopback stand-in for the hub)
    into HF_HUB_CACHE: config, weights and tokenizer files, not the older pytorch_model.bin beside them, and prints
    transformers' greedy tokens; offline, the next run (its main in this process) reads the cache."""
    hf, directory = random_hf_gpt2(tmp_path)
    torch.save(hf.state_dict(), directory / "pytorch_model.bin")
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    make_char_data(tmp_path / "data", text)
    tokenizer = CharTokenizer.from_text(text)
    prompt = torch.tensor([tokenizer.encode("First")])
    greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    expected = "First" + tokenizer.decode(greedy[0, 5:].tolist()) + "\n"
    args = cli_args(init_from="gpt2", data_dir=tmp_path / "data", start="First", max_new_tokens=12, temperature=0)
    hub = {"HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    with serving_hub({"openai-community/gpt2": directory}) as (base, requested):
        online = run_script(
            "sample.py",
            *args,
            "--stream=False",
            "--device=cpu",
            env=clean_env(**hub, HF_ENDPOINT=base, HF_HUB_OFFLINE="0"),
        )
    assert online.returncode == 0, online.stderr
    assert online.stdout == expected
    fetched = sorted(
        line.rsplit("/", 1)[1] for line in requested if line.startswith("GET /openai-community/gpt2/resolve/")
    )
    assert fetched == ["config.json", "generation_config.json", "model.safetensors"]
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", hub["HF_HUB_CACHE"])  # read once, on import
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    offline = run_in_process(sample.main, [*args, "--stream=False", "--device=cpu"], capsys)
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == expected


@pytest.mark.parametrize(
    "config_text, weights, message",
    [
        ("{not json", None, "config.json is not JSON"),
        ('{"n_positions": 8}', None, "not a usable GPT2LMHeadModel config"),
        (
            '{"n_positions": 8, "vocab_size": 10, "n_layer": 1, "n_head": 1, "n_embd": 8, "activation_function": "swish"}',
            None,
            "activation_function 'swish' is not one of",
        ),
        (
            '{"n_positions": 8, "vocab_size": 10, "n_layer": 1, "n_head": 1, "n_embd": 8}',
            b"garbage",
            "cannot read weights",
        ),
    ],
)
def test_malformed_hf_directories_are_clear_errors(tmp_path, config_text, weights, message):
    (tmp_path / "config.json").write_text(config_text)
    if weights is not None:
        (tmp_path / "model.safetensors").write_bytes(weights)
    with pytest.raises(UserError, match=message):
        load(str(tmp_path), tokenizer=False)


def test_a_layer_count_beyond_the_weights_is_one_line_before_a_model_is_made(tmp_path):
    """A config.json giving far more layers than the weights hold is said from the weights' names (a model of that
    many layers would take minutes and gigabytes to make before any weight is read)."""
    _, directory = random_hf_gpt2(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "n_layer": 1_000_000}))
    with pytest.raises(UserError) as info:
        load(str(directory), tokenizer=False)
    assert str(info.value) == (
        f"{directory}: 1000000 layers in its config.json, but its weights hold layers 0 to 1 (2); the files are "
        "damaged; download or export the model again"
    )


def test_weights_holding_nan_or_infinity_are_refused_naming_the_tensor(tmp_path):
    """A Hugging Face directory whose weights hold an infinity (transformers saves it as it is) is refused in one
    line naming the directory and the tensor under its own name; the directory before the damage loads."""
    hf, directory = random_hf_gpt2(tmp_path)
    load(str(directory), tokenizer=False)
    with torch.no_grad():
        hf.transformer.h[1].mlp.c_proj.weight[2, 7] = float("-inf")
    hf.save_pretrained(directory)
    with pytest.raises(UserError) as info:
        load(str(directory), tokenizer=False)
    assert str(info.value).startswith(
        f"{directory}: weight transformer.h.1.mlp.c_proj.weight holds infinity in 1 of its 4096 values"
    )
    assert "\n" not in str(info.value) and str(info.value).endswith("download or export the model again")
