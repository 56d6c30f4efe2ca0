"""Typed settings for every script: defaults in a dataclass, config files read with `ast`, `--key=value` flags.

A settings class is a dataclass whose fields are declared with `setting(default, help)`. `parse_settings`
fills it from config files (plain `name = literal` lines, never executed) and then from the command line,
checks every value's type and the rules its fields declare, calls the class's optional `validate()` and returns
the instance. Every mistake a user can make here is a `UserError` naming the key (and the file and line for config
files).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import math
import re
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

from gptkit.core.errors import UserError
from gptkit.core.fileio import read_utf8_text

T = TypeVar("T")


# Rules a setting can declare; parse_settings checks them for every script, worded the same everywhere.
# NaN fails every rule (each comparison with NaN is false).
RULES: dict[str, tuple[Any, str]] = {
    "positive": (lambda v: v > 0, "must be a positive integer"),
    "positive_number": (lambda v: v > 0 and math.isfinite(v), "must be a positive number"),
    "non_negative": (lambda v: v >= 0, "must be >= 0"),
    "fraction": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "seed": (lambda v: 0 <= v < 2**63, "must be in [0, 2**63)"),  # what torch's generators take
}


def setting(default: Any, help: str, rule: str | None = None, choices: Sequence[str] = ()) -> Any:  # noqa: A002
    """Declare a settings field with its default, a one-line description for --help, and optionally a rule from
    RULES or the values it may take (None, where the type allows it, passes both)."""
    if rule is not None and rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}")  # a programming error, caught by any test that builds settings
    metadata = {"help": help, "rule": rule, "choices": tuple(choices)}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def fixed(default: Any, why: str) -> Any:
    """Re-declare a shared settings field that this script does not take: it keeps `default`, has no key and is not
    in --help (`why` says why, for the reader). E.g. the preference script's records name their own fields."""
    return dataclasses.field(default=default, metadata={"help": why, "fixed": True})


def _takes_key(field: dataclasses.Field) -> bool:
    return not field.name.startswith("_") and not field.metadata.get("fixed", False)


def check_rules(instance: Any) -> None:
    """UserError for the first field whose value breaks its declared rule or choices."""
    for field in dataclasses.fields(instance):
        value, rule, choices = getattr(instance, field.name), field.metadata.get("rule"), field.metadata.get("choices")
        if value is None:
            continue
        if rule is not None and not RULES[rule][0](value):
            raise UserError(f"--{field.name} {RULES[rule][1]}, got {value}")
        if choices and value not in choices:
            raise UserError(f"--{field.name}={value!r} is not one of {', '.join(choices)}")


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    """(inner type, whether None is allowed) for `X | None` / Optional[X]; (annotation, False) otherwise."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(annotation)) == 2:
            return args[0], True
    return annotation, False


_READABLE_TYPES = {bool: "boolean (True/False)", int: "integer", float: "number", str: "string"}


def _type_name(annotation: Any) -> str:
    inner, optional = _unwrap_optional(annotation)
    if typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        name = f"list of {_READABLE_TYPES.get(item, item.__name__)}s"
    else:
        name = _READABLE_TYPES.get(inner, getattr(inner, "__name__", str(inner)))
    return f"{name} or None" if optional else name


def _coerce(key: str, value: Any, annotation: Any, where: str) -> Any:
    """Check a literal value (from a config file or parsed from the CLI) against the field's type."""
    inner, optional = _unwrap_optional(annotation)
    if value is None:
        if optional:
            return None
        raise UserError(f"{where}{key} cannot be None; give a value of type {_type_name(annotation)}")
    if typing.get_origin(inner) is list:
        (item_type,) = typing.get_args(inner)
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_coerce(key, item, item_type, where) for item in items]
    if inner is bool:
        if isinstance(value, bool):
            return value
    elif inner is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif inner is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif inner is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a programming error in a settings class
        raise TypeError(f"unsupported settings type {annotation!r} for {key}")
    raise UserError(f"{where}{key} must be of type {_type_name(annotation)}, got {value!r}")


_TRUE_WORDS = {"true", "1", "yes", "on"}
_FALSE_WORDS = {"false", "0", "no", "off"}


def _parse_cli_value(key: str, text: str, annotation: Any) -> Any:
    """Turn the text after `--key=` into a value of the field's type."""
    inner, optional = _unwrap_optional(annotation)
    if optional and text.lower() == "none":  # as the switches' words, in any case
        return None
    if typing.get_origin(inner) is list:
        (item_type,) = typing.get_args(inner)
        return [_parse_cli_value(key, text, item_type)]
    try:
        if inner is bool:
            word = text.lower()
            if word in _TRUE_WORDS:
                return True
            if word in _FALSE_WORDS:
                return False
            raise ValueError
        if inner is int:
            return int(text)
        if inner is float:
            return float(text)
    except ValueError:
        raise UserError(f"--{key} must be of type {_type_name(annotation)}, got {text!r}") from None
    return text


def read_config_file(path: str | Path) -> dict[str, tuple[Any, int]]:
    """Read a config file of `name = literal` lines without executing it.

    Returns {name: (value, line number)}. Anything but a literal assignment (imports, calls, attribute
    access, comprehensions, augmented assignment, ...) is a UserError naming the file and line.
    A module docstring is allowed.
    """
    path = Path(path)
    if not path.is_file() and "=" in path.name:  # a setting without its dashes
        raise UserError(f"config file {path} does not exist; a setting is given as --{path.name}")
    if not path.is_file():
        raise UserError(f"config file {path} does not exist or is not a file; check the path")
    source = read_utf8_text(path)  # editors on Windows may start the file with a byte-order mark: no text
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as exc:
        raise UserError(f"{path}:{exc.lineno or 1}: not valid Python syntax ({exc.msg})") from None
    except (ValueError, MemoryError, RecursionError):  # null bytes; nesting too deep for the parser
        raise UserError(f"{path}: not a config file (null bytes or too deeply nested)") from None
    values: dict[str, tuple[Any, int]] = {}
    for index, node in enumerate(tree.body):
        is_docstring = index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if is_docstring and isinstance(node.value.value, str):
            continue
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise UserError(
                f"{path}:{node.lineno}: only `name = literal` assignments are allowed in config files "
                f"(found {type(node).__name__}); config files are read, never executed"
            )
        name = node.targets[0].id
        try:
            value = ast.literal_eval(node.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            raise UserError(
                f"{path}:{node.lineno}: {name} must be a literal (number, string, bool, None, list); "
                "expressions and calls are not allowed"
            ) from None
        if name in values:
            raise UserError(f"{path}:{node.lineno}: {name} is set twice (first at line {values[name][1]}); keep one")
        values[name] = (value, node.lineno)
    return values


def format_help(cls: type, prog: str, description: str, config_files: bool, positional: str | None = None) -> str:
    """The --help text: usage, then every key with its type, default and meaning."""
    words = "[CONFIG_FILE.py ...] " if config_files else f"{positional.upper()} ... " if positional else ""
    usage = f"usage: python {prog} {words}[--key=value ...]"
    lines = [usage, "", description, "", "settings (key, type, default: meaning):"]
    types_by_name = _field_types(cls)
    for field in filter(_takes_key, dataclasses.fields(cls)):
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        lines.append(f"  --{field.name}  ({_type_name(types_by_name[field.name])}, default {default!r})")
        meaning, choices = field.metadata.get("help", ""), field.metadata.get("choices", ())
        if choices and not all(choice in meaning for choice in choices):  # the values it takes, where not said
            meaning += f" (one of: {', '.join(choices)})"
        lines.append(f"      {meaning}")
    if config_files:
        lines.append("")
        lines.append("Config files hold `name = literal` lines with the same keys; they are read, never executed.")
        lines.append("Later files override earlier ones, and command-line flags override files wherever they stand.")
    return "\n".join(lines)


def unknown_setting(key: str, known: set[str], where: str) -> UserError:
    """The error for a key no setting has, naming the closest known key when one is close (a likely typo)."""
    hint = ""
    for close in difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75):
        hint = f"did you mean {close!r}? " if where else f"did you mean --{close}? "  # as the user writes it there
    return UserError(f"{where}unknown setting {key!r}; {hint}run with --help to list the settings")


def parse_settings(
    cls: type[T],
    argv: Sequence[str],
    prog: str,
    description: str,
    config_files: bool = False,
    positional: str | None = None,
) -> T:
    """Build a `cls` instance from config files and `--key=value` / `--key value` flags.

    Takes the settings dataclass, the argument list (without the program name), the program name and a
    one-line description for --help, and whether positional config files are accepted, or else `positional`: the
    list setting that arguments without `--` add to (plot.py's run directories). Prints help and exits 0 on
    --help/-h. Returns the validated instance; raises UserError for any mistake.
    """
    if "--help" in argv or "-h" in argv:
        print(format_help(cls, prog, description, config_files, positional))
        sys.exit(0)
    given = _Given(types=_field_types(cls), known={f.name for f in dataclasses.fields(cls) if _takes_key(f)})
    index = 0
    while index < len(argv):
        arg = argv[index]
        index += 1
        if not arg.startswith("--") and positional and not config_files:
            given.flag_lists.setdefault(positional, []).append(arg)
        elif not arg.startswith("--"):
            if not config_files:
                raise UserError(f"unexpected argument {arg!r}; settings are given as --key=value (see --help)")
            given.add_file(arg)
        else:
            key, has_value, text = arg[2:].partition("=")
            if key not in given.known:
                raise unknown_setting(key, given.known, "")
            if not has_value:
                text, index = _value_after(key, given.types[key], argv, index)
            given.add_flag(key, text)
    instance = cls(**given.values())
    try:
        check_rules(instance)
        validate = getattr(instance, "validate", None)
        if callable(validate):
            validate()
    except UserError as error:
        raise _with_origin(error, given.file_origins()) from None
    return instance


@dataclasses.dataclass(kw_only=True)
class _Given:
    """What config files and flags gave, by key: later files override earlier ones, and flags override files
    wherever they stand; a list setting's repeated flags add up."""

    types: dict[str, Any]
    known: set[str]
    from_files: dict[str, Any] = dataclasses.field(default_factory=dict)
    origins: dict[str, str] = dataclasses.field(default_factory=dict)  # key: the config file line its value came from
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    flag_lists: dict[str, list[Any]] = dataclasses.field(default_factory=dict)

    def add_file(self, path: str) -> None:
        for key, (value, line) in read_config_file(path).items():
            where = f"{path}:{line}: "
            if key not in self.known:
                raise unknown_setting(key, self.known, where)
            self.from_files[key] = _coerce(key, value, self.types[key], where)
            self.origins[key] = where

    def add_flag(self, key: str, text: str) -> None:
        annotation = self.types[key]
        value = _parse_cli_value(key, text, annotation)
        if typing.get_origin(_unwrap_optional(annotation)[0]) is list and value is not None:
            self.flag_lists.setdefault(key, []).extend(value)
        else:
            self.flags[key] = value

    def values(self) -> dict[str, Any]:
        return {**self.from_files, **self.flags, **self.flag_lists}

    def file_origins(self) -> dict[str, str]:
        """The config file line of each key whose value a flag did not replace."""
        flagged = self.flags.keys() | self.flag_lists.keys()
        return {key: where for key, where in self.origins.items() if key not in flagged}


def _value_after(key: str, annotation: Any, argv: Sequence[str], index: int) -> tuple[str, int]:
    """The text of `--key` given without `=`, and the index of the argument after it: the next argument, or "true"
    for a bool flag not followed by a bool word (--compile, --compile False)."""
    is_flag = _unwrap_optional(annotation)[0] is bool
    next_is_value = index < len(argv) and not argv[index].startswith("--")
    words = _TRUE_WORDS | _FALSE_WORDS | ({"none"} if _unwrap_optional(annotation)[1] else set())
    if is_flag and not (next_is_value and argv[index].lower() in words):
        return "true", index
    if next_is_value:
        return argv[index], index + 1
    raise UserError(f"--{key} needs a value, e.g. --{key}=VALUE")


def _with_origin(error: UserError, origins: dict[str, str]) -> UserError:
    """The error, led by the config file line of the first setting it names (--key) whose value came from one."""
    message = str(error)
    for key in re.findall(r"--(\w+)", message):
        if key in origins:
            return UserError(f"{origins[key]}{message}")
    return error


def settings_to_dict(instance: Any) -> dict[str, Any]:
    """The settings as a plain dict of literals (for checkpoints, logs and wandb)."""
    return {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}


def setting_list(default: list[Any], help: str) -> Any:  # noqa: A002
    """Declare a list-valued settings field; on the command line each repeated --key=value adds an item."""
    return setting(list(default), help)
