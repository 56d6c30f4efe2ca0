"""prepare_data/preferences.py and gptkit.data.preferences: TRL's preference forms rendered with the chat template
(masks on the candidate replies only), pairs kept together, parquet, bad records, and pair batches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gptkit.data.preferences import PairBatches, PairEpoch, open_pairs
from helpers import gpt2_chat_tokenizer, run_main
from prepare_data import preferences as script


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def prepare(tmp_path: Path, records: list, capsys, *extra: str) -> tuple[int, str, str, Path]:
    source = write_jsonl(tmp_path / "pairs.jsonl", records)
    out = tmp_path / "prefs"
    args = [f"--input={source}", f"--out_dir={out}", "--num_workers=1", "--val_fraction=0.3", *extra]
    code, stdout, stderr = run_main(script.main, args, capsys)
    return code, stdout, stderr, out


def expected(prompt: list[dict], reply: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Rendered by hand: the whole conversation, the mask zero up to and including the assistant marker."""
    chat = gpt2_chat_tokenizer()
    ids, mask = chat.chat.render(prompt + reply, chat)
    mask[: len(chat.chat.render_prompt(prompt, chat)) - 1] = 0
    return ids, mask


@pytest.mark.gpt2_bpe
def test_text_and_message_forms_render_pairs_with_masks_on_the_replies(tmp_path, capsys):
    """Each form for each of four prompts; every pair of a prompt goes to the same split."""

    def reply(text: str) -> list[dict]:
        return [{"role": "assistant", "content": text}]

    records, prompt_of, rejected_of = [], {}, {}
    for k, question in enumerate(["What is two plus two?", "What is 2 + 2?", "Two plus two is?", "Add two and two."]):
        user = [{"role": "user", "content": question}]
        four, five, quatre, fish = f"four{k}", f"five{k}", f"quatre{k}", f"fish{k}"
        records += [
            {"prompt": question, "chosen": four, "rejected": five},
            {"prompt": user, "chosen": reply(f"4{k}"), "rejected": reply(f"22{k}")},
            {"chosen": user + reply(quatre), "rejected": user + reply(fish)},
        ]
        rejected_of |= {four: five, f"4{k}": f"22{k}", quatre: fish}
        prompt_of |= dict.fromkeys((four, f"4{k}", quatre), question)
    code, stdout, _, out = prepare(tmp_path, records, capsys)
    assert code == 0 and "pairs" in stdout
    seen: dict[str, list[str]] = {"train": [], "val": []}
    for split in ("train", "val"):
        pairs = open_pairs(out, split)
        for p in range(len(pairs) // 2):
            chosen_ids, chosen_mask = pairs.conversation(2 * p)
            rejected_ids, rejected_mask = pairs.conversation(2 * p + 1)
            scored = [int(t) for t, m in zip(chosen_ids, chosen_mask) if m][:-1]  # the scored reply
            text = gpt2_chat_tokenizer().decode(scored)
            user = [{"role": "user", "content": prompt_of[text]}]
            want_ids, want_mask = expected(user, reply(text))
            np.testing.assert_array_equal(chosen_ids, want_ids)
            np.testing.assert_array_equal(chosen_mask, want_mask)
            want_ids, want_mask = expected(user, reply(rejected_of[text]))
            np.testing.assert_array_equal(rejected_ids, want_ids)
            np.testing.assert_array_equal(rejected_mask, want_mask)
            seen[split].append(text)
    assert sorted(seen["train"] + seen["val"]) == sorted(rejected_of)
    for split, texts in seen.items():  # a prompt's three pairs are together
        assert len({prompt_of[text] for text in texts}) * 3 == len(texts), split


@pytest.mark.gpt2_bpe
def test_a_record_without_chosen_is_one_line_naming_file_and_line(tmp_path, capsys):
    records = [{"prompt": "a", "chosen": "b", "rejected": "c"}, {"prompt": "a", "rejected": "c"}]
    code, _, stderr, out = prepare(tmp_path, records, capsys)
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1
    assert "pairs.jsonl:2" in stderr and "'chosen'" in stderr
    assert not (out / "meta.json").exists()


@pytest.mark.parametrize(
    "record, message",
    [
        ({"prompt": "a", "chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are the same reply"),
        ({"chosen": "x", "rejected": "y"}, "text candidates need a 'prompt' field"),
        (
            {
                "chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"}],
                "rejected": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"}],
            },
            "share no first message (the prompt)",
        ),
        (
            {
                "prompt": [],
                "chosen": [{"role": "assistant", "content": "x"}],
                "rejected": [{"role": "assistant", "content": "y"}],
            },
            "'prompt' holds no message",
        ),
    ],
)
@pytest.mark.gpt2_bpe
def test_a_pair_with_nothing_to_prefer_is_one_line(tmp_path, capsys, record, message):
    """The same reply twice, or replies to different prompts: DPO's loss would learn nothing, or the wrong thing."""
    code, _, stderr, out = prepare(tmp_path, [{"prompt": "a", "chosen": "b", "rejected": "c"}, record], capsys)
    assert code == 2 and len(stderr.strip().splitlines()) == 1
    assert "pairs.jsonl:2" in stderr and message in stderr
    assert not (out / "meta.json").exists()


@pytest.mark.gpt2_bpe
def test_skip_counts_bad_records(tmp_path, capsys):
    good = [{"prompt": f"q{i}", "chosen": "yes", "rejected": "no"} for i in range(10)]
    code, stdout, _, _ = prepare(tmp_path, [*good, {"prompt": "x", "chosen": "y"}], capsys, "--on_bad=skip")
    assert code == 0 and "1 skipped (1 no chosen or rejected)" in stdout


@pytest.mark.gpt2_bpe
def test_parquet_records(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"prompt": f"question {i}", "chosen": "good", "rejected": "bad"} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    out = tmp_path / "prefs"
    args = [f"--input={tmp_path / 'p.parquet'}", f"--out_dir={out}", "--num_workers=1", "--val_fraction=0.3"]
    (
        code,
        _,
        _,
    ) = run_main(script.main, args, capsys)[:3]
    assert code == 0
    total = sum(len(open_pairs(out, split)) for split in ("train", "val"))
    assert total == 24
    ids, _ = open_pairs(out, "train").conversation(0)
    assert gpt2_chat_tokenizer().decode(ids.tolist()).count("question") == 1


@pytest.mark.gpt2_bpe
def test_pair_batches_hold_chosen_then_rejected_rows_and_resume_by_index(tmp_path, capsys):
    records = [{"prompt": f"q {i}", "chosen": "yes " * (1 + i % 3), "rejected": "no"} for i in range(20)]
    _, _, _, out = prepare(tmp_path, records, capsys)
    split = open_pairs(out, "train")
    batches = PairBatches(split, batch_size=3, block_size=64, seed=5)
    x, y = batches.batch(4)
    pairs = batches.pair_indices(4)
    assert x.shape[0] == 6
    for row, pair in enumerate(pairs):
        for offset, conversation in ((0, 2 * pair), (3, 2 * pair + 1)):
            ids, mask = split.conversation(conversation)
            n = len(ids) - 1
            np.testing.assert_array_equal(x[row + offset, :n].numpy(), ids[:-1])
            np.testing.assert_array_equal(y[row + offset, :n].numpy(), np.where(mask[1:] > 0, ids[1:], -1))
            assert (y[row + offset, n:] == -1).all()
    again = PairBatches(split, batch_size=3, block_size=64, seed=5)
    again.load_state_dict(batches.state_dict())
    assert again.pair_indices(4) == pairs
    every = sorted(
        p for i in range(len(PairEpoch(split, 3, 64))) for p in range(len(PairEpoch(split, 3, 64)[i][0]) // 2)
    )
    assert len(every) == len(split) // 2
