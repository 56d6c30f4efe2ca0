"""An exponential moving average (EMA) of the weights: evaluated, saved and sampled in place of the trained ones.

Near the end of a run the trained weights still jitter from step to step with the gradient noise; their average
over the last steps sits nearer the bottom of the valley, for the cost of one more copy of the weights. Averaging
starts after step `start` (the weights then seed it); each later step moves it `1 - decay` of the way to the new
weights. The optimizer keeps stepping the trained weights: the average is only swapped into the model to be
evaluated, and saved beside them.

In a checkpoint, "model" holds the weights to use (the average, once it has started: what sample.py, eval.py
and serve.py load) and "trained_model" the trained weights, which only --init_from=resume needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gptkit.core.distributed import is_fsdp
from gptkit.core.errors import UserError
from gptkit.weights.checkpoint import clean_state_dict

TRAINED_KEY = "trained_model"  # the checkpoint entry of the trained weights while an average is kept


class WeightAverage:
    """The EMA of `model`'s parameters with `decay` per step from step `start` on (decay 0: off, a no-op)."""

    def __init__(self, model: torch.nn.Module, decay: float, start: int) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.decay, self.start = decay, start
        by_tensor: dict[int, list[str]] = {}  # a tied matrix has one parameter but a state-dict key per name
        params = dict(model.named_parameters(remove_duplicate=False))
        for name, param in params.items():
            by_tensor.setdefault(id(param), []).append(name)
        self.names = list(by_tensor.values())
        self.params = [params[names[0]] for names in self.names]
        self.average: list[torch.Tensor] | None = None

    @property
    def active(self) -> bool:
        return self.average is not None

    @torch.no_grad()
    def update(self, steps_done: int) -> None:
        """Fold in the weights after the optimizer step that brought the run to `steps_done` steps."""
        if self.decay == 0 or steps_done < self.start:
            return
        if self.average is None:
            self.average = [param.detach().clone() for param in self.params]
        else:
            torch._foreach_lerp_(self.average, [param.detach() for param in self.params], 1 - self.decay)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """The averaged weights in the model for the duration (the trained ones back after); no change before
        averaging has started."""
        if self.average is None:
            yield
            return
        with torch.no_grad():
            trained = [param.detach().clone() for param in self.params]
            torch._foreach_copy_(self.params, self.average)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self.params, trained)

    def checkpoint_entries(self, trained_state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """The checkpoint's weights: {"model": trained_state} before averaging starts, after it the average as
        "model" (trained_state with each parameter's entries replaced) and trained_state as "trained_model"."""
        if self.average is None:
            return {"model": trained_state}
        averaged = dict(trained_state)
        for names, average in zip(self.names, self.average):
            for name in names:
                averaged[name] = average.detach()
        return {"model": averaged, TRAINED_KEY: trained_state}

    def load(self, averaged_state: dict[str, torch.Tensor]) -> None:
        """Continue the average saved as a checkpoint's "model" (see checkpoint_entries)."""
        missing = [names[0] for names in self.names if names[0] not in averaged_state]
        if missing:
            raise KeyError(f"the averaged weights lack {', '.join(missing[:3])}")
        for names, param in zip(self.names, self.params):
            if tuple(averaged_state[names[0]].shape) != tuple(param.shape):
                shape = tuple(averaged_state[names[0]].shape)
                raise ValueError(f"the averaged {names[0]} has shape {shape}, the model's {tuple(param.shape)}")
        self.average = [
            averaged_state[names[0]].to(param.device, param.dtype).clone()
            for names, param in zip(self.names, self.params)
        ]


def trained_weights(checkpoint: dict) -> dict:
    """`checkpoint` as the model to continue training from: its "trained_model" in place of "model", if kept."""
    trained = checkpoint.get(TRAINED_KEY)
    return checkpoint if trained is None else {**checkpoint, "model": trained}


def for_training(model: torch.nn.Module, decay: float, start: int, checkpoint: dict | None) -> WeightAverage:
    """A run's average (a no-op for decay 0), continuing the one `checkpoint` kept (--init_from=resume)."""
    if decay and is_fsdp(model):
        raise UserError("ema_decay needs whole weights in every process; use it with --parallel=ddp, not fsdp")
    average = WeightAverage(model, decay, start)
    if decay and checkpoint is not None and TRAINED_KEY in checkpoint:
        try:
            average.load(clean_state_dict(checkpoint["model"]))
        except (KeyError, ValueError, AttributeError) as exc:  # a damaged file: one line, as every other
            raise UserError(
                f"the checkpoint's averaged weights are damaged ({exc}); resume with --ema_decay=0 to drop the "
                "average, or from another checkpoint"
            ) from exc
    return average
