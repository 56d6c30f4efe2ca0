"""Generate text from a trained checkpoint or from GPT-2: settings → checkpoint → tokenizer → model → text.

python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --max_new_tokens=300
python sample.py --init_from=gpt2 --start="FILE:prompt.txt" --top_p=0.9 --stop="\\n\\n"
python sample.py --out_dir=out --interactive          # one prompt per line from stdin, until EOF
python sample.py --init_from=gpt2 --decode=eager      # a backend of your choice (default auto: the fastest here)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit.core.devices import Runtime, autocast
from gptkit.core.errors import UserError, run_cli
from gptkit.core.settings import parse_settings, setting, setting_list
from gptkit.data.tokenizer import Tokenizer
from gptkit.infer.decoding import Decoding
from gptkit.infer.engine import Engine, Request
from gptkit.infer.next_token import sampling_problem
from gptkit.infer.textstream import TextStream
from gptkit.model import GPT
from gptkit.weights.loading import ModelSource, load_for_inference

SEPARATOR = "\n" + "-" * 40 + "\n"


@dataclass
class SampleSettings(ModelSource, Decoding, Runtime):
    start: str = setting("\n", "the prompt; FILE:path reads it from a file")
    num_samples: int = setting(1, "how many samples, generated together as one batch")
    max_new_tokens: int = setting(500, "tokens to generate per sample")
    temperature: float = setting(0.8, "sampling temperature; 0 = greedy (always the most likely token)")
    top_k: int | None = setting(200, "sample only among the k most likely tokens (None = all)")
    top_p: float | None = setting(None, "sample only among the most likely tokens whose probability reaches p")
    stop: list[str] = setting_list([], "end a sample when this text appears (repeatable); not printed")
    stop_at_eot: bool = setting(True, "end a sample at the end-of-text token, when the tokenizer has one")
    interactive: bool = setting(False, "read prompts from stdin, one per line, until end of input")
    stream: bool = setting(True, "print tokens as they are generated (when num_samples is 1)")

    def validate(self) -> None:
        super().validate()
        if self.max_new_tokens <= 0:
            raise UserError(f"--max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.num_samples <= 0:
            raise UserError(f"--num_samples must be positive, got {self.num_samples}")
        problem = sampling_problem(self.temperature, self.top_k, self.top_p)
        if problem:
            raise UserError(f"--{problem}")
        if any(stop == "" for stop in self.stop):
            raise UserError("--stop needs a non-empty string")


def read_prompt(start: str) -> str:
    """The prompt text: `start` itself, or the contents of the file after a FILE: prefix."""
    if start.startswith("FILE:"):
        path = Path(start[len("FILE:") :])
        try:
            return path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"prompt file {path} does not exist") from None
        except UnicodeDecodeError as exc:
            raise UserError(f"prompt file {path} is not UTF-8 text (byte {exc.start})") from None
    return start


def generate_samples(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    cfg: SampleSettings,
    device: torch.device,
    dtype: torch.dtype,
    write: Callable[[str], None] | None,
) -> list[str]:
    """Generate cfg.num_samples continuations of `prompt`; stream sample 0 through `write` when given.

    Returns each sample's text (prompt included, stop strings and end-of-text excluded).
    """
    if prompt == "":
        raise UserError('the prompt is empty; give some text with --start (e.g. --start="\\n")')
    ids = tokenizer.encode(prompt)
    block = model.config.block_size
    if len(ids) > block:
        print(
            f"warning: the prompt has {len(ids)} tokens; keeping the last {block} (the context length)", file=sys.stderr
        )
        ids = ids[-block:]
    generator = torch.Generator(device=device).manual_seed(cfg.seed)  # one for the batch: the samples differ
    stop_tokens = [] if not cfg.stop_at_eot or tokenizer.eot_token is None else [tokenizer.eot_token]
    requests = [
        Request(ids, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, stop_tokens, generator=generator)
        for _ in range(cfg.num_samples)
    ]
    streams = [TextStream(tokenizer, cfg.stop, stop_tokens[0] if stop_tokens else None) for _ in requests]
    stream_of = dict(zip(requests, streams))
    if write:
        write(prompt)
    with autocast(device, dtype):
        engine = Engine(model, slots=cfg.num_samples, decode=cfg.decode)  # inside autocast: it computes in dtype
        for made in engine.run(requests):
            for request, token in made:
                piece = stream_of[request].push(token)
                if write and request is requests[0]:
                    write(piece)
                if stream_of[request].done and request.finish_reason is None:
                    engine.remove(request)  # a stop string ended its text: free the row
    tails = [stream.finish() for stream in streams]
    if write:
        write(tails[0])
    return [prompt + stream.text for stream in streams]


def main(argv: list[str]) -> int:
    cfg = parse_settings(SampleSettings, argv, prog="sample.py", description="Generate text from a trained model.")
    torch.manual_seed(cfg.seed)
    device, dtype = cfg.resolve()
    model, tokenizer = load_for_inference(cfg, device, dtype)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if not cfg.interactive:
        answer(model, tokenizer, read_prompt(cfg.start), cfg, device, dtype, write)
        write("\n")
        return 0
    for line in sys.stdin:
        prompt = line.rstrip("\n")
        if not prompt:
            continue  # an empty line asks for nothing
        try:
            answer(model, tokenizer, prompt, cfg, device, dtype, write)
        except UserError as exc:  # a bad prompt (e.g. a character the model never saw) must not end the interactive run
            print(f"error: {exc}; type another prompt", file=sys.stderr, flush=True)
            continue
        write(SEPARATOR)
    return 0


def answer(
    model: GPT,
    tokenizer: Tokenizer,
    prompt: str,
    cfg: SampleSettings,
    device: torch.device,
    dtype: torch.dtype,
    write: Callable[[str], None],
) -> None:
    """Generate for one prompt: sample 0 streamed as it comes when there is one sample, else all at the end."""
    streaming = cfg.stream and cfg.num_samples == 1
    samples = generate_samples(model, tokenizer, prompt, cfg, device, dtype, write if streaming else None)
    if not streaming:
        write(SEPARATOR.join(samples))


if __name__ == "__main__":
    run_cli(main)
