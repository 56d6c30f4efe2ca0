"""Generation: the engine (KV cache, requests, continuous batching), next-token choice, text streaming, and the decoding backends."""
