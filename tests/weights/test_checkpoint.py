"""Tests for checkpoint.py: atomic saves, safe loads that refuse damaged or malicious files, RNG states, lookup."""

from __future__ import annotations

import os
import random
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from gptkit.core.errors import UserError
from gptkit.model import GPT, GPTConfig
from gptkit.weights import checkpoint as ckpt
from gptkit.weights.sources import model_of_checkpoint

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
        "missing": "does not exist",
        "empty": "is empty",
        "truncated": "truncated, damaged",
        "random": "damaged",
        "malicious": "run code",
        "not_a_dict": "not a checkpoint dict",
        "no_keys": "lacks model_args",
    }
    assert expected[damage] in message


@pytest.mark.parametrize("keep", [0.5, 0.1])
def test_a_damaged_file_is_one_complete_line_saying_what_to_do(tmp_path: Path, keep: float) -> None:
    """However torch words the failure (a tenth of a file: its zip reader's sentence, then advice to torch's own
    developers), the line says what is wrong and what to do, and ends there."""
    path = tmp_path / "ckpt.pt"
    ckpt.save_checkpoint(path, tiny_checkpoint())
    path.write_bytes(path.read_bytes()[: int(path.stat().st_size * keep)])
    with pytest.raises(UserError) as info:
        ckpt.load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"cannot load checkpoint {path}: the file is truncated, damaged or not a checkpoint (")
    assert message.endswith("); use another checkpoint (a run keeps best.pt and ckpt.pt) or train again")
    assert "If you are seeing" not in message and message.count("(") == message.count(")") == 2


@pytest.mark.parametrize(
    ("entry", "value", "found"), [("model", "nan", "NaN in 1"), ("trained_model", "inf", "infinity in 1")]
)
def test_weights_holding_nan_or_infinity_are_refused_naming_the_tensor(
    tmp_path: Path, entry: str, value: str, found: str
) -> None:
    """The weights to use and, under an average (EMA), the trained ones; reading only the tokenizer record of such a
    checkpoint (required_keys=()) still works."""
    checkpoint = {**tiny_checkpoint(), "trained_model": tiny_checkpoint()["model"], "tokenizer": {"kind": "char"}}
    checkpoint[entry]["transformer.h.0.attn.c_proj.weight"][1, 2] = float(value)
    path = tmp_path / "ckpt.pt"
    ckpt.save_checkpoint(path, checkpoint)
    with pytest.raises(UserError) as info:
        ckpt.load_checkpoint(path)
    assert str(info.value) == (
        f"checkpoint {path}: weight transformer.h.0.attn.c_proj.weight holds {found} of its 256 values; "
        f"{ckpt.NONFINITE_CHECKPOINT_REMEDY}"
    )
    assert ckpt.load_checkpoint(path, required_keys=())["tokenizer"] == {"kind": "char"}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_finds_a_single_nan_or_infinity_anywhere(dtype: torch.dtype) -> None:
    """One bad value among many, at either end or in the middle of a strided view; the largest finite values (whose
    sum would overflow) and an empty tensor pass."""
    values = torch.linspace(-1, 1, 3000, dtype=torch.float64).to(dtype).view(30, 100)
    assert ckpt.all_finite(values) and ckpt.all_finite(values[:, ::7]) and ckpt.all_finite(values[:0])
    largest = torch.full((4, 4), torch.finfo(dtype).max, dtype=dtype)
    largest[0, 0] = torch.finfo(dtype).min
    assert ckpt.all_finite(largest)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for row, column in ((0, 0), (17, 42), (29, 99)):
            damaged = values.clone()
            damaged[row, column] = bad
            assert not ckpt.all_finite(damaged)
            assert ckpt.all_finite(damaged[:, ::7]) == (column % 7 != 0)


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


def test_a_copied_checkpoint_keeps_its_contents_when_the_source_is_rewritten(tmp_path: Path) -> None:
    # train.py writes a new best as best.pt and copies it to ckpt.pt; the next save replaces ckpt.pt only.
    best, latest = tmp_path / "best.pt", tmp_path / "ckpt.pt"
    ckpt.save_checkpoint(best, {"model": {}, "model_args": {}, "iter_num": 1})
    ckpt.copy_checkpoint(best, latest)
    ckpt.save_checkpoint(latest, {"model": {}, "model_args": {}, "iter_num": 2})
    assert ckpt.load_checkpoint(best)["iter_num"] == 1
    assert ckpt.load_checkpoint(latest)["iter_num"] == 2
    ckpt.copy_checkpoint(latest, best)  # over an existing file
    assert ckpt.load_checkpoint(best)["iter_num"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "ckpt.pt"]


def test_copy_checkpoint_copies_where_hard_links_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise OSError(1, "Operation not permitted")

    best, latest = tmp_path / "best.pt", tmp_path / "ckpt.pt"
    ckpt.save_checkpoint(best, {"model": {}, "model_args": {}, "iter_num": 1})
    monkeypatch.setattr(os, "link", refuse)  # as on FAT or some network filesystems
    ckpt.copy_checkpoint(best, latest)
    assert latest.read_bytes() == best.read_bytes() and os.stat(latest).st_ino != os.stat(best).st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "ckpt.pt"]


def test_build_model_restores_weights_and_strips_wrapper_prefixes(tmp_path: Path) -> None:
    state = tiny_checkpoint()
    state["model"] = {"_orig_mod." + k: v for k, v in state["model"].items()}
    model = model_of_checkpoint(state, "x.pt", overrides={"dropout": 0.1})
    assert model.config.dropout == 0.1 and model.config.n_embd == 16
    reference = tiny_checkpoint()["model"]
    assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.items())


def test_nanogpt_checkpoints_load_with_exact_gelu_and_mask_buffers_ignored() -> None:
    state = tiny_checkpoint(GPTConfig(**{**asdict(TINY), "activation": "gelu"}))
    state["model_args"] = {
        k: state["model_args"][k]
        for k in ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")
    }
    state["model"]["transformer.h.0.attn.bias"] = torch.ones(1, 1, 16, 16).tril()
    model = model_of_checkpoint(state, "nanogpt.pt")
    assert model.config.activation == "gelu"


def test_shape_mismatch_is_a_user_error() -> None:
    state = tiny_checkpoint()
    state["model_args"]["n_embd"] = 32
    with pytest.raises(UserError, match=r"x.pt: .* has shape"):
        model_of_checkpoint(state, "x.pt")
    state = tiny_checkpoint()
    state["model_args"]["n_layer"] = 2
    with pytest.raises(UserError, match=r"x.pt: 2 layers in its model_args, but its weights hold layers 0 to 0 \(1\)"):
        model_of_checkpoint(state, "x.pt")


def test_tokenizer_record_is_meta_tokenizer_plus_sizes() -> None:
    from gptkit.data.tokenizer import tokenizer_from_meta

    meta = {"tokenizer": {"kind": "char", "chars": ["a", "b"], "eot": True}, "vocab_size": 3, "eot_token": 2}
    record = ckpt.tokenizer_record(meta)
    assert record == {"kind": "char", "chars": ["a", "b"], "eot": True, "vocab_size": 3, "eot_token": 2}
    assert tokenizer_from_meta(record).decode([1, 0]) == "ba"


def test_stale_temporaries_of_a_killed_save_are_removed(tmp_path: Path) -> None:
    keep = [tmp_path / "ckpt.pt", tmp_path / "notes.tmp", tmp_path / ".other.tmp"]
    stale = [tmp_path / ".ckpt.pt.abc123.tmp", tmp_path / ".best.pt.link"]
    for path in keep + stale:
        path.write_bytes(b"x")
    assert sorted(ckpt.remove_stale_temporaries(tmp_path)) == sorted(stale)
    assert sorted(tmp_path.iterdir()) == sorted(keep)


def test_training_state_is_restored_and_a_damaged_one_is_a_user_error(tmp_path: Path) -> None:
    from gptkit.data.loader import BatchSampler, TokenStream

    (np.arange(100) % 40).astype(np.uint16).tofile(tmp_path / "train.bin")
    stream = TokenStream(name="train", paths=(tmp_path / "train.bin",), lengths=(100,), dtype=np.dtype(np.uint16))

    def parts() -> tuple:
        model = GPT(TINY)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, torch.amp.GradScaler("cpu", enabled=False), BatchSampler(stream, 2, 16, seed=1)

    model, optimizer, scaler, sampler = parts()
    model(torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long))[1].backward()
    optimizer.step()
    sampler.position = 7
    saved = {
        "optimizer": optimizer.state_dict(),
        "iter_num": 3,
        "best_val_loss": 2.5,
        "scaler": {},
        "sampler": sampler.state_dict(),
        "rng": ckpt.capture_rng_state(),
    }
    expected_draw = torch.rand(2)

    model, optimizer, scaler, sampler = parts()
    assert ckpt.restore_training_state(saved, "x.pt", model, optimizer, scaler, sampler) == (3, 2.5)
    assert sampler.position == 7 and torch.equal(torch.rand(2), expected_draw)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved["optimizer"]["state"][0]["exp_avg"])
    for iter_num in ("ten", -5, 2.5, True):  # -5 would restart the warmup and write over the run
        with pytest.raises(UserError, match=r"checkpoint x\.pt has a damaged training state \(ValueError"):
            ckpt.restore_training_state({**saved, "iter_num": iter_num}, "x.pt", *parts())
    with pytest.raises(UserError, match=r"x\.pt: the optimizer state belongs to another model or optimizer"):
        ckpt.restore_training_state({**saved, "optimizer": {"state": {}, "param_groups": []}}, "x.pt", *parts())
    other = {**saved, "optimizer": {"state": {}, "param_groups": []}, "config": {"optimizer": "muon"}}
    with pytest.raises(UserError, match=r"optimizer; it was trained with --optimizer=muon: resume with that$"):
        ckpt.restore_training_state(other, "x.pt", *parts())
    with pytest.raises(UserError, match=r"belongs to another model or optimizer$"):  # the same optimizer: no hint
        ckpt.restore_training_state(other, "x.pt", *parts(), optimizer_name="muon")


def test_a_written_training_checkpoint_is_read_back_by_this_module(tmp_path: Path) -> None:
    """The writing side and the reading side of the format, together: what is saved loads, resumes and rebuilds."""
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    meta = {"vocab_size": TINY.vocab_size, "eot_token": None, "tokenizer": {"kind": "char", "chars": ["a", "b"]}}
    checkpoint = ckpt.training_checkpoint(
        weights={"model": model.state_dict()},
        optimizer_state=optimizer.state_dict(),
        model_args=asdict(TINY),
        iter_num=5,
        best_val_loss=1.5,
        config={"learning_rate": 1e-3},
        scaler_state={},
        sampler_state={"position": 10},
        meta=meta,
    )
    ckpt.save_training_checkpoint(tmp_path, checkpoint, best=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    loaded = ckpt.load_checkpoint(tmp_path / "ckpt.pt", required_keys=ckpt.RESUME_KEYS)
    assert loaded["tokenizer"] == {**meta["tokenizer"], "vocab_size": TINY.vocab_size, "eot_token": None}
    assert (loaded["iter_num"], loaded["best_val_loss"], loaded["sampler"]) == (5, 1.5, {"position": 10})
    rebuilt = model_of_checkpoint(loaded, "ckpt.pt")
    assert all(torch.equal(a, b) for a, b in zip(rebuilt.state_dict().values(), model.state_dict().values()))

    ckpt.save_training_checkpoint(tmp_path, {**checkpoint, "iter_num": 6}, best=True)  # a new best: both names
    assert [ckpt.load_checkpoint(tmp_path / name)["iter_num"] for name in ("best.pt", "ckpt.pt")] == [6, 6]
    ckpt.save_training_checkpoint(tmp_path, {**checkpoint, "iter_num": 7}, best=False)  # not a best: ckpt.pt only
    assert [ckpt.load_checkpoint(tmp_path / name)["iter_num"] for name in ("best.pt", "ckpt.pt")] == [6, 7]


def test_a_checkpoint_from_another_tokenizer_is_refused(tmp_path: Path) -> None:
    meta = {"tokenizer": {"kind": "char", "chars": ["a", "b"]}, "vocab_size": 2, "eot_token": None}
    ckpt.check_same_tokenizer({"tokenizer": ckpt.tokenizer_record(meta)}, meta, tmp_path / "ckpt.pt")
    ckpt.check_same_tokenizer({}, meta, tmp_path / "ckpt.pt")  # nanoGPT's checkpoints record none
    other = {**meta, "tokenizer": {"kind": "char", "chars": ["b", "a"]}}
    with pytest.raises(UserError, match=r"ckpt\.pt was trained with another tokenizer than this data's"):
        ckpt.check_same_tokenizer({"tokenizer": ckpt.tokenizer_record(other)}, meta, tmp_path / "ckpt.pt")


def test_a_base_from_another_tokenizer_names_the_preparation_that_fits_the_data(tmp_path: Path) -> None:
    """Chat data is prepared with prepare_data/chat.py, which reads a base's tokenizer itself; plain text with
    corpus.py and the base's --tokenizer: the hint names the script for the data at hand."""
    base = {"tokenizer": {"kind": "tiktoken", "encoding": "gpt2", "vocab_size": 50257, "eot_token": 50256}}
    text = {"tokenizer": {"kind": "tiktoken", "encoding": "cl100k_base"}, "vocab_size": 100277, "eot_token": 100257}
    with pytest.raises(UserError) as error:
        ckpt.check_base_tokenizer(base, text, tmp_path / "best.pt")
    assert "chat.py" not in str(error.value) and "prepare_data/corpus.py --tokenizer=gpt2" in str(error.value)
    chat = {**text, "tokenizer": {**text["tokenizer"], "chat": {}}}
    with pytest.raises(UserError, match=f"prepare_data/chat.py --tokenizer={tmp_path}$"):
        ckpt.check_base_tokenizer(base, chat, tmp_path / "best.pt")
