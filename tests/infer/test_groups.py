"""sample_groups: G completions of many prompts in one engine are what each would be alone (greedy: the plain
uncached decoding; sampled: the same seeded tokens whatever the batch), stop at a stop token, and fit the context."""

from __future__ import annotations

from gptkit.infer.groups import sample_groups
from helpers import lively_model, reference_greedy

PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]


def test_greedy_groups_match_plain_decoding_one_prompt_at_a_time():
    model = lively_model()
    made = sample_groups(model, PROMPTS, 2, seed=0, max_new_tokens=6, temperature=0.0)
    assert len(made) == 6
    for index, prompt in enumerate(PROMPTS):
        want = reference_greedy(model, prompt, 6)
        assert made[2 * index] == want and made[2 * index + 1] == want


def test_sampled_completions_do_not_depend_on_the_batch():
    model = lively_model()
    together = sample_groups(model, PROMPTS, 3, seed=4, max_new_tokens=5)
    one_row = sample_groups(model, PROMPTS, 3, seed=4, max_new_tokens=5, slots=1)
    alone = sample_groups(model, PROMPTS[2:], 3, seed=4, max_new_tokens=5, first_prompt=2)
    assert together == one_row
    assert together[6:] == alone
    assert len({tuple(c) for c in together[:3]}) > 1  # a group's completions differ
    assert sample_groups(model, PROMPTS, 3, seed=5, max_new_tokens=5) != together


def test_stop_tokens_end_a_completion_and_the_context_bounds_it():
    model = lively_model()
    greedy = sample_groups(model, [[1, 2]], 1, seed=0, max_new_tokens=8, temperature=0.0)[0]
    stop = greedy[3]
    cut = sample_groups(model, [[1, 2]], 1, seed=0, max_new_tokens=8, temperature=0.0, stop_tokens=[stop])[0]
    assert cut == greedy[: greedy.index(stop) + 1]
    long_prompt = list(range(1, 15))  # 14 of 16 positions
    assert len(sample_groups(model, [long_prompt], 2, seed=0, max_new_tokens=10)[0]) == 2
