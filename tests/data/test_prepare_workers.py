"""gptkit.data.prepare.workers: what a worker makes of each kind of work item, its one-line errors, and the pool."""

from __future__ import annotations

import os
import pickle
import signal
import time
from pathlib import Path

import psutil
import pytest

from gptkit.core.errors import UserError
from gptkit.data import tokenizer as tok
from gptkit.data.prepare.items import Documents, JsonlLines, SkippedDocument, TextPiece, is_val_document
from gptkit.data.prepare.workers import Job, Worker, run_items

CHARS = tok.CharTokenizer(list(" ?abcdefghijklmnopqrstuvwxyzé\ufffd"), eot=True)
EOT = CHARS.eot_token


def worker(tokenizer: tok.Tokenizer | None = CHARS, policy: str = "error", seed: int = 0) -> Worker:
    job = Job(
        tokenizer=tokenizer, dtype="uint16", seed=seed, val_fraction=0.5, on_decode_error=policy, text_field="text"
    )
    return Worker(job)


def piece(data: bytes, **changes: object) -> TextPiece:
    values = {
        "source": "doc.txt",
        "data": data,
        "offset": 0,
        "split": "val",
        "starts_document": True,
        "counts_document": True,
        "input_bytes": 7,
        **changes,
    }
    return TextPiece(**values)


def lines(data: bytes, source: str = "c.jsonl", offset: int = 0) -> JsonlLines:
    return JsonlLines(source=source, file_index=3, data=data, offset=offset, first_line=10, input_bytes=len(data))


def test_text_piece_goes_to_its_split_with_one_separator_per_document() -> None:
    first = worker().run(piece(b"ab"))
    assert first.input_bytes == 7 and list(first.parts) == ["val"]
    part = first.parts["val"]
    assert (part.ids.tolist(), part.text_bytes, part.documents, part.ids.dtype) == (
        [EOT, *CHARS.encode("ab")],
        2,
        1,
        "uint16",
    )
    later = worker().run(piece("é".encode(), offset=9, starts_document=False, counts_document=False))
    assert later.parts["val"].ids.tolist() == [CHARS.encode("é")[0]] and later.parts["val"].text_bytes == 2
    assert later.parts["val"].documents == 0


def test_text_piece_that_is_not_utf8_names_file_and_offset() -> None:
    with pytest.raises(UserError) as error:
        worker().run(piece(b"ab\xffc", source="x.txt.gz", offset=100))
    message = str(error.value)
    assert message.startswith("x.txt.gz is not valid UTF-8 at uncompressed byte offset 102; convert it to UTF-8")
    # skip is the advice for a stray file in another encoding, before replace (which keeps U+FFFD noise)
    assert message.index("--on_decode_error=skip") < message.index("--on_decode_error=replace")
    replaced = worker(policy="replace").run(piece(b"ab\xffc"))
    assert CHARS.decode(replaced.parts["val"].ids[1:].tolist()) == "ab\ufffdc"


def test_jsonl_lines_are_documents_keyed_by_line_number() -> None:
    result = worker(seed=4).run(lines(b'{"text": "ab"}\n\n{"text": "ba", "n": 1}\n{"text": ""}\n'))
    expected = {"train": [], "val": []}
    for line, text in ((10, "ab"), (12, "ba")):  # line 11 is blank, line 13 an empty document
        expected["val" if is_val_document(4, 0.5, 3, line) else "train"] += [EOT, *CHARS.encode(text)]
    assert {split: part.ids.tolist() for split, part in result.parts.items()} == {
        k: v for k, v in expected.items() if v
    }
    assert sum(part.documents for part in result.parts.values()) == 2


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"text": "a"}\n{"text": "caf\xe9"}\n', "c.jsonl is not valid UTF-8 at byte offset 77 (line 11)"),
        (b'{"text": oops}\n', "c.jsonl:10: not valid JSON (Expecting value); fix or remove the line"),
        (
            b'{"body": "a"}\n',
            "c.jsonl:10: no string field 'text' (fields: 'body'); name the text field with --text_field",
        ),
        (b'["a"]\n', "c.jsonl:10: a list, not an object with a string field 'text'"),
        (b'{"text": 42}\n', "c.jsonl:10: field 'text' is a number, not a string"),
        (b'{"text": null}\n', "c.jsonl:10: field 'text' is null, not a string"),
        (b'{"text": {"en": "a"}}\n', "c.jsonl:10: field 'text' is an object, not a string"),
        (b'"just a string"\n', "c.jsonl:10: a string, not an object with a string field 'text'"),
        (b'{"text": "\\ud800"}\n', "c.jsonl is not valid UTF-8 at line 10 (an unpaired surrogate)"),
    ],
)
def test_jsonl_errors_are_one_line_naming_file_and_line(data: bytes, message: str) -> None:
    with pytest.raises(UserError) as error:
        worker().run(lines(data, offset=50))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_jsonl_decode_policies_skip_or_replace_a_line() -> None:
    data = b'{"text": "ab"}\n{"text": "caf\xe9"}\n{"text": "\\ud800a"}\n'
    skipped = worker(policy="skip").run(lines(data))
    assert skipped.skipped == 2 and sum(part.documents for part in skipped.parts.values()) == 1
    replaced = worker(policy="replace").run(lines(data))
    assert replaced.skipped == 0 and sum(part.documents for part in replaced.parts.values()) == 3
    text = "".join(CHARS.decode(part.ids.tolist()) for part in replaced.parts.values())
    assert "caf\ufffd" in text and "?a" in text  # a surrogate cannot be encoded: "?" as str.encode replaces it


def test_documents_and_skipped_documents() -> None:
    result = worker(seed=1).run(Documents(file_index=0, texts=["ab", "", "b"], first_row=5, input_bytes=9))
    assert sum(part.documents for part in result.parts.values()) == 2  # the empty row is no document
    assert sum(part.text_bytes for part in result.parts.values()) == 3
    splits = {"val" if is_val_document(1, 0.5, 0, row) else "train" for row in (5, 7)}
    assert set(result.parts) == splits
    skipped = worker().run(SkippedDocument(input_bytes=11))
    assert (skipped.skipped, skipped.parts, skipped.input_bytes) == (1, {}, 11)


def test_without_a_tokenizer_a_worker_collects_characters() -> None:
    result = worker(tokenizer=None).run(lines(b'{"text": "caf\\u00e9"}\n{"text": "zz"}\n'))
    assert result.chars == set("cafézz") and result.parts == {}


def test_two_processes_give_the_results_of_one_in_order() -> None:
    job = Job(tokenizer=CHARS, dtype="uint16", seed=0, val_fraction=0.5, on_decode_error="error", text_field="text")
    items = [lines(b"".join(b'{"text": "%s"}\n' % (b"ab" * (i % 7 + 1)) for i in range(n))) for n in range(1, 30)]
    one = [{s: p.ids.tolist() for s, p in r.parts.items()} for r in run_items(items, job, num_workers=1)]
    two = [{s: p.ids.tolist() for s, p in r.parts.items()} for r in run_items(items, job, num_workers=2)]
    assert one == two and len(one) == len(items)


@pytest.mark.gpt2_bpe
@pytest.mark.parametrize("kind", ["char", "gpt2"])
def test_a_job_survives_pickling_for_platforms_without_fork(kind: str) -> None:
    # Where workers are spawned instead of forked, each receives the Job (and its built tokenizer) pickled.
    tokenizer = CHARS if kind == "char" else tok.TiktokenTokenizer("gpt2")
    job = Job(tokenizer=tokenizer, dtype="uint16", seed=0, val_fraction=0.5, on_decode_error="error", text_field="text")
    item = piece(b"abba cab")
    copy = pickle.loads(pickle.dumps(job))
    assert Worker(copy).run(item).parts["val"].ids.tolist() == Worker(job).run(item).parts["val"].ids.tolist()


def signal_masks(pid: int) -> dict[str, int]:
    """The ignored and blocked signal sets of a process, from /proc/PID/status."""
    fields = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )
    return {name: int(fields[name].strip(), 16) for name in ("SigIgn", "SigBlk")}


def masks_once_initialised(pid: int, signals: int, timeout: float = 10.0) -> dict[str, int]:
    """signal_masks(pid) once the worker ignores `signals` and no longer blocks them (its initializer has run), or
    at the timeout: the pool forks every worker at once, and the first result can come before another worker has
    run its initializer."""
    deadline = time.monotonic() + timeout
    masks = signal_masks(pid)
    while (masks["SigIgn"] & signals != signals or masks["SigBlk"] & signals) and time.monotonic() < deadline:
        time.sleep(0.01)
        masks = signal_masks(pid)
    return masks


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_pool_workers_leave_ctrl_c_and_sigterm_to_the_main_process() -> None:
    # They go to the whole process group: the main process unwinds and shuts the pool down, the workers finish the
    # item at hand. The main process keeps both signals unblocked, so it still receives them.
    job = Job(tokenizer=CHARS, dtype="uint16", seed=0, val_fraction=0.5, on_decode_error="error", text_field="text")
    before = {child.pid for child in psutil.Process().children()}
    results = run_items(iter([lines(b'{"text": "ab"}\n')] * 20), job, num_workers=2)
    try:
        next(results)
        workers = [child.pid for child in psutil.Process().children() if child.pid not in before]
        assert len(workers) == 2
        stop = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
        for pid in workers:
            masks = masks_once_initialised(pid, stop)
            assert masks["SigIgn"] & stop == stop and masks["SigBlk"] & stop == 0
        assert signal_masks(os.getpid())["SigBlk"] & stop == 0
    finally:
        results.close()
    assert all(not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE for pid in workers)
