"""The chat API and sample.py --chat on a Hugging Face tokenizer: the model's own template renders the prompt
(transformers' apply_chat_template ids) and a reply ends at the template's end of turn."""

from __future__ import annotations

import io

import httpx
import pytest
import torch
from transformers import AutoTokenizer

import sample
from gptkit.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from helpers import lively_model, reference_greedy, running_app
from hf_tokenizer_dirs import write_byte_level, write_llama3

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ça va ? 🙂"}]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> tuple[AutoTokenizer, HFTokenizer]:
    directory = write_byte_level(tmp_path_factory.mktemp("chatml"))
    return AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)


def ending_soon(model: torch.nn.Module, tokenizer: HFTokenizer, prompt: list[int]) -> torch.nn.Module:
    """`model` (in place) with the end of turn's output row a scaled copy of the row greedy decoding picks third,
    so a greedy reply ends within three tokens."""
    third = reference_greedy(model, prompt, 3)[2]
    with torch.no_grad():
        model.lm_head.weight[tokenizer.chat.end_of_turn] = 1.5 * model.lm_head.weight[third]
    return model


def expected_reply(model: torch.nn.Module, tokenizer: HFTokenizer, prompt: list[int], steps: int) -> tuple[str, str]:
    """The greedy reply up to the first reply stop, and OpenAI's finish reason."""
    tokens = reference_greedy(model, prompt, steps)
    ends = [i for i, token in enumerate(tokens) if token in tokenizer.chat.reply_stops]
    if ends:
        return tokenizer.decode(tokens[: ends[0]]), "stop"
    return tokenizer.decode(tokens), "length"


def test_chat_api_renders_with_the_models_template(chatml: tuple[AutoTokenizer, HFTokenizer]) -> None:
    auto, ours = chatml
    prompt = auto.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    model = ending_soon(lively_model(ours.vocab_size, block_size=96), ours, prompt)
    with running_app(model, ours) as base:
        tokenized = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES}).json()
        bare = httpx.post(f"{base}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body).json()
        info = httpx.get(f"{base}/tokenizer_info").json()
    assert tokenized["tokens"] == prompt
    assert bare["tokens"] == auto.apply_chat_template(MESSAGES, tokenize=True, return_dict=False)
    content, finish = expected_reply(model, ours, prompt, 12)
    assert (reply["choices"][0]["message"]["content"], reply["choices"][0]["finish_reason"]) == (content, finish)
    assert finish == "stop" and content
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert info["chat_template"] == ours.chat.source and info["eos_token"] == "<|im_end|>"
    assert info["bos_token"] is auto.bos_token is None and info["pad_token"] == auto.pad_token == "<|endoftext|>"


def test_tokenizer_info_names_the_bos_token_of_a_tokenizer_that_has_one(tmp_path) -> None:
    directory = write_llama3(tmp_path / "llama3")
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    with running_app(lively_model(ours.vocab_size, block_size=32), ours) as base:
        info = httpx.get(f"{base}/tokenizer_info").json()
    assert (
        (info["bos_token"], info["eos_token"])
        == (auto.bos_token, auto.eos_token)
        == ("<|begin_of_text|>", "<|eot_id|>")
    )


def test_sample_chat_streams_the_reply_up_to_the_end_of_turn(chatml: tuple[AutoTokenizer, HFTokenizer]) -> None:
    auto, ours = chatml
    prompt = auto.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    model = ending_soon(lively_model(ours.vocab_size, block_size=96, seed=1), ours, prompt)
    cfg = sample.SampleSettings(temperature=0.0, max_new_tokens=12)
    written = io.StringIO()
    reply = sample.chat_reply(model, ours, MESSAGES, cfg, torch.device("cpu"), torch.float32, written.write)
    assert reply == written.getvalue() == expected_reply(model, ours, prompt, 12)[0]
    assert expected_reply(model, ours, prompt, 12)[1] == "stop" and reply
