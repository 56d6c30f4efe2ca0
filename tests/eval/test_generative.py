"""eval.py's generative tasks: pass@k against brute-force enumeration, and a prompt file scored end to end
(answers set to the model's own greedy replies, made by plain uncached decoding, for some prompts only)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import eval as eval_script
from gptkit.eval.generative import pass_at_k
from gptkit.weights.sources import model_of_checkpoint
from helpers import assert_one_line_error, lively_char_checkpoint, reference_greedy, run_main


@pytest.mark.parametrize("n,c,k", [(5, 0, 1), (5, 2, 1), (5, 2, 2), (6, 3, 4), (4, 4, 2), (7, 1, 7)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_pass(n, c, k):
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_prompt_file_end_to_end(tmp_path: Path, capsys):
    import torch

    tokenizer = lively_char_checkpoint(tmp_path / "out", chat=True, block_size=48)
    checkpoint = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    model = model_of_checkpoint(checkpoint, "ckpt").eval()
    records = []
    for i, question in enumerate(["Speak", "ROMEO", "All", "hear me", "First"]):
        ids = tokenizer.chat.render_prompt([{"role": "user", "content": question}], tokenizer)
        reply = reference_greedy(model, ids, 6)
        stops = set(tokenizer.chat.reply_stops)
        cut = next((j for j, t in enumerate(reply) if t in stops), len(reply))
        text = tokenizer.decode(reply[:cut])
        records.append({"prompt": question, "answer": text if i % 2 == 0 else text + "?"})
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    common = [f"--out_dir={tmp_path / 'out'}", "--tasks=", f"--prompts={prompts}", "--device=cpu", "--decode=eager"]
    args = [*common, "--reward=exact", "--max_new_tokens=6", f"--json_out={tmp_path / 'r.json'}"]
    code, stdout, _ = run_main(eval_script.main, args, capsys)
    assert code == 0, stdout
    result = json.loads((tmp_path / "r.json").read_text())["generative"]
    assert result["pass@1"] == pytest.approx(3 / 5) and result["n"] == 5
    code, _, stderr = run_main(eval_script.main, args, capsys)  # an earlier evaluation's file is never replaced
    assert_one_line_error(code, stderr, f"--json_out={tmp_path / 'r.json'} exists", "--overwrite=True")
    assert json.loads((tmp_path / "r.json").read_text())["generative"] == result
    assert run_main(eval_script.main, [*args, "--overwrite=True"], capsys)[0] == 0
    assert "pass@1 0.6000" in stdout.splitlines()[-1]

    sampled = [*common, "--reward=regex:.", "--samples=4", "--pass_k=1,4", "--temperature=1.0"]
    code, stdout, _ = run_main(eval_script.main, sampled, capsys)
    assert code == 0 and "pass@4" in stdout

    code, _, stderr = run_main(eval_script.main, [*common, "--samples=2", "--pass_k=3", "--temperature=1"], capsys)
    assert_one_line_error(code, stderr, "--pass_k=3")

    long = tmp_path / "long.jsonl"
    long.write_text(
        json.dumps({"prompt": "Speak", "answer": "x"}) + "\n" + json.dumps({"prompt": "Speak " * 20}) + "\n"
    )
    args = [*common[:2], f"--prompts={long}", *common[3:]]
    code, _, stderr = run_main(eval_script.main, args, capsys)
    assert_one_line_error(code, stderr, f"{long}:2: the prompt is", "the model's context holds 48", "shorten it")
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"prompt": "x", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    code, _, stderr = run_main(eval_script.main, [*common[:2], f"--prompts={deep}", *common[3:]], capsys)
    assert_one_line_error(code, stderr, f"{deep}:1: not valid JSON (nested too deeply)")
    for target, message in (
        (tmp_path, "is a directory"),
        (prompts, "is the --prompts file"),
        (prompts / "r.json", f"{prompts} is a file, not a directory"),  # before the evaluation, not after it
    ):
        code, _, stderr = run_main(eval_script.main, [*common, f"--json_out={target}", "--overwrite=True"], capsys)
        assert_one_line_error(code, stderr, message)
    code, _, stderr = run_main(eval_script.main, [*common, "--temperature=inf"], capsys)
    assert_one_line_error(code, stderr, "--temperature must be a finite number >= 0, got inf")
