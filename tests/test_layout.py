"""The shape of the code: subpackages import only from the layers below them, model.py reads alone, no module
shadows another distribution's, and nothing edits sys.path.

The layers are the picture in gptkit/__init__.py, lowest first; the root scripts, prepare_data/ and benchmarks/ sit
above them all. A new subpackage must be placed in MAY_IMPORT (the test says so), which keeps picture and code in step.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

from helpers import REPO

# What each part of the package may import from the package, besides itself. Two parts on the same level (train
# and infer, serve and eval) do not import each other.
MAY_IMPORT: dict[str, set[str]] = {
    "gptkit": set(),
    "gptkit.model": set(),
    "gptkit.core": set(),
    "gptkit.data": {"gptkit.core"},
    "gptkit.weights": {"gptkit.core", "gptkit.data", "gptkit.model"},
    "gptkit.train": {"gptkit.core", "gptkit.data", "gptkit.weights", "gptkit.model"},
    "gptkit.infer": {"gptkit.core", "gptkit.data", "gptkit.weights", "gptkit.model"},
    "gptkit.serve": {"gptkit.core", "gptkit.data", "gptkit.weights", "gptkit.model", "gptkit.infer"},
    "gptkit.eval": {"gptkit.core", "gptkit.data", "gptkit.weights", "gptkit.model", "gptkit.infer"},
}
SCRIPT_DIRS = ("prepare_data", "benchmarks")
ROOT_SCRIPTS = {"train.py", "sample.py", "serve.py", "eval.py", "plot.py", "export.py"}
ROOT_MODEL = "model.py"  # the transformer itself, the file a reader opens first; gptkit/model.py links to it


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files(root: Path) -> list[Path]:
    return sorted((root / "gptkit").rglob("*.py"))


def project_files(root: Path) -> list[Path]:
    """The package and the scripts: every Python file but the tests."""
    files = package_files(root) + sorted(root.glob("*.py"))
    for directory in SCRIPT_DIRS:
        files += sorted((root / directory).glob("*.py"))
    return files


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement or an `importlib.import_module("...")` call in `path` names; a relative
    import is named with its leading dots, which no layer allows (the package writes imports whole)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level:
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from gptkit import data`
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module"):
            names.update(arg.value for arg in node.args[:1] if isinstance(arg, ast.Constant))
    return names


def part_of(name: str) -> str | None:
    """The part of the package a module belongs to: gptkit.infer.engine -> gptkit.infer; None outside it."""
    parts = name.split(".")
    if parts[0] != "gptkit":
        return None
    return ".".join(parts[:2])


def upward_imports(root: Path, may_import: dict[str, set[str]]) -> list[str]:
    """'importer -> imported' for each import the layers forbid (of a higher or sideways part, or of a script),
    and 'unplaced part X' for a subpackage missing from the layers."""
    scripts = {Path(name).stem for name in ROOT_SCRIPTS} | set(SCRIPT_DIRS)
    scripts |= {path.stem for directory in SCRIPT_DIRS for path in (root / directory).glob("*.py")}
    problems = []
    for path in package_files(root):
        name = module_name(path, root)
        part = part_of(name)
        if part not in may_import:
            problems.append(f"unplaced part {part}: add it to MAY_IMPORT")
            continue
        for imported in imported_modules(path):
            target = part_of(imported)
            forbidden = target not in (None, "gptkit", part) and target not in may_import[part]
            if forbidden or imported.startswith(".") or imported.split(".")[0] in scripts:
                problems.append(f"{name} -> {imported}")
    return sorted(set(problems))


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_imports(REPO, MAY_IMPORT) == []


def test_the_checker_finds_upward_and_sideways_imports(tmp_path: Path) -> None:
    """The layer test can fail: a low module importing a higher one, a sideways part, or a script, is reported."""
    for part in ("core", "data", "train", "infer", "extra"):
        (tmp_path / "gptkit" / part).mkdir(parents=True)
        (tmp_path / "gptkit" / part / "__init__.py").write_text("")
    (tmp_path / "gptkit" / "__init__.py").write_text("")
    (tmp_path / "gptkit" / "core" / "errors.py").write_text("from gptkit.data import loader\nimport train\n")
    (tmp_path / "gptkit" / "data" / "loader.py").write_text("from gptkit.core.errors import UserError\n")
    (tmp_path / "gptkit" / "train" / "loop.py").write_text("from gptkit.infer import engine\n")
    (tmp_path / "gptkit" / "infer" / "engine.py").write_text("from gptkit.data.loader import x\nfrom . import y\n")
    (tmp_path / "gptkit" / "data" / "reader.py").write_text("import importlib\nimportlib.import_module('bench_x')\n")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "bench_x.py").write_text("")
    problems = upward_imports(
        tmp_path,
        {key: MAY_IMPORT[key] for key in ("gptkit", "gptkit.core", "gptkit.data", "gptkit.train", "gptkit.infer")},
    )
    assert problems == [
        "gptkit.core.errors -> gptkit.data",
        "gptkit.core.errors -> gptkit.data.loader",
        "gptkit.core.errors -> train",
        "gptkit.data.reader -> bench_x",
        "gptkit.infer.engine -> .",
        "gptkit.train.loop -> gptkit.infer",
        "gptkit.train.loop -> gptkit.infer.engine",
        "unplaced part gptkit.extra: add it to MAY_IMPORT",
    ]


def test_the_model_imports_torch_and_the_standard_library_only() -> None:
    imported = {name.split(".")[0] for name in imported_modules(REPO / ROOT_MODEL)}
    outside = {name for name in imported if name not in sys.stdlib_module_names and name != "__future__"}
    assert outside == {"torch"}


def test_nothing_outside_the_tests_edits_sys_path() -> None:
    offenders = [str(p.relative_to(REPO)) for p in project_files(REPO) if "sys.path" in p.read_text(encoding="utf-8")]
    assert offenders == []


def test_the_root_holds_only_scripts_and_the_model() -> None:
    """Support code lives in the package: the root's Python files are the scripts people run and model.py."""
    root_python = {p.name for p in REPO.glob("*.py")}
    assert root_python == ROOT_SCRIPTS | {ROOT_MODEL}


def test_the_root_model_and_the_package_model_are_one_file() -> None:
    """`import model` from the checkout and `import gptkit.model` read the same file: one copy of the code. A fresh
    Python in the checkout says which file each import would read (find_spec: without running model.py, whose torch
    would take seconds to import)."""
    assert (REPO / "gptkit" / "model.py").is_symlink()
    assert (REPO / "gptkit" / "model.py").resolve() == (REPO / ROOT_MODEL).resolve()
    probe = "from importlib.util import find_spec; from pathlib import Path; print(Path(find_spec('model').origin).resolve()); print(Path(find_spec('gptkit.model').origin).resolve())"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    root_file, package_file = out.stdout.split()
    assert root_file == package_file == str((REPO / ROOT_MODEL).resolve())


def test_the_text_preparation_scripts_load_without_torch() -> None:
    """Preparing text needs no torch: its import alone takes seconds, which each of these scripts would pay on
    every run (and each of their tests that starts one)."""
    scripts = ["corpus.py", "fineweb.py", "shakespeare.py", "shakespeare_char.py", "train_tokenizer.py"]
    probe = "import runpy, sys\nfor name in sys.argv[1:]:\n    runpy.run_path(f'prepare_data/{name}')\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", probe, *scripts], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"


def load_module_from(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The module in the file at `path`, run under a name of its own (registered while the test lasts, as its
    dataclasses need)."""
    spec = importlib.util.spec_from_file_location("installed_model", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_a_wheel_holds_the_model_in_the_package_and_no_top_level_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel built from the checkout's files installs gptkit with model.py's code inside it and no top-level `model`,
    and ships every C++ file of the native step. It is built from a copy, since setuptools leaves a build/ folder in
    the tree it builds."""
    source, wheels, target = tmp_path / "source", tmp_path / "wheels", tmp_path / "site"
    source.mkdir()
    for name in ("pyproject.toml", "requirements.txt", ROOT_MODEL):
        shutil.copy2(REPO / name, source / name, follow_symlinks=False)
    shutil.copytree(REPO / "gptkit", source / "gptkit", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, source], check=True, cwd=tmp_path)
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        assert archive.read("gptkit/model.py") == (REPO / ROOT_MODEL).read_bytes()
        for source in sorted((REPO / "gptkit" / "infer" / "native" / "csrc").iterdir()):  # the native step's C++
            assert archive.read(source.relative_to(REPO).as_posix()) == source.read_bytes()
    assert not [name for name in names if name.startswith("model")]
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", target, wheel], check=True)
    assert (target / "gptkit" / "model.py").is_file() and not (target / "gptkit" / "model.py").is_symlink()
    assert not (target / "model.py").exists()
    # A fresh Python finds gptkit.model in the installed tree (find_spec: without importing torch, which takes seconds)
    probe = "from importlib.util import find_spec; print(find_spec('gptkit.model').origin)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == f"{target / 'gptkit' / 'model.py'}\n"
    installed = load_module_from(target / "gptkit" / "model.py", monkeypatch)  # this process has torch already
    params = installed.GPT(
        installed.GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=4, vocab_size=5)
    ).get_num_params()
    # wte 5*8 (tied head), block: two LayerNorms 2*16, c_attn 8*24+24, c_proj 8*8+8, c_fc 8*32+32, c_proj 32*8+8; ln_f 16
    assert params == 40 + (32 + 216 + 72 + 288 + 264) + 16


def test_only_the_package_is_installed_as_a_top_level_module() -> None:
    """`pip install` puts gptkit alone into site-packages: no `model` or script module to collide with others."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    setuptools = project["tool"]["setuptools"]
    assert "py-modules" not in setuptools
    assert setuptools["packages"]["find"]["include"] == ["gptkit*"]


def test_no_root_script_shadows_an_installed_distribution() -> None:
    """A root script named like a module another distribution installs (evaluate.py and Hugging Face's `evaluate`)
    would be imported in its place by anything run from the checkout."""
    installed = set(importlib.metadata.packages_distributions()) - {"gptkit"}
    stems = {Path(name).stem for name in ROOT_SCRIPTS} | set(SCRIPT_DIRS)
    assert stems & installed == set()


def test_every_dataclass_is_built_with_keywords() -> None:
    """A dataclass of several fields built by position breaks silently when two fields of one type swap; kw_only
    makes Python refuse it."""
    positional = []
    for path in project_files(REPO) + sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for decorator in node.decorator_list:
                    text = ast.unparse(decorator)
                    if text.split("(")[0] in ("dataclass", "dataclasses.dataclass") and "kw_only=True" not in text:
                        positional.append(f"{path.relative_to(REPO)}: {node.name}")
    assert positional == []
