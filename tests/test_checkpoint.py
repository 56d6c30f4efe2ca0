"""Tests for checkpoint.py: atomic saves, safe loads that refuse damaged or malicious files, RNG states, lookup."""

from __future__ import annotations

import os
import random
import signal
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit import checkpoint as ckpt
from gptkit.errors import UserError
from model import GPT, GPTConfig

TINY = GPTConfig(block_size=16, vocab_size=40, n_layer=1, n_head=2, n_embd=16)


def tiny_checkpoint(config: GPTConfig = TINY) -> dict:
    torch.manual_seed(0)
    model = GPT(config)
    return {"model": model.state_dict(), "model_args": asdict(config), "iter_num": 3, "best_val_loss": 2.5}


def test_save_then_load_round_trips_and_leaves_no_temp_files(tmp_path: Path) -> None:
    state = {**tiny_checkpoint(), "rng": ckpt.capture_rng_state(), "config": {"lr": 1e-3, "name": "x", "t": None}}
    path = tmp_path / "run" / "ckpt.pt"
    ckpt.save_checkpoint(path, state)
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt"]
    loaded = ckpt.load_checkpoint(path, required_keys=(*ckpt.RESUME_KEYS[:2], "iter_num"))
    assert loaded["iter_num"] == 3 and loaded["config"] == {"lr": 1e-3, "name": "x", "t": None}
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    ckpt.save_checkpoint(path, tiny_checkpoint())
    before = path.read_bytes()
    with pytest.raises(Exception):  # noqa: B017 - torch.save's own error for an unpicklable object
        ckpt.save_checkpoint(path, {"model": {}, "bad": lambda: 0})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.mark.parametrize("damage", ["missing", "empty", "truncated", "random", "malicious", "not_a_dict", "no_keys"])
def test_bad_files_are_one_line_user_errors_naming_the_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ckpt.pt"
    marker = tmp_path / "code_ran"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        ckpt.save_checkpoint(path, tiny_checkpoint())
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "random":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif damage == "malicious":
        torch.save({"model": _RunsCode(marker), "model_args": {}}, path)
    elif damage == "not_a_dict":
        torch.save([1, 2, 3], path)
    elif damage == "no_keys":
        torch.save({"model": {}}, path)
    with pytest.raises(UserError) as info:
        ckpt.load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    assert not marker.exists()
    expected = {
        "missing": "does not exist", "empty": "is empty", "truncated": "truncated, damaged", "random": "damaged",
        "malicious": "run code", "not_a_dict": "not a checkpoint dict", "no_keys": "lacks model_args",
    }  # fmt: skip
    assert expected[damage] in message


def test_rng_state_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    state = ckpt.capture_rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    ckpt.save_checkpoint(tmp_path / "rng.pt", {"model": {}, "model_args": {}, "rng": state})
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    ckpt.restore_rng_state(ckpt.load_checkpoint(tmp_path / "rng.pt")["rng"])
    assert random.random() == expected[0] and np.random.rand() == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def test_resolve_checkpoint_prefers_best_and_falls_back(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no checkpoint in"):
        ckpt.resolve_checkpoint(tmp_path)
    (tmp_path / "ckpt.pt").write_bytes(b"latest")
    assert ckpt.resolve_checkpoint(tmp_path, "best") == tmp_path / "ckpt.pt"  # nanoGPT out dirs have only ckpt.pt
    (tmp_path / "best.pt").write_bytes(b"best")
    assert ckpt.resolve_checkpoint(tmp_path) == tmp_path / "best.pt"
    assert ckpt.resolve_checkpoint(tmp_path, "latest") == tmp_path / "ckpt.pt"
    assert ckpt.resolve_checkpoint(tmp_path / "best.pt", "latest") == tmp_path / "best.pt"
    with pytest.raises(UserError, match="'best' or 'latest'"):
        ckpt.resolve_checkpoint(tmp_path, "newest")


def test_mark_best_keeps_its_contents_when_latest_is_rewritten(tmp_path: Path) -> None:
    latest, best = tmp_path / "ckpt.pt", tmp_path / "best.pt"
    ckpt.save_checkpoint(latest, {"model": {}, "model_args": {}, "iter_num": 1})
    ckpt.mark_best(latest, best)
    ckpt.save_checkpoint(latest, {"model": {}, "model_args": {}, "iter_num": 2})
    assert ckpt.load_checkpoint(best)["iter_num"] == 1
    assert ckpt.load_checkpoint(latest)["iter_num"] == 2
    ckpt.mark_best(latest, best)
    assert ckpt.load_checkpoint(best)["iter_num"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "ckpt.pt"]


def test_build_model_restores_weights_and_strips_wrapper_prefixes(tmp_path: Path) -> None:
    state = tiny_checkpoint()
    state["model"] = {"_orig_mod." + k: v for k, v in state["model"].items()}
    model = GPT.from_checkpoint(state, "x.pt", overrides={"dropout": 0.1})
    assert model.config.dropout == 0.1 and model.config.n_embd == 16
    reference = tiny_checkpoint()["model"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.items())


def test_nanogpt_checkpoints_load_with_exact_gelu_and_mask_buffers_ignored() -> None:
    state = tiny_checkpoint(GPTConfig(**{**asdict(TINY), "activation": "gelu"}))
    state["model_args"] = {k: state["model_args"][k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias",
                                                               "vocab_size", "dropout")}  # fmt: skip
    state["model"]["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16).tril()
    model = GPT.from_checkpoint(state, "nanogpt.pt")
    assert model.config.activation == "gelu"


def test_shape_mismatch_is_a_user_error() -> None:
    state = tiny_checkpoint()
    state["model_args"]["n_embd"] = 32
    with pytest.raises(UserError, match=r"x.pt: .* has shape"):
        GPT.from_checkpoint(state, "x.pt")
    state = tiny_checkpoint()
    state["model_args"]["n_layer"] = 2
    with pytest.raises(UserError, match="does not match its model_args"):
        GPT.from_checkpoint(state, "x.pt")


def test_tokenizer_record_is_meta_tokenizer_plus_sizes() -> None:
    from gptkit.tokenizer import tokenizer_from_meta

    meta = {"tokenizer": {"kind": "char", "chars": ["a", "b"], "eot": True}, "vocab_size": 3, "eot_token": 2}
    record = ckpt.tokenizer_record(meta)
    assert record == {"kind": "char", "chars": ["a", "b"], "eot": True, "vocab_size": 3, "eot_token": 2}
    assert tokenizer_from_meta(record).decode([1, 0]) == "ba"


def test_stop_request_turns_signals_into_a_flag_and_restores_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with ckpt.StopRequest() as stop:
        assert stop.signal_name is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal_name == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # asking again with Ctrl-C means "now"
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before
    with ckpt.StopRequest(force_on_repeat=False) as stop:  # under torchrun a Ctrl-C arrives twice
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"


def test_stale_temporaries_of_a_killed_save_are_removed(tmp_path: Path) -> None:
    keep = [tmp_path / "ckpt.pt", tmp_path / "notes.tmp", tmp_path / ".other.tmp"]
    stale = [tmp_path / ".ckpt.pt.abc123.tmp", tmp_path / ".best.pt.link"]
    for path in keep + stale:
        path.write_bytes(b"x")
    assert sorted(ckpt.remove_stale_temporaries(tmp_path)) == sorted(stale)
    assert sorted(tmp_path.iterdir()) == sorted(keep)
