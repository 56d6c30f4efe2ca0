"""serve.py end to end: the official `openai` client, curl-style HTTP, bad input, abandoned streams, a soak, and the
playground in a real headless browser. One server (a tiny char-level model, with an API key) serves the module;
all traffic goes to 127.0.0.1 on a port the test picks."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import httpx
import psutil
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import serve
from helpers import HTTP, assert_one_line_error, free_port, get_json, lively_char_checkpoint, run_main, serve_process

if TYPE_CHECKING:
    import openai  # imported where used: it takes most of a second, in every process that collects this file

KEY = "test-key-123"
NAME = "tiny"
MAX_BODY = 20_000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, server process, tokenizer) of serve.py on a tiny model: 8 slots, a key, long generations allowed."""
    root = tmp_path_factory.mktemp("serve")
    tokenizer = lively_char_checkpoint(root / "out")
    args = (
        f"--out_dir={root / 'out'}",
        f"--api_key={KEY}",
        f"--model_name={NAME}",
        "--device=cpu",
        "--slots=8",
        "--max_queue=32",
        "--max_tokens=100000",
        f"--max_body_bytes={MAX_BODY}",
        "--access_log=False",
    )
    with serve_process(*args, log=root / "server.log") as (base, process):
        yield base, process, tokenizer


@pytest.fixture
def client(served) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(base: str, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (bytes, Iterator)) else json.dumps(body).encode()
    return HTTP.post(f"{base}/v1/completions", content=content, headers={"Content-Type": "application/json", **headers})


def wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def greedy(client: openai.OpenAI, prompt: str, max_tokens: int = 24, **extra):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra)


class LongStreams:
    """`count` streamed completions that run until closed (sampled, far more tokens than the test waits for)."""

    def __init__(self, base: str, count: int) -> None:
        self.client = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"})
        self.streams = []
        for i in range(count):
            body = {"model": NAME, "prompt": "All:", "max_tokens": 90000, "stream": True, "seed": i}
            response = self.client.send(
                self.client.build_request("POST", f"{base}/v1/completions", json=body), stream=True
            )
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a collected line iterator would close its connection
            assert next(line for line in lines if line.startswith("data: "))  # decoding has begun
            self.streams.append((response, lines))

    def close(self) -> None:
        for response, _ in self.streams:
            response.close()
        self.client.close()


# ----------------------------------------------------------------------------------------------- the API


def test_completion_through_the_openai_client(client, served):
    tokenizer = served[2]
    answer = greedy(client, "ROMEO:", 20)
    (choice,) = answer.choices
    assert answer.object == "text_completion" and answer.model == NAME and choice.index == 0
    assert choice.finish_reason == "length" and len(choice.text) == 20
    assert answer.usage.prompt_tokens == len(tokenizer.encode("ROMEO:")) == 6
    assert answer.usage.completion_tokens == len(tokenizer.encode(choice.text)) == 20
    assert answer.usage.total_tokens == 26
    assert greedy(client, "ROMEO:", 20).choices[0].text == choice.text  # greedy: the same every time
    by_ids = client.completions.create(model=NAME, prompt=tokenizer.encode("ROMEO:"), max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == choice.text


def test_streamed_text_equals_the_whole_answer(client):
    # long enough that even the fastest decoding (the native step) makes tokens over many reads of the stream: the
    # server merges what a client has not read yet into one chunk
    whole = greedy(client, "All:", 1000).choices[0].text
    chunks = list(
        client.completions.create(
            model=NAME,
            prompt="All:",
            max_tokens=1000,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole and len(texts) > 3  # many chunks, not one at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 1000
    assert chunks[-1].usage.prompt_tokens == 4


def test_stop_strings_end_the_text_before_them(client):
    whole = greedy(client, "ROMEO:", 40).choices[0].text
    stop = whole[12:14]
    expected = whole[: whole.index(stop)]
    answer = greedy(client, "ROMEO:", 40, stop=[stop, "never-there"])
    assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == len(expected) + len(stop)  # tokens made, the stop string's included
    streamed = greedy(client, "ROMEO:", 40, stop=stop, stream=True)
    chunks = [c.choices[0] for c in streamed]
    assert "".join(c.text for c in chunks) == expected and chunks[-1].finish_reason == "stop"


def test_n_and_a_list_of_prompts_give_every_choice_in_order(client):
    first, second = greedy(client, "ROMEO:").choices[0].text, greedy(client, "All:").choices[0].text
    answer = greedy(client, ["ROMEO:", "All:"], n=2)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert [c.text for c in answer.choices] == [first, first, second, second]
    assert answer.usage.prompt_tokens == 6 + 4 and answer.usage.completion_tokens == 4 * 24
    # sampled with a seed: choice j of n uses seed + j, so each choice is what that seed gives alone
    seeded = client.completions.create(model=NAME, prompt="All:", max_tokens=24, n=2, seed=7, extra_body={"top_k": 5})
    alone = [
        client.completions.create(model=NAME, prompt="All:", max_tokens=24, seed=s, extra_body={"top_k": 5})
        .choices[0]
        .text
        for s in (7, 8)
    ]
    assert [c.text for c in seeded.choices] == alone and alone[0] != alone[1]


def test_models_health_and_the_playground_page(client, served):
    base = served[0]
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME
    health = get_json(f"{base}/health")
    assert health["status"] == "ok" and health["model"] == NAME and health["slots"] == 8
    page = HTTP.get(f"{base}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="generate"' in page.text and "http://" not in page.text and "https://" not in page.text  # offline


def test_output_does_not_depend_on_what_else_is_decoding(client, served):
    """Greedy alone == greedy while 7 other requests decode; a seed gives the same text alone and batched."""
    sampled = {"max_tokens": 40, "temperature": 1.0, "seed": 1234, "extra_body": {"top_k": 10}}
    alone_greedy = greedy(client, "ROMEO:", 40).choices[0].text
    alone_sampled = client.completions.create(model=NAME, prompt="ROMEO:", **sampled).choices[0].text
    others = LongStreams(served[0], 7)
    try:
        assert get_json(f"{served[0]}/health")["active"] == 7
        assert greedy(client, "ROMEO:", 40).choices[0].text == alone_greedy
        assert client.completions.create(model=NAME, prompt="ROMEO:", **sampled).choices[0].text == alone_sampled
        assert get_json(f"{served[0]}/health")["active"] == 7  # the others were decoding all along
    finally:
        others.close()
    wait_for(lambda: get_json(f"{served[0]}/health")["active"] == 0, what="the closed streams to leave")


def test_a_closed_stream_frees_its_slot_and_stops_costing_compute(served):
    base = served[0]
    streams = LongStreams(base, 1)
    steps_while_open = get_json(f"{base}/health")["steps"]
    wait_for(lambda: get_json(f"{base}/health")["steps"] > steps_while_open, what="the stream to decode")
    streams.close()
    wait_for(lambda: get_json(f"{base}/health")["active"] == 0, what="the slot to be freed")
    steps = get_json(f"{base}/health")["steps"]
    time.sleep(0.5)
    health = get_json(f"{base}/health")
    assert health["steps"] == steps and health["queued"] == 0  # the engine is idle: nothing decodes for it
    with pytest.raises(httpx.ReadTimeout):  # the same for a whole-answer request whose client gives up
        HTTP.post(
            f"{base}/v1/completions",
            json={"model": NAME, "prompt": "All:", "max_tokens": 90000},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=0.5,
        )
    wait_for(lambda: get_json(f"{base}/health")["active"] == 0, what="the abandoned request to leave")


# ----------------------------------------------------------------------------------------------- safety


def test_a_key_is_needed_for_v1_but_not_for_the_page_or_health(served):
    import openai

    base = served[0]
    body = {"model": NAME, "prompt": "All:", "max_tokens": 2}
    for key in (None, "wrong-key", KEY + "x"):
        answer = post(base, body, key=key)
        assert answer.status_code == 401
        assert answer.json()["error"]["code"] == "invalid_api_key"
    assert HTTP.get(f"{base}/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="nope", max_retries=0).models.list()
    assert post(base, body).status_code == 200
    assert HTTP.get(f"{base}/health").status_code == 200 and HTTP.get(f"{base}/").status_code == 200


BAD_REQUESTS = [
    (b"{not json", 400, None),
    (b"", 400, None),
    (b"[1, 2]", 400, None),
    ({"prompt": "All:"}, 400, "model"),
    ({"model": NAME}, 400, "prompt"),
    ({"model": NAME, "prompt": 5}, 400, "prompt"),
    ({"model": NAME, "prompt": []}, 400, "prompt"),
    ({"model": NAME, "prompt": "All:", "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "All:", "max_tokens": 2.5}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "All:", "max_tokens": 0}, 400, "max_tokens"),  # generates nothing without echo
    ({"model": NAME, "prompt": "All:", "max_tokens": 100001}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "All:", "temperature": 2.5}, 400, "temperature"),
    ({"model": NAME, "prompt": "All:", "temperature": True}, 400, "temperature"),
    ({"model": NAME, "prompt": "All:", "top_p": 0}, 400, "top_p"),
    ({"model": NAME, "prompt": "All:", "top_k": 0}, 400, "top_k"),
    ({"model": NAME, "prompt": "All:", "n": 0}, 400, "n"),
    ({"model": NAME, "prompt": "All:", "n": 17}, 400, "n"),
    ({"model": NAME, "prompt": "All:", "seed": 2**70}, 400, "seed"),
    ({"model": NAME, "prompt": "All:", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": NAME, "prompt": "All:", "stop": ""}, 400, "stop"),
    ({"model": NAME, "prompt": "All:", "stream": "yes"}, 400, "stream"),
    ({"model": NAME, "prompt": "All:", "logprobs": 21}, 400, "logprobs"),
    ({"model": NAME, "prompt": "All:", "logprobs": -1}, 400, "logprobs"),
    ({"model": NAME, "prompt": "All:", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ({"model": NAME, "prompt": "All:", "presence_penalty": "high"}, 400, "presence_penalty"),
    ({"model": NAME, "prompt": "All:", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "All:", "logit_bias": {"A": 1}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "All:", "logit_bias": {"1": "up"}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "All:", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "All:", "best_of": 1, "n": 2}, 400, "best_of"),
    ({"model": NAME, "prompt": "All:", "best_of": 3, "stream": True}, 400, "best_of"),
    ({"model": NAME, "prompt": "All:", "suffix": "end"}, 400, "suffix"),
    ({"model": NAME, "prompt": "Zebra"}, 400, "prompt"),  # 'Z' is not in the model's characters
    ({"model": NAME, "prompt": [0, 9999]}, 400, "prompt"),
    ({"model": "gpt-4", "prompt": "All:"}, 404, "model"),
    ({"model": NAME, "prompt": "x" * (MAX_BODY + 10)}, 413, None),
]


@pytest.mark.parametrize("body, status, param", BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_bad_requests_get_an_openai_error_body(served, body, status, param):
    answer = post(served[0], body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_other_bad_http_gets_4xx_and_the_server_stays_up(served):
    base = served[0]
    assert HTTP.get(f"{base}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}).status_code == 405
    assert HTTP.get(f"{base}/nowhere").json()["error"]["code"] == "not_found"
    chunked = post(base, (b"x" * 1000 for _ in range(MAX_BODY // 1000 + 1)))  # no Content-Length: the bytes are counted
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    malformed = [
        b"THIS IS NOT HTTP\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"GET /health HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n",
    ]
    for request in malformed:
        with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=5) as raw:
            raw.sendall(request)
            head, _, body = read_until_closed(raw).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head.lower(), head
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed HTTP request")
    assert get_json(f"{base}/health")["status"] == "ok"


def read_until_closed(connection: socket.socket) -> bytes:
    received = b""
    while chunk := connection.recv(4096):
        received += chunk
    return received


def test_a_public_address_without_a_key_is_refused(capsys, tmp_path):
    code, _, err = run_main(serve.main, [f"--out_dir={tmp_path}", "--host=0.0.0.0"], capsys)
    assert_one_line_error(code, err, "--host=0.0.0.0", "--api_key", "--allow_public_without_key")
    code, out, _ = run_main(serve.main, ["--help"], capsys)
    assert code == 0 and all(f"--{key}" in out for key in ("api_key", "max_queue", "max_body_bytes", "long_prompts"))


@contextlib.contextmanager
def serving_in_a_thread(monkeypatch: pytest.MonkeyPatch, *args: str) -> Iterator[str]:
    """serve.py's main(ARGS --port=P) in a thread of this process (uvicorn leaves the signals to the main thread
    there) until the block ends; yields the base URL once the server has started. The module's server is the
    process as a user starts it; this one saves starting Python and torch again."""
    servers: list[uvicorn.Server] = []

    class KeptServer(uvicorn.Server):  # kept, so that the end of the block can stop it
        def __init__(self, *server_args, **kwargs) -> None:
            super().__init__(*server_args, **kwargs)
            servers.append(self)

    monkeypatch.setattr(uvicorn, "Server", KeptServer)
    port = free_port()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            serve.main([*args, f"--port={port}"])
        except BaseException as exc:  # re-raised in the test
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: failures or (servers and servers[0].started), timeout=60, what="serve.py to start")
        if failures:
            raise failures[0]
        yield f"http://127.0.0.1:{port}"
    finally:
        for server in servers:
            server.should_exit = True
        thread.join(10)


def test_int8_weights_serve_and_bfloat16_with_them_is_refused(capsys, tmp_path, monkeypatch):
    lively_char_checkpoint(tmp_path / "out")
    args = (f"--out_dir={tmp_path / 'out'}", "--device=cpu", "--quantize=int8", "--access_log=False")
    with serving_in_a_thread(monkeypatch, *args) as base:
        body = {"model": "out", "prompt": "ROMEO:", "max_tokens": 12, "temperature": 0}
        answer = HTTP.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 12
    code, _, err = run_main(serve.main, [*args, "--dtype=bfloat16", "--port=0"], capsys)
    assert_one_line_error(code, err, "--quantize=int8 computes in float32")


def test_a_taken_port_is_one_line(capsys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, _, err = run_main(serve.main, [f"--out_dir={tmp_path}", f"--port={taken.getsockname()[1]}"], capsys)
    assert_one_line_error(code, err, "cannot listen on 127.0.0.1", "--port")


def test_soak_of_mixed_requests_leaves_the_server_up_with_flat_memory(served):
    """A few hundred requests: valid, malformed, wrong key, abandoned mid-stream, dropped connections, scored (logprobs,
    echo, penalties, bias), and bad values of those."""
    base, process, _ = served
    port = int(base.rsplit(":", 1)[1])
    good = {"model": NAME, "prompt": "All:", "max_tokens": 8}

    scored = {**good, "logprobs": 2, "echo": True, "presence_penalty": 0.5, "logit_bias": {"3": -100}}
    bad_values = [{"logprobs": 21}, {"logit_bias": {"99999": 1}}, {"logit_bias": {"1": "up"}}, {"frequency_penalty": 5}]

    def one(i: int) -> None:
        kind = i % 8
        if kind == 0:
            assert post(base, {**good, "temperature": 0}).status_code == 200
        elif kind == 1:
            assert post(base, b'{"model": "tiny", "prompt": ').status_code == 400
        elif kind == 2:
            assert post(base, {**good, "max_tokens": -1}).status_code == 400
        elif kind == 3:
            assert post(base, good, key="bad").status_code == 401
        elif kind == 4:  # abandoned: read one chunk of a long stream, then hang up
            with HTTP.stream(
                "POST",
                f"{base}/v1/completions",
                json={**good, "max_tokens": 5000, "stream": True},
                headers={"Authorization": f"Bearer {KEY}"},
            ) as response:
                next(response.iter_lines())
        elif kind == 5:  # a connection that sends half a request and goes
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        elif kind == 6:  # scored: logprobs, echo, a penalty, a bias
            answer = post(base, {**scored, "max_tokens": i % 3})
            assert answer.status_code == 200 and len(answer.json()["choices"][0]["logprobs"]["tokens"]) >= 4
        else:
            assert post(base, {**good, **bad_values[i // 8 % len(bad_values)]}).status_code == 400

    def rss() -> int:
        return psutil.Process(process.pid).memory_info().rss

    unauthorized = metrics_401(base)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(60)))  # warm-up: allocator pools, code paths
        wait_for(lambda: get_json(f"{base}/health")["active"] == 0, what="warm-up streams to leave")
        warm = rss()
        list(pool.map(one, range(60, 360)))
    wait_for(lambda: get_json(f"{base}/health")["active"] == 0, what="abandoned streams to leave")
    health = get_json(f"{base}/health")
    assert health["status"] == "ok" and health["queued"] == 0
    assert post(base, {**good, "temperature": 0}).json()["choices"][0]["finish_reason"] == "length"
    grown = rss() - warm
    assert grown < 40 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB over 300 requests"
    # a wrong key (kind 3) or none (kind 5, the half requests: refused before their body comes)
    sent = sum(i % 8 in (3, 5) for i in range(360))
    wait_for(lambda: metrics_401(base) - unauthorized == sent, what=f"/metrics to count {sent} more 401s")


def metrics_401(base: str) -> int:
    """The 401 answers to /v1/completions that GET /metrics counts, read with prometheus_client's parser."""
    text = HTTP.get(f"{base}/metrics").text
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "gptkit_requests_total" and sample.labels == {"endpoint": "/v1/completions", "status": "401"}
    )


# ----------------------------------------------------------------------------------------------- the playground


def test_playground_streams_text_and_stops_in_a_real_browser(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base = served[0]
    browser.get(f"{base}/")
    wait = WebDriverWait(browser, 20)
    wait.until(lambda b: NAME in b.find_element(By.ID, "model").text)
    field = {name: browser.find_element(By.ID, name) for name in ("prompt", "max_tokens", "api_key", "seed")}
    for name, value in (("prompt", "ROMEO:"), ("max_tokens", "90000"), ("api_key", KEY), ("seed", "3")):
        field[name].clear()
        field[name].send_keys(value)
    browser.find_element(By.ID, "generate").click()

    def completion() -> str:
        return browser.find_element(By.ID, "completion").text

    wait.until(lambda b: len(completion()) > 20)  # text streams in as it is generated
    assert browser.find_element(By.ID, "status").text.startswith("generating")
    wait.until(lambda b: "tokens/s" in b.find_element(By.ID, "speed").text)
    seen = len(completion())
    wait.until(lambda b: len(completion()) > seen)  # and keeps coming
    assert get_json(f"{base}/health")["active"] == 1
    browser.find_element(By.ID, "stop").click()
    wait.until(lambda b: b.find_element(By.ID, "status").text == "stopped")
    stopped_at = completion()
    wait_for(lambda: get_json(f"{base}/health")["active"] == 0, what="the stopped request to leave the engine")
    time.sleep(0.3)
    assert completion() == stopped_at  # nothing more arrives
    assert browser.find_element(By.ID, "generate").is_enabled()


def test_two_threads_of_requests_share_the_server(client):
    """Concurrent clients each get their own complete answer (no mixed-up streams)."""
    results: dict[str, str] = {}

    def ask(prompt: str) -> None:
        results[prompt] = "".join(c.choices[0].text for c in greedy(client, prompt, 30, stream=True))

    threads = [threading.Thread(target=ask, args=(p,)) for p in ("ROMEO:", "All:", "First")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {p: greedy(client, p, 30).choices[0].text for p in ("ROMEO:", "All:", "First")}
