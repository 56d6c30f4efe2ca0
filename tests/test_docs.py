"""The documentation stays a manual: a short README, no working notes in product files, links that resolve, and
every result JSON in docs/results cited by the page that reports it."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("gptkit", "prepare_data", "benchmarks", "config")
SCRIPT_PLACES = ("prepare_data", "benchmarks")
README_MAX_LINES = 280

ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
PROCESS_WORDS = re.compile(
    r"\bsessions?\b"
    rf"|\btwenty-?({ORDINALS})\b|\b(eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth"
    r"|eighteenth|nineteenth|twentieth|thirtieth)\b"
    r"|\bnot kept\b|/tmp/",
    re.IGNORECASE,
)
ISSUE_NUMBER = re.compile(r"(?:^|[\s(])#\d+\b")
# Uses of the word that name a technical thing, not a working period.
TECHNICAL = re.compile(r"requests\.Session|start_new_session|terminal session", re.IGNORECASE)

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
RESULT_JSON = re.compile(r"(?<!\w)results/([\w.-]+\.json)")  # not bench_results/, the benchmarks' output


def code_files() -> list[Path]:
    files = sorted(ROOT.glob("*.py"))
    for folder in CODE_DIRS:
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def prose_of_python(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the comments and string literals of a Python file: what a reader reads, not identifiers."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
    kinds = (tokenize.COMMENT, tokenize.STRING)
    return [(tok.start[0], tok.string) for tok in tokens if tok.type in kinds]


def process_words(text: str) -> list[str]:
    return [match.group(0) for match in PROCESS_WORDS.finditer(TECHNICAL.sub("", text))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        if line.startswith("#"):
            base = slug(line.lstrip("#"))
            count = seen.get(base, 0)
            found.add(f"{base}-{count}" if count else base)  # a repeated heading gets -1, -2, ...
            seen[base] = count + 1
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(FENCE.sub("", path.read_text(encoding="utf-8")))


def resolves(page: Path, target: str) -> bool:
    """Whether a link of `page` leads somewhere: a web address, or an existing path (and heading, for a page)."""
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
        return True
    file_part, _, anchor = target.partition("#")
    linked = (page.parent / file_part).resolve() if file_part else page
    if not linked.exists():
        return False
    return not anchor or linked.suffix != ".md" or anchor in anchors(linked)


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move long form to docs/"


def test_slug_follows_github() -> None:
    assert slug(" nanoGPT's char recipe on the H200 (2026-11-26)") == "nanogpts-char-recipe-on-the-h200-2026-11-26"
    assert slug("Decoding on the CPU") == "decoding-on-the-cpu"


def test_process_words_are_found_and_technical_uses_are_not() -> None:
    assert process_words("measured in the twenty-ninth session; not kept (/tmp/x.py)") == [
        "twenty-ninth",
        "session",
        "not kept",
        "/tmp/",
    ]
    assert process_words("requests.Session() with start_new_session=True") == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_hold_no_working_notes(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    found = process_words(text) + ISSUE_NUMBER.findall(FENCE.sub("", text))
    assert not found, f"{path.name}: {found}"


def test_code_holds_no_working_notes() -> None:
    found = []
    for path in code_files():
        name = path.relative_to(ROOT).as_posix()
        for line, text in prose_of_python(path):
            words = process_words(text)
            if words:
                found.append(f"{name}:{line}: {words}")
    assert not found, "\n".join(found)


def other_product_files() -> list[Path]:
    """The product's files that are not Python or docs/*.md: the native step's C++, the playground page, the build
    and CI files, and the result files the docs cite."""
    files = sorted(path for path in (ROOT / "gptkit").rglob("*") if path.suffix in (".h", ".cpp", ".html", ".js"))
    files += [ROOT / name for name in ("Makefile", "pyproject.toml", "requirements.txt", ".ci/run")]
    return files + sorted((ROOT / "docs" / "results").glob("*.json"))


def test_other_product_files_hold_no_working_notes() -> None:
    files = other_product_files()
    assert {path.suffix for path in files} >= {".h", ".cpp", ".html", ".json"}
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        words = process_words(text)
        if path.suffix != ".html":  # in a page, #222 is a colour
            words += ISSUE_NUMBER.findall(text)
        if words:
            found.append(f"{path.relative_to(ROOT).as_posix()}: {words}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    broken = [target for target in links(path) if not resolves(path, target)]
    assert not broken, f"{path.name}: {broken}"


def test_every_result_json_is_cited_and_every_citation_exists() -> None:
    cited = {name for path in DOCS for name in RESULT_JSON.findall(path.read_text(encoding="utf-8"))}
    stored = {path.name for path in (ROOT / "docs" / "results").glob("*.json")}
    assert not stored - cited, f"not cited from README.md or docs/*.md: {sorted(stored - cited)}"
    assert not cited - stored, f"cited but missing from docs/results: {sorted(cited - stored)}"


def test_the_scripts_the_project_files_name_exist() -> None:
    """requirements*.txt, pyproject.toml and the Makefile name scripts in their comments; each must be a real file."""
    files = [*sorted(ROOT.glob("requirements*.txt")), ROOT / "pyproject.toml", ROOT / "Makefile"]
    named = {(path.name, name) for path in files for name in re.findall(r"[\w./-]+\.py\b", path.read_text())}
    places = [ROOT, *(ROOT / part for part in SCRIPT_PLACES)]  # a bare name may be a script in one of them
    missing = sorted((where, name) for where, name in named if not any((place / name).exists() for place in places))
    assert not missing, missing


def test_every_gpt_method_the_code_and_docs_name_exists() -> None:
    """A docstring or page naming `GPT.something` names a method model.py's GPT has."""
    from gptkit.model import GPT

    pages = [*code_files(), *DOCS]
    named = {(p.name, name) for p in pages for name in re.findall(r"\bGPT\.(\w+)", p.read_text(encoding="utf-8"))}
    missing = sorted((where, name) for where, name in named if not hasattr(GPT, name))
    assert not missing, missing


# The scripts whose documented command lines are checked setting by setting.
DOCUMENTED_SCRIPTS = {
    "train.py": "TrainSettings",
    "sample.py": "SampleSettings",
    "serve.py": "ServeSettings",
    "eval.py": "EvaluateSettings",
    "export.py": "ExportSettings",
}


def documented_commands(script: str) -> list[tuple[str, list[str]]]:
    """(page, arguments) of every `python SCRIPT ...` line in a bash block of the README and docs/ (a script's own
    docstring too): what a reader copies and runs. Lines with a `...` placeholder are left out."""
    import shlex

    found = []
    texts = [(page.name, page.read_text(encoding="utf-8")) for page in DOCS]
    texts.append((script, (ROOT / script).read_text(encoding="utf-8").split('"""')[1]))
    for name, text in texts:
        for line in text.replace("\\\n", " ").splitlines():  # a command continued with a backslash is one line
            command = re.sub(r"\s+#\s.*$", "", line).strip()
            if command.startswith(f"python {script} ") and "..." not in command:
                found.append((name, shlex.split(command.replace('"$(openssl rand -hex 16)"', "KEY"))[2:]))
    return found


@pytest.mark.parametrize("script", sorted(DOCUMENTED_SCRIPTS))
def test_every_documented_command_line_has_valid_settings(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A documented command line a reader copies must pass the script's own settings checks: a renamed setting or a
    combination the script refuses (eval.py's --samples=8 at the greedy default temperature) is a broken manual."""
    import importlib

    from gptkit.core.errors import UserError
    from gptkit.core.settings import parse_settings

    settings_class = getattr(importlib.import_module(script.removesuffix(".py")), DOCUMENTED_SCRIPTS[script])
    commands = documented_commands(script)
    assert commands, f"no documented {script} command found"
    monkeypatch.chdir(ROOT)  # train.py's config files are named from the checkout's root
    refused = []
    for page, args in commands:
        try:
            parse_settings(settings_class, args, prog=script, description="", config_files=script == "train.py")
        except UserError as exc:
            refused.append(f"{page}: {' '.join(args)}: {exc}")
    assert not refused, "\n".join(refused)


# ----------------------------------------------------------------------------- names the text promises exist

DOTTED_NAME = re.compile(r"\bgptkit(?:\.[A-Za-z_]\w*)+")
PACKAGE_PATH = re.compile(r"\bgptkit(?:/[\w.]+)+")
MAKE_TARGET = re.compile(r"`make ([\w-]+)`|^\s*make ([\w-]+)\b|\bmake ([\w-]+) (?:runs|does|builds|installs)", re.M)


def texts_that_name_things() -> list[tuple[Path, str]]:
    """Every doc page and every source file of the product and the benchmarks (C++ and its headers too), with its
    text."""
    cpp = [*sorted((ROOT / "gptkit").rglob("*.cpp")), *sorted((ROOT / "gptkit").rglob("*.h"))]
    files = [*DOCS, *code_files(), *cpp, ROOT / "Makefile"]
    return [(path, path.read_text(encoding="utf-8")) for path in files]


def names_something(dotted: str) -> bool:
    """Whether `dotted` names a module of the package, or an attribute (at any depth) of one."""
    import importlib

    parts = dotted.rstrip(".").split(".")
    for cut in range(len(parts), 0, -1):
        try:
            thing = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(thing, attribute):
                return False
            thing = getattr(thing, attribute)
        return True
    return False


def test_every_gptkit_name_and_path_the_text_mentions_exists() -> None:
    missing = []
    for path, text in texts_that_name_things():
        for name in sorted(set(DOTTED_NAME.findall(text))):
            if not names_something(name):
                missing.append(f"{path.relative_to(ROOT)}: {name}")
        for name in sorted(set(PACKAGE_PATH.findall(text))):
            if not (ROOT / name.rstrip(".")).exists() and not (ROOT / f"{name.rstrip('.')}.py").exists():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, missing


def test_every_make_target_the_text_mentions_exists() -> None:
    targets = set(re.findall(r"^([\w.$()/-]+):", (ROOT / "Makefile").read_text(), re.M))
    mentioned = {
        (path.relative_to(ROOT), name)
        for path, text in texts_that_name_things()
        for match in MAKE_TARGET.finditer(text)
        for name in match.groups()
        if name
    }
    assert {name for _, name in mentioned} >= {"demo", "test", "test-fast"}  # the check sees the README's commands
    assert not [(str(path), name) for path, name in mentioned if name not in targets], sorted(mentioned)
