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
