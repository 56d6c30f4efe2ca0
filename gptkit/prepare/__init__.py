"""Data preparation: read inputs, tokenise them in worker processes, write token files and meta.json."""
