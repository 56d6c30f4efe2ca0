"""POST /v1/chat/completions in-process: OpenAI's wire format through the official client and raw HTTP, stopping at
the end of the turn, a request alone against the same request in a busy batch, every bad body a 4xx with OpenAI's
error body, and the playground's chat mode in a real browser."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from gptkit.data.tokenizer import CharTokenizer, ChatTokenizer
from gptkit.model import GPT
from helpers import HTTP, SERVE_TEXT, lively_model, running_app

NAME = "m"  # running_app's model name


@pytest.fixture(scope="module")
def chat_tokenizer() -> ChatTokenizer:
    return ChatTokenizer.extending(CharTokenizer.from_text(SERVE_TEXT, eot=True))


@pytest.fixture(scope="module")
def chat_server(chat_tokenizer):
    with running_app(lively_model(chat_tokenizer.vocab_size), chat_tokenizer, slots=8) as base:
        yield base


def ask(base: str, body: dict) -> httpx.Response:
    return HTTP.post(f"{base}/v1/chat/completions", json={"model": NAME, **body}, timeout=60)


def events(response: httpx.Response) -> list:
    """The parsed server-sent events of a streamed answer ("[DONE]" kept as the string)."""
    lines = [line[len("data: ") :] for line in response.text.split("\n\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def test_the_official_client_gets_a_chat_completion_with_usage(chat_server):
    import openai  # here, not at the top: it takes most of a second to import

    client = openai.OpenAI(base_url=f"{chat_server}/v1", api_key="none", max_retries=0)
    answer = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Speak"}], temperature=0, max_completion_tokens=7
    )
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    message, reason = answer.choices[0].message, answer.choices[0].finish_reason
    assert message.role == "assistant"
    # begin, <|user|>, 5 characters, <|end|>, <|assistant|>
    assert answer.usage.prompt_tokens == 1 + 1 + 5 + 1 + 1
    if reason == "length":  # one character per token
        assert answer.usage.completion_tokens == 7 == len(message.content)
    else:
        assert reason == "stop" and answer.usage.completion_tokens == len(message.content) + 1
    older = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Speak"}], temperature=0, max_tokens=7
    )
    assert older.choices[0].message.content == message.content


def test_a_stream_names_the_role_first_then_deltas_then_the_reason_usage_and_done(chat_server):
    body = {"messages": [{"role": "system", "content": "Speak"}, {"role": "user", "content": "All:"}]}
    whole = ask(chat_server, {**body, "temperature": 0, "max_completion_tokens": 12}).json()
    streamed = ask(
        chat_server,
        {
            **body,
            "temperature": 0,
            "max_completion_tokens": 12,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = events(streamed)
    assert chunks[-1] == "[DONE]"
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks[:-1])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks[1:-2])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-3]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"] == whole["usage"]


def constant_reply_model(vocab_size: int, token: int) -> GPT:
    """A model whose every next token is `token`: the final norm outputs one constant vector, and only `token`'s row
    of the head points along it."""
    model = lively_model(vocab_size)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 10.0
    return model


def test_a_reply_ends_at_the_end_of_its_turn(chat_tokenizer):
    model = constant_reply_model(chat_tokenizer.vocab_size, chat_tokenizer.chat.end_of_turn)
    with running_app(model, chat_tokenizer) as base:
        answer = ask(base, {"messages": [{"role": "user", "content": "All:"}], "max_completion_tokens": 50}).json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert answer["usage"]["completion_tokens"] == 1  # the end-of-turn token, not shown


def test_the_official_client_streams_a_last_chunk_with_an_empty_delta_and_the_finish_reason(chat_server):
    import openai  # here, not at the top: it takes most of a second to import

    client = openai.OpenAI(base_url=f"{chat_server}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Speak"}]
    whole = client.chat.completions.create(model=NAME, messages=messages, temperature=0, max_completion_tokens=9)
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=messages, temperature=0, max_completion_tokens=9, stream=True
        )
    )
    last = chunks[-1].choices[0]
    assert last.finish_reason == whole.choices[0].finish_reason
    assert last.delta.content is None and last.delta.role is None  # OpenAI's last chunk: delta {}
    assert all(chunk.choices[0].finish_reason is None for chunk in chunks[:-1])
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content
    raw = events(ask(chat_server, {"messages": messages, "max_completion_tokens": 9, "stream": True}))
    assert raw[-2]["choices"][0]["delta"] == {} and raw[-2]["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("marker", ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"])
def test_a_completion_on_a_chat_model_stops_at_a_marker_and_never_shows_it(chat_tokenizer, marker):
    model = constant_reply_model(chat_tokenizer.vocab_size, chat_tokenizer.chat.special_tokens[marker])
    body = {"model": NAME, "prompt": "All:", "max_tokens": 20}
    with running_app(model, chat_tokenizer) as base:
        answer = HTTP.post(f"{base}/v1/completions", json=body, timeout=60).json()
        streamed = events(HTTP.post(f"{base}/v1/completions", json={**body, "stream": True}, timeout=60))
    choice = answer["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == 1  # the marker ended it, unshown
    assert "".join(chunk["choices"][0]["text"] for chunk in streamed[:-1]) == ""
    assert streamed[-2]["choices"][0]["finish_reason"] == "stop"


def test_a_request_alone_equals_itself_in_a_busy_batch(chat_server):
    body = {"messages": [{"role": "user", "content": "ROMEO:"}], "temperature": 1.0, "seed": 7, "n": 2}
    body["max_completion_tokens"] = 20
    alone = ask(chat_server, body).json()["choices"]
    others = [{**body, "seed": seed, "messages": [{"role": "user", "content": "First"}]} for seed in range(6)]
    with ThreadPoolExecutor(7) as pool:
        busy = list(pool.map(lambda b: ask(chat_server, b).json(), [*others, body]))
    assert busy[-1]["choices"] == alone
    assert len({choice["message"]["content"] for answer in busy for choice in answer["choices"]}) > 2


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "Speak"}, {"role": "system", "content": "late"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "é"}]}, "messages"),  # no such character in the vocabulary
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),  # no logprobs: true
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"-1": 5}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\u00b2": 5}}, "logit_bias"),  # superscript 2
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\u0661": 5}}, "logit_bias"),  # Arabic 1
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"9" * 5000: 5}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_bodies_are_4xx_with_openai_error_bodies(chat_server, body, param):
    response = ask(chat_server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_text_parts_are_joined_into_one_message(chat_server):
    parts = [{"type": "text", "text": "Spe"}, {"type": "text", "text": "ak"}]
    joined = ask(chat_server, {"messages": [{"role": "user", "content": parts}], "temperature": 0}).json()
    plain = ask(chat_server, {"messages": [{"role": "user", "content": "Speak"}], "temperature": 0}).json()
    assert joined["choices"] == plain["choices"] and joined["usage"] == plain["usage"]


def test_a_model_without_a_chat_template_says_so_with_a_400():
    tokenizer = CharTokenizer.from_text(SERVE_TEXT)
    with running_app(lively_model(tokenizer.vocab_size), tokenizer) as base:
        response = ask(base, {"messages": [{"role": "user", "content": "Speak"}]})
        models = HTTP.get(f"{base}/v1/models").json()
    assert response.status_code == 400 and "chat template" in response.json()["error"]["message"]
    assert models["data"][0]["chat"] is False


def test_the_playground_talks_in_chat_mode_streams_and_stops(chat_tokenizer, browser, tmp_path: Path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    model = lively_model(chat_tokenizer.vocab_size, block_size=4096)
    with torch.no_grad():  # greedy replies never end by themselves: only Stop ends the second one
        model.lm_head.weight[list(chat_tokenizer.chat.reply_stops)] = 0.0
    with running_app(model, chat_tokenizer, max_tokens=100000) as base:
        browser.get(f"{base}/")
        wait = WebDriverWait(browser, 20)
        wait.until(lambda b: b.find_element(By.ID, "mode_chat").is_selected())  # a chat model opens in chat mode
        assert browser.find_element(By.ID, "generate").text == "Send"
        browser.find_element(By.ID, "system").send_keys("Speak")
        temperature = browser.find_element(By.ID, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        field = browser.find_element(By.ID, "max_tokens")
        field.clear()
        field.send_keys("5")
        browser.find_element(By.ID, "prompt").send_keys("All:")
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda b: b.find_element(By.ID, "status").text.startswith("done"))
        replies = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .content")
        users = browser.find_elements(By.CSS_SELECTOR, ".message.user .content")
        assert [u.text for u in users] == ["All:"] and len(replies) == 1 and len(replies[0].text) > 0

        field.clear()
        field.send_keys("90000")  # a long reply, stopped by the Stop button
        browser.find_element(By.ID, "prompt").send_keys("Speak")
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".message.assistant .content")[-1].text) > 10)
        browser.find_element(By.ID, "stop").click()
        wait.until(lambda b: b.find_element(By.ID, "status").text == "stopped")
        stopped = browser.find_elements(By.CSS_SELECTOR, ".message.assistant .content")[-1].text
        time.sleep(0.3)
        assert browser.find_elements(By.CSS_SELECTOR, ".message.assistant .content")[-1].text == stopped
        assert len(browser.find_elements(By.CSS_SELECTOR, ".message")) == 4

        browser.find_element(By.ID, "reset").click()
        assert browser.find_elements(By.CSS_SELECTOR, ".message") == []
