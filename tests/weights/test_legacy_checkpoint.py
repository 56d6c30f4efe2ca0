"""A checkpoint written before the package layout (commit 56d161f) still loads, samples, evaluates and resumes.

tests/fixtures/legacy_checkpoint.pt is a 20-step, 2-layer RoPE + QK-norm char model trained by that commit's
train.py on helpers.make_char_data(); legacy_checkpoint.json holds what that commit's code computed from it
(logits, greedy tokens, whole-split val loss), so the expected values come from the old code, not this one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import sample
import train
from gptkit.data.tokenizer import tokenizer_from_meta
from gptkit.infer.engine import generate
from gptkit.weights.checkpoint import load_checkpoint
from gptkit.weights.sources import model_of_checkpoint
from helpers import FIXTURES, make_char_data, run_in_process

CHECKPOINT = FIXTURES / "legacy_checkpoint.pt"
EXPECTED = json.loads((FIXTURES / "legacy_checkpoint.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(out_dir holding the legacy checkpoint as ckpt.pt, the data directory it was trained on)."""
    root = tmp_path_factory.mktemp("legacy")
    make_char_data(root / "data")  # the fixture's data: tiny Shakespeare's first 60,000 characters
    (root / "out").mkdir()
    shutil.copyfile(CHECKPOINT, root / "out" / "ckpt.pt")
    return root / "out", root / "data"


def test_weights_give_the_logits_and_greedy_tokens_the_old_code_gave() -> None:
    checkpoint = load_checkpoint(CHECKPOINT)
    model = model_of_checkpoint(checkpoint, str(CHECKPOINT)).eval()
    assert tokenizer_from_meta(checkpoint["tokenizer"]).encode(EXPECTED["prompt"]) == EXPECTED["prompt_ids"]
    idx = torch.tensor([EXPECTED["prompt_ids"]])
    with torch.no_grad():
        logits, _ = model(idx)
    torch.testing.assert_close(logits[0, -1, :8], torch.tensor(EXPECTED["last_logits_first8"]), atol=1e-5, rtol=0)
    greedy = generate(model, idx, 40, temperature=0)[0, idx.shape[1] :].tolist()
    assert greedy == EXPECTED["greedy_40"]


def test_sample_py_prints_the_old_greedy_text(legacy_run: tuple[Path, Path], capsys) -> None:
    out_dir, _ = legacy_run
    tokenizer = tokenizer_from_meta(load_checkpoint(CHECKPOINT)["tokenizer"])
    args = [f"--out_dir={out_dir}", "--checkpoint=latest", "--start=" + EXPECTED["prompt"], "--temperature=0"]
    result = run_in_process(sample.main, [*args, "--max_new_tokens=40", "--device=cpu", "--stream=False"], capsys)
    assert result.returncode == 0, result.stderr
    assert EXPECTED["prompt"] + tokenizer.decode(EXPECTED["greedy_40"]) in result.stdout


def test_train_py_evaluates_and_resumes_it(legacy_run: tuple[Path, Path], capsys) -> None:
    """train.main and sample.main in this process: the old file is what these tests check, not the process."""
    out_dir, data_dir = legacy_run
    common = [f"--data_dir={data_dir}", f"--out_dir={out_dir}", "--init_from=resume", "--device=cpu", "--curves=False"]
    common += ["--block_size=32", "--batch_size=4", "--gradient_accumulation_steps=1", "--eval_iters=2"]
    evaluated = run_in_process(train.main, [*common, "--eval_only=True", "--eval_full_split=True"], capsys)
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"val loss {EXPECTED['whole_val_loss']:.4f}" in evaluated.stdout.split("whole val split")[1]
    resumed = run_in_process(
        train.main, [*common, "--max_iters=24", "--eval_interval=4", "--lr_decay_iters=24"], capsys
    )
    assert resumed.returncode == 0, resumed.stderr
    assert load_checkpoint(out_dir / "ckpt.pt")["iter_num"] == EXPECTED["iter_num"] + 4
