"""Corpus preparation: text -> token files (raw uint16/uint32 arrays) + meta.json that train.py streams.

Scripts (run from the repository root): shakespeare_char.py, shakespeare.py, corpus.py, fineweb.py.
Shared code: download.py (HTTP fetch into a cache), pipeline.py (streaming, parallel tokenisation, atomic output).
"""
