"""bench/greedy_identity.py's comparison, without a server: which answers differ and where they part."""

import greedy_identity as gi


def test_answers_part_at_their_first_differing_token_or_where_the_shorter_ends():
    assert gi.parted_at([1, 2, 3], [1, 2, 3]) is None
    assert gi.parted_at([1, 2, 3], [1, 5, 3]) == 1
    assert gi.parted_at([1, 2, 3], [1, 2]) == 2  # one stopped early: they part there


def test_the_comparison_counts_the_differing_answers_and_sorts_where_they_part():
    alone = [[1, 2, 3], [4, 5, 6], [7, 8]]
    other = [[1, 2, 9], [4, 5, 6], [0, 8]]
    assert gi.compare(alone, other) == {"differing": 2, "of": 3, "first_differing_token": [0, 2]}
