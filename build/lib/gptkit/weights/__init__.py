"""A model's weights on disk and in memory: checkpoints, GPT-2 in Hugging Face's layout, int8 weights, loading a model to run."""
