"""The OpenAI-compatible HTTP server: the app, the continuous batcher, the wire formats and the playground page."""
