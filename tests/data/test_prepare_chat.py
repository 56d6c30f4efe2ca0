"""prepare_data/chat.py end to end: JSONL, .gz, parquet and prompt/completion read back as the rendered
conversations, the train/val assignment, cut and drop, bad input, tokenizer reuse and failed runs."""

from __future__ import annotations

import gzip
import hashlib
import json
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gptkit.data import tokenizer as tok
from gptkit.data.conversations import open_conversations
from gptkit.data.meta import read_meta
from gptkit.data.prepare import chat_inputs, discover
from gptkit.data.prepare.items import JsonlLines, is_val_document
from helpers import (
    REPO,
    alive,
    assert_one_line_error,
    gpt2_chat_tokenizer,
    make_char_data,
    run_main,
    signal_mid_run,
)
from prepare_data import chat as chat_script

WORDS = "the cat sat on a mat and then it ran off to see the dog who was not there at all".split()  # noqa: SIM905


def conversation(i: int, turns: int = 2) -> list[dict[str, str]]:
    """A varied conversation; every third opens with a system message."""
    messages = [{"role": "system", "content": "You answer briefly."}] if i % 3 == 0 else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Question {i}.{t}: " + " ".join(WORDS[(i + t) % 7 :][:5])})
        messages.append({"role": "assistant", "content": " ".join(WORDS[: 3 + (i * 7 + t) % 15])})
    return messages


def write_jsonl(path: Path, records: list[Any]) -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=7)
    return path


def prepare(capsys: Any, *args: str) -> tuple[int, str, str]:
    return run_main(chat_script.main, ["--num_workers=1", *args], capsys)


def read_back(out: Path) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Each split's conversations as (ids, mask) lists, through the reader training uses."""
    meta = read_meta(out, check_files=True)
    splits = {}
    for split in ("train", "val"):
        conversations = open_conversations(out, split, meta)
        splits[split] = [tuple(a.tolist() for a in conversations.conversation(i)) for i in range(len(conversations))]
    return splits


def rendered(messages: list[dict[str, str]], tokenizer: tok.ChatTokenizer | None = None) -> tuple[list[int], list[int]]:
    tokenizer = tokenizer or gpt2_chat_tokenizer()
    ids, mask = tokenizer.chat.render(messages, tokenizer)
    return ids.tolist(), mask.tolist()


def turns_key(messages: list[dict]) -> int:
    """The split key of a conversation, computed here on its own: blake2b (8 bytes, little-endian) of the JSON list
    of [role, content] pairs, non-ASCII kept."""
    pairs = [[message["role"], message["content"]] for message in messages]
    digest = hashlib.blake2b(json.dumps(pairs, ensure_ascii=False).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@pytest.mark.gpt2_bpe
def test_jsonl_conversations_read_back_exactly(tmp_path: Path, capsys: Any) -> None:
    records = [{"messages": conversation(i, turns=1 + i % 3)} for i in range(60)]
    source = write_jsonl(tmp_path / "chats.jsonl", [*records[:30], "", *records[30:]])  # a blank line is no record
    out = tmp_path / "out"
    code, stdout, err = prepare(capsys, f"--input={source}", f"--out_dir={out}", "--block_size=1024", "--seed=5")
    assert code == 0, err
    expected: dict[str, list] = {"train": [], "val": []}
    for record in records:
        split = "val" if is_val_document(5, 0.05, turns_key(record["messages"])) else "train"
        expected[split].append(rendered(record["messages"]))
    got = read_back(out)
    assert got == expected and len(got["val"]) > 0
    assert sorted(got["train"] + got["val"]) == sorted(rendered(r["messages"]) for r in records)  # complete
    meta = read_meta(out)
    assert meta["tokenizer"] == gpt2_chat_tokenizer().to_meta()
    assert meta["vocab_size"] == 50261 and meta["dtype"] == "uint16"
    for split in ("train", "val"):
        info = meta["splits"][split]
        assert info["documents"] == len(expected[split])
        assert info["tokens"] == sum(len(ids) for ids, _ in expected[split])
        assert info["assistant_tokens"] == sum(sum(mask) for _, mask in expected[split])
    assert meta["source"]["cut"] == 0 and meta["source"]["dropped"] == {} and meta["source"]["skipped"] == {}
    assert stdout.startswith(f"wrote 7 files to {out} (uint16, vocab 50,261): train {len(expected['train'])} conv")


@pytest.mark.gpt2_bpe
def test_gz_parquet_and_prompt_completion_in_a_directory(tmp_path: Path, capsys: Any) -> None:
    root = tmp_path / "in"
    root.mkdir()
    # Sorted order gives the file indexes of the split: a.jsonl.gz 0, b.parquet 1, c.jsonl 2.
    gz = [conversation(i) for i in range(20)]
    write_jsonl(root / "a.jsonl.gz", [{"messages": m} for m in gz])
    extra = {"name": "x", "tool_calls": None}  # fields a Hugging Face export may carry: ignored
    parquet = [[{**m, **extra} for m in conversation(100 + i)] for i in range(20)]
    write_parquet(root / "b.parquet", [{"messages": m, "id": i} for i, m in enumerate(parquet)])
    pairs: list[dict[str, Any]] = [{"prompt": f"Say {w}.", "completion": f"{w}!"} for w in WORDS[:10]]
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    pairs += [
        {
            "prompt": [*history, {"role": "user", "content": f"Say {w}."}],
            "completion": [{"role": "assistant", "content": w}],
        }
        for w in WORDS[10:20]
    ]
    write_jsonl(root / "c.jsonl", pairs)
    (root / ".hidden.jsonl").write_text("not json\n")  # left out by the directory walk, as corpus.py does
    out = tmp_path / "out"
    code, stdout, err = prepare(capsys, f"--input={root}", f"--out_dir={out}", "--val_fraction=0.2")
    assert code == 0, err
    expected: dict[str, list] = {"train": [], "val": []}

    def add(messages: list[dict], ids_mask: tuple[list[int], list[int]]) -> None:
        expected["val" if is_val_document(1337, 0.2, turns_key(messages)) else "train"].append(ids_mask)

    for messages in gz:
        add(messages, rendered(messages))
    for messages in parquet:
        add(messages, rendered([{"role": m["role"], "content": m["content"]} for m in messages]))
    enc = gpt2_chat_tokenizer().base
    for pair in pairs:
        if isinstance(pair["prompt"], str):
            turns = [{"role": "user", "content": pair["prompt"]}, {"role": "assistant", "content": pair["completion"]}]
            add(turns, rendered(turns))
            continue
        word = pair["completion"][0]["content"]
        # By hand: eot, then marker + content + end per turn; only the completion's content and end are trained.
        ids = [50256]
        for message in [*pair["prompt"], *pair["completion"]]:
            marker = {"user": 50258, "assistant": 50259}[message["role"]]
            ids += [marker, *enc.encode(message["content"]), 50260]
        trained = len(enc.encode(word)) + 1
        add([*pair["prompt"], *pair["completion"]], (ids, [0] * (len(ids) - trained) + [1] * trained))
    assert read_back(out) == expected
    meta = read_meta(out)
    assert meta["source"]["files"] == 3 and meta["source"]["skipped_files"]["hidden"] == 1
    assert "1 file left out (1 hidden)" in stdout


def test_char_table_from_the_conversations_same_for_any_worker_count(tmp_path: Path, capsys: Any) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation(i)} for i in range(40)])
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        args = [f"--input={source}", f"--out_dir={out}", "--tokenizer=char", "--block_size=1024", "--chunk_bytes=512"]
        code, _, err = run_main(chat_script.main, [*args, f"--num_workers={workers}"], capsys)
        assert code == 0, err
        outs.append(out)
    chars = sorted({c for i in range(40) for m in conversation(i) for c in m["content"]})
    meta = read_meta(outs[0])
    assert meta["tokenizer"]["chars"] == chars and meta["tokenizer"]["eot"] is True
    assert meta["vocab_size"] == len(chars) + 1 + 4 and meta["tokenizer"]["chat"]["begin"] == len(chars)
    char_chat = tok.ChatTokenizer.extending(tok.CharTokenizer(chars, eot=True))
    got = read_back(outs[0])
    assert sorted(got["train"] + got["val"]) == sorted(rendered(conversation(i), char_chat) for i in range(40))
    for name in ("train.bin", "val.bin", "train.mask.bin", "val.conversations.bin", "meta.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes().replace(b"out2", b"out1")


@pytest.mark.gpt2_bpe
def test_cut_and_drop(tmp_path: Path, capsys: Any) -> None:
    long_answer = " ".join(WORDS * 3)
    variants = [  # four of each kind, each its own conversation
        [
            {"messages": conversation(k, turns=1)},  # fits in 41 tokens
            {"messages": [{"role": "user", "content": f"Tell me {k}."}, {"role": "assistant", "content": long_answer}]},
            {"messages": [{"role": "user", "content": f"{k} {long_answer}"}, {"role": "assistant", "content": "Yes."}]},
        ]
        for k in range(4)
    ]
    source = write_jsonl(tmp_path / "c.jsonl", [record for variant in variants for record in variant])
    full = [[rendered(r["messages"]) for r in variant] for variant in variants]
    assert all(len(f[0][0]) <= 41 < min(len(f[1][0]), len(f[2][0])) for f in full)
    assert all(sum(f[2][1][:41]) == 0 for f in full)  # the third's reply starts after the block: nothing to learn
    common = [f"--input={source}", "--block_size=40", "--val_fraction=0.3", "--seed=1"]  # both splits, dropped or not
    code, stdout, err = prepare(capsys, *common, f"--out_dir={tmp_path / 'cut'}")
    assert code == 0, err
    got = read_back(tmp_path / "cut")
    assert sorted(got["train"] + got["val"]) == sorted(x for f in full for x in (f[0], (f[1][0][:41], f[1][1][:41])))
    source_meta = read_meta(tmp_path / "cut")["source"]
    assert source_meta["cut"] == 4 and source_meta["dropped"] == {"no assistant token in the first block_size + 1": 4}
    assert "4 conversations cut to block_size + 1; 4 conversations dropped (4 no assistant token" in stdout
    code, stdout, err = prepare(capsys, *common, f"--out_dir={tmp_path / 'drop'}", "--too_long=drop")
    assert code == 0, err
    got = read_back(tmp_path / "drop")
    assert sorted(got["train"] + got["val"]) == sorted(f[0] for f in full)
    source_meta = read_meta(tmp_path / "drop")["source"]
    assert source_meta["cut"] == 0 and source_meta["dropped"] == {"longer than block_size + 1": 8}


GOOD_LINE = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_LINES = {
    "wrong role": ({"messages": [{"role": "bot", "content": "x"}, GOOD_LINE["messages"][1]]}, "role 'bot'"),
    "empty content": ({"messages": [{"role": "user", "content": ""}, GOOD_LINE["messages"][1]]}, "empty"),
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "malformed JSON": ('{"messages": [', "not valid JSON"),
    "invalid UTF-8": (
        '{"messages": [{"role": "user", "content": "a\\ud800"}, {"role": "assistant", "content": "b"}]}',
        "unpaired surrogate",
    ),
    "not a record": ({"text": "hi"}, "no 'messages' field nor 'prompt' and 'completion'"),
}


@pytest.mark.gpt2_bpe
@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_record_one_line_with_file_and_line(tmp_path: Path, capsys: Any, reason: str) -> None:
    record, fragment = BAD_LINES[reason]
    source = write_jsonl(tmp_path / "c.jsonl", [GOOD_LINE] * 3 + [record] + [GOOD_LINE])
    code, _, err = prepare(capsys, f"--input={source}", f"--out_dir={tmp_path / 'out'}", "--block_size=4")
    assert_one_line_error(code, err, f"{source}:4: ", fragment, "--on_bad=skip")
    assert not (tmp_path / "out").exists()


@pytest.mark.gpt2_bpe
def test_on_bad_skip_counts_each_reason(tmp_path: Path, capsys: Any) -> None:
    goods = [{"messages": [{"role": "user", "content": f"hi {i}"}, GOOD_LINE["messages"][1]]} for i in range(20)]
    records = goods + [BAD_LINES[r][0] for r in sorted(BAD_LINES)] + [BAD_LINES["wrong role"][0]]
    source = write_jsonl(tmp_path / "c.jsonl", records)
    out = tmp_path / "out"
    code, stdout, err = prepare(capsys, f"--input={source}", f"--out_dir={out}", "--block_size=32", "--on_bad=skip")
    assert code == 0, err
    meta = read_meta(out)
    assert meta["source"]["skipped"] == {reason: 2 if reason == "wrong role" else 1 for reason in BAD_LINES}
    assert sum(meta["splits"][s]["documents"] for s in ("train", "val")) == 20
    assert "7 conversations skipped (1 empty content, 1 invalid UTF-8, 1 malformed JSON, 1 no assistant turn" in stdout


@pytest.mark.gpt2_bpe
def test_parquet_bad_row_names_the_row(tmp_path: Path, capsys: Any) -> None:
    rows = [{"messages": GOOD_LINE["messages"]}] * 9 + [{"messages": [{"role": "user", "content": "hi"}]}]
    source = write_parquet(tmp_path / "c.parquet", rows)
    code, _, err = prepare(capsys, f"--input={source}", f"--out_dir={tmp_path / 'out'}", "--block_size=4")
    assert_one_line_error(code, err, f"{source} row 10: ", "no assistant turn")
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    code, _, err = prepare(capsys, f"--input={other}", f"--out_dir={tmp_path / 'out'}")
    assert_one_line_error(code, err, f"{other}: chat data is read from .jsonl")


def test_reused_tokenizer_gives_the_base_ids(tmp_path: Path, capsys: Any) -> None:
    base_dir = tmp_path / "base"
    base_meta = make_char_data(base_dir, text="hello world, how are you? fine.\n" * 20)
    base = tok.tokenizer_from_meta(base_meta["tokenizer"])
    questions = ["how are you?" + "?" * k for k in range(12)]  # twelve conversations
    seed = "--seed=2"  # one of them in val (of 0.05)
    chats = [[{"role": "user", "content": q}, {"role": "assistant", "content": "fine, hello."}] for q in questions]
    messages = chats[0]
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat} for chat in chats])
    # A training out_dir: its checkpoint records the data's tokenizer (gptkit.weights.checkpoint.tokenizer_record).
    import torch

    from gptkit.weights.checkpoint import tokenizer_record

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save({"model": {}, "model_args": {}, "tokenizer": tokenizer_record(base_meta)}, run_dir / "ckpt.pt")
    # No end-of-text token in this base (as shakespeare_char's): nothing opens a conversation.
    assert base.eot_token is None
    answer = [base.vocab_size + 2, *base.encode("fine, hello."), base.vocab_size + 3]
    expected_ids = sorted([base.vocab_size + 1, *base.encode(q), base.vocab_size + 3, *answer] for q in questions)
    for name, tokenizer in (("data", base_dir), ("dir", run_dir), ("file", run_dir / "ckpt.pt")):
        out = tmp_path / f"out-{name}"
        code, _, err = prepare(
            capsys, f"--input={source}", f"--out_dir={out}", f"--tokenizer={tokenizer}", "--block_size=1024", seed
        )
        assert code == 0, err
        meta = read_meta(out)
        assert {k: v for k, v in meta["tokenizer"].items() if k != "chat"} == base_meta["tokenizer"]
        assert meta["vocab_size"] == base.vocab_size + 4
        got = read_back(out)
        assert sorted(ids for ids, _ in got["train"] + got["val"]) == expected_ids
    # Chat data as the base: its template is kept as it is.
    code, _, err = prepare(
        capsys,
        f"--input={source}",
        f"--out_dir={tmp_path / 'again'}",
        f"--tokenizer={tmp_path / 'out-data'}",
        "--block_size=1024",
        seed,
    )
    assert code == 0, err
    assert read_meta(tmp_path / "again")["tokenizer"] == read_meta(tmp_path / "out-data")["tokenizer"]
    # A character the base never saw is bad input, not a new table entry.
    unknown = write_jsonl(
        tmp_path / "u.jsonl",
        [{"messages": messages}, {"messages": [messages[0], {"role": "assistant", "content": "Zut!"}]}],
    )
    code, _, err = prepare(
        capsys, f"--input={unknown}", f"--out_dir={tmp_path / 'u'}", f"--tokenizer={base_dir}", "--block_size=1024"
    )
    assert_one_line_error(code, err, f"{unknown}:2: ", "'Z'", "not in the character vocabulary")


@pytest.mark.gpt2_bpe
def test_failure_midway_leaves_the_earlier_data(tmp_path: Path, capsys: Any) -> None:
    good = [{"messages": conversation(i)} for i in range(200)]
    out = tmp_path / "out"
    first = write_jsonl(tmp_path / "first.jsonl", good)
    code, _, err = prepare(capsys, f"--input={first}", f"--out_dir={out}")
    assert code == 0, err
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    second = write_jsonl(tmp_path / "second.jsonl", good + good + ['{"messages": 3}'])
    code, _, err = prepare(capsys, f"--input={second}", f"--out_dir={out}", "--chunk_bytes=1024", "--overwrite=True")
    assert_one_line_error(code, err, f"{second}:401: ")
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    fresh = tmp_path / "fresh"
    code, _, err = prepare(capsys, f"--input={second}", f"--out_dir={fresh}", "--chunk_bytes=1024")
    assert code == 2 and not fresh.exists()


def test_help_lists_every_setting(capsys: Any) -> None:
    code, stdout, _ = run_main(chat_script.main, ["--help"], capsys)
    assert code == 0
    for name in (
        "input",
        "include",
        "exclude",
        "tokenizer",
        "out_dir",
        "val_fraction",
        "seed",
        "block_size",
        "too_long",
        "on_bad",
    ):
        assert f"--{name} " in stdout
    assert "--block_size  (integer, default 1024)" in stdout and "--too_long  (string, default 'cut')" in stdout


@pytest.mark.gpt2_bpe
def test_mask_file_matches_assistant_tokens(tmp_path: Path, capsys: Any) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": conversation(i)} for i in range(30)])
    out = tmp_path / "out"
    code, _, err = prepare(capsys, f"--input={source}", f"--out_dir={out}", "--block_size=1024")
    assert code == 0, err
    meta = read_meta(out)
    for split in ("train", "val"):
        mask = np.fromfile(out / f"{split}.mask.bin", dtype=np.uint8)
        assert int(mask.sum()) == meta["splits"][split]["assistant_tokens"] and set(mask.tolist()) <= {0, 1}


def test_work_items_are_bounded_and_keep_every_record_in_order(tmp_path: Path) -> None:
    # Memory stays flat because the pool holds at most 2 x num_workers items, each about --chunk_bytes.
    records = [{"messages": conversation(i)} for i in range(400)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", records)
    parquet = write_parquet(tmp_path / "b.parquet", records)
    files = discover.find_inputs([str(jsonl), str(parquet)], binary_suffixes=(chat_inputs.PARQUET_SUFFIX,)).files
    items = list(chat_inputs.chat_items(files, 4096, "messages"))
    longest_line = max(len(json.dumps(r)) + 1 for r in records)
    lines = [i for i in items if isinstance(i, JsonlLines)]
    rows = [i for i in items if isinstance(i, chat_inputs.ParquetRows)]
    assert len(lines) > 10 and all(len(i.data) <= 4096 + longest_line for i in lines)
    assert len(rows) > 3 and all(len(i.rows) <= 4096 // 100 + chat_inputs.PARQUET_BATCH_ROWS for i in rows)
    places = [r.where for item in items for r in chat_inputs.records(item)]
    assert places == [f"{jsonl}:{k}" for k in range(1, 401)] + [f"{parquet} row {k}" for k in range(1, 401)]
    assert sum(i.input_bytes for i in items) == jsonl.stat().st_size + parquet.stat().st_size


@pytest.mark.gpt2_bpe
def test_sigterm_mid_run_ends_the_workers_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # this checkout's gptkit, whatever the environment installed
    block = "".join(json.dumps({"messages": conversation(i, turns=3)}) + "\n" for i in range(2000))
    source = tmp_path / "big.jsonl"
    with open(source, "w", encoding="utf-8") as handle:
        for _ in range(-(-40_000_000 // len(block))):  # ~40 MB: seconds of rendering on 2 cores
            handle.write(block)
    out = tmp_path / "out"
    command = [sys.executable, str(REPO / "prepare_data" / "chat.py"), f"--input={source}", f"--out_dir={out}"]
    result, workers = signal_mid_run([*command, "--num_workers=2"], out, signal.SIGTERM, workers=2)
    assert (result.returncode, result.stderr, result.stdout) == (143, "terminated by SIGTERM\n", "")
    assert alive(workers) == [] and not out.exists()


@pytest.mark.gpt2_bpe
def test_a_conversation_given_twice_goes_to_one_split(tmp_path: Path, capsys: Any) -> None:
    """Datasets repeat records: were the copies split apart, val would measure what train learned by heart."""
    distinct = [{"messages": conversation(i)} for i in range(30)]
    source = write_jsonl(tmp_path / "c.jsonl", distinct + distinct[:10] * 3)  # ten of them four times
    out = tmp_path / "out"
    code, _, err = prepare(capsys, f"--input={source}", f"--out_dir={out}", "--val_fraction=0.3")
    assert code == 0, err
    got = read_back(out)
    train, val = set(map(str, got["train"])), set(map(str, got["val"]))
    assert train and val and not train & val
    assert len(got["train"]) + len(got["val"]) == 60


@pytest.mark.gpt2_bpe
def test_a_conversation_past_16_mib_of_text_is_bad_input_not_a_memory_blow_up(tmp_path: Path, capsys: Any) -> None:
    """Its tokenization would take memory in proportion (a 300 MB reply asked for 9.6 GB): refused before."""
    huge = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a " * (2**23 + 9)}]}
    good = [{"messages": conversation(i)} for i in range(30)]
    source = write_jsonl(tmp_path / "c.jsonl", [*good[:3], huge, *good[3:]])
    code, _, err = prepare(capsys, f"--input={source}", f"--out_dir={tmp_path / 'out'}")
    assert_one_line_error(code, err, f"{source}:4: the conversation holds 16 MiB of text, past the 16 MiB")
    code, stdout, err = prepare(capsys, f"--input={source}", f"--out_dir={tmp_path / 'out'}", "--on_bad=skip")
    assert code == 0, err
    assert "1 conversation skipped (1 over 16 MiB of text)" in stdout
