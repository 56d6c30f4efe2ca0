"""Generation: the engine (KV cache, requests, continuous batching), next-token choice, text streaming, and the decoding
backends. The one call: `from gptkit.infer import generate; generate(model, idx, max_new_tokens, temperature=0.8,
top_k=200)`, decode="auto" by default, as sample.py decodes."""

__all__ = ["generate", "generate_stream"]


def __getattr__(name: str):
    # imported on first use, so that `python -m gptkit.infer.native --build` runs that module once, not twice
    if name in __all__:
        from gptkit.infer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'gptkit.infer' has no attribute {name!r}")
