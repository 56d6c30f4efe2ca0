"""LoRA runs of train.py: a frozen base and small trained adapters, checkpoints that hold only the adapters and find
their base by path and sha256, exact resume, chat data's new token rows, loading in sample.py, export.py's merged
and peft formats with PEFT itself running the adapters (new token rows included), and DDP against one process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import export
import sample
import train
from data.test_packing import write_chat_data
from gptkit.weights import checkpoint as ckpt
from gptkit.weights import load
from gptkit.weights.sources import model_of_checkpoint
from helpers import assert_script_error, cli_args, run_in_process, run_main
from test_train_chat import RUN, write_text_data
from test_train_ddp import assert_close_weights, assert_same_curve, train_in

LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_targets": "all"}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A base checkpoint trained a few steps on text, and text data of the same characters beside it."""
    root = tmp_path_factory.mktemp("lora")
    write_text_data(root / "text", "abcdefgh " * 400)
    args = {**RUN, "max_iters": 3, "gradient_accumulation_steps": 1}
    assert train.main(cli_args(**args, data_dir=root / "text", out_dir=root / "base")) == 0  # the tests' input
    write_chat_data(root / "chat")
    return root / "base"


def lora_run(base: Path, data: Path, out: Path, capsys: pytest.CaptureFixture, **extra: object):
    """train.py's LoRA run, its main in this process (a finished process's exit code, stdout and stderr): the LoRA
    run as a process is rank 1 of test_lora_under_ddp_matches_one_process."""
    args = cli_args(**{**RUN, **LORA, "max_iters": 3, "init_from": base, "data_dir": data, "out_dir": out, **extra})
    return run_in_process(train.main, args, capsys)


def test_a_lora_run_trains_only_adapters_and_saves_only_them(base: Path, tmp_path: Path, capsys) -> None:
    result = lora_run(base, base.parent / "text", tmp_path / "out", capsys)
    assert result.returncode == 0, result.stderr
    # 2 blocks x 4 layers (rank 4, 32 wide): c_attn 4*32+96*4, attn.c_proj 4*32+32*4, c_fc 4*32+128*4, mlp.c_proj 4*128+32*4
    trained = 2 * ((128 + 384) + (128 + 128) + (128 + 512) + (512 + 128))
    assert f"{trained:,} trained parameters" in result.stdout
    saved = ckpt.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert all(name.endswith((".lora_A", ".lora_B")) for name in saved["model"])
    assert sum(t.numel() for t in saved["model"].values()) == trained
    assert saved["lora"]["base"]["source"] == str((base / "best.pt").resolve())
    frozen = ckpt.load_checkpoint(base / "best.pt")["model"]
    tuned = model_of_checkpoint(saved, "test", merge=False)
    for name, tensor in frozen.items():  # the base's own weights did not move
        if "lora" not in name and name in dict(tuned.named_parameters()):
            torch.testing.assert_close(dict(tuned.named_parameters())[name].detach(), tensor)


@pytest.mark.parametrize("base_weights", ["float32", "int4"])
def test_a_lora_run_resumes_exactly(base: Path, tmp_path: Path, capsys, base_weights: str) -> None:
    """Also QLoRA's (int4), whose base checkpoint's products are read as int4 blocks at the start and at resume."""
    text, held = base.parent / "text", {"lora_base_weights": base_weights}
    assert lora_run(base, text, tmp_path / "a", capsys, max_iters=6, **held).returncode == 0
    assert lora_run(base, text, tmp_path / "b", capsys, max_iters=3, **held).returncode == 0
    rest = lora_run(base, text, tmp_path / "b", capsys, max_iters=6, init_from="resume", **held)
    assert rest.returncode == 0, rest.stderr
    a = ckpt.load_checkpoint(tmp_path / "a" / "ckpt.pt")["model"]
    b = ckpt.load_checkpoint(tmp_path / "b" / "ckpt.pt")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


def test_a_resume_trains_the_runs_own_adapters_and_refuses_other_lora_settings(
    base: Path, tmp_path: Path, capsys
) -> None:
    text, out = base.parent / "text", tmp_path / "run"
    assert lora_run(base, text, out, capsys, max_iters=2).returncode == 0
    plain = cli_args(**{**RUN, "max_iters": 4, "init_from": "resume", "data_dir": text, "out_dir": out})
    for flags, named in [
        (["--lora_rank=8"], "--lora_rank=8 (the run's: 4)"),
        (["--lora_targets=mlp", "--lora_alpha=2.0"], "--lora_alpha=2.0 (the run's: 8.0), --lora_targets='mlp' (the"),
    ]:
        refused = run_in_process(train.main, [*plain, *flags], capsys)
        assert_script_error(refused, f"{out / 'ckpt.pt'} trains adapters of other settings: {named}")
    resumed = run_in_process(train.main, plain, capsys)  # no LoRA flag: the run's adapters, named as they are
    assert resumed.returncode == 0, resumed.stderr
    assert "LoRA rank 4 on all: " in resumed.stdout
    assert ckpt.load_checkpoint(out / "ckpt.pt")["config"]["lora_rank"] == 4
    full = tmp_path / "full"
    args = cli_args(**{**RUN, "max_iters": 2, "init_from": base, "data_dir": text, "out_dir": full})
    assert run_in_process(train.main, args, capsys).returncode == 0
    onto_full = cli_args(**{**RUN, "max_iters": 4, "init_from": "resume", "data_dir": text, "out_dir": full})
    refused = run_in_process(train.main, [*onto_full, "--lora_rank=4"], capsys)
    assert_script_error(refused, f"{full / 'ckpt.pt'} trained every weight", "leave out --lora_rank")


def test_on_chat_data_the_new_token_rows_train_with_the_adapters(base: Path, tmp_path: Path, capsys) -> None:
    result = lora_run(base, base.parent / "chat", tmp_path / "out", capsys)
    assert result.returncode == 0, result.stderr
    saved = ckpt.load_checkpoint(tmp_path / "out" / "ckpt.pt")
    assert saved["model"]["transformer.wte.extra"].shape == (4, 32)  # the template's four markers
    loaded = load(str(tmp_path / "out"))
    model, tokenizer = loaded.model, loaded.tokenizer
    assert tokenizer.chat is not None and model.transformer.wte.weight.shape[0] == tokenizer.vocab_size


def test_merge_writes_a_plain_checkpoint_with_the_same_outputs(base: Path, tmp_path: Path, capsys) -> None:
    assert lora_run(base, base.parent / "text", tmp_path / "out", capsys).returncode == 0
    merge = ["--format=merged", f"--out_dir={tmp_path / 'out'}", f"--export_dir={tmp_path / 'm'}"]
    result = run_in_process(export.main, merge, capsys)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"wrote {tmp_path / 'm'}: ckpt.pt"
    merged = ckpt.load_checkpoint(tmp_path / "m" / "ckpt.pt")
    assert "lora" not in merged
    adapted = model_of_checkpoint(ckpt.load_checkpoint(tmp_path / "out" / "ckpt.pt"), "test", merge=False).eval()
    plain = load(str(tmp_path / "m")).model
    x = torch.randint(0, 10, (2, 16))
    torch.testing.assert_close(plain(x, x)[0], adapted(x, x)[0], rtol=1e-5, atol=1e-5)
    assert_script_error(run_in_process(export.main, merge, capsys), "already holds files")
    whole = ["--format=peft", f"--out_dir={tmp_path / 'm'}", f"--export_dir={tmp_path / 'p'}"]
    assert_script_error(run_in_process(export.main, whole, capsys), "is not a LoRA run's checkpoint")
    assert not (tmp_path / "p").exists()


def test_a_missing_or_changed_base_is_one_clear_line(base: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "base"
    shutil.copytree(base, copy)
    assert lora_run(copy, base.parent / "text", tmp_path / "out", capsys).returncode == 0
    sampling = [f"--out_dir={tmp_path / 'out'}", "--max_new_tokens=5"]
    (copy / "best.pt").write_bytes((copy / "best.pt").read_bytes() + b"\0")
    assert_script_error(run_in_process(sample.main, sampling, capsys), "has changed since the adapters were trained")
    shutil.rmtree(copy)
    assert_script_error(run_in_process(sample.main, sampling, capsys), "is missing")


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda record: "x", "it is no dict"),
        (lambda record: {**record, "base": "/a/path"}, "its base is not {source, sha256} text"),
        (lambda record: {**record, "base": {"source": record["base"]["source"]}}, "its base is not"),
        (lambda record: {**record, "base_weights": "int3"}, "its base_weights 'int3' are none of"),
        (lambda record: {**record, "first_new_row": "x"}, "its first_new_row 'x' is no row"),
    ],
)
def test_a_damaged_lora_record_is_one_line_in_sample_and_export(
    base: Path, tmp_path: Path, capsys, damage, problem
) -> None:
    assert lora_run(base, base.parent / "text", tmp_path / "out", capsys).returncode == 0
    checkpoint = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    checkpoint["lora"] = damage(checkpoint["lora"])
    torch.save(checkpoint, tmp_path / "out" / "ckpt.pt")
    (tmp_path / "out" / "best.pt").unlink(missing_ok=True)
    expected = ("its LoRA record is damaged", problem)
    sampling = [f"--out_dir={tmp_path / 'out'}", "--max_new_tokens=5"]
    assert_script_error(run_in_process(sample.main, sampling, capsys), *expected)
    exporting = [f"--out_dir={tmp_path / 'out'}", "--format=peft", f"--export_dir={tmp_path / 'peft'}"]
    assert_script_error(run_in_process(export.main, exporting, capsys), *expected)


def test_lora_settings_that_cannot_work_are_refused(base: Path, tmp_path: Path, capsys) -> None:
    scratch = cli_args(**RUN, **LORA, data_dir=base.parent / "text", out_dir=tmp_path / "o")
    assert_script_error(run_in_process(train.main, scratch, capsys), "LoRA adapts a trained model")
    assert_script_error(lora_run(base, base.parent / "text", tmp_path / "o", capsys, lora_rank=-1), "lora_rank")


def test_lora_under_ddp_matches_one_process(base: Path, tmp_path: Path) -> None:
    """Two gloo processes with two micro-batches each train the adapters and the chat markers' new rows as one
    process does with all four (dropout on, in the base and on the adapters' input)."""
    lora = [f"--init_from={base}", *cli_args(**LORA, lora_dropout=0.1)]
    chat = base.parent / "chat"
    train_in(1, chat, tmp_path / "one", *lora)
    assert "LoRA rank 4" in train_in(2, chat, tmp_path / "two", *lora)
    assert_same_curve(tmp_path / "one", tmp_path / "two")
    assert_close_weights(tmp_path / "one", tmp_path / "two")
    adapters = ckpt.load_checkpoint(tmp_path / "two" / "ckpt.pt")["model"]
    assert "transformer.wte.extra" in adapters and adapters["transformer.h.0.attn.c_attn.lora_B"].abs().max() > 0


@pytest.mark.heavy
def test_peft_runs_our_adapters_on_the_exported_base(base: Path, tmp_path: Path, capsys) -> None:
    """The whole route to Hugging Face: train.py's LoRA run, its adapters written for PEFT, the base exported with
    export.py; PEFT on transformers' model then gives the logits the toolkit gives for the LoRA run."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    assert lora_run(base, base.parent / "text", tmp_path / "out", capsys, learning_rate=3e-2).returncode == 0
    peft_args = ["--format=peft", f"--out_dir={tmp_path / 'out'}", f"--export_dir={tmp_path / 'adapter'}"]
    assert run_main(export.main, peft_args, capsys)[0] == 0
    export_args = [f"--out_dir={base}", "--format=hf", f"--export_dir={tmp_path / 'hf'}"]
    assert run_main(export.main, export_args, capsys)[0] == 0
    loaded = load(str(tmp_path / "out"))
    ours, tokenizer = loaded.model, loaded.tokenizer
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    text = "abc hgf eddcba gh"
    ids = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == [tokenizer.encode(text)]
    # The adapter directory alone: PEFT finds the base the command wrote beside the adapters.
    beside = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ours(ids, ids)[0]
        torch.testing.assert_close(theirs(ids).logits, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(beside(ids).logits, expected, rtol=1e-5, atol=1e-5)
        with theirs.disable_adapter():  # the adapters matter: the bare base answers otherwise
            assert (theirs(ids).logits - expected).abs().max() > 1e-2


@pytest.mark.parametrize("base_weights", ["int8", "int4"])
def test_peft_runs_a_quantized_base_runs_adapters_to_its_logits(
    base: Path, tmp_path: Path, capsys, base_weights
) -> None:
    """QLoRA's adapters trained against the base's int8 or int4 values: the base written beside them for PEFT holds
    those values, so PEFT gives the run's logits (the float base would be off by the quantization's error)."""
    peft = pytest.importorskip("peft")
    held = {"learning_rate": 3e-2, "lora_base_weights": base_weights}
    assert lora_run(base, base.parent / "text", tmp_path / "out", capsys, **held).returncode == 0
    peft_args = ["--format=peft", f"--out_dir={tmp_path / 'out'}", f"--export_dir={tmp_path / 'adapter'}"]
    assert run_main(export.main, peft_args, capsys)[0] == 0
    loaded = load(str(tmp_path / "out"))
    ids = torch.tensor([loaded.tokenizer.encode("abc hgf eddcba gh")])
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, loaded.model(ids, ids)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
def test_peft_runs_a_chat_lora_run_with_its_new_token_rows(base: Path, tmp_path: Path, capsys) -> None:
    """A LoRA run on chat data also trains the template's marker rows; PEFT gets them as trainable_token_indices
    on the base written beside the adapters (its vocabulary grown to the run's), and gives our logits on a rendered
    conversation, markers and all."""
    peft = pytest.importorskip("peft")
    assert lora_run(base, base.parent / "chat", tmp_path / "out", capsys, learning_rate=3e-2).returncode == 0
    peft_args = ["--format=peft", f"--out_dir={tmp_path / 'out'}", f"--export_dir={tmp_path / 'adapter'}"]
    code, out, _ = run_main(export.main, peft_args, capsys)
    assert code == 0 and out.strip().endswith("adapter_config.json, adapter_model.safetensors, base")
    (tmp_path / "adapter" / "base" / "stale.txt").write_text("from an earlier export")
    code, out, err = run_main(export.main, [*peft_args, "--overwrite=True"], capsys)  # base/ replaced whole
    assert code == 0 and out.strip().endswith("base"), err
    assert not (tmp_path / "adapter" / "base" / "stale.txt").exists()
    loaded = load(str(tmp_path / "out"))
    ours, tokenizer = loaded.model, loaded.tokenizer
    rows = ckpt.load_checkpoint(tmp_path / "out" / "ckpt.pt")["lora"]["first_new_row"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["trainable_token_indices"] == list(range(rows, tokenizer.vocab_size))
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype=torch.float32).eval()
    conversation = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "hgf"}]
    ids = torch.tensor([tokenizer.chat.render(conversation, tokenizer)[0].tolist()])
    assert (ids >= rows).sum() >= 4  # the markers are read
    with torch.no_grad():
        expected = ours(ids, ids)[0]
        torch.testing.assert_close(theirs(ids).logits, expected, rtol=1e-5, atol=1e-5)
        with theirs.disable_adapter():  # the adapters and the trained rows matter
            assert (theirs(ids).logits - expected).abs().max() > 1e-2


def write_hf_base(directory: Path, family: str, tied: bool) -> Path:
    """A random transformers model (Qwen3 or Llama) saved without a tokenizer, so chat data in any tokenizer fits
    it: its 10 rows are the characters' and end of text of write_chat_data, which adds the template's 4 markers."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, head_dim=16)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=10, num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tied, **shape
    )
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(directory)
    return directory


HF_HEADS = {"qwen3, tied head": ("Qwen3", True), "llama, untied head": ("Llama", False)}


@pytest.mark.parametrize(("family", "tied"), HF_HEADS.values(), ids=HF_HEADS.keys())
def test_peft_runs_a_chat_lora_run_on_a_llama_family_base_from_anywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys, family: str, tied: bool
) -> None:
    """A chat LoRA run on a Hugging Face Qwen3 or Llama base trains the markers' new rows (the embedding's, and an
    untied head's) and exports them for PEFT as trainable_token_indices. The adapter, exported to a relative
    --export_dir, names its base by absolute path: PEFT loads it offline from another working directory, with our
    logits on a rendered conversation."""
    peft = pytest.importorskip("peft")
    import huggingface_hub.constants

    base = write_hf_base(tmp_path / "hf", family, tied)
    tokenizer = write_chat_data(tmp_path / "chat")
    run = {key: value for key, value in RUN.items() if key not in ("n_layer", "n_head", "n_embd")}
    args = {**run, **LORA, "max_iters": 3, "gradient_accumulation_steps": 1, "learning_rate": 3e-2}
    args = cli_args(**args, init_from=base, data_dir=tmp_path / "chat", out_dir=tmp_path / "out")
    trained = run_in_process(train.main, args, capsys)
    assert trained.returncode == 0, trained.stderr
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(export.main, ["--format=peft", "--out_dir=out", "--export_dir=adapter"], capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    rows = list(range(10, tokenizer.vocab_size))
    assert config["trainable_token_indices"] == (rows if tied else {"embed_tokens": rows, "lm_head": rows})
    assert config["base_model_name_or_path"] == str(tmp_path.resolve() / "adapter" / "base")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype=torch.float32).eval()
    assert type(theirs.get_base_model()).__name__ == f"{family}ForCausalLM"
    ours = load(str(tmp_path / "out")).model
    conversation = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "hgf"}]
    ids = torch.tensor([tokenizer.chat.render(conversation, tokenizer)[0].tolist()])
    assert (ids >= 10).sum() >= 4  # the markers are read
    with torch.no_grad():
        expected = ours(ids, ids)[0]
        torch.testing.assert_close(theirs(ids).logits, expected, rtol=0, atol=1e-4)
        with theirs.disable_adapter():  # the adapters and the trained rows matter
            assert (theirs(ids).logits - expected).abs().max() > 1e-2
