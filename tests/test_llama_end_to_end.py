"""A small Llama-shaped Hugging Face model end to end: its own tokenizer and chat template prepare chat data, a LoRA
run fine-tunes it, sample.py --chat answers, the merged run exports back to LlamaForCausalLM, which transformers
loads with our logits and tokenizer ids, and its adapters export for PEFT with the same logits."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import export
import sample
import train
from gptkit.weights import load
from helpers import cli_args, run_in_process, run_main
from hf_tokenizer_dirs import write_byte_level
from prepare_data import chat as chat_script

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}."},
    ]
    for i in range(30)
]


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory) -> Path:
    """A random LlamaForCausalLM (2 layers, 64 wide, 2 KV heads) beside a byte-level tokenizer with ChatML."""
    directory = write_byte_level(tmp_path_factory.mktemp("llama") / "base")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=704,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


@pytest.mark.heavy
def test_chat_lora_run_on_a_llama_base_answers_and_exports_back(
    llama_base: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every script in this process (test_train, test_sample and test_export run each as a process)."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS), encoding="utf-8")
    data, out = tmp_path / "data", tmp_path / "out"
    code, _, err = run_main(
        chat_script.main, [f"--input={chats}", f"--out_dir={data}", f"--tokenizer={llama_base}"], capsys
    )
    assert code == 0, err
    train_args = cli_args(
        init_from=llama_base,
        data_dir=data,
        out_dir=out,
        device="cpu",
        compile=False,
        block_size=64,
        batch_size=2,
        gradient_accumulation_steps=1,
        max_iters=4,
        eval_interval=4,
        eval_iters=1,
        learning_rate=1e-3,
        lora_rank=4,
        lora_alpha=8.0,
        lora_targets="all",
    )
    trained = run_in_process(train.main, train_args, capsys)
    assert trained.returncode == 0, trained.stderr

    monkeypatch.setattr("sys.stdin", io.StringIO("What is 3 plus 3?\n"))
    chat = run_in_process(sample.main, [f"--out_dir={out}", "--chat", "--max_new_tokens=8", "--temperature=0"], capsys)
    assert chat.returncode == 0, chat.stderr

    merged, exported = tmp_path / "merged", tmp_path / "hf"
    for fmt, source, target in (("merged", out, merged), ("hf", merged, exported)):
        done = run_in_process(export.main, [f"--out_dir={source}", f"--format={fmt}", f"--export_dir={target}"], capsys)
        assert done.returncode == 0, done.stderr
    loaded = load(str(merged))
    ours, tokenizer = loaded.model, loaded.tokenizer
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    auto = transformers.AutoTokenizer.from_pretrained(exported)
    ids = auto.apply_chat_template(CONVERSATIONS[3], tokenize=True, return_dict=False)
    assert ids == tokenizer.chat.render(CONVERSATIONS[3], tokenizer)[0].tolist()
    idx = torch.tensor([ids[:64]])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx, targets=torch.zeros_like(idx))[0], rtol=0, atol=1e-4)
    peft = pytest.importorskip("peft")
    peft_export = [f"--out_dir={out}", "--format=peft", f"--export_dir={tmp_path / 'peft'}"]
    done = run_in_process(export.main, peft_export, capsys)
    assert done.returncode == 0, done.stderr
    base = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "peft" / "base")
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    with torch.no_grad():
        torch.testing.assert_close(adapted(idx).logits, hf(idx).logits, rtol=0, atol=1e-4)
