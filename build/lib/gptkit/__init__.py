"""gptkit: prepare a corpus, train a small GPT, and generate text from a prompt.

The subpackages are layers; each imports only from the ones before it:

    model.py   the transformer (torch and the standard library only)
    core/      errors, settings, devices, processes, files, downloads, progress, signals
    data/      tokenizers, corpus preparation, token files and batches
    weights/   checkpoints, GPT-2 weights in Hugging Face's layout, int8 weights, loading a model to run
    train/     the training loop's pieces: schedule, optimizers, EMA, run directory, run log, curves
    infer/     generation: the engine (KV cache, continuous batching) and its decoding backends
    serve/     the OpenAI-compatible HTTP server and its playground page
    eval/      HellaSwag and the lm-evaluation-harness adapter

The root scripts (train.py, sample.py, serve.py, eval.py, plot.py, prepare_data/) sit above them all.
"""

__version__ = "0.1.0"
