"""gptkit.data.prepare.settings: the one declaration and check of the preparation settings that corpus.py and fineweb.py
share, and what each script adds or changes."""

from __future__ import annotations

import dataclasses
import runpy
from typing import Any

import pytest

from gptkit.core.errors import UserError
from gptkit.core.settings import parse_settings
from gptkit.data.prepare.settings import PrepareSettings
from helpers import REPO


def script_settings(script: str, name: str) -> type:
    return runpy.run_path(str(REPO / "prepare_data" / script))[name]


def declared(cls: type) -> dict[str, tuple[Any, str]]:
    """{name: (default, help)} of a settings class."""
    return {
        f.name: (f.default if f.default_factory is dataclasses.MISSING else f.default_factory(), f.metadata["help"])
        for f in dataclasses.fields(cls)
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"val_fraction": 1.0}, "--val_fraction must be between 0 and 1 (exclusive), got 1.0"),
        ({"shard_tokens": 0}, "--shard_tokens must be a positive number of tokens"),
        ({"block_size": 0}, "--block_size must be at least 1"),
        ({"on_decode_error": "ignore"}, "--on_decode_error must be one of error, replace, skip"),
        ({"chunk_bytes": 10}, "--chunk_bytes must be at least 256"),
        ({"num_workers": -1}, "--num_workers must be 0 or more"),
    ],
)
def test_validate_rejects_impossible_values(changes: dict, message: str) -> None:
    settings = PrepareSettings()
    for key, value in changes.items():
        setattr(settings, key, value)
    with pytest.raises(UserError) as error:
        settings.validate()
    assert str(error.value).startswith(message)
    PrepareSettings().validate()  # the defaults are fine


def test_corpus_settings_are_the_shared_ones_plus_inputs_and_the_utf8_policy() -> None:
    corpus = script_settings("corpus.py", "CorpusSettings")
    assert issubclass(corpus, PrepareSettings)
    shared, own = declared(PrepareSettings), declared(corpus)
    assert {name: own[name] for name in shared} == shared  # the base's defaults are corpus.py's
    assert sorted(set(own) - set(shared)) == ["exclude", "include", "input", "on_decode_error"]
    cfg = parse_settings(corpus, ["--input=d", "--exclude=*.log", "--exclude=build/"], prog="corpus.py", description="")
    assert (cfg.include, cfg.exclude) == ([], ["*.log", "build/"])  # repeatable, none by default
    with pytest.raises(UserError, match="--val_fraction must be between 0 and 1"):  # the shared check applies
        parse_settings(corpus, ["--input=x", "--val_fraction=1.5"], prog="corpus.py", description="")
    with pytest.raises(UserError, match="no input given"):
        parse_settings(corpus, [], prog="corpus.py", description="")


def test_fineweb_settings_change_only_defaults_and_add_the_download_settings() -> None:
    fineweb = script_settings("fineweb.py", "FinewebSettings")
    assert issubclass(fineweb, PrepareSettings)
    shared, own = declared(PrepareSettings), declared(fineweb)
    assert set(shared) < set(own) and "on_decode_error" not in own  # parquet text is never invalid UTF-8
    assert sorted(set(own) - set(shared)) == ["base_url", "cache_dir", "read_timeout", "retries", "shards"]
    changed = {name for name in shared if own[name] != shared[name]}
    assert changed == {"out_dir", "text_field", "val_fraction", "shard_tokens", "block_size"}
    assert (own["val_fraction"][0], own["shard_tokens"][0], own["block_size"][0]) == (0.001, 100_000_000, 1024)
    cfg = parse_settings(fineweb, [], prog="fineweb.py", description="")
    assert cfg.on_decode_error == "error"  # the strict policy, without a flag
    for flags, message in [
        (["--on_decode_error=skip"], "unknown setting 'on_decode_error'"),
        (["--chunk_bytes=1"], "--chunk_bytes must be at least 256"),
        (["--shards=0"], "--shards must be at least 1"),
        (["--read_timeout=nan"], "--retries must be >= 0 and --read_timeout > 0"),
    ]:
        with pytest.raises(UserError, match=message):
            parse_settings(fineweb, flags, prog="fineweb.py", description="")
