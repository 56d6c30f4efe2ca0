"""export.py end to end: a chat checkpoint exported to a Hugging Face directory that transformers runs to our
tokens, a run exported to GGUF; a new directory every time unless --overwrite; every mistake one line."""

from __future__ import annotations

import dataclasses
import functools
import os
import resource
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

import export
import train
from gptkit.data import tokenizer as tok
from gptkit.weights import load
from gptkit.weights.checkpoint import save_checkpoint, tokenizer_record
from helpers import (
    REPO,
    assert_one_line_error,
    assert_script_error,
    clean_env,
    cli_args,
    gpt2_chat_tokenizer,
    greedy_llama_cpp,
    lively_model,
    reference_greedy,
    run_in_process,
    run_main,
    run_script,
)

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, who are you?"}]


def write_checkpoint(path: Path, tokenizer, **model_settings) -> Path:
    """A checkpoint as train.py saves one (model, model_args, tokenizer record) of a lively tiny model."""
    model = lively_model(
        **{"vocab_size": tok.padded_vocab_size(tokenizer.vocab_size), "block_size": 64, **model_settings}
    )
    meta = {"tokenizer": tokenizer.to_meta(), "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token}
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "model_args": dataclasses.asdict(model.config),
        "tokenizer": tokenizer_record(meta),
    }
    save_checkpoint(path, state)
    return path


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory) -> Path:
    tokenizer = gpt2_chat_tokenizer()
    return write_checkpoint(tmp_path_factory.mktemp("run") / "ckpt.pt", tokenizer, n_embd=64)


@pytest.mark.gpt2_bpe
@pytest.mark.heavy
def test_hf_export_of_a_chat_checkpoint_runs_in_transformers_to_our_tokens(tmp_path, chat_checkpoint, capsys):
    destination = tmp_path / "exported"
    code, out, err = run_main(export.main, cli_args(out_dir=chat_checkpoint, export_dir=destination), capsys)
    assert code == 0, err
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert out == f"wrote {destination}: {', '.join(files)}\n"
    assert sorted(p.name for p in destination.iterdir()) == files  # nothing else (no staging left behind)
    loaded = load(str(chat_checkpoint))
    model, tokenizer = loaded.model, loaded.tokenizer
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(destination)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(destination).eval()
    prompt = hf_tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, Mapping) else prompt)
    assert prompt == tokenizer.chat.render_prompt(MESSAGES, tokenizer)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0][0, -1].argmax()))
        generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert generated[0].tolist() == ids


def test_gguf_export_writes_the_file_and_a_modelfile(tmp_path, capsys):
    """A character-level run (GPT-2's vocabulary in GGUF is tests/weights/test_export_gguf.py's: reading its 50,000
    tokens back takes seconds)."""
    gguf = pytest.importorskip("gguf")
    checkpoint = write_checkpoint(tmp_path / "run" / "ckpt.pt", tok.CharTokenizer("abc\n", eot=True), n_embd=64)
    destination = tmp_path / "gguf"
    args = cli_args(out_dir=checkpoint, format="gguf", outtype="q8_0", export_dir=destination)
    code, out, err = run_main(export.main, args, capsys)
    assert code == 0, err
    assert out == f"wrote {destination}: run-q8_0.gguf, Modelfile\n"  # named after the run directory, by default
    reader = gguf.GGUFReader(destination / "run-q8_0.gguf")
    assert reader.fields["general.name"].contents() == "run"
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 64  # one per row of the model: 5 tokens, padded
    assert (destination / "Modelfile").read_text().startswith("FROM ./run-q8_0.gguf\n")


def test_gguf_export_takes_a_hugging_face_tokenizer_along(tmp_path, capsys):
    """A Qwen3-shaped run on a Qwen2-style tokenizer.json: the file is llama.cpp's Qwen3 with that tokenizer, its
    `qwen2` pre-tokenizer and chat template."""
    gguf = pytest.importorskip("gguf")
    from gptkit.data.hf_tokenizer import load_hf_tokenizer
    from hf_tokenizer_dirs import write_family

    tokenizer = load_hf_tokenizer(write_family(tmp_path / "tokenizer", "qwen2"))
    qwen3 = dict(pos_encoding="rope", norm="rmsnorm", activation="swiglu", bias=False, qk_norm=True, mlp_hidden=96)
    checkpoint = write_checkpoint(tmp_path / "run" / "ckpt.pt", tokenizer, n_head=4, n_kv_head=2, **qwen3)
    args = cli_args(out_dir=checkpoint.parent, format="gguf", outtype="f32", export_dir=tmp_path / "gguf")
    code, out, err = run_main(export.main, args, capsys)
    assert code == 0 and out == f"wrote {tmp_path / 'gguf'}: run-f32.gguf, Modelfile\n", err
    reader = gguf.GGUFReader(tmp_path / "gguf" / "run-f32.gguf")
    assert reader.fields["general.architecture"].contents() == "qwen3"
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    assert reader.fields["tokenizer.chat_template"].contents() == tokenizer.chat.source
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == tok.padded_vocab_size(tokenizer.vocab_size)
    assert tokens.contents(tokenizer.eot_token) == "<|im_end|>"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, char_data_dir) -> Path:
    """`make demo`'s recipe as it is, trained 40 steps on Shakespeare's first characters: its run directory."""
    out_dir = tmp_path_factory.mktemp("demo") / "out"
    recipe = REPO / "config" / "train_shakespeare_char_cpu.py"
    flags = cli_args(data_dir=char_data_dir, out_dir=out_dir, max_iters=40, lr_decay_iters=40, eval_interval=40)
    extra = ["--eval_iters=2", "--eval_full_split=False", "--curves=False", "--cpu_threads=1"]
    assert train.main([str(recipe), *flags, *extra]) == 0
    return out_dir


@pytest.mark.heavy
def test_the_demos_model_exports_as_qwen3_that_transformers_runs_to_our_greedy_tokens(tmp_path, demo_run, capsys):
    destination = tmp_path / "hf"
    code, _, err = run_main(export.main, cli_args(out_dir=demo_run, export_dir=destination), capsys)
    assert code == 0, err
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(destination)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(destination).eval()
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    loaded = load(str(demo_run))
    model, tokenizer = loaded.model, loaded.tokenizer
    prompt = hf_tokenizer.encode("First Citizen:\n")
    assert prompt == tokenizer.encode("First Citizen:\n")
    with torch.no_grad():
        generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None)
    ours = reference_greedy(model.eval(), prompt, 40)
    assert generated[0].tolist()[len(prompt) :] == ours
    assert hf_tokenizer.decode(ours) == tokenizer.decode(ours)


@pytest.mark.slow
def test_the_demos_model_exports_to_gguf_that_llama_cpp_runs_to_our_greedy_tokens(tmp_path, request, demo_run, capsys):
    """llama.cpp (llama-cpp-python) reads the f32 file as Qwen3, tokenizes the text as we do, picks our greedy
    tokens and turns them back into our text."""
    if "slow" not in (request.config.getoption("-m") or "") and os.environ.get("GPTKIT_SLOW_TESTS") != "1":
        pytest.skip("slow: runs llama.cpp; ask with -m slow or GPTKIT_SLOW_TESTS=1")
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    gguf = pytest.importorskip("gguf")
    destination = tmp_path / "gguf"
    args = cli_args(out_dir=demo_run, format="gguf", outtype="f32", export_dir=destination, name="demo")
    code, _, err = run_main(export.main, args, capsys)
    assert code == 0, err
    path = destination / "demo-f32.gguf"
    assert gguf.GGUFReader(path).fields["general.architecture"].contents() == "qwen3"
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, verbose=False)
    loaded = load(str(demo_run))
    model, tokenizer = loaded.model, loaded.tokenizer
    text = "First Citizen:\nBefore we proceed any further, hear me speak."
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == tokenizer.encode(text)
    prompt = tokenizer.encode("First Citizen:\n")
    ours = reference_greedy(model.eval(), prompt, 40)
    assert greedy_llama_cpp(llm, prompt, 40) == ours
    assert llm.detokenize(ours).decode() == tokenizer.decode(ours)


@pytest.mark.gpt2_bpe
def test_never_overwrites_unasked(tmp_path, chat_checkpoint, capsys):
    destination = tmp_path / "taken"
    destination.mkdir()
    (destination / "config.json").write_text("mine")
    (destination / "notes.txt").write_text("mine")
    code, _, err = run_main(export.main, cli_args(out_dir=chat_checkpoint, export_dir=destination), capsys)
    assert_one_line_error(code, err, "already holds files", "--overwrite")
    assert (destination / "config.json").read_text() == "mine"
    code, _, err = run_main(
        export.main, [*cli_args(out_dir=chat_checkpoint, export_dir=destination), "--overwrite"], capsys
    )
    assert code == 0, err
    assert (destination / "config.json").read_text() != "mine" and (destination / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # no staging directory left beside it
    (tmp_path / ".taken.partial").write_text("a file of the user's, named as a staging folder once was")
    code, _, err = run_main(
        export.main, [*cli_args(out_dir=chat_checkpoint, export_dir=destination), "--overwrite"], capsys
    )
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".taken.partial", "taken"]
    below_a_file = cli_args(out_dir=chat_checkpoint, export_dir=destination / "notes.txt" / "export")
    code, _, err = run_main(export.main, below_a_file, capsys)
    assert_one_line_error(code, err, f"{destination / 'notes.txt'} is a file, not a directory")


@pytest.mark.gpt2_bpe
def test_mistakes_are_one_line_errors_and_leave_no_directory(tmp_path, capsys):
    rope = write_checkpoint(tmp_path / "rope" / "ckpt.pt", tok.TiktokenTokenizer("gpt2"), pos_encoding="rope")
    char = write_checkpoint(tmp_path / "char" / "ckpt.pt", tok.CharTokenizer("abc\n", eot=True))
    cases = [
        (cli_args(out_dir=rope, export_dir=tmp_path / "x"), ["pos_encoding=rope"]),
        (cli_args(out_dir=rope, format="gguf", export_dir=tmp_path / "x"), ["pos_encoding=rope with norm=layernorm"]),
        (cli_args(out_dir=tmp_path / "missing", export_dir=tmp_path / "x"), ["no checkpoint in"]),
        (cli_args(out_dir=char), ["--export_dir is required"]),
        (cli_args(out_dir=char, format="onnx", export_dir=tmp_path / "x"), ["onnx"]),
        (cli_args(out_dir=char, format="peft", export_dir=tmp_path / "x"), ["is not a LoRA run's checkpoint"]),
        (cli_args(init_from="gpt2", format="merged", export_dir=tmp_path / "x"), ["exports a LoRA run"]),
        (cli_args(out_dir=char, format="gguf", export_dir=tmp_path / "x", name="../../keep"), ["names the GGUF file"]),
        (cli_args(out_dir=char.parent, export_dir=char.parent, overwrite=True), ["is the run's own directory"]),
        (cli_args(out_dir=char, export_dir=tmp_path / "x", outtype="q4_0"), ["--outtype is for --format=gguf"]),
        (cli_args(out_dir=char, export_dir=tmp_path / "x", name="tiny"), ["--name is for --format=gguf"]),
    ]
    for args, fragments in cases:
        code, _, err = run_main(export.main, args, capsys)
        assert_one_line_error(code, err, *fragments)
        assert not (tmp_path / "x").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["char", "rope"]


def test_the_script_runs_as_a_user_runs_it(tmp_path, capsys):
    """export.py as a process; the refused second export calls its main in this process."""
    char = write_checkpoint(tmp_path / "char" / "ckpt.pt", tok.CharTokenizer("abc\n", eot=True))
    result = run_script("export.py", *cli_args(out_dir=char.parent, export_dir=tmp_path / "hf"))
    assert result.returncode == 0, result.stderr
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf.encode("cab\n") == [2, 0, 1, 3]
    failed = run_in_process(export.main, cli_args(out_dir=char.parent, export_dir=tmp_path / "hf"), capsys)
    assert_script_error(failed, "already holds files")


def test_a_gguf_file_cut_short_is_one_line_and_leaves_nothing(tmp_path):
    """numpy says a short write without an errno; the user reads one line. A file size limit cuts the file short
    (Python ignores SIGXFSZ), as a full disk would."""
    char = write_checkpoint(tmp_path / "char" / "ckpt.pt", tok.CharTokenizer("abc\n", eot=True), n_embd=64)
    command = [sys.executable, str(REPO / "export.py"), f"--out_dir={char.parent}", "--format=gguf"]
    command.append(f"--export_dir={tmp_path / 'gguf'}")
    limit = functools.partial(resource.setrlimit, resource.RLIMIT_FSIZE, (1 << 14, 1 << 14))
    result = subprocess.run(command, cwd=REPO, env=clean_env(), capture_output=True, text=True, preexec_fn=limit)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: the GGUF file was cut short (")
    assert result.stderr.endswith("a file size limit was reached; free some space or choose another --export_dir\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["char"]


def test_help_names_the_script_and_every_format(capsys):
    code, out, _ = run_main(export.main, ["--help"], capsys)
    assert code == 0 and out.startswith("usage: python export.py [--key=value ...]\n")
    assert all(f"{name}:" in out for name in export.FORMATS)


def test_a_hub_models_gguf_file_is_named_by_the_models_name() -> None:
    """The file name of --format=gguf from owner/name (or owner/name:TAG) is the name alone, not a path."""
    for source in ("testowner/tiny-llama", "testowner/tiny-llama:Q4_K_M"):
        assert export.model_name(export.ExportSettings(init_from=source, export_dir="x", format="gguf")) == "tiny-llama"


def test_a_gguf_files_name_loses_its_type_for_the_exports(tmp_path: Path) -> None:
    """model-q4_0.gguf exported to q8_0 is model-q8_0.gguf, not model-q4_0-q8_0.gguf."""
    names = {
        "SmolLM2-135M-Instruct-Q4_K_M.gguf": "SmolLM2-135M-Instruct",
        "tiny-q4_0.gguf": "tiny",
        "tiny.f16.gguf": "tiny",
        "tiny-IQ2_XS.gguf": "tiny",
        "Qwen3-0.6B-BF16.gguf": "Qwen3-0.6B",
        "gpt2-q8.gguf": "gpt2",
        "v1-2.gguf": "v1-2",  # no type: the name as it is
        "q4_0.gguf": "q4_0",  # nothing but a type: kept
    }
    for file_name, expected in names.items():
        (tmp_path / file_name).write_bytes(b"GGUF")
        cfg = export.ExportSettings(init_from=str(tmp_path / file_name), export_dir="x", format="gguf")
        assert export.model_name(cfg) == expected, file_name
