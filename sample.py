"""Generate text from a trained checkpoint or from GPT-2: settings → checkpoint → tokenizer → model → text.

python sample.py --out_dir=out-shakespeare-char --start="ROMEO:" --max_new_tokens=300
python sample.py --init_from=gpt2 --start="FILE:prompt.txt" --top_p=0.9 --stop=$'\\n\\n'   # bash's $'...': a blank line
python sample.py --out_dir=out --interactive          # one prompt per line from stdin, until EOF
python sample.py --init_from=gpt2 --decode=eager      # a backend of your choice (default auto: the fastest here)
python sample.py --out_dir=out-chat --chat --system="Answer briefly."   # talk with a chat fine-tuned model
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gptkit.core.devices import Runtime, autocast
from gptkit.core.errors import UserError, run_cli
from gptkit.core.fileio import read_utf8_text
from gptkit.core.settings import parse_settings, setting, setting_list
from gptkit.data.chat import ChatError
from gptkit.data.tokenizer import Tokenizer, completion_stops, no_chat_reason, prompt_opening, reply_stops
from gptkit.infer.decoding import Decoding, backend_name
from gptkit.infer.engine import Engine, GenerationError, Request
from gptkit.infer.next_token import sampling_problem
from gptkit.infer.textstream import TextStream
from gptkit.model import GPT
from gptkit.weights import load
from gptkit.weights.source_settings import ModelSource, for_inference, keeps_int4_in_file

SEPARATOR = "\n" + "-" * 40 + "\n"
RESET, EXIT = "/reset", "/exit"  # the chat's two commands


@dataclass(kw_only=True)
class SampleSettings(ModelSource, Decoding, Runtime):
    start: str = setting("\n", "the prompt; FILE:path reads it from a file")
    num_samples: int = setting(1, "how many samples, generated together as one batch", rule="positive")
    max_new_tokens: int = setting(500, "tokens to generate per sample", rule="positive")
    temperature: float = setting(0.8, "sampling temperature; 0 = greedy (always the most likely token)")
    top_k: int | None = setting(200, "sample only among the k most likely tokens (None = all)")
    top_p: float | None = setting(None, "sample only among the most likely tokens whose probability reaches p")
    stop: list[str] = setting_list([], "end a sample when this text appears (repeatable); not printed")
    stop_at_eot: bool = setting(
        True,
        "end a sample at the end-of-text token, when the tokenizer has one (a chat model's sample always ends at a "
        "chat marker, never printed, as the server's /v1/completions does)",
    )
    interactive: bool = setting(False, "read prompts from stdin, one per line, until end of input")
    stream: bool = setting(True, "print tokens as they are generated (when num_samples is 1)")
    chat: bool = setting(
        False,
        f"talk with a chat fine-tuned model: one message per line, {RESET} starts over, {EXIT} or end of input ends",
    )
    system: str = setting("", "--chat: the system message that opens every conversation (empty: none)")

    def validate(self) -> None:
        super().validate()
        problem = sampling_problem(self.temperature, self.top_k, self.top_p)
        if problem:
            raise UserError(f"--{problem}")
        if any(stop == "" for stop in self.stop):
            raise UserError("--stop needs a non-empty string")
        if self.chat and (self.num_samples != 1 or self.interactive):
            raise UserError("--chat answers one message at a time; drop --num_samples and --interactive")
        if self.system and not self.chat:
            raise UserError("--system opens a --chat conversation; add --chat, or put the text in --start")


def read_prompt(start: str) -> str:
    """The prompt text: `start` itself, or the contents of the file after a FILE: prefix."""
    if start.startswith("FILE:"):
        path = Path(start[len("FILE:") :])
        try:
            return read_utf8_text(path)
        except FileNotFoundError:
            raise UserError(f"prompt file {path} does not exist") from None
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
    ids = tokenizer.encode(prompt)
    if not ids:  # no text, or text the tokenizer makes no tokens of (whitespace a word-level one drops)
        what = "is empty" if prompt == "" else f"{prompt!r} gives no tokens"
        raise UserError(f'the prompt {what}; give some text with --start (e.g. --start="\\n")')
    ids = prompt_opening(tokenizer) + ids
    block = model.config.block_size
    if len(ids) > block:
        print(
            f"warning: the prompt has {len(ids)} tokens; keeping the last {block} (the context length)", file=sys.stderr
        )
        ids = ids[-block:]
    skipped = None if cfg.stop_at_eot else tokenizer.eot_token
    stop_tokens = [token for token in completion_stops(tokenizer) if token != skipped]
    if write:
        write(prompt)
    return [prompt + text for text in continue_ids(model, tokenizer, ids, stop_tokens, cfg, device, dtype, write)]


def continue_ids(
    model: GPT,
    tokenizer: Tokenizer,
    ids: list[int],
    stop_tokens: list[int],
    cfg: SampleSettings,
    device: torch.device,
    dtype: torch.dtype,
    write: Callable[[str], None] | None,
) -> list[str]:
    """cfg.num_samples continuations of the prompt `ids`, as text (stop strings and stop tokens excluded); sample 0
    is streamed through `write` when given."""
    generator = torch.Generator(device=device).manual_seed(cfg.seed)  # one for the batch: the samples differ
    requests = [
        Request(
            prompt=ids,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop_tokens=stop_tokens,
            generator=generator,
        )
        for _ in range(cfg.num_samples)
    ]
    streams = [TextStream(tokenizer, cfg.stop, stop_tokens) for _ in requests]
    stream_of = dict(zip(requests, streams))
    with autocast(device, dtype):
        # inside autocast: it computes in dtype; its cache holds the positions these samples reach, not the model's
        # whole context (a short sample of a long-context model needs a small part of it)
        reach = len(ids) + cfg.max_new_tokens
        engine = Engine(model, slots=cfg.num_samples, decode=cfg.decode, positions=reach)
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
    return [stream.text for stream in streams]


def main(argv: list[str]) -> int:
    cfg = parse_settings(SampleSettings, argv, prog="sample.py", description="Generate text from a trained model.")
    torch.manual_seed(cfg.seed)
    device, dtype = cfg.resolve()
    keep_int4 = keeps_int4_in_file(cfg, device, cfg.decode)
    loaded = load(cfg.source(), checkpoint=cfg.checkpoint, data_dir=cfg.data_dir, merge=False, keep_int4=keep_int4)
    model, tokenizer = for_inference(loaded.model, cfg, device, dtype), loaded.tokenizer
    backend_name(cfg.decode, model, cfg.num_samples, dtype)  # a backend that cannot run the model fails before any text

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if cfg.chat:
        return chat(model, tokenizer, cfg, device, dtype, write)
    if not cfg.interactive:
        answer(model, tokenizer, read_prompt(cfg.start), cfg, device, dtype, write)
        write("\n")
        return 0
    for line in sys.stdin:
        prompt = line.rstrip("\r\n")  # a terminal's or a CRLF file's line end
        if not prompt:
            continue  # an empty line asks for nothing
        try:
            answer(model, tokenizer, prompt, cfg, device, dtype, write)
        except UserError as exc:  # a bad prompt (e.g. a character the model never saw) must not end the interactive run
            if isinstance(exc, GenerationError):  # its answer had begun: end it
                write(SEPARATOR)
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


# ----------------------------------------------------------------------------- --chat


def chat(
    model: GPT, tokenizer: Tokenizer, cfg: SampleSettings, device: torch.device, dtype: torch.dtype, write: Callable
) -> int:
    """A conversation in the terminal: each line of stdin is a user message, each reply is streamed as it is made
    and ends at the end of its turn. A message the model cannot take is one line on stderr; the talk goes on."""
    if tokenizer.chat is None:
        none = "this model has no chat template: it was not fine-tuned on conversations (prepare_data/chat.py)"
        raise UserError(f"{no_chat_reason(tokenizer, none)}; use --start or --interactive")
    history = opening(cfg.system)
    print(f"chat: type a message and Enter; {RESET} starts over, {EXIT} or Ctrl-D ends", file=sys.stderr, flush=True)
    for line in sys.stdin:
        text = line.rstrip("\r\n")  # a terminal's or a CRLF file's line end
        if text.strip() == EXIT:
            break
        if text.strip() == RESET:
            history = opening(cfg.system)
            print("(a new conversation)", file=sys.stderr, flush=True)
            continue
        if not text.strip():
            continue
        asked = [*history, {"role": "user", "content": text}]
        try:
            reply = chat_reply(model, tokenizer, asked, cfg, device, dtype, write)
        except UserError as exc:  # e.g. a character the model never saw: this message is dropped, the talk goes on
            if isinstance(exc, GenerationError):  # the reply had begun: end its line
                write("\n")
            print(f"error: {exc}; type another message", file=sys.stderr, flush=True)
            continue
        history = asked  # less the oldest turns chat_reply left out: they are not told of again
        if reply:  # an empty reply (an immediate end of turn) is no message
            history.append({"role": "assistant", "content": reply})
        write("\n")
    return 0


def opening(system: str) -> list[dict[str, str]]:
    """The messages a conversation starts with: the system message, if any."""
    return [{"role": "system", "content": system}] if system else []


def chat_reply(
    model: GPT,
    tokenizer: Tokenizer,
    messages: list[dict[str, str]],
    cfg: SampleSettings,
    device: torch.device,
    dtype: torch.dtype,
    write: Callable[[str], None],
) -> str:
    """The assistant's next reply to `messages`, streamed through `write`. When the conversation has outgrown the
    context, its oldest turns (after the system message) are left out of the prompt and removed from `messages` (in
    place), and the user is told so."""
    template, block = tokenizer.chat, model.config.block_size
    try:
        ids = template.render_prompt(messages, tokenizer)
        while len(ids) >= block and len(messages) > 1 + (messages[0]["role"] == "system"):
            del messages[1 if messages[0]["role"] == "system" else 0]
            ids = template.render_prompt(messages, tokenizer)
            print("(the conversation is longer than the context: its oldest turn is left out)", file=sys.stderr)
    except ChatError as exc:
        raise UserError(str(exc)) from None
    if len(ids) >= block:
        raise UserError(f"the message needs {len(ids)} tokens with the template; the context holds {block - 1}")
    return continue_ids(model, tokenizer, ids, reply_stops(tokenizer), cfg, device, dtype, write)[0]


if __name__ == "__main__":
    run_cli(main)
