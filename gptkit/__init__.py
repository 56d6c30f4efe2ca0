"""gptkit: what the toolkit's scripts (train.py, sample.py, prepare_data/, benchmarks/) are built from.

The modules are layered (see the README's "How it is built"): each imports only from layers below it, and
nothing here imports the root scripts or model.py, which sit above the package.
"""

__version__ = "0.1.0"
