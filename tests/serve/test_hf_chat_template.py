"""The chat API and sample.py --chat on a Hugging Face tokenizer: the model's own template renders the prompt
(transformers' apply_chat_template ids) and a reply ends at the template's end of turn; a Qwen3-style model's
reasoning tokens (added, not special) are text in completions and replies, as vLLM and transformers show them."""

from __future__ import annotations

import io
import json

import httpx
import pytest
import torch
from transformers import AutoTokenizer

import sample
from gptkit.data.hf_tokenizer import HFTokenizer, load_hf_tokenizer
from helpers import HTTP, lively_model, reference_greedy, running_app
from hf_tokenizer_dirs import write_byte_level, write_llama3, write_qwen3

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
        tokenized = HTTP.post(f"{base}/tokenize", json={"messages": MESSAGES}).json()
        bare = HTTP.post(f"{base}/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        reply = HTTP.post(f"{base}/v1/chat/completions", json=body).json()
        info = HTTP.get(f"{base}/tokenizer_info").json()
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
        info = HTTP.get(f"{base}/tokenizer_info").json()
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


def test_a_chat_that_outgrows_the_context_leaves_each_oldest_turn_out_once(
    chatml: tuple[AutoTokenizer, HFTokenizer], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """sample.py --chat over many messages: a turn left out of the prompt is gone from the conversation, so each
    note on stderr stands for a turn newly left out, never for one left out before."""
    _, ours = chatml
    model = lively_model(ours.vocab_size, block_size=64, seed=1)
    cfg = sample.SampleSettings(temperature=0.0, max_new_tokens=4)
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"message number {i}\r\n" for i in range(12))))
    assert sample.chat(model, ours, cfg, torch.device("cpu"), torch.float32, io.StringIO().write) == 0
    notes = capsys.readouterr().err.count("its oldest turn is left out")
    # Each message with its reply and the template's markers takes well over a tenth of 64 tokens: some turns are
    # left out, and no more notes than there were turns to leave out (11 messages before the last, and replies).
    assert 0 < notes <= 22


# ----------------------------------------------------------------------------- Qwen3's reasoning tokens are text

QWEN3_SHAPE = dict(block_size=96, n_head=4, n_kv_head=2, head_dim=16, mlp_hidden=64, bias=False)
QWEN3_FAMILY = dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu", qk_norm=True, qk_norm_weight=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> tuple[AutoTokenizer, HFTokenizer, list[int]]:
    """transformers' and our tokenizer of a Qwen3-style directory, and its generation_config.json's eos ids."""
    directory = write_qwen3(tmp_path_factory.mktemp("qwen3"))
    eos = json.loads((directory / "generation_config.json").read_text())["eos_token_id"]
    return AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory), eos


def thinking_model(auto: AutoTokenizer, prompt: list[int], seed: int) -> torch.nn.Module:
    """A tiny random Qwen3-style model (RoPE, RMSNorm, SwiGLU, QK-norm with scales, grouped KV heads) whose greedy
    answer to `prompt` opens with <think> (its output row a scaled copy of greedy's first pick) and reaches
    <|im_end|> a few tokens later (the same with greedy's sixth pick); the other special tokens' rows are zero."""
    model = lively_model(len(auto), seed=seed, **QWEN3_SHAPE, **QWEN3_FAMILY)
    think, end = auto.convert_tokens_to_ids(["<think>", "<|im_end|>"])
    with torch.no_grad():
        model.lm_head.weight[[i for i, added in auto.added_tokens_decoder.items() if added.special]] = 0.0
        model.lm_head.weight[think] = 1.5 * model.lm_head.weight[reference_greedy(model, prompt, 1)[0]]
        model.lm_head.weight[end] = 1.5 * model.lm_head.weight[reference_greedy(model, prompt, 6)[5]]
    return model


def greedy_answer(model: torch.nn.Module, auto: AutoTokenizer, prompt: list[int], stops: set[int]) -> str:
    """transformers' text of the greedy tokens before the first of `stops`, which must come within 16 tokens after
    a <think> the answer shows."""
    tokens = reference_greedy(model, prompt, 16)
    cut = next(i for i, token in enumerate(tokens) if token in stops)
    assert auto.convert_tokens_to_ids("<think>") in tokens[:cut]  # the case tested: reasoning before the end
    return auto.decode(tokens[:cut])


def streamed_text(response: httpx.Response, text: callable) -> tuple[str, str]:
    """The text and the finish reason of a streamed answer's one choice."""
    lines = [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]
    chunks = [json.loads(line)["choices"][0] for line in lines if line != "[DONE]"]
    return "".join(text(chunk) for chunk in chunks), chunks[-1]["finish_reason"]


def test_a_qwen3_completion_shows_its_reasoning_tokens_and_stops_at_special_ones(qwen3) -> None:
    auto, ours, eos = qwen3
    special = {token_id for token_id, added in auto.added_tokens_decoder.items() if added.special}
    prompt = "<|im_start|>user\nÇa va ? 🙂<|im_end|>\n<|im_start|>assistant\n"
    ids = auto(prompt, add_special_tokens=False)["input_ids"]  # the client sends the rendered prompt as ids
    model = thinking_model(auto, ids, seed=5)
    expected = greedy_answer(model, auto, ids, special | set(eos))
    body = {"model": "m", "prompt": ids, "max_tokens": 16, "temperature": 0}
    with running_app(model, ours) as base:
        answer = HTTP.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]
        streamed = HTTP.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert (answer["text"], answer["finish_reason"]) == (expected, "stop")
    assert streamed_text(streamed, lambda choice: choice["text"]) == (expected, "stop")
    assert expected.startswith("<think>") and not any(auto.decode([token]) in expected for token in special)


def test_a_qwen3_chat_reply_shows_its_reasoning_and_ends_at_the_end_of_turn(qwen3) -> None:
    auto, ours, eos = qwen3
    prompt = auto.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    model = thinking_model(auto, prompt, seed=3)
    expected = greedy_answer(model, auto, prompt, set(eos))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 16, "temperature": 0}
    with running_app(model, ours) as base:
        reply = HTTP.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        streamed = HTTP.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert (reply["message"]["content"], reply["finish_reason"]) == (expected, "stop")
    assert streamed_text(streamed, lambda choice: choice["delta"].get("content", "")) == (expected, "stop")
    assert expected.startswith("<think>")


def test_sample_prints_a_qwen3_models_reasoning_tokens(qwen3) -> None:
    auto, ours, eos = qwen3
    special = {token_id for token_id, added in auto.added_tokens_decoder.items() if added.special}
    prompt = "Ça va ? 🙂"
    ids = auto(prompt, add_special_tokens=False)["input_ids"]
    model = thinking_model(auto, ids, seed=5)
    cfg = sample.SampleSettings(temperature=0.0, max_new_tokens=16)
    written = io.StringIO()
    texts = sample.generate_samples(model, ours, prompt, cfg, torch.device("cpu"), torch.float32, written.write)
    assert texts == [prompt + greedy_answer(model, auto, ids, special | set(eos))] == [written.getvalue()]
    chat_prompt = auto.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)
    model = thinking_model(auto, chat_prompt, seed=7)
    written = io.StringIO()
    reply = sample.chat_reply(model, ours, MESSAGES, cfg, torch.device("cpu"), torch.float32, written.write)
    assert reply == written.getvalue() == greedy_answer(model, auto, chat_prompt, set(eos))


def test_a_template_that_fails_serves_completions_and_says_why_chat_is_refused(tmp_path) -> None:
    """A model whose chat template is not valid Jinja serves completions; the chat API and /tokenize of messages
    answer 400 with the reason (and no path of the server's files), completions 200."""
    directory = write_byte_level(tmp_path / "broken", "{% for m in messages %}{{ m.content }")
    tokenizer = load_hf_tokenizer(directory)
    with running_app(lively_model(tokenizer.vocab_size, block_size=32), tokenizer) as base:
        chat = HTTP.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "max_tokens": 2})
        tokenized = HTTP.post(f"{base}/tokenize", json={"messages": MESSAGES})
        completion = HTTP.post(f"{base}/v1/completions", json={"model": "m", "prompt": "Hi", "max_tokens": 2})
    for refused in (chat, tokenized):
        assert refused.status_code == 400
        message = refused.json()["error"]["message"]
        assert message.startswith("the chat template is not valid Jinja (line 1") and str(tmp_path) not in message
    assert completion.status_code == 200 and len(completion.json()["choices"]) == 1


@pytest.mark.parametrize("marker", ["<|start_header_id|>", "<|begin_of_text|>", "<|end_header_id|>"])
def test_a_chat_reply_ends_at_a_special_token_of_the_template_and_never_shows_it(tmp_path, marker) -> None:
    """A Llama 3 model that writes a header or begin marker in its reply has left its turn: the reply ends there
    (not shown), as a completion ends at it, where only <|eot_id|> and the end of text are its template's stops."""
    directory = write_llama3(tmp_path)
    auto, ours = AutoTokenizer.from_pretrained(str(directory)), load_hf_tokenizer(directory)
    token = auto.convert_tokens_to_ids(marker)
    assert token in auto.all_special_ids or auto.added_tokens_decoder[token].special
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "logit_bias": {str(token): 100}}
    with running_app(lively_model(ours.vocab_size, block_size=96), ours) as base:
        reply = HTTP.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
        streamed = HTTP.post(f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    choice = reply["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], reply["usage"]["completion_tokens"]) == (
        "",
        "stop",
        1,
    )
    assert streamed_text(streamed, lambda chunk: chunk["delta"].get("content", "")) == ("", "stop")


def test_an_unpaired_surrogate_is_a_400_naming_the_field(chatml: tuple[AutoTokenizer, HFTokenizer]) -> None:
    """JSON can spell a lone surrogate (\\ud800), which is no text: the prompt or the messages holding one are refused
    with a 400, and the server answers on."""
    _, ours = chatml
    lone = json.loads('"\\ud800x"')
    requests = [
        ("v1/completions", {"model": "m", "prompt": lone, "max_tokens": 2}, "prompt"),
        ("v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": lone}]}, "messages"),
        (
            "v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": lone}], "stream": True},
            "messages",
        ),
        ("tokenize", {"prompt": lone}, "prompt"),
        ("tokenize", {"messages": [{"role": "user", "content": lone}]}, "messages"),
    ]
    with running_app(lively_model(ours.vocab_size, block_size=96), ours) as base:
        for path, body, param in requests:
            sent = json.dumps(body).encode()  # json.dumps writes the surrogate as its escape
            answer = HTTP.post(f"{base}/{path}", content=sent, headers={"Content-Type": "application/json"}, timeout=60)
            assert answer.status_code == 400, (path, answer.text)
            assert answer.json()["error"]["param"] == param and "surrogate" in answer.json()["error"]["message"]
        assert (
            HTTP.post(f"{base}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2}).status_code == 200
        )
