"""Tests for gptkit/train/ema.py: the moving average's arithmetic, swapping it in and out, tied weights in the
checkpoint's entries, continuing a saved average, and its no-op when off. Runs of train.py with --ema_decay are
in test_train.py."""

from __future__ import annotations

import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.train import ema
from gptkit.train.ema import TRAINED_KEY, WeightAverage, trained_weights


class Tied(torch.nn.Module):
    """Two layers sharing one matrix (like the token embedding and the head) and a vector of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(2, 2, bias=False)
        self.second = torch.nn.Linear(2, 2, bias=False)
        self.second.weight = self.first.weight
        self.gain = torch.nn.Parameter(torch.zeros(2))


def set_weights(model: Tied, value: float) -> None:
    with torch.no_grad():
        model.first.weight.fill_(value)
        model.gain.fill_(-value)


def test_the_average_starts_at_start_and_then_moves_by_one_minus_decay() -> None:
    model = Tied()
    average = WeightAverage(model, decay=0.75, start=2)
    set_weights(model, 8.0)
    average.update(1)  # before start: nothing kept
    assert not average.active
    average.update(2)  # seeded with the weights of step 2
    set_weights(model, 4.0)
    average.update(3)  # 0.75 * 8 + 0.25 * 4 = 7
    set_weights(model, 7.0 + 4 * 3.0)
    average.update(4)  # 0.75 * 7 + 0.25 * 19 = 10
    assert average.active
    with average.applied():
        assert torch.equal(model.first.weight, torch.full((2, 2), 10.0))
        assert torch.equal(model.second.weight, torch.full((2, 2), 10.0))  # the tied use sees it too
        assert torch.equal(model.gain, torch.full((2,), -10.0))
    assert torch.equal(model.first.weight, torch.full((2, 2), 19.0))  # the trained weights are back
    assert torch.equal(model.gain, torch.full((2,), -19.0))


def test_the_trained_weights_come_back_when_the_block_fails() -> None:
    model = Tied()
    average = WeightAverage(model, decay=0.5, start=0)
    set_weights(model, 1.0)
    average.update(0)
    set_weights(model, 3.0)
    with pytest.raises(RuntimeError), average.applied():
        assert model.gain[0].item() == -1.0
        raise RuntimeError("evaluation failed")
    assert torch.equal(model.gain, torch.full((2,), -3.0))


def test_checkpoint_entries_hold_the_average_under_every_tied_name_and_the_trained_state_beside_it() -> None:
    model = Tied()
    average = WeightAverage(model, decay=0.5, start=0)
    set_weights(model, 2.0)
    assert average.checkpoint_entries(model.state_dict()).keys() == {"model"}  # nothing averaged yet
    average.update(0)
    set_weights(model, 6.0)
    average.update(1)  # (2 + 6) / 2 = 4
    trained = {key: value.clone() for key, value in model.state_dict().items()}
    entries = average.checkpoint_entries(trained)
    assert set(entries) == {"model", TRAINED_KEY} and entries[TRAINED_KEY] is trained
    assert set(entries["model"]) == {"first.weight", "second.weight", "gain"}
    assert torch.equal(entries["model"]["first.weight"], torch.full((2, 2), 4.0))
    assert torch.equal(entries["model"]["second.weight"], torch.full((2, 2), 4.0))
    assert torch.equal(entries["model"]["gain"], torch.full((2,), -4.0))
    assert torch.equal(trained["gain"], torch.full((2,), -6.0))

    resumed = Tied()  # a resumed run, its trained weights at 0: the saved average goes on
    set_weights(resumed, 0.0)
    continued = WeightAverage(resumed, decay=0.5, start=0)
    continued.load(entries["model"])
    continued.update(2)  # (4 + 0) / 2 = 2
    with continued.applied():
        assert torch.equal(resumed.gain, torch.full((2,), -2.0))


def test_a_saved_average_missing_a_parameter_is_refused() -> None:
    average = WeightAverage(Tied(), decay=0.5, start=0)
    with pytest.raises(KeyError, match="gain"):
        average.load({"first.weight": torch.zeros(2, 2)})


def test_decay_zero_is_off() -> None:
    model = Tied()
    average = WeightAverage(model, decay=0.0, start=0)
    set_weights(model, 5.0)
    for step in range(3):
        average.update(step)
    assert not average.active
    with average.applied():
        assert model.gain[0].item() == -5.0
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        WeightAverage(model, decay=1.0, start=0)


def test_a_checkpoint_continues_training_from_its_trained_weights() -> None:
    averaged, trained = {"w": torch.ones(1)}, {"w": torch.zeros(1)}
    checkpoint = {"model": averaged, TRAINED_KEY: trained, "iter_num": 3}
    assert trained_weights(checkpoint) == {"model": trained, TRAINED_KEY: trained, "iter_num": 3}
    assert trained_weights({"model": averaged})["model"] is averaged  # no average kept: "model" is trained


def test_an_average_under_fsdp_is_refused_with_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ema, "is_fsdp", lambda model: True)  # shards without a process group
    with pytest.raises(UserError, match="ema_decay needs whole weights in every process; use it with --parallel=ddp"):
        ema.for_training(Tied(), 0.9, 0, None)
    assert not ema.for_training(Tied(), 0.0, 0, None).active  # off: FSDP trains as before


def test_a_resumed_checkpoint_with_damaged_averaged_weights_is_one_clear_error() -> None:
    good = Tied().state_dict()
    for damaged in ({"first.weight": good["first.weight"]}, {**good, "gain": torch.zeros(3)}):
        checkpoint = {"model": damaged, TRAINED_KEY: good}
        with pytest.raises(UserError, match=r"averaged weights are damaged \(.*(gain).*\); resume with --ema_decay=0"):
            ema.for_training(Tied(), 0.9, 0, checkpoint)
    assert ema.for_training(Tied(), 0.9, 0, {"model": good, TRAINED_KEY: good}).active  # intact: continued
