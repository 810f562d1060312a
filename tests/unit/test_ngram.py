from services.draft.ngram import NgramProposer


def test_longest_most_recent_match_first():
    p = NgramProposer(max_ngram=3, min_ngram=1)
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    conts = p.continuations(tokens, 3)
    # [2, 3] occurs at 1 (then 9 9 1) and at 6 (then 4 5 7); most recent first.
    assert conts[0] == [4, 5, 7]
    assert conts[1] == [9, 9, 1]


def test_chain_and_tree_shapes():
    p = NgramProposer()
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    chain = p.tree(tokens, draft_length=3, tree_size=3)
    assert chain.tokens == [4, 5, 7] and chain.is_chain()
    tree = p.tree(tokens, draft_length=3, tree_size=6)
    assert len(tree) == 6 and not tree.is_chain()
    tree.validate(vocab_size=16)
    assert all(q == [1.0] for q in tree.q_probs) and all(ids == [t] for ids, t in zip(tree.q_ids, tree.tokens))
    assert len(p.tree(tokens, draft_length=0, tree_size=6)) == 0


def test_no_match_proposes_nothing():
    assert len(NgramProposer(min_ngram=2).tree([1, 2, 3, 4], 4, 4)) == 0


def test_by_default_a_match_needs_two_tokens():
    p = NgramProposer()
    assert p.min_match == 2 and len(p.tree([5, 1, 2, 9, 5], 2, 2)) == 0  # only 5 recurs
    assert p.tree([5, 1, 2, 9, 5, 1], 2, 2).tokens == [2, 9]


def test_confidence_grows_with_agreeing_and_longer_matches():
    p = NgramProposer(max_ngram=3, min_ngram=1)
    once = p.tree([1, 2, 3, 4, 1, 2, 3], draft_length=1, tree_size=1)  # one 3-gram match (and shorter ones)
    assert once.tokens == [4]
    twice = p.tree([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], draft_length=1, tree_size=1)
    assert twice.tokens == [4] and twice.confidence[0] > once.confidence[0]
    split = p.tree([7, 5, 9, 7, 6, 9, 7], draft_length=1, tree_size=2)  # 7 was followed by 5 and by 6
    assert sorted(split.tokens) == [5, 6] and max(split.confidence) <= 0.5
    assert all(0 < c < 1 for c in once.confidence + twice.confidence + split.confidence)


def test_a_match_is_as_long_as_the_context_agrees_and_the_longest_comes_first():
    p = NgramProposer(max_ngram=3, min_ngram=1)
    # The last 3 tokens [1, 2, 3] occur at 2 (after 8 5, as at the end: 5 tokens agree) and,
    # more recently, at 8 (after 9: 3 tokens).
    tokens = [8, 5, 1, 2, 3, 4, 0, 9, 1, 2, 3, 6, 0, 8, 5, 1, 2, 3]
    found = p.matches(tokens, 2)
    assert found[:2] == [((4, 0), 5), ((6, 0), 3)]
    assert p.continuations(tokens, 2)[0] == [4, 0]


def test_a_longer_match_gives_more_confidence():
    p = NgramProposer(max_ngram=3, min_ngram=3)
    short = p.tree([7, 1, 2, 3, 4, 9, 1, 2, 3], draft_length=1, tree_size=1)  # 3 tokens agree
    long = p.tree([5, 6, 1, 2, 3, 4, 9, 5, 6, 1, 2, 3], draft_length=1, tree_size=1)  # 5 agree
    assert short.tokens == long.tokens == [4]
    assert short.confidence == [3 / 4] and long.confidence == [5 / 6]


def test_match_lengths_equal_a_token_by_token_count():
    """_extend (one array comparison for every occurrence and offset) counts, for each
    occurrence of the last n tokens, n plus the tokens before it that agree with those before the
    request's end, up to MAX_MATCH_LENGTH and the start of the context: a brute-force count on
    random contexts over a small alphabet (long agreeing runs) and on repeated text."""
    import random

    import numpy as np

    from services.draft.ngram import MAX_MATCH_LENGTH

    def brute(arr, start, n):
        end, j = len(arr) - n, 1
        while j <= MAX_MATCH_LENGTH - n and j <= end and start - j >= 0 and arr[start - j] == arr[end - j]:
            j += 1
        return n + j - 1

    rng = random.Random(5)
    contexts = [[rng.randrange(3) for _ in range(rng.randrange(4, 120))] for _ in range(200)]
    contexts += [list(range(20)) * 4, [7] * 50]
    for tokens in contexts:
        arr = np.asarray(tokens, dtype=np.int64)
        for n in (1, 2, 3):
            starts = np.nonzero(arr[: len(arr) - n] == arr[-n])[0] if len(arr) > n else np.zeros(0, dtype=np.int64)
            got = NgramProposer._extend(arr, starts, n).tolist()
            assert got == [brute(tokens, int(s), n) for s in starts], (tokens, n)
