"""gptkit/infer/next_token.py: greedy, temperature, top-k and top-p sampling, and the draw with one uniform number a row.

Expected frequencies are softmaxes computed here in float64 from the rule; 20,000 draws keep them within 0.01.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from gptkit.infer.next_token import (
    TOP_K_BLOCK,
    Sampling,
    draw,
    largest_k,
    most_likely_holding,
    sample_next_token,
)


def test_sampling_controls():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    assert sample_next_token(logits, temperature=0).item() == 1
    generator = torch.Generator().manual_seed(0)
    top2 = {sample_next_token(logits, 1.0, top_k=2, generator=generator).item() for _ in range(200)}
    assert top2 == {1, 2}
    probs = F.softmax(logits, -1)[0]  # sorted: 1 (0.64), 2 (0.24), 0 (0.09), ...
    p = (probs[1] + 0.5 * probs[2]).item()  # needs tokens 1 and 2 to reach p
    nucleus = {sample_next_token(logits, 1.0, top_p=p, generator=generator).item() for _ in range(300)}
    assert nucleus == {1, 2}
    only_top = {sample_next_token(logits, 1.0, top_p=0.1, generator=generator).item() for _ in range(50)}
    assert only_top == {1}
    a = sample_next_token(logits.repeat(8, 1), 1.0, generator=torch.Generator().manual_seed(5))
    b = sample_next_token(logits.repeat(8, 1), 1.0, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_of_tied_largest_logits(dtype):
    """Each row's token is its largest logit's column; on a tie, the lowest such column (as argmax documents)."""
    logits = torch.zeros(3, 50257, dtype=dtype)
    ties = [(7, 3000, 50000), (50256,), (40000, 40001)]
    for row, columns in enumerate(ties):
        logits[row, list(columns)] = 2.5
    assert sample_next_token(logits, temperature=0).tolist() == [7, 50256, 40000]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, kept",
    [
        (1.0, None, None, [0, 1, 2, 3, 4]),
        (1.0, 3, None, [1, 2, 0]),
        (1.0, None, 0.8, [1, 2]),
        (1.0, 4, 0.9, [1, 2, 0]),
        (0.5, 2, None, [1, 2]),
    ],
)
def test_sampling_frequencies_follow_the_renormalized_distribution(temperature, top_k, top_p, kept):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]]).repeat(20_000, 1)  # probabilities .09 .64 .24 .03 .01
    tokens = sample_next_token(logits, temperature, top_k, top_p, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=5).double() / tokens.numel()
    expected = torch.zeros(5, dtype=torch.float64)
    expected[kept] = F.softmax(logits[0, kept].double() / temperature, dim=-1)
    torch.testing.assert_close(frequencies, expected, rtol=0, atol=0.01)


@pytest.mark.heavy
def test_top_p_over_a_whole_vocabulary_keeps_exactly_the_nucleus():
    """GPT-2's vocabulary size, so the nucleus comes from a partial top-k (peaked rows) or a whole sort (a flat row);
    the reference nucleus is computed here in float64 from a full sort."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50257, generator=generator)
    logits[0, :6] += torch.tensor([14.0, 13.5, 13.0, 12.0, 11.0, 10.0])  # a few tokens hold most of the mass
    logits[1, 100:400] += 9.0  # the nucleus needs more than the first prefix (256 columns)
    logits[2] *= 0.01  # almost flat: tens of thousands of tokens in the nucleus
    for row, top_p in ((0, 0.9), (1, 0.8), (2, 0.5)):
        probs = F.softmax(logits[row].double(), dim=-1)
        ordered, order = torch.sort(probs, descending=True)
        expected = set(order[(ordered.cumsum(0) - ordered) < top_p].tolist())
        drawn = set()
        for _ in range(10):
            drawn |= set(sample_next_token(logits[row].repeat(100, 1), 1.0, top_p=top_p, generator=generator).tolist())
        assert drawn <= expected and len(drawn) >= min(len(expected), 5)
    top, columns = most_likely_holding(F.softmax(logits, dim=-1), 0.5)  # the flat row needs the whole sort
    assert top.shape == (3, 50257) and torch.equal(top[:, :-1] >= top[:, 1:], torch.ones(3, 50256, dtype=torch.bool))
    peaked = F.softmax(logits[:1], dim=-1)
    top, columns = most_likely_holding(peaked, 0.9)
    assert top.shape == (1, 256) and set(columns[0, :6].tolist()) == {0, 1, 2, 3, 4, 5}
    assert torch.equal(top, torch.sort(peaked, descending=True).values[:, :256])


def test_top_p_frequencies_over_a_whole_vocabulary():
    logits = torch.full((1, 50257), -20.0)
    logits[0, [7, 300, 50000]] = torch.tensor([2.0, 1.0, 0.0])  # probabilities ~.665 .245 .090 (the rest ~1e-8)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.cat(
        [sample_next_token(logits.repeat(500, 1), 1.0, top_p=0.95, generator=generator) for _ in range(8)]
    )
    kept = torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64).softmax(0)  # all three needed to reach 0.95
    frequencies = torch.tensor(
        [(tokens == token).double().mean().item() for token in (7, 300, 50000)], dtype=torch.float64
    )
    torch.testing.assert_close(frequencies, kept, rtol=0, atol=0.025)
    assert set(tokens.tolist()) == {7, 300, 50000}


def test_a_draw_that_rounds_up_to_the_total_takes_the_last_token_with_a_probability(monkeypatch):
    monkeypatch.setattr(torch, "rand", lambda shape, **kwargs: torch.ones(shape, dtype=kwargs.get("dtype")))
    probs = torch.tensor([[0.2, 0.0, 0.8, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0]])
    assert draw(probs).squeeze(-1).tolist() == [2, 1]  # never a column whose probability is 0


def test_draw_follows_unnormalized_weights():
    weights = torch.tensor([[1.0, 0.0, 3.0, 6.0]]).repeat(20_000, 1)  # .1 0 .3 .6 once normalized
    columns = draw(weights, torch.Generator().manual_seed(3)).squeeze(-1)
    frequencies = torch.bincount(columns, minlength=4).double() / columns.numel()
    torch.testing.assert_close(frequencies, torch.tensor([0.1, 0.0, 0.3, 0.6], dtype=torch.float64), rtol=0, atol=0.01)


@pytest.mark.parametrize(
    "top_k, uniform, token",
    [(None, 0.05, 0), (None, 0.5, 1), (None, 0.97, 3), (None, 0.995, 4), (2, 0.7, 1), (2, 0.75, 2)],
)
def test_a_given_uniform_number_picks_the_column_where_the_cumulative_probability_passes_it(top_k, uniform, token):
    """Probabilities of [1, 3, 2, 0, -1]: .0861 .6364 .2341 .0317 .0117, cumulative .0861 .7225 .9566 .9883 1 in
    column order; with top_k=2 the columns are 1 then 2, cumulative .7311 1."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -1.0]])
    assert sample_next_token(logits, 1.0, top_k, uniform=torch.tensor([[uniform]])).item() == token


def test_given_uniform_numbers_are_the_generators_own_draw():
    """A caller that draws (B, 1) numbers from a generator and passes them gets the tokens the generator gives."""
    logits = torch.randn(6, 50257, generator=torch.Generator().manual_seed(2))
    for top_k in (None, 200):
        drawn = sample_next_token(logits, 0.8, top_k, generator=torch.Generator().manual_seed(9))
        uniform = torch.rand((6, 1), generator=torch.Generator().manual_seed(9))
        assert torch.equal(sample_next_token(logits, 0.8, top_k, uniform=uniform), drawn)


def test_a_temperature_given_as_a_tensor_samples_as_the_number_does():
    """A compiled step passes its temperature as a 0-d tensor (one graph for every value): the same tokens as the
    number, with and without top-k; over the whole vocabulary, the column where the float64 cumulative softmax of
    logits / 0.7 first passes each row's number."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    uniform = torch.rand((4, 1), generator=torch.Generator().manual_seed(8))
    for top_k in (None, 20):
        as_number = sample_next_token(logits, 0.7, top_k, uniform=uniform)
        assert torch.equal(sample_next_token(logits, torch.tensor(0.7), top_k, uniform=uniform), as_number)
    cumulative = F.softmax(logits.double() / 0.7, dim=-1).cumsum(-1)
    expected = [int((row > u).nonzero()[0]) for row, u in zip(cumulative, uniform[:, 0].double())]
    assert sample_next_token(logits, torch.tensor(0.7), uniform=uniform).tolist() == expected


@pytest.mark.parametrize(
    ("settings", "normal"),
    [
        ((0.0, 40, 0.9), Sampling(temperature=0.0, top_k=None, top_p=None)),  # greedy reads neither
        ((0, None, None), Sampling(temperature=0.0, top_k=None, top_p=None)),
        ((0.8, 40, 1.0), Sampling(temperature=0.8, top_k=40, top_p=None)),  # a top-p of 1 keeps every token
        ((1e-310, 40, 1e-300), Sampling(temperature=0.0, top_k=None, top_p=None)),  # so small a temperature is greedy
        (
            (0.8, 60, None),
            Sampling(temperature=0.8, top_k=None, top_p=None),
        ),  # a top-k of the whole vocabulary (60) keeps every token
        ((0.8, 2**70, None), Sampling(temperature=0.8, top_k=None, top_p=None)),
        ((0.8, None, 0.95), Sampling(temperature=0.8, top_k=None, top_p=0.95)),
        ((1.0, 5, None), Sampling(temperature=1.0, top_k=5, top_p=None)),
    ],
)
def test_sampling_settings_that_choose_alike_are_equal(settings, normal):
    """Sampling.of gives settings that choose alike one form: the engine groups rows by it, and a backend samples
    inside its step only when every row's is the same."""
    assert Sampling.of(*settings, vocab_size=60) == normal
    logits = torch.randn(3, 60, generator=torch.Generator().manual_seed(1))
    uniform = torch.rand((3, 1), generator=torch.Generator().manual_seed(2))
    raw = sample_next_token(logits, *settings, uniform=uniform)
    assert torch.equal(normal.next_token(logits, uniform=uniform), raw)


def test_largest_k_in_a_compiled_graph_is_torch_topk():
    """Compiled, largest_k searches by blocks of TOP_K_BLOCK columns; its values and columns are torch.topk's, for
    vocabularies that are and are not multiples of the block, rows whose largest entries crowd into a few blocks, and
    a vocabulary too small for blocks. Where entries tie at the k-th place only the values must agree."""
    compiled = torch.compile(largest_k, fullgraph=True, dynamic=False)
    generator = torch.Generator().manual_seed(4)
    for vocab, k in ((50257, 200), (4096, 40), (1000, 100)):  # 1000: 4 * 100 * 16 columns would not pay, plain topk
        logits = torch.randn(3, vocab, generator=generator)
        logits[1, 32:64] += 10.0  # the row's 32 largest entries fill two blocks
        logits[2, -5:] += 10.0  # and here the last, partial block (with 50257 columns)
        values, columns = compiled(logits, k)
        expected = torch.topk(logits, k, dim=-1)
        assert torch.equal(values, expected.values) and torch.equal(columns, expected.indices)
    tied = torch.zeros(3, 50257)  # the first case's shape: its graph, no new compile
    tied[:, 100:150] = torch.arange(50, 0, -1.0)  # 50 distinct largest, then 50207 zeros tie for the other places
    values, columns = compiled(tied, 200)
    assert torch.equal(values, torch.topk(tied, 200, dim=-1).values)
    assert torch.equal(tied.gather(1, columns), values) and all(len(set(row)) == 200 for row in columns.tolist())
    assert TOP_K_BLOCK * 4 * 200 <= 50257  # the first case above took the block search


@pytest.mark.parametrize("temperature", [1e-310, 1e-40, 1e-6])
def test_a_temperature_too_small_for_float32_is_greedy(temperature):
    """logits / 1e-40 overflow float32 (and 1e-310 is 0 in it): every row still gets its largest logit's token."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 30
    uniform = torch.rand((4, 1), generator=torch.Generator().manual_seed(4))
    expected = [int(row.argmax()) for row in logits]
    assert sample_next_token(logits, temperature, uniform=uniform).tolist() == expected
    assert sample_next_token(logits, temperature, top_k=5, top_p=0.5, uniform=uniform).tolist() == expected


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 1e-9])
def test_a_top_p_below_the_largest_probability_keeps_the_most_likely_token_alone(top_p):
    """A nucleus always holds the most likely token, even for a top_p that float32 rounds to 0."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3
    expected = [int(row.argmax()) for row in logits]
    for seed in range(5):
        uniform = torch.rand((4, 1), generator=torch.Generator().manual_seed(seed))
        assert sample_next_token(logits, 1.0, top_p=top_p, uniform=uniform).tolist() == expected
        assert sample_next_token(logits, 1.0, top_k=7, top_p=top_p, uniform=uniform).tolist() == expected
