"""gptkit.core.settings: typos in setting names are answered with the closest known key."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from gptkit.core.errors import UserError
from gptkit.core.settings import parse_settings, setting


@dataclass
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
