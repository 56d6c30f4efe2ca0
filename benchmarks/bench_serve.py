"""Serving benchmark: serve.py with a GPT-2 124M-shaped model (random weights), many clients at once vs one at a time.

    python benchmarks/bench_serve.py [--clients=16 --new_tokens=128 --device=cpu --json_out=bench_results/serve.json]
    python benchmarks/bench_serve.py --chat   # chat clients on /v1/chat/completions (a chat template's model)

It writes the model as a checkpoint (GPT-2 BPE tokenizer), starts `serve.py` on a free 127.0.0.1 port, and measures,
with streaming HTTP clients in this process (one thread each):
- one at a time: `clients` requests of `new_tokens` tokens, each sent when the previous one has finished;
- concurrent: the same `clients` requests sent at once (continuous batching decodes them together);
  the two phases alternate for `rounds` rounds (load from other programs then hits both alike);
- time to first token: of a request sent to the idle server, and of requests sent while `clients - 1` others decode.
Total tokens/s counts the completion tokens the server reports (usage) over the wall time of the phase.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting
from gptkit.data.tokenizer import ChatTokenizer, make_tokenizer
from gptkit.model import GPT, GPTConfig, config_to_dict
from gptkit.weights.checkpoint import save_checkpoint
from measure import print_table, run_benchmark

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The history of the city begins with a small settlement on the river, where traders met"


@dataclass(kw_only=True)
class ServeBench:
    clients: int = setting(16, "concurrent clients (and the server's slots)", rule="positive")
    new_tokens: int = setting(128, "tokens each client asks for", rule="positive")
    rounds: int = setting(2, "rounds of both phases (one at a time, then concurrent), alternating", rule="positive")
    probes: int = setting(3, "requests timed to their first token while clients - 1 others decode", rule="positive")
    probe_tokens: int = setting(8, "tokens each timed probe asks for", rule="positive")
    temperature: float = setting(0.8, "sampling temperature of every request (each has its own seed)")
    top_k: int = setting(200, "top-k of every request", rule="positive")
    n_layer: int = setting(12, "model shape: layers (GPT-2 124M: 12)", rule="positive")
    n_head: int = setting(12, "model shape: heads (12)", rule="positive")
    n_embd: int = setting(768, "model shape: width (768)", rule="positive")
    block_size: int = setting(1024, "model shape: context (1024)", rule="positive")
    device: str = setting("cpu", "the server's --device")
    threads: int = setting(0, "the server's --cpu_threads (0 = torch's default: one per core)", rule="non_negative")
    work_dir: str = setting("bench_results/serve_model", "where the model's checkpoint and the server log go")
    json_out: str = setting("bench_results/serve.json", "where to write the JSON results ('' = nowhere)")
    chat: bool = setting(False, "chat clients (/v1/chat/completions) and a model with the chat template's tokens")


def write_model(cfg: ServeBench) -> Path:
    """A random model of the benchmark's shape, saved as a checkpoint that records GPT-2's BPE tokenizer (with the
    chat template for --chat)."""
    tokenizer = make_tokenizer("gpt2")
    if cfg.chat:
        tokenizer = ChatTokenizer.extending(tokenizer)
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=tokenizer.vocab_size,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_embd=cfg.n_embd,
        block_size=cfg.block_size,
    )
    model = GPT(config)
    out_dir = Path(cfg.work_dir)
    record = {**tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token}
    save_checkpoint(
        out_dir / "ckpt.pt", {"model": model.state_dict(), "model_args": config_to_dict(config), "tokenizer": record}
    )
    return out_dir


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def running_server(cfg: ServeBench, out_dir: Path) -> Iterator[int]:
    """serve.py on a free loopback port, for the block; yields the port. Its output goes to work_dir/server.log."""
    port = free_port()
    command = [
        sys.executable,
        str(REPO / "serve.py"),
        f"--out_dir={out_dir}",
        f"--port={port}",
        f"--device={cfg.device}",
        *([f"--cpu_threads={cfg.threads}"] if cfg.threads else []),
        f"--slots={cfg.clients}",
        "--model_name=bench",
        "--access_log=False",
        f"--max_tokens={max(cfg.new_tokens, cfg.probe_tokens)}",
    ]
    with open(out_dir / "server.log", "w") as log:
        server = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not health(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise UserError(f"serve.py did not start; see {out_dir / 'server.log'}")
            time.sleep(0.2)
        yield port
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def health(port: int) -> dict | None:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        connection.request("GET", "/health")
        return json.loads(connection.getresponse().read())
    except OSError:
        return None


def stream(port: int, max_tokens: int, seed: int, cfg: ServeBench, first: threading.Event | None = None) -> dict:
    """One streamed completion; returns its completion tokens, time to the first text and total seconds."""
    body = {
        "model": "bench",
        "temperature": cfg.temperature,
        "top_k": cfg.top_k,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.chat:
        body.update(messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=max_tokens)
    else:
        body.update(prompt=PROMPT, max_tokens=max_tokens)
    path = "/v1/chat/completions" if cfg.chat else "/v1/completions"
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise UserError(f"the server answered {response.status}: {response.read()[:200]!r}")
    ttft, tokens = None, 0
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if ttft is None and any(c.get("text") or c.get("delta", {}).get("content") for c in chunk["choices"]):
            ttft = time.perf_counter() - start
            if first is not None:
                first.set()
    connection.close()
    return {"tokens": tokens, "ttft_s": ttft, "seconds": time.perf_counter() - start}


def concurrently(
    port: int,
    cfg: ServeBench,
    seeds: list[int],
    firsts: list[threading.Event] | None = None,
) -> tuple[list[dict], list[threading.Thread]]:
    """Start one client thread per seed; returns the list their results land in, and the threads."""
    results: list[dict] = []

    def client(seed: int, first: threading.Event | None) -> None:
        results.append(stream(port, cfg.new_tokens, seed, cfg, first))

    threads = [
        threading.Thread(target=client, args=(seed, firsts[i] if firsts else None)) for i, seed in enumerate(seeds)
    ]
    for thread in threads:
        thread.start()
    return results, threads


def phase_row(mode: str, runs: list[tuple[list[dict], float]]) -> dict:
    """One phase over all rounds: (each round's results, its wall seconds). Tokens/s is all tokens over all seconds;
    each round's own figure is listed too."""
    results = [r for round_results, _ in runs for r in round_results]
    tokens, seconds = sum(r["tokens"] for r in results), sum(s for _, s in runs)
    return {
        "mode": mode,
        "requests": len(results),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "rounds_tokens_per_s": [round(sum(r["tokens"] for r in rs) / s, 1) for rs, s in runs],
        "median_ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in results), 1),
    }


def timed(function, *args) -> tuple[list[dict], float]:
    start = time.perf_counter()
    return function(*args), time.perf_counter() - start


def all_at_once(port: int, cfg: ServeBench) -> list[dict]:
    results, threads = concurrently(port, cfg, list(range(cfg.clients)))
    for thread in threads:
        thread.join()
    return results


def measure(port: int, cfg: ServeBench) -> list[dict]:
    stream(port, min(4, cfg.new_tokens), 0, cfg)  # warm-up: first-call costs (allocations, the CPU fast path)
    alone, together = [], []
    for _ in range(cfg.rounds):  # the phases alternate, so a burst of load from elsewhere hits both alike
        alone.append(timed(lambda: [stream(port, cfg.new_tokens, seed, cfg) for seed in range(cfg.clients)]))
        together.append(timed(all_at_once, port, cfg))
    rows = [phase_row("one at a time", alone), phase_row(f"{cfg.clients} concurrent", together)]
    rows[-1]["x_one_at_a_time"] = round(rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"], 2)
    idle = [stream(port, cfg.probe_tokens, 1000 + i, cfg)["ttft_s"] for i in range(cfg.probes)]
    rows.append(
        {
            "mode": "first token, idle server",
            "requests": cfg.probes,
            "median_ttft_ms": round(1000 * statistics.median(idle), 1),
        }
    )
    firsts = [threading.Event() for _ in range(cfg.clients - 1)]
    _, threads = concurrently(port, cfg, list(range(100, 100 + cfg.clients - 1)), firsts)
    for first in firsts:
        first.wait(600)  # every other client is decoding now
    busy = []  # (seconds to the first token, requests decoding when the probe was sent)
    for i in range(cfg.probes):
        active = health(port)["active"]
        busy.append((stream(port, cfg.probe_tokens, 2000 + i, cfg)["ttft_s"], active))
    for thread in threads:
        thread.join()
    rows.append(
        {
            "mode": f"first token, {cfg.clients - 1} others decoding",
            "requests": cfg.probes,
            "median_ttft_ms": round(1000 * statistics.median(t for t, _ in busy), 1),
            "all_ttft_ms": [round(1000 * t, 1) for t, _ in busy],
            "decoding_when_sent": [active for _, active in busy],
        }
    )
    return rows


def bench_serve(cfg: ServeBench) -> list[dict]:
    """Total tokens/s of concurrent clients against one at a time, and time to first token, through serve.py."""
    out_dir = write_model(cfg)
    try:
        with running_server(cfg, out_dir) as port:
            rows = measure(port, cfg)
    finally:
        (out_dir / "ckpt.pt").unlink(missing_ok=True)  # random weights, written again by every run: no need to keep
    print_table(rows, ["mode", "requests", "tokens", "seconds", "tokens_per_s", "x_one_at_a_time", "median_ttft_ms"])
    return rows


def main(argv: list[str]) -> int:
    cfg = parse_settings(ServeBench, argv, prog="bench_serve.py", description=bench_serve.__doc__ or "")
    return run_benchmark(cfg, bench_serve, "serve")


if __name__ == "__main__":
    run_cli(main)
