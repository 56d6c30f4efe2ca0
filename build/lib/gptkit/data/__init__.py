"""Text to tokens and tokens to batches: tokenizers (characters, tiktoken, trained BPEs), corpus preparation, token files."""
