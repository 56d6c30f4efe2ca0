"""A model and its tokenizer, from a training run's checkpoint or from GPT-2 weights: what sample.py and serve.py
load before they generate.

The package never imports model.py (it sits above the package), so the scripts pass its GPT class in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gptkit.checkpoint import load_checkpoint, resolve_checkpoint
from gptkit.errors import UserError
from gptkit.hf_gpt2 import GPT2_HUB_NAMES
from gptkit.tokenizer import Tokenizer, make_tokenizer, read_meta, tokenizer_from_meta


def load_model_and_tokenizer(
    gpt: Any, init_from: str, out_dir: str, checkpoint: str = "best", data_dir: str = ""
) -> tuple[Any, Tokenizer]:
    """The model (on CPU, eval mode) and its tokenizer.

    gpt: model.py's GPT class. init_from: "resume" (the checkpoint of out_dir, `checkpoint` = best or latest; out_dir
    may also be a checkpoint file), a Hugging Face GPT-2 directory, or a GPT-2 hub name. data_dir: take the tokenizer
    from that data directory's meta.json instead (for checkpoints without one). UserError for every problem.
    """
    if init_from == "resume":
        path = resolve_checkpoint(out_dir, checkpoint)
        state = load_checkpoint(path)
        model = gpt.from_checkpoint(state, str(path))
        tokenizer_meta = state.get("tokenizer")
        if data_dir:
            tokenizer_meta = read_meta(data_dir)["tokenizer"]
        if not tokenizer_meta:
            raise UserError(
                f"checkpoint {path} records no tokenizer; pass --data_dir=DIR with the meta.json it was trained on"
            )
        try:
            tokenizer = tokenizer_from_meta(tokenizer_meta)
        except UserError as exc:  # say where the tokenizer description came from
            raise UserError(f"{data_dir or f'checkpoint {path}'}: {exc}") from exc
    elif Path(init_from).is_dir() or init_from in GPT2_HUB_NAMES:
        model = gpt.from_pretrained(init_from)
        tokenizer = tokenizer_from_meta(read_meta(data_dir)["tokenizer"]) if data_dir else make_tokenizer("gpt2")
    else:
        raise UserError(f"--init_from={init_from!r}: use resume, a GPT-2 directory, or {', '.join(GPT2_HUB_NAMES)}")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {model.config.vocab_size}; "
            "pass the --data_dir the model was trained on"
        )
    return model.eval(), tokenizer
