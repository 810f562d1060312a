"""The acceptance rules on their own: greedy walk, and exactness of recursive rejection sampling."""

import pytest
import torch
from scipy.stats import chisquare

from services.common.tree import DraftTree
from services.verifier.rejection import accept_greedy, accept_sampling

V = 6


def test_greedy_follows_argmax_and_adds_the_bonus():
    tree = DraftTree()
    for tok, parent in [(1, -1), (2, -1), (3, 1), (4, 2)]:
        tree.add(tok, parent, [tok], [1.0])
    logits = torch.full((5, V), -1.0)
    for row, best in enumerate([2, 0, 3, 4, 5]):  # root wants 2 (node 1), node 1 wants 3 (node 2) ...
        logits[row, best] = 1.0
    v = accept_greedy(tree, logits)
    assert v.accepted_nodes == [1, 2, 3] and v.tokens == [2, 3, 4, 5] and v.bonus
    logits[3, 4], logits[3, 1] = -1.0, 1.0  # node 2 now wants 1: no such child -> recovered token
    v = accept_greedy(tree, logits)
    assert v.accepted_nodes == [1, 2] and v.tokens == [2, 3, 1] and not v.bonus


def one_level_trial(p, q, n_children, gen, deterministic):
    tree = DraftTree()
    if deterministic:  # point masses on fixed distinct tokens (n-gram style)
        for tok in range(n_children):
            tree.add(tok, -1, [tok], [1.0])
    else:  # drawn without replacement from q, each sibling with its own exact q
        qq = q.clone()
        for _ in range(n_children):
            qi = qq / qq.sum()
            tok = int(torch.multinomial(qi, 1, generator=gen))
            tree.add(tok, -1, list(range(V)), qi.tolist())
            qq[tok] = 0.0
    probs = torch.stack([p] + [torch.full((V,), 1.0 / V)] * n_children)
    return accept_sampling(tree, probs, gen).tokens[0]


@pytest.mark.parametrize("n_children,deterministic", [(1, False), (3, False), (2, True)])
def test_first_token_has_exactly_the_target_distribution(n_children, deterministic):
    gen = torch.Generator().manual_seed(11)
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15, 0.0])
    q = torch.tensor([0.3, 0.1, 0.3, 0.05, 0.05, 0.2])  # poor draft, support where p is 0
    n = 20000
    counts = torch.zeros(V)
    for _ in range(n):
        counts[one_level_trial(p, q, n_children, gen, deterministic)] += 1
    assert counts[5] == 0  # never emits a token the target gives probability 0
    stat = chisquare(counts[:5].numpy(), (p[:5] * n).numpy())
    assert stat.pvalue > 1e-3, (counts, stat)


def test_a_token_with_zero_q_is_refused():
    tree = DraftTree()
    tree.add(1, -1, [2], [1.0])
    with pytest.raises(ValueError, match="q = 0"):
        accept_sampling(tree, torch.full((2, V), 1.0 / V), torch.Generator().manual_seed(0))
