"""Data preparation: read inputs, tokenise them in worker processes, write token files and meta.json.

How a corpus flows through here, one module per job:

1. `discover`: `find_inputs` expands --input paths, directories and globs into a sorted list of files (leaving
   out binary files, __pycache__, version control and what --include/--exclude say); `inputs`: the readers cut
   each file into bounded work items (`items`: a piece of a text document, whole JSONL lines;
   prepare_data/fineweb.py makes lists of parquet rows).
2. `workers`: a pool of processes (or the main process for --num_workers=1) decodes each item, splits it into
   documents, assigns each document to train or val and tokenises. Results come back in item order, so the
   output is the same for any number of workers.
3. `writer`: appends the tokens to the split's token files, written as `*.tmp` and renamed into place only when
   everything succeeded, then writes meta.json last.
4. `driver`: `prepare` runs 1-3 for one set of `settings` and `summary_line` reports the result.

Documents: a plain text file is one document, a JSONL line is one, a parquet row is one. The end-of-text token
goes *before* each document, so every document in the stream starts after a separator.
"""
