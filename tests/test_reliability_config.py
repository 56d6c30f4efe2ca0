"""Hostile config files and impossible values: refused with one line before anything runs or is written.

Config files are read with `ast` and never executed (settings.read_config_file). Every snippet below would create a
marker file if any part of it ran; the tests prove it never does. Bad values of train.py and sample.py settings
are refused before a model is built and before out_dir exists. docs/reliability.md lists every case.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import sample
import train
from gptkit.core.errors import UserError
from gptkit.core.settings import parse_settings, read_config_file
from helpers import assert_one_line_error, assert_one_line_message, run_main, tiny_train_args

# Each snippet would create MARKER if executed; {marker} is replaced by its path.
CODE_SNIPPETS = {
    "import": 'import os; os.system("touch {marker}")',
    "from_import": "from os import system",
    "call": 'n_layer = open("{marker}", "w")',
    "dunder_import": 'n_layer = __import__("os").system("touch {marker}")',
    "exec": "exec(\"open('{marker}', 'w')\")",
    "eval_in_value": "n_layer = eval(\"open('{marker}', 'w')\")",
    "attribute": "n_layer = os.path",
    "dunder_attribute": "n_layer = ().__class__.__bases__",
    "comprehension": 'n_layer = [open("{marker}", "w") for _ in range(1)]',
    "generator": 'n_layer = list(open("{marker}", "w") for _ in "x")',
    "lambda": 'n_layer = (lambda: open("{marker}", "w"))()',
    "f_string": "out_dir = f\"{{open('{marker}', 'w')}}\"",
    "walrus": 'n_layer = (handle := open("{marker}", "w"))',
    "subscript": 'n_layer = [open("{marker}", "w")][0]',
    "dict_with_call": 'n_layer = {{1: open("{marker}", "w")}}',
    "arithmetic": "n_layer = 2 * 3",
    "conditional": 'n_layer = 1 if open("{marker}", "w") else 2',
    "name_reference": "n_layer = n_head",
    "augmented_assignment": "n_layer = 1\nn_layer += 1",
    "annotated_assignment": "n_layer: int = 4",
    "tuple_unpacking": "n_layer, n_head = 1, 2",
    "chained_assignment": "n_layer = n_head = 2",
    "attribute_target": "os.environ = 1",
    "subscript_target": "n_layer[0] = 1",
    "if_statement": 'if True:\n    open("{marker}", "w")',
    "with_statement": 'with open("{marker}", "w"):\n    pass',
    "function_def": 'def f():\n    open("{marker}", "w")',
    "decorated_class": '@print\nclass A:\n    x = open("{marker}", "w")',
    "bare_expression": 'n_layer = 2\nopen("{marker}", "w")',
    "assert": 'assert open("{marker}", "w")',
    "delete": "del n_layer",
    "try": 'try:\n    open("{marker}", "w")\nexcept Exception:\n    pass',
}


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def parse_train(args: list[str]) -> train.TrainSettings:
    return parse_settings(train.TrainSettings, args, prog="train.py", description="", config_files=True)


# ----------------------------------------------------------------------------- config files with code


@pytest.mark.parametrize("name", sorted(CODE_SNIPPETS))
def test_config_file_with_code_is_refused_and_nothing_runs(name: str, tmp_path: Path) -> None:
    marker = tmp_path / "code_ran"
    config = write(
        tmp_path / "evil.py", '"""a recipe"""\nlearning_rate = 1e-3\n' + CODE_SNIPPETS[name].format(marker=marker)
    )
    with pytest.raises(UserError) as info:
        parse_train([str(config)])
    message = str(info.value)
    assert_one_line_message(message, f"{config}:")
    assert any(
        phrase in message
        for phrase in ("only `name = literal` assignments are allowed", "must be a literal", "not valid Python syntax")
    ), message
    assert not marker.exists()


def test_code_inside_a_string_stays_a_string(tmp_path: Path) -> None:
    marker = tmp_path / "code_ran"
    config = write(tmp_path / "strings.py", f"out_dir = \"__import__('os').system('touch {marker}')\"\n")
    assert parse_train([str(config)]).out_dir == f"__import__('os').system('touch {marker}')"
    assert not marker.exists()


def test_dunder_names_are_unknown_settings(tmp_path: Path) -> None:
    config = write(tmp_path / "dunder.py", "__builtins__ = {'open': None}\n")
    with pytest.raises(UserError, match=r"dunder.py:1: unknown setting '__builtins__'"):
        parse_train([str(config)])


def test_a_plain_recipe_with_docstring_comments_and_literals_is_accepted(tmp_path: Path) -> None:
    config = write(
        tmp_path / "ok.py",
        '"""Docstring."""\n# comment\nlearning_rate = 3e-4  # trailing comment\nmin_lr = -0.0\nwandb_run_name = None\n'
        "compile = False\nn_layer = (4)\n",
    )
    cfg = parse_train([str(config)])
    assert (cfg.learning_rate, cfg.n_layer, cfg.wandb_run_name, cfg.compile) == (3e-4, 4, None, False)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"n_layer = 1\x00\n", "null bytes"),  # a SyntaxError or a ValueError, by Python version
        (b"n_layer = " + b"-" * 200_000 + b"1\n", "not a config file (null bytes or too deeply nested)"),
        (b"n_layer = " + b"[" * 5_000 + b"]" * 5_000 + b"\n", "not valid Python syntax"),
        (b'n_layer = 2\nout_dir = "\xff"\n', ":2: not UTF-8 text (byte 0xff)"),
        (b"n_layer = 4 +\n", ":1: not valid Python syntax"),
        (b"n_layer = 12.0\n", "n_layer must be of type integer, got 12.0"),
        (b'batch_size = "12"\n', "batch_size must be of type integer, got '12'"),
        (b"compile = 1\n", "compile must be of type boolean (True/False) or None, got 1"),
        (b"lerning_rate = 1e-3\n", ":1: unknown setting 'lerning_rate'"),
    ],
    ids=[
        "null_byte",
        "parser_exhaustion",
        "too_deep",
        "not_utf8",
        "syntax",
        "float_for_int",
        "str_for_int",
        "int_for_bool",
        "unknown_key",
    ],
)
def test_malformed_config_files_are_one_line_errors(content: bytes, fragment: str, tmp_path: Path) -> None:
    config = tmp_path / "bad.py"
    config.write_bytes(content)
    with pytest.raises(UserError) as info:
        parse_train([str(config)])
    assert_one_line_message(str(info.value), str(config), fragment)


def test_missing_or_directory_config_file(tmp_path: Path) -> None:
    for path in (tmp_path / "nope.py", tmp_path):
        with pytest.raises(UserError) as info:
            read_config_file(path)
        assert_one_line_message(str(info.value), f"config file {path} does not exist or is not a file")


def test_byte_order_mark_of_windows_editors_is_accepted(tmp_path: Path) -> None:
    config = tmp_path / "bom.py"
    config.write_bytes(b"\xef\xbb\xbfn_layer = 3\n")
    assert read_config_file(config) == {"n_layer": (3, 1)}


def test_config_with_code_through_the_script_exits_2_before_anything_is_created(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    marker = tmp_path / "code_ran"
    config = write(tmp_path / "evil.py", f'import os; os.system("touch {marker}")\n')
    out_dir = tmp_path / "out"
    code, _, stderr = run_main(train.main, [str(config), f"--out_dir={out_dir}", "--device=cpu"], capsys)
    assert_one_line_error(code, stderr)
    assert stderr == f"error: {config}:1: only `name = literal` assignments are allowed in config files " + (
        "(found Import); config files are read, never executed\n"
    )
    assert not marker.exists() and not out_dir.exists()


# ----------------------------------------------------------------------------- bad values


# Not repeated here (tests/test_train.py::test_impossible_settings_fail_before_training): learning_rate=-1,
# n_embd=30 with n_head=4, block_size larger than the data, dtype=float8, resume without a checkpoint.
TRAIN_BAD_VALUES = [
    (["--learning_rate=0"], "learning_rate must be a positive number, got 0.0"),
    (["--learning_rate=nan"], "learning_rate must be a positive number, got nan"),
    (["--learning_rate=inf"], "learning_rate must be a positive number, got inf"),
    (["--batch_size=0"], "batch_size must be a positive integer, got 0"),
    (["--batch_size=-4"], "batch_size must be a positive integer, got -4"),
    (["--block_size=0"], "block_size must be a positive integer, got 0"),
    (["--block_size=-16"], "block_size must be a positive integer, got -16"),
    (["--gradient_accumulation_steps=0"], "gradient_accumulation_steps must be a positive integer"),
    (["--n_layer=0"], "n_layer must be a positive integer, got 0"),
    (["--n_head=0"], "n_head must be a positive integer, got 0"),
    (["--n_embd=18", "--n_head=4"], "n_embd (18) must be divisible by n_head (4)"),
    (["--max_iters=-1"], "max_iters must be >= 0, got -1"),
    (["--dropout=1.0"], "dropout must be in [0, 1), got 1.0"),
    (["--beta2=1"], "beta2 must be in [0, 1), got 1.0"),
    (["--grad_clip=nan"], "grad_clip must be >= 0, got nan"),
    (["--muon_lr=-0.02"], "muon_lr must be a positive number, got -0.02"),
    (["--muon_momentum=1.5"], "muon_momentum must be in [0, 1), got 1.5"),
    (["--out_dir="], "out_dir must not be empty"),
    (["--device=tpu"], "unknown device 'tpu'; use auto, cpu, cuda, cuda:N or mps"),
    (["--device=cuda:99"], "'cuda:99'"),
    (["--dtype=float16"], "float16 needs a CUDA device"),
    (["--dtype=fp8"], "dtype='fp8' is not one of auto, float32, bfloat16, float16"),
    (["--optimizer=sgd"], "optimizer='sgd' is not one of adamw, muon"),
    (["--parallel=zero3"], "parallel='zero3' is not one of ddp, fsdp"),
    (["--pos_encoding=alibi"], "pos_encoding='alibi' is not one of learned, sinusoidal, rope"),
    (["--activation=swish"], "activation='swish' is not one of gelu, gelu_tanh, relu2"),
    (["--attention=flash"], "attention='flash' is not one of sdpa, math"),
    (["--pos_encoding=rope", "--n_embd=30", "--n_head=2"], "rope positions need an even head size, got 15"),
    (["--cpu_threads=0"], "cpu_threads must be a positive integer, got 0"),
    (["--lerning_rate=1e-3"], "unknown setting 'lerning_rate'"),  # the hint that follows: tests/core/test_settings.py
    (["--debug"], "unknown setting 'debug'"),  # a flag that no longer exists
    (["--batch_size=big"], "--batch_size must be of type integer, got 'big'"),
    (["--batch_size=1.5"], "--batch_size must be of type integer, got '1.5'"),
    (["--learning_rate=fast"], "--learning_rate must be of type number, got 'fast'"),
    (["--compile=maybe"], "--compile must be of type boolean (True/False) or None, got 'maybe'"),
    (["--n_layer"], "--n_layer needs a value, e.g. --n_layer=VALUE"),
    (["stray"], "config file stray does not exist or is not a file"),
    (["max_iters=5"], "config file max_iters=5 does not exist; a setting is given as --max_iters=5"),
    (["--seed=-1"], "seed must be in [0, 2**63), got -1"),
    (["--seed=99999999999999999999999"], "seed must be in [0, 2**63), got 9999"),
    (["--learning_rate=1e-4", "--min_lr=1"], "--min_lr (1.0) is above --learning_rate (0.0001)"),
    (["--init_from=gpt3"], "gpt3 is neither a directory, a hub name (owner/name) nor one of gpt2"),
]


@pytest.mark.parametrize(("flags", "message"), TRAIN_BAD_VALUES, ids=[" ".join(f) for f, _ in TRAIN_BAD_VALUES])
def test_train_bad_values_are_one_line_before_training(
    flags: list[str], message: str, char_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out_dir = tmp_path / "out"
    code, stdout, stderr = run_main(train.main, [*tiny_train_args(char_data_dir, out_dir), *flags], capsys)
    assert_one_line_error(code, stderr, message)
    assert stdout == ""  # refused before a model was built or a line printed
    assert sorted(tmp_path.iterdir()) == []  # nothing created, out_dir included


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--n_head=0"], "n_head must be a positive integer, got 0"),
        (["--dropout=-0.1"], "dropout must be in [0, 1), got -0.1"),
        (["--pos_encoding=rope", "--n_embd=30", "--n_head=2"], "rope positions need an even head size, got 15"),
    ],
)
def test_model_settings_are_refused_before_the_data_is_read(flags: list[str], message: str, tmp_path: Path) -> None:
    # Were the model's shape checked only when the model is built, the missing data would be reported first.
    args = [*tiny_train_args(tmp_path / "no_data", tmp_path / "out"), *flags]
    with pytest.raises(UserError) as info:
        train.main(args)
    assert_one_line_message(info.value, message)
    assert sorted(tmp_path.iterdir()) == []


def test_a_bad_value_from_a_config_file_names_its_line(
    char_data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "run.py"
    config.write_text("# a run's settings\nmax_iters = 5\ndropout = 2.0\nmin_lr = 1.0\n")
    args = [*tiny_train_args(char_data_dir, tmp_path / "out"), str(config)]
    code, _, stderr = run_main(train.main, args, capsys)
    assert_one_line_error(code, stderr, f"error: {config}:4: --min_lr (1.0) is above --learning_rate")
    code, _, stderr = run_main(train.main, [*args, "--min_lr=1e-5"], capsys)
    assert_one_line_error(code, stderr, f"error: {config}:3: --dropout must be in [0, 1), got 2.0")
    code, _, stderr = run_main(train.main, [*args, "--dropout=0.0", "--min_lr=2.0"], capsys)
    assert_one_line_error(code, stderr, "error: --min_lr (2.0) is above --learning_rate")
    assert sorted(tmp_path.iterdir()) == [config]


# Not repeated here (tests/test_sample.py::test_bad_settings_are_one_clear_error): max_new_tokens=0, top_p=1.5,
# top_p=0, an empty prompt, top_k=0, temperature=-1.
SAMPLE_BAD_VALUES = [
    (["--max_new_tokens=-5"], "--max_new_tokens must be a positive integer, got -5"),
    (["--num_samples=0"], "--num_samples must be a positive integer, got 0"),
    (["--top_p=-0.1"], "--top_p must be in (0, 1], got -0.1"),
    (["--top_p=nan"], "--top_p must be in (0, 1], got nan"),
    (["--top_k=-3"], "--top_k must be a positive integer or None, got -3"),
    (["--temperature=nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--temperature=inf"], "--temperature must be a finite number >= 0, got inf"),
    (["--checkpoint=newest"], "--checkpoint must be best or latest, got 'newest'"),
    (["--stop="], "--stop needs a non-empty string"),
    (["--device=tpu"], "unknown device 'tpu'"),
    (["--dtype=float16", "--device=cpu"], "float16 needs a CUDA device"),
    (["--max_new_tokens=lots"], "--max_new_tokens must be of type integer, got 'lots'"),
    (["--temprature=0.5"], "unknown setting 'temprature'"),
    (["config.py"], "unexpected argument 'config.py'; settings are given as --key=value"),
]


@pytest.mark.parametrize(("flags", "message"), SAMPLE_BAD_VALUES, ids=[" ".join(f) for f, _ in SAMPLE_BAD_VALUES])
def test_sample_bad_values_are_one_line(
    flags: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, stdout, stderr = run_main(sample.main, [f"--out_dir={tmp_path / 'none'}", *flags], capsys)
    assert_one_line_error(code, stderr, message)
    assert stdout == ""
    assert sorted(tmp_path.iterdir()) == []
