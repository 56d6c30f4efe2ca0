"""gptkit.core.settings: typos in setting names are answered with the closest known key."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from gptkit.core.errors import UserError
from gptkit.core.settings import fixed, parse_settings, setting


@dataclass(kw_only=True)
class Demo:
    learning_rate: float = setting(1e-3, "peak learning rate")
    min_lr: float = setting(1e-4, "final learning rate")
    max_iters: int = setting(10, "steps")


def parse(argv: list[str]) -> Demo:
    return parse_settings(Demo, argv, prog="demo", description="", config_files=True)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (
            "--learning_rat=3",
            "unknown setting 'learning_rat'; did you mean --learning_rate? run with --help to list the settings",
        ),
        ("--max_iter=3", "unknown setting 'max_iter'; did you mean --max_iters? run with --help to list the settings"),
        ("--batch_size=3", "unknown setting 'batch_size'; run with --help to list the settings"),
    ],
)
def test_unknown_flag_suggests_the_closest_key_only_when_close(flag: str, message: str) -> None:
    with pytest.raises(UserError) as error:
        parse([flag])
    assert str(error.value) == message


def test_unknown_key_in_a_config_file_is_suggested_as_the_file_spells_keys(tmp_path: Path) -> None:
    config = tmp_path / "recipe.py"
    config.write_text("max_iters = 5\nlearningrate = 0.1\n", encoding="utf-8")
    with pytest.raises(UserError) as error:
        parse([str(config)])
    hint = "did you mean 'learning_rate'? run with --help to list the settings"
    assert str(error.value) == f"{config}:2: unknown setting 'learningrate'; {hint}"


@dataclass(kw_only=True)
class Fixed(Demo):
    min_lr: float = fixed(0.0, "this script decays to zero")


def test_a_fixed_field_keeps_its_value_and_takes_no_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = parse_settings(Fixed, ["--max_iters=3"], prog="fixed", description="")
    assert (cfg.learning_rate, cfg.min_lr, cfg.max_iters) == (1e-3, 0.0, 3)
    with pytest.raises(UserError, match=r"^unknown setting 'min_lr'; run with --help"):
        parse_settings(Fixed, ["--min_lr=1e-5"], prog="fixed", description="")
    config = tmp_path / "c.py"
    config.write_text("min_lr = 1e-5\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(config))}:1: unknown setting 'min_lr'"):
        parse_settings(Fixed, [str(config)], prog="fixed", description="", config_files=True)
    with pytest.raises(SystemExit):
        parse_settings(Fixed, ["--help"], prog="fixed", description="")
    listed = capsys.readouterr().out
    assert "--learning_rate" in listed and "--max_iters" in listed and "min_lr" not in listed


@dataclass(kw_only=True)
class Ruled:
    max_iters: int = setting(10, "steps", rule="positive")
    warmup_iters: int = setting(0, "warm-up steps")

    def validate(self) -> None:
        if self.warmup_iters > self.max_iters:
            raise UserError(f"--warmup_iters ({self.warmup_iters}) must not exceed --max_iters ({self.max_iters})")


def test_a_bad_value_from_a_config_file_names_the_file_and_line(tmp_path: Path) -> None:
    config = tmp_path / "run.py"
    config.write_text("# a run\nwarmup_iters = 5\nmax_iters = 0\n")
    cases = [
        ([str(config)], f"{config}:3: --max_iters must be a positive integer, got 0"),
        ([str(config), "--max_iters=2"], f"{config}:2: --warmup_iters (5) must not exceed --max_iters (2)"),
        ([str(config), "--max_iters=2", "--warmup_iters=3"], "--warmup_iters (3) must not exceed --max_iters (2)"),
        (["--max_iters=-1"], "--max_iters must be a positive integer, got -1"),
    ]
    for argv, message in cases:
        with pytest.raises(UserError) as error:
            parse_settings(Ruled, argv, prog="ruled", description="", config_files=True)
        assert str(error.value) == message, argv


@dataclass(kw_only=True)
class Switches:
    max_iters: int = setting(10, "steps")
    compile: bool | None = setting(None, "compile the model (None: where it is faster)")


def test_flags_override_config_files_wherever_they_stand(tmp_path: Path) -> None:
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("max_iters = 100\ncompile = True\n")
    second.write_text("max_iters = 200\n")
    for argv in (["--max_iters=3", str(first), str(second)], [str(first), "--max_iters=3", str(second)]):
        cfg = parse_settings(Switches, argv, prog="s", description="", config_files=True)
        assert (cfg.max_iters, cfg.compile) == (3, True), argv
    cfg = parse_settings(Switches, [str(first), str(second)], prog="s", description="", config_files=True)
    assert cfg.max_iters == 200  # the later file
    cfg = parse_settings(Switches, [str(first), "--compile", "None"], prog="s", description="", config_files=True)
    assert cfg.compile is None


def test_a_key_set_twice_in_one_config_file_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "c.py"
    config.write_text("max_iters = 4\n# later\nmax_iters = 8\n")
    with pytest.raises(UserError) as error:
        parse_settings(Switches, [str(config)], prog="s", description="", config_files=True)
    assert str(error.value) == f"{config}:3: max_iters is set twice (first at line 1); keep one"


@dataclass(kw_only=True)
class Chosen:
    targets: str = setting("attention", "which layers get adapters", choices=("attention", "mlp", "all"))
    mode: str = setting("a", "a | b: how", choices=("a", "b"))


def test_help_lists_the_values_a_choice_takes_where_its_meaning_does_not(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_settings(Chosen, ["--help"], prog="c", description="")
    lines = capsys.readouterr().out.splitlines()
    assert "      which layers get adapters (one of: attention, mlp, all)" in lines
    assert "      a | b: how" in lines
