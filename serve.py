"""Serve a trained model over HTTP: an OpenAI-compatible API and a playground page in the browser.

python serve.py --out_dir=out-shakespeare-char-cpu               # http://127.0.0.1:8000/ (the playground)
python serve.py --init_from=gpt2 --port=8080 --api_key=SECRET     # /v1 requests need `Authorization: Bearer SECRET`
curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
     -d '{"model": "out-shakespeare-char-cpu", "prompt": "ROMEO:", "max_tokens": 50}'

settings → model and tokenizer → app (gptkit.serve.app: FastAPI routes, the decode thread of gptkit.serve.batcher) → uvicorn.
"""

from __future__ import annotations

from pathlib import Path

import torch
from fastapi import FastAPI

from gptkit.core.devices import in_passing_thread
from gptkit.core.errors import run_cli
from gptkit.core.settings import parse_settings
from gptkit.serve.app import ServeSettings, create_app, listen, serve
from gptkit.weights import load
from gptkit.weights.source_settings import for_inference, keeps_int4_in_file


def default_model_name(cfg: ServeSettings) -> str:
    """The id clients send when --model_name is not given: the out_dir's name, or init_from's."""
    if cfg.init_from != "resume":
        return Path(cfg.init_from).name or cfg.init_from
    location = Path(cfg.out_dir).resolve()
    return (location.parent.name if location.is_file() else location.name) or "model"


def build_app(cfg: ServeSettings, device: torch.device, dtype: torch.dtype) -> FastAPI:
    """The model loaded as sample.py loads it, and the app that serves it."""
    keep_int4 = keeps_int4_in_file(cfg, device, cfg.decode)
    loaded = load(cfg.source(), checkpoint=cfg.checkpoint, data_dir=cfg.data_dir, merge=False, keep_int4=keep_int4)
    return create_app(for_inference(loaded.model, cfg, device, dtype), loaded.tokenizer, cfg, device, dtype)


def main(argv: list[str]) -> int:
    cfg = parse_settings(
        ServeSettings,
        argv,
        prog="serve.py",
        description="Serve a model: an OpenAI-compatible HTTP API and a playground page.",
    )
    torch.manual_seed(cfg.seed)
    device, dtype = cfg.resolve()
    sock = listen(cfg.host, cfg.port)  # before the model loads: a taken port fails at once
    try:
        cfg.model_name = cfg.model_name or default_model_name(cfg)
        app = in_passing_thread(build_app, cfg, device, dtype)  # torch's work stays off the main thread
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        print(f"serving {cfg.model_name!r} at {url}/ (playground) and {url}/v1 (OpenAI API)", flush=True)
        serve(app, sock, cfg.access_log)
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    run_cli(main)
