"""Generation: the engine (KV cache, requests, continuous batching), next-token choice, text streaming, and the decoding
backends. The one call: `from gptkit.infer import generate; generate(model, idx, max_new_tokens, temperature=0.8,
top_k=200)`, decode="auto" by default, as sample.py decodes.

- engine: KVCache, Request, Engine, generate and generate_stream; it knows only the backend's interface.
- backend: that interface (Backend: prefill rows of the cache, decode one step) and the eager backend.
- decoding: the `decode` setting, and make_backend, the one place a backend is chosen (auto's rules: auto_choice).
- onednn, compiled, native: the other backends (oneDNN on transposed weights; torch.compile and CUDA graphs; the
  C++ step, a package with its build and its C++ in native/csrc).
- next_token: the sampling rule (greedy, temperature, top-k, top-p) and its settings (Sampling).
- memory, groups, textstream: memory on huge pages; groups of seeded completions (GRPO, pass@k); tokens to text.
"""

__all__ = ["generate", "generate_stream"]


def __getattr__(name: str):
    # imported on first use, so that `python -m gptkit.infer.native --build` loads the native package alone
    if name in __all__:
        from gptkit.infer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'gptkit.infer' has no attribute {name!r}")
