"""Packing conversations into rows: best fit by hand, every conversation once per epoch, targets only where the mask
is 1, batches a pure function of their index (resume), and the trained-target counts the training step divides by."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gptkit.core.errors import UserError
from gptkit.data.conversations import open_conversations
from gptkit.data.packing import PackedBatches, PackedEpoch, masked_targets, pack_rows
from gptkit.data.prepare.writer import DatasetWriter
from gptkit.data.tokenizer import CharTokenizer, ChatTokenizer


def test_best_fit_by_hand() -> None:
    # Rows of 10: 8 first (the longest), then 2 fills its gap; 6 with 3; 5 alone.
    rows = pack_rows(np.array([5, 3, 8, 2, 6]), np.arange(5), row_tokens=10)
    assert rows == [[2, 3], [4, 1], [0]]
    # A window of 2: only the next two conversations are candidates.
    assert pack_rows(np.array([5, 3, 8, 2, 6]), np.arange(5), row_tokens=10, window=2) == [[0, 1], [2, 3], [4]]
    assert pack_rows(np.array([30, 4]), np.arange(2), row_tokens=10) == [[0], [1]]  # too long: a row of its own


def write_chat_data(directory: Path, count: int = 40, seed: int = 0) -> ChatTokenizer:
    """`count` conversations of random lengths (one to three exchanges, at most 61 tokens) in train and val."""
    tokenizer = ChatTokenizer.extending(CharTokenizer.from_text("abcdefgh ", eot=True))
    rng = np.random.default_rng(seed)
    with DatasetWriter(directory, "uint16", side_streams=True) as writer:
        for split in ("train", "val"):
            for _ in range(count):
                messages = []
                for _ in range(int(rng.integers(1, 4))):
                    for role in ("user", "assistant"):
                        text = "".join(rng.choice(list("abcdefgh"), size=int(rng.integers(1, 9))))
                        messages.append({"role": role, "content": text})
                ids, mask = tokenizer.chat.render(messages, tokenizer)
                writer.write_conversation(split, ids, mask, len(ids))
        writer.commit(tokenizer, {})
    return tokenizer


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    directory = tmp_path_factory.mktemp("chat")
    write_chat_data(directory)
    return open_conversations(directory, "train")


def test_an_epoch_holds_every_conversation_once_and_rows_hold_whole_ones(split) -> None:
    batches = PackedBatches(split, batch_size=4, block_size=63, seed=3)
    plan = batches.plan(0)
    assert sorted(plan.order.tolist()) == list(range(len(split)))
    for row in range(len(plan)):
        members = plan.order[plan.bounds[row] : plan.bounds[row + 1]]
        assert split.lengths[members].sum() <= 64
    assert batches.plan(1).order.tolist() != plan.order.tolist()  # each epoch in another order
    assert 0 < batches.padding_share() < 0.5


def test_targets_are_the_next_tokens_where_the_mask_is_one(split) -> None:
    batches = PackedBatches(split, batch_size=4, block_size=63, seed=3)
    x, y = batches.batch(0)
    plan = batches.plan(0)
    for row in range(4):
        members = plan.order[plan.bounds[row] : plan.bounds[row + 1]].tolist()
        ids = np.concatenate([split.conversation(m)[0] for m in members])
        mask = np.concatenate([split.conversation(m)[1] for m in members])
        n = len(ids)
        assert x[row, : min(n, 63)].tolist() == ids[:63].tolist()
        expected = [int(t) if m else -1 for t, m in zip(ids[1:], mask[1:])]
        assert y[row, : n - 1].tolist() == expected
        assert (y[row, n - 1 :] == -1).all()  # padding is never a target
    assert batches.counted(0) == int((y >= 0).sum())


def test_masked_positions_never_become_targets_whatever_they_hold() -> None:
    rows = np.array([[5, 6, 7, 8, 9]])
    mask = np.array([[0, 0, 1, 1, 0]])
    assert masked_targets(rows, mask).tolist() == [[-1, 7, 8, -1]]
    altered = rows.copy()
    altered[0, [1, 4]] = [0, 0]  # other tokens where the mask is 0
    assert masked_targets(altered, mask).tolist() == masked_targets(rows, mask).tolist()


def test_a_batch_is_a_pure_function_of_its_index(split) -> None:
    first = PackedBatches(split, batch_size=4, block_size=63, seed=3)
    expected = [first.batch(i) for i in range(12)]  # beyond one epoch
    again = PackedBatches(split, batch_size=4, block_size=63, seed=3)
    again.load_state_dict({"seed": 3, "purpose": 0, "position": 9})
    for i in (9, 10, 11, 2):
        x, y = again.batch(i)
        assert x.equal(expected[i][0]) and y.equal(expected[i][1])
    other = PackedBatches(split, batch_size=4, block_size=63, seed=4).batch(0)
    assert not other[0].equal(expected[0][0])


def test_the_full_epoch_counts_each_trained_token_once(split) -> None:
    epoch = PackedEpoch(split, block_size=63, batch_size=5)
    targets = sum(int((y >= 0).sum()) for _, y in epoch)
    everything = sum(int(split.conversation(i)[1].sum()) for i in range(len(split)))
    assert targets == everything


def test_a_loss_mask_of_other_values_than_0_and_1_is_one_line(tmp_path: Path) -> None:
    """A mask value of 2 would weigh its token twice (and halve the loss's scale): the data is damaged."""
    write_chat_data(tmp_path)
    mask = np.fromfile(tmp_path / "train.mask.bin", dtype=np.uint8)
    (mask * 2).astype(np.uint8).tofile(tmp_path / "train.mask.bin")
    with pytest.raises(UserError, match="split 'train' has loss-mask values other than 0 and 1; prepare it again"):
        open_conversations(tmp_path, "train")
    open_conversations(tmp_path, "val")  # the other split is intact
