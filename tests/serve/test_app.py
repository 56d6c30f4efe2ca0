"""gptkit.serve.app, gptkit.serve.batcher and Engine.add_many in-process: the queue and 429, prompt limits, UTF-8 safe
streaming of BPE text, batched prefill, settings checks. Servers run with uvicorn in a thread on 127.0.0.1."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from gptkit.core.errors import UserError
from gptkit.data.tokenizer import CharTokenizer, TiktokenTokenizer
from gptkit.infer.engine import Engine, Request
from gptkit.infer.native import NativeStep
from gptkit.serve.app import ServeSettings, is_loopback
from gptkit.serve.openai_api import APIError, error_response
from helpers import (
    HTTP,
    SERVE_TEXT,
    count_native_steps,
    get_json,
    lively_model,
    overflowing_model,
    plain_copy,
    reference_greedy,
    running_app,
)


def wait_for_health(base: str, timeout: float = 10, **expected: int) -> dict:
    """/health once it shows the expected counts (AssertionError after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        health = get_json(f"{base}/health")
        if all(health[key] == value for key, value in expected.items()):
            return health
        assert time.monotonic() < deadline, health
        time.sleep(0.02)


@pytest.fixture(scope="module")
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer.from_text(SERVE_TEXT)


def test_a_full_queue_answers_429_with_retry_after(char_tokenizer):
    import openai  # here, not at the top: it takes most of a second to import

    model = lively_model(char_tokenizer.vocab_size)
    with running_app(model, char_tokenizer, slots=1, max_queue=1, max_n=2, max_tokens=100000) as base:
        client = httpx.Client(timeout=30)
        body = {"model": "m", "prompt": "All:", "max_tokens": 90000, "stream": True}
        decoding = client.send(client.build_request("POST", f"{base}/v1/completions", json=body), stream=True)
        with pytest.raises(httpx.ReadTimeout):  # a whole-answer request whose client gives up while it waits
            client.post(f"{base}/v1/completions", json={**body, "stream": False}, timeout=0.5)
        wait_for_health(base, active=1, queued=0)
        waiting = client.send(client.build_request("POST", f"{base}/v1/completions", json=body), stream=True)
        assert wait_for_health(base, active=1, queued=1)
        refused = client.post(f"{base}/v1/completions", json={"model": "m", "prompt": "All:"})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0).completions.create(model="m", prompt="A")
        waiting.close()  # a waiting request whose client leaves never starts
        decoding.close()
        health = wait_for_health(base, active=0, queued=0)
        assert (health["requests_cancelled"], health["requests_finished"]) == (1, 0)  # the waiting one never started
        answer = client.post(f"{base}/v1/completions", json={"model": "m", "prompt": "All:", "max_tokens": 3})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3


def test_auto_decoding_serves_a_lone_request_natively_with_the_eager_text(char_tokenizer, monkeypatch):
    """--decode=auto (the default) on the CPU: a request alone in the engine decodes through the native step (greedy,
    and sampled with a seed), with the text the plain eager path gives, past a sliding window."""
    model = lively_model(char_tokenizer.vocab_size, block_size=32)
    native_calls = count_native_steps(monkeypatch)
    greedy = {"model": "m", "prompt": "All:", "max_tokens": 40, "temperature": 0}
    bodies = [greedy, {**greedy, "prompt": "ROMEO:", "temperature": 1.0, "top_k": 5, "seed": 3}]
    texts = {}
    for decode in ("eager", "auto"):
        with running_app(model, char_tokenizer, decode=decode) as base:
            texts[decode] = [
                HTTP.post(f"{base}/v1/completions", json=body).json()["choices"][0]["text"] for body in bodies
            ]
    assert texts["auto"] == texts["eager"] and [len(text) for text in texts["auto"]] == [40, 40]
    assert len(native_calls) == 80


def test_auto_decoding_serves_concurrent_requests_natively_with_the_eager_text(char_tokenizer, monkeypatch):
    """--decode=auto on the CPU with 6 requests sent at once (greedy and seeded, of different prompt lengths): every
    token is made by the native step, one row or several rows a call as requests join and leave the batch, and each
    text is the eager server's."""
    model = lively_model(char_tokenizer.vocab_size, block_size=32)
    single_rows = count_native_steps(monkeypatch)
    several_rows: list[int] = []
    step_rows = NativeStep.step_rows
    monkeypatch.setattr(
        NativeStep,
        "step_rows",
        lambda self, tokens, *args: several_rows.append(len(tokens)) or step_rows(self, tokens, *args),
    )
    prompts = ["All:", "ROMEO:", "First Citizen:", "Speak", "A", "hear me"]
    bodies = [
        {"model": "m", "prompt": prompt, "max_tokens": 20 + 3 * i, "temperature": 0}
        if i % 2 == 0
        else {"model": "m", "prompt": prompt, "max_tokens": 20 + 3 * i, "temperature": 1.0, "top_k": 5, "seed": i}
        for i, prompt in enumerate(prompts)
    ]
    texts = {}
    for decode in ("eager", "auto"):
        with running_app(model, char_tokenizer, decode=decode, slots=6) as base, ThreadPoolExecutor(6) as pool:
            url = f"{base}/v1/completions"
            answers = list(pool.map(lambda body, url=url: HTTP.post(url, json=body, timeout=60), bodies))
        texts[decode] = [answer.json()["choices"][0]["text"] for answer in answers]
    assert texts["auto"] == texts["eager"]
    assert len(single_rows) + sum(several_rows) == sum(body["max_tokens"] for body in bodies)


def test_a_request_whose_logits_overflow_gets_a_json_error_and_the_server_goes_on(char_tokenizer):
    """A model with finite weights whose logits overflow to infinity after a '?' (helpers.overflowing_model), served
    as by default: a request whose text reaches one gets 422 with an OpenAI error body (streamed: an error event, then
    [DONE]; an echoed prompt to score: 422 too), while a request sent beside it and one sent after it get their
    reference greedy text."""
    model = overflowing_model(char_tokenizer.vocab_size, char_tokenizer.encode("?")[0])
    expected = char_tokenizer.decode(reference_greedy(plain_copy(model), char_tokenizer.encode("All:"), 10))
    assert "?" not in expected
    plain = {"model": "m", "prompt": "All:", "max_tokens": 10, "temperature": 0}
    failing = {**plain, "prompt": "ROMEO: Juliet?"}
    with running_app(model, char_tokenizer, slots=2) as base, ThreadPoolExecutor(2) as pool:
        url = f"{base}/v1/completions"
        refused, beside = pool.map(lambda body: HTTP.post(url, json=body, timeout=30), [failing, plain])
        assert refused.status_code == 422 and refused.json()["error"]["type"] == "invalid_request_error"
        assert "logits for new token 1 are NaN or infinite" in refused.json()["error"]["message"]
        assert beside.status_code == 200 and beside.json()["choices"][0]["text"] == expected
        with HTTP.stream("POST", url, json={**failing, "stream": True}, timeout=30) as stream:
            events = [line.removeprefix("data: ") for line in stream.iter_lines() if line.startswith("data: ")]
        assert stream.status_code == 200 and events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "invalid_request_error"
        scoring = {**plain, "prompt": "Juliet? hear", "echo": True, "logprobs": 1, "max_tokens": 0}
        scored = HTTP.post(url, json=scoring, timeout=30)
        assert scored.status_code == 422 and "cannot be scored" in scored.json()["error"]["message"]
        after = HTTP.post(url, json=plain, timeout=30)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == expected
        health = get_json(f"{base}/health")
        assert (health["requests_finished"], health["active"], health["queued"]) == (5, 0, 0)


def test_long_prompts_are_cut_from_the_left_or_refused(char_tokenizer):
    model = lively_model(char_tokenizer.vocab_size)  # a 16-token context
    prompt = "Speak, speak. " * 3  # 42 tokens
    with running_app(model, char_tokenizer) as base:
        long = HTTP.post(f"{base}/v1/completions", json={"model": "m", "prompt": prompt, "temperature": 0}).json()
        tail = HTTP.post(f"{base}/v1/completions", json={"model": "m", "prompt": prompt[-16:], "temperature": 0})
        assert long["usage"]["prompt_tokens"] == 16 and long["choices"][0]["text"] == tail.json()["choices"][0]["text"]
    with running_app(model, char_tokenizer, long_prompts="refuse") as base:
        refused = HTTP.post(f"{base}/v1/completions", json={"model": "m", "prompt": prompt})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        assert HTTP.post(f"{base}/v1/completions", json={"model": "m", "prompt": prompt[-16:]}).status_code == 200


@pytest.mark.gpt2_bpe
def test_bpe_text_streams_utf8_safe_and_whole():
    """A random GPT-2-vocabulary model makes byte tokens that split characters: every streamed chunk is whole text,
    and the chunks join to the non-streamed answer of the same seed."""
    import openai  # here, not at the top: it takes most of a second to import

    tokenizer = TiktokenTokenizer("gpt2")
    model = lively_model(tokenizer.vocab_size, block_size=32)
    body = {"model": "m", "prompt": "日本語 🙂", "max_tokens": 60, "seed": 5, "top_k": None}
    with running_app(model, tokenizer) as base:
        whole = HTTP.post(f"{base}/v1/completions", json=body).json()["choices"][0]["text"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0)
        chunks = [
            c.choices[0].text
            for c in client.completions.create(model="m", prompt=body["prompt"], max_tokens=60, seed=5, stream=True)
        ]
    assert "".join(chunks) == whole and len(whole) > 0
    for chunk in chunks:
        chunk.encode("utf-8", errors="strict")  # no lone surrogates: each chunk is complete characters


def test_add_many_prefills_equal_prompts_together_with_the_same_tokens():
    model = lively_model(37)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    alone = []
    for prompt in prompts:
        engine = Engine(model, slots=1, decode="eager")  # eager: every prompt fill is a pass of the model
        request = Request(prompt=prompt, max_new_tokens=12, temperature=0)
        engine.add(request)
        while engine.active:
            engine.step()
        alone.append(request.output)
    engine = Engine(model, slots=4, decode="eager")
    requests = [Request(prompt=prompt, max_new_tokens=12, temperature=0) for prompt in prompts]
    passes = []
    # every pass over tokens, with logits or without (a prompt fill), starts at the token embedding
    handle = model.transformer.wte.register_forward_pre_hook(lambda module, args: passes.append(args[0].shape))
    try:
        engine.add_many(requests)
    finally:
        handle.remove()
    assert sorted(passes) == sorted([(2, 3), (1, 1), (1, 4)])  # the two 4-token prompts in one pass
    while engine.active:
        engine.step()
    assert [r.output for r in requests] == alone
    with pytest.raises(RuntimeError, match="slots are busy"):
        Engine(model, slots=1).add_many([Request(prompt=[1], max_new_tokens=2), Request(prompt=[2], max_new_tokens=2)])
    finished = Request(prompt=[1], max_new_tokens=0)
    Engine(model, slots=1).add_many([finished])
    assert finished.finish_reason == "length" and finished.output == []


def test_settings_refuse_what_cannot_work():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.org")
    with pytest.raises(UserError, match="--api_key"):
        ServeSettings(host="0.0.0.0").validate()
    ServeSettings(host="0.0.0.0", api_key="k").validate()
    ServeSettings(host="0.0.0.0", allow_public_without_key=True).validate()
    with pytest.raises(UserError, match="max_n"):
        ServeSettings(slots=2, max_queue=1, max_n=4).validate()


def test_connections_to_the_listening_socket_send_small_answers_at_once():
    """Each accepted connection has Nagle's algorithm off (TCP_NODELAY), as asyncio sets it on TCP sockets: with it
    on, a client's delayed ACK held every small answer back about 40 ms."""
    import asyncio
    import socket

    from gptkit.serve.app import listen

    sock = listen("127.0.0.1", 0)

    async def accepted_flag() -> int:
        accepted = asyncio.get_running_loop().create_future()
        server = await asyncio.start_server(lambda reader, writer: accepted.set_result(writer), sock=sock)
        _, client = await asyncio.open_connection(*sock.getsockname()[:2])
        writer = await accepted
        flag = writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        for end in (client, writer):
            end.close()
        server.close()
        return flag

    assert asyncio.run(accepted_flag()) != 0


def test_an_error_is_built_from_named_fields_into_openais_error_body():
    error = APIError(status=404, message="no such model", param="model", code="model_not_found")
    answer = error.response()
    assert answer.status_code == 404
    assert json.loads(answer.body) == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(TypeError):  # positional fields were easy to swap (param and code, kind and param)
        APIError(404, "no such model", "model")
    with pytest.raises(TypeError):
        error_response(400, "bad", "invalid_request_error")


def test_sampling_values_at_the_edges_of_float32_are_answered_and_spare_the_requests_beside_them(char_tokenizer):
    """A temperature or top_p that float32 rounds to 0, and a top_k past int64, are answered 200 (greedy, the most
    likely token, every token) while requests decoding beside them get their own text."""
    model = lively_model(char_tokenizer.vocab_size, block_size=32)
    greedy = {"model": "m", "prompt": "All:", "max_tokens": 12, "temperature": 0}
    seeded = {**greedy, "temperature": 1.0, "seed": 7}
    edges = [
        ({**greedy, "temperature": 1e-310}, greedy),
        ({**greedy, "temperature": 1e-40, "top_p": 0.9, "top_k": 3, "logprobs": 2}, greedy),
        ({**seeded, "top_p": 1e-300}, greedy),  # the nucleus is the most likely token alone
        ({**seeded, "top_k": 2**70}, seeded),
    ]
    with running_app(model, char_tokenizer, slots=8) as base, ThreadPoolExecutor(8) as pool:
        url = f"{base}/v1/completions"
        alone = {json.dumps(body): HTTP.post(url, json=body, timeout=30).json() for body in (greedy, seeded)}
        long_ones = [pool.submit(HTTP.post, url, json={**greedy, "max_tokens": 30}, timeout=30) for _ in range(3)]
        answers = list(pool.map(lambda pair: HTTP.post(url, json=pair[0], timeout=30), edges))
        beside = [future.result() for future in long_ones]
    for answer, (_, same_as) in zip(answers, edges):
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == alone[json.dumps(same_as)]["choices"][0]["text"]
    assert all(response.status_code == 200 for response in beside)
    assert len({response.json()["choices"][0]["text"] for response in beside}) == 1


def test_a_body_that_stops_arriving_is_answered_408(char_tokenizer, monkeypatch):
    """A client that sends part of its body and then nothing gets a 408 with an OpenAI error body, not a held
    connection; the server answers the next request."""
    import socket

    from gptkit.serve import app

    monkeypatch.setattr(app, "BODY_SECONDS", 0.5)
    model = lively_model(char_tokenizer.vocab_size, block_size=32)
    with running_app(model, char_tokenizer) as base:
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
            client.sendall(head.encode() + b'{"model": "m",')
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                answer += client.recv(4096)
        status, _, body = answer.partition(b"\r\n\r\n")
        assert status.split()[1] == b"408"
        assert json.loads(body)["error"]["code"] == "timeout"
        assert (
            HTTP.post(f"{base}/v1/completions", json={"model": "m", "prompt": "All:", "max_tokens": 2}).status_code
            == 200
        )
