"""Our models in EleutherAI's lm-evaluation-harness (the `lm-eval` package): an `LM` over model.py's GPT.

    from gptkit.eval.harness import GPTKitLM, simple_evaluate
    lm = GPTKitLM(model, tokenizer, device="cpu", batch_size=16)
    results = simple_evaluate(lm, ["hellaswag"], include_path="my_tasks/")   # or lm_eval.simple_evaluate(model=lm, ...)

The harness asks three kinds of question; all three use the same model calls as the rest of the toolkit:
loglikelihood (a continuation's log-probability given a context, and whether greedy decoding would produce it:
gptkit.eval.hellaswag.score_rows, batched), loglikelihood_rolling (a whole text's log-probability in windows of the
context length) and generate_until (gptkit.infer.engine's batched generation, cut at the stop strings).

A tokenizer without an end-of-text token (a character-level one) has nothing to condition a text's first token
on: an empty context and the first window of a rolling loglikelihood then leave the first token unscored.

lm_eval is imported here only; the rest of the package works without it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import torch

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # raised as one line by the scripts
    raise ImportError("the lm-evaluation-harness is not installed: pip install lm-eval") from exc

from gptkit.core.devices import autocast
from gptkit.data.hf_tokenizer import HFTokenizer
from gptkit.data.tokenizer import Tokenizer, prompt_opening
from gptkit.eval.hellaswag import score_rows
from gptkit.infer.engine import Engine, Request
from gptkit.infer.textstream import TextStream

NO_PREFIX = -1  # eot_token_id of a tokenizer without an end-of-text token: "leave the first token unscored"


class GPTKitLM(TemplateLM):
    """lm-eval's LM interface over a GPT (model.py) and its tokenizer, on `device` in `dtype` (None: float32)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        batch_size: int = 16,
        max_gen_toks: int = 256,
        decode: str = "auto",
    ) -> None:
        super().__init__()
        self._device = torch.device(device)
        self.model = model.to(self._device).eval()
        self.gpt_tokenizer = tokenizer
        self.dtype = dtype or torch.float32
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        self.decode = decode  # generate_until's backend (gptkit.infer.decoding)
        self.block_size = model.config.block_size

    @property
    def eot_token_id(self) -> int:
        eot = self.gpt_tokenizer.eot_token
        return NO_PREFIX if eot is None else eot

    @property
    def prefix_token_id(self) -> int:
        """What an empty context and a text's first window condition on: the tokenizer's bos where it names one,
        else the end of text (as the harness's Hugging Face model does)."""
        tokenizer = self.gpt_tokenizer
        bos = tokenizer.named_token_id("bos_token") if isinstance(tokenizer, HFTokenizer) else None
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self.block_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """The text's tokens, opened as the tokenizer opens a text (a Llama's bos) unless add_special_tokens is
        False: the harness's Hugging Face model encodes so, and the model was trained so."""
        opening = [] if add_special_tokens is False else prompt_opening(self.gpt_tokenizer)
        return opening + self.gpt_tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int], **kwargs: Any) -> str:
        return self.gpt_tokenizer.decode(tokens)

    def _precision(self) -> contextlib.AbstractContextManager:
        return autocast(self._device, self.dtype)

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each (context tokens, continuation tokens) pair, longest first in batches.

        A pair longer than the context window keeps its last block_size + 1 tokens (the context's start goes
        first); a context of [NO_PREFIX] is replaced by the continuation's first token, which is then not scored."""
        rows = []
        for context, continuation in pairs:
            if context == [NO_PREFIX]:
                context, continuation = continuation[:1], continuation[1:]
            tokens = (context + continuation)[-(self.block_size + 1) :]
            rows.append((tokens, max(1, len(tokens) - len(continuation))))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chosen = order[start : start + self.batch_size]
            scorable = [i for i in chosen if len(rows[i][0]) > rows[i][1]]  # an empty continuation scores 0
            if not scorable:
                continue
            with self._precision():
                sums, _, greedy = score_rows(self.model, [rows[i] for i in scorable], self._device)
            for i, loss, is_greedy in zip(scorable, sums.tolist(), greedy.tolist()):
                results[i] = (-loss, bool(is_greedy))
        return results

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        return self.score([(context, continuation) for _, context, continuation in requests])

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each whole text, scored in disjoint windows of the context length."""
        results = []
        for (text,) in (request.args for request in requests):
            tokens = self.tok_encode(text)
            prefix = self.prefix_token_id
            if prefix == NO_PREFIX:  # nothing to condition the first token on: it stays unscored
                prefix, tokens = (tokens[0], tokens[1:]) if tokens else (0, [])
            windows = [
                make_disjoint_window(window)
                for window in get_rolling_token_windows(tokens, prefix, self.block_size, context_len=1)
            ]
            results.append(sum(logprob for logprob, _ in self.score(windows)))
        return results

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation, generated until a stop string (`until`), end of text or max_gen_toks."""
        eot = self.gpt_tokenizer.eot_token
        engine_requests, streams = [], []
        for context, options in (request.args for request in requests):
            options = dict(options or {})
            until = options.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sampling = options.get("do_sample", False) and float(options.get("temperature", 1.0)) > 0
            prompt = self.tok_encode(context) or ([eot] if eot is not None else self.tok_encode(" "))
            engine_requests.append(
                Request(
                    prompt=prompt,
                    max_new_tokens=int(options.get("max_gen_toks", self.max_gen_toks)),
                    temperature=float(options.get("temperature", 1.0)) if sampling else 0.0,
                    stop_tokens=[eot] if eot is not None else [],
                    seed=0,
                )
            )
            streams.append(TextStream(self.gpt_tokenizer, until, () if eot is None else (eot,)))
        stream_of = dict(zip(map(id, engine_requests), streams))
        with self._precision():
            engine = Engine(self.model, slots=self.batch_size, decode=self.decode)
            for made in engine.run(engine_requests):
                for request, token in made:
                    stream = stream_of[id(request)]
                    stream.push(token)
                    if stream.done and request.finish_reason is None:
                        engine.remove(request)  # a stop string ended its text
        for stream in streams:
            stream.finish()
        return [stream.text for stream in streams]


def simple_evaluate(
    lm: GPTKitLM | str,
    tasks: Sequence[str],
    include_path: str | None = None,
    limit: int | None = None,
    **options: Any,
) -> dict[str, Any]:
    """lm_eval.simple_evaluate over `lm` (or a model the harness names, e.g. "local-completions" with its
    `model_args`), with local task definitions from `include_path` (a directory of task YAML files) added to the
    harness's own; returns the harness's results dictionary."""
    import lm_eval

    return lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), task_manager=task_manager(include_path, tuple(tasks)), limit=limit, **options
    )


def task_manager(include_path: str | None, tasks: tuple[str, ...] = ()) -> Any:
    """The harness's index of task files for `tasks`: where each is a task under `include_path` (not a group or a
    tag, which may name the harness's own), that folder's alone; else the harness's thousands with the folder's."""
    if include_path:
        local = task_index(include_path, include_defaults=False)
        if only_local_tasks(local, tasks):
            return local
    return task_index(include_path, include_defaults=True)


@functools.lru_cache(maxsize=8)
def task_index(include_path: str | None, include_defaults: bool) -> Any:
    """lm-eval's TaskManager over `include_path` and, with include_defaults, the harness's own task files: each built
    once per process, whatever tasks a run asks for, since indexing the harness's own takes seconds."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def only_local_tasks(local: Any, tasks: tuple[str, ...]) -> bool:
    """Whether every one of `tasks` is a task (not a group or a tag) of the index `local`."""
    return bool(tasks) and set(tasks) <= set(local.all_subtasks)
