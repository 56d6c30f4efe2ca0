"""The shape of the code: layers import only downwards, sizes stay readable, no sys.path edits.

The layers are the README's "How it is built" picture, lowest first. A new module must be placed in LAYERS (the
test says so), which keeps the picture and the code in step.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import REPO

# Lowest first. A module may import from its own layer and the ones below it, never from a higher one.
LAYERS: list[set[str]] = [
    {"gptkit", "gptkit.errors"},
    {"gptkit.fileio", "gptkit.progress", "gptkit.signals", "gptkit.bpe"},
    {"gptkit.settings", "gptkit.devices", "gptkit.download", "gptkit.tokenizer", "gptkit.muon"},
    {"gptkit.data", "gptkit.hf_gpt2", "gptkit.distributed", "gptkit.checkpoint", "gptkit.rundir", "gptkit.averaging"},
    {"gptkit.textstream", "gptkit.sampling"},
    {
        "gptkit.prepare",
        "gptkit.prepare.settings",
        "gptkit.prepare.discover",
        "gptkit.prepare.inputs",
        "gptkit.prepare.items",
    },
    {"gptkit.prepare.workers", "gptkit.prepare.writer"},
    {"gptkit.prepare.driver", "gptkit.prepare.shakespeare", "gptkit.prepare.tokenizer_training"},
    {
        "gptkit.cpu_decoding",
        "gptkit.compiled_decoding",
        "gptkit.native_decoding",
        "gptkit.quantization",
        "gptkit.loading",
        "gptkit.runlog",
        "gptkit.training",
        "gptkit.evaluation",
        "gptkit.plotting",
    },
    {"gptkit.engine"},
    {"gptkit.batcher", "gptkit.openai_api", "gptkit.harness"},
    {"gptkit.server"},
    {"model"},
]
SCRIPT_DIRS = ("prepare_data", "benchmarks")  # scripts: the top layer, with train.py, sample.py and friends
ROOT_SCRIPT_MAX_FUNCTION_LINES = 80
PACKAGE_MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 500
MODEL_MAX_LINES = 380


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files(root: Path) -> list[Path]:
    """The package, model.py and the scripts: every Python file but the tests."""
    files = sorted((root / "gptkit").rglob("*.py")) + sorted(root.glob("*.py"))
    for directory in SCRIPT_DIRS:
        files += sorted((root / directory).glob("*.py"))
    return files


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement in `path` names (absolute imports; the package uses no relative ones)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from gptkit import data`
    return names


def layer_of(name: str, layers: list[set[str]]) -> int | None:
    for rank, layer in enumerate(layers):
        if name in layer:
            return rank
    return None


def upward_imports(root: Path, layers: list[set[str]]) -> list[str]:
    """'importer -> imported' for each import of a higher layer (scripts are above every layer), and 'unplaced
    module X' for a package module missing from the layers."""
    problems = []
    for path in project_files(root):
        name = module_name(path, root)
        in_package = name == "model" or name.startswith("gptkit")
        rank = layer_of(name, layers) if in_package else len(layers)
        if rank is None:
            problems.append(f"unplaced module {name}: add it to LAYERS")
            continue
        for imported in imported_modules(path):
            target = layer_of(imported, layers)
            is_script = imported.split(".")[0] in {"train", "sample", "serve", "evaluate", "plot", "bench",
                                                   *SCRIPT_DIRS}  # fmt: skip
            if (target is not None and target > rank) or (is_script and in_package):
                problems.append(f"{name} -> {imported}")
    return problems


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_imports(REPO, LAYERS) == []


def test_the_checker_finds_an_upward_import(tmp_path: Path) -> None:
    """The layer test can fail: a low module importing a higher one, or a script, is reported."""
    (tmp_path / "gptkit").mkdir()
    (tmp_path / "gptkit" / "__init__.py").write_text("")
    (tmp_path / "gptkit" / "errors.py").write_text("from gptkit import data\nimport train\n")
    (tmp_path / "gptkit" / "data.py").write_text("from gptkit.errors import UserError\n")
    (tmp_path / "gptkit" / "extra.py").write_text("")
    problems = upward_imports(tmp_path, [{"gptkit", "gptkit.errors"}, {"gptkit.data"}])
    assert sorted(problems) == [
        "gptkit.errors -> gptkit.data",
        "gptkit.errors -> train",
        "unplaced module gptkit.extra: add it to LAYERS",
    ]


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """(name, lines) of every function and method in `path`, decorators excluded."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    functions = (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    return [(f.name, f.end_lineno - f.lineno + 1) for f in functions]


@pytest.mark.parametrize("path", project_files(REPO), ids=lambda p: str(p.relative_to(REPO)))
def test_functions_and_modules_stay_readable(path: Path) -> None:
    in_package = path.is_relative_to(REPO / "gptkit")
    limit = PACKAGE_MAX_FUNCTION_LINES if in_package else ROOT_SCRIPT_MAX_FUNCTION_LINES
    too_long = [(name, lines) for name, lines in function_lengths(path) if lines > limit]
    assert too_long == [], f"functions over {limit} lines"
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= (MODEL_MAX_LINES if path.name == "model.py" and path.parent == REPO else MAX_MODULE_LINES)


def test_nothing_outside_the_tests_edits_sys_path() -> None:
    offenders = [str(p.relative_to(REPO)) for p in project_files(REPO) if "sys.path" in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_the_root_holds_only_scripts_and_project_files() -> None:
    """Support code lives in the package: the root's Python files are the scripts people read and run."""
    root_python = sorted(p.name for p in REPO.glob("*.py"))
    assert set(root_python) <= {"model.py", "train.py", "sample.py", "serve.py", "evaluate.py", "plot.py"}, root_python
