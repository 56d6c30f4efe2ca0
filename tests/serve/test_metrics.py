"""GET /metrics (gptkit.serve.metrics): a known set of requests, then the scrape read with prometheus_client's own
text parser; every count is checked against the answers the clients got and the batcher's /health counters."""

from __future__ import annotations

import ast
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gptkit.data.tokenizer import CharTokenizer
from helpers import HTTP, REPO, SERVE_TEXT, get_json, lively_model, running_app
from test_layout import module_name, package_files

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


def scrape(base: str) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, its labels): value}, parsed by prometheus_client's parser."""
    answer = HTTP.get(f"{base}/metrics")  # no key needed
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def requests_by_endpoint(samples: dict) -> dict[tuple[str, str], int]:
    return {
        (dict(labels)["endpoint"], dict(labels)["status"]): int(count)
        for (name, labels), count in samples.items()
        if name == "gptkit_requests_total"
    }


@pytest.fixture(scope="module")
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer.from_text(SERVE_TEXT)


def test_metrics_count_requests_tokens_timings_and_steps(char_tokenizer):
    model = lively_model(char_tokenizer.vocab_size)
    with running_app(model, char_tokenizer, api_key=KEY, slots=4, max_body_bytes=2000) as base:
        client = httpx.Client(timeout=30, headers=AUTH)
        url = f"{base}/v1/completions"
        usages, n = [], []  # each answer's usage, and its number of choices
        for prompt, max_tokens in (("All:", 5), ("ROMEO:", 7), ("Speak", 9)):
            body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
            usages.append(client.post(url, json=body).json()["usage"])
            n.append(1)
        usages.append(client.post(url, json={"model": "m", "prompt": "First", "max_tokens": 4, "n": 2}).json()["usage"])
        n.append(2)
        streamed = {"model": "m", "prompt": "hear", "max_tokens": 6, "stream": True}
        streamed["stream_options"] = {"include_usage": True}
        with client.stream("POST", url, json=streamed) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        usages.append(chunks[-1]["usage"])
        n.append(1)
        assert client.post(url, content=b'{"model": "m", "prompt": ').status_code == 400
        wrong_key = client.post(url, json={"model": "m", "prompt": "x"}, headers={"Authorization": "Bearer no"})
        assert wrong_key.status_code == 401
        assert client.post(url, json={"model": "m", "prompt": "x" * 3000}).status_code == 413
        messages = [{"role": "user", "content": "hi"}]
        chat = client.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": messages})
        assert chat.status_code == 400  # a char model without a chat template
        assert client.get(f"{base}/v1/models/m").status_code == 200
        assert client.get(f"{base}/no/such/path").status_code == 404
        health = get_json(f"{base}/health")
        samples = scrape(base)

    assert requests_by_endpoint(samples) == {
        ("/v1/completions", "200"): 5,
        ("/v1/completions", "400"): 1,
        ("/v1/completions", "401"): 1,
        ("/v1/completions", "413"): 1,
        ("/v1/chat/completions", "400"): 1,
        ("/v1/models/{model}", "200"): 1,
        ("other", "404"): 1,
        ("/health", "200"): 1,
    }
    choices = sum(n)
    tokens = sum(usage["completion_tokens"] for usage in usages)
    assert tokens == 5 + 7 + 9 + 2 * 4 + 6  # every choice ran to its max_tokens (a char model has no end-of-text)
    assert value(samples, "gptkit_generated_tokens_total") == tokens == health["tokens_generated"]
    # usage counts a prompt once; the engine prefills it once per choice
    prefilled = sum(usage["prompt_tokens"] * k for usage, k in zip(usages, n))
    assert value(samples, "gptkit_prompt_tokens_total") == prefilled == 4 + 6 + 5 + 2 * 5 + 4
    assert value(samples, "gptkit_time_to_first_token_seconds_count") == choices
    assert value(samples, "gptkit_time_per_output_token_seconds_count") == tokens - choices
    assert value(samples, "gptkit_time_to_first_token_seconds_sum") > 0
    assert value(samples, "gptkit_batch_occupancy_count") == health["steps"]
    assert value(samples, "gptkit_batch_occupancy_sum") == tokens  # every active row makes a token in a step
    assert value(samples, "gptkit_batch_occupancy_bucket", le="+Inf") == health["steps"]
    assert value(samples, "gptkit_requests_finished_total", finish_reason="length") == choices
    assert value(samples, "gptkit_queue_length") == 0 and value(samples, "gptkit_active_slots") == 0
    assert value(samples, "gptkit_slots") == 4


def test_metrics_count_an_abandoned_stream_as_cancelled(char_tokenizer):
    model = lively_model(char_tokenizer.vocab_size)
    with running_app(model, char_tokenizer, max_tokens=100000) as base:
        body = {"model": "m", "prompt": "All:", "max_tokens": 90000, "stream": True}
        with HTTP.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as response:
            next(response.iter_lines())
        deadline = time.monotonic() + 10
        cancelled = ("gptkit_requests_finished_total", frozenset({("finish_reason", "cancelled")}))
        while (samples := scrape(base)).get(cancelled) != 1:  # the decode thread drops it before its next step
            assert time.monotonic() < deadline, samples
            time.sleep(0.02)
        health = get_json(f"{base}/health")
    assert health["requests_cancelled"] == 1 and health["active"] == 0
    assert value(samples, "gptkit_generated_tokens_total") == health["tokens_generated"] > 0
    assert requests_by_endpoint(samples)[("/v1/completions", "200")] == 1


def serve_imports() -> dict[str, set[str]]:
    """Each module of gptkit.serve and the modules of gptkit.serve it imports, type-checking imports included."""
    paths = {module_name(p, REPO): p for p in package_files(REPO) if module_name(p, REPO).startswith("gptkit.serve.")}
    graph = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        found |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        graph[name] = found & set(paths)
    return graph


def test_the_servers_modules_import_one_another_without_a_loop() -> None:
    """The batcher reports to the metrics; the metrics know the batcher's jobs only by what they read of them."""
    graph = serve_imports()
    assert "gptkit.serve.metrics" in graph["gptkit.serve.batcher"]
    assert [name for name in graph if name in reachable(graph, name)] == []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph[name]
    return seen
