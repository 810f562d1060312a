import pytest
import torch

from services.common.kv_cache import KVCache
from services.common.tree import DraftTree, ancestor_mask, forest_depths, forest_parents


def test_ancestor_mask_and_depths():
    parents = [-1, 0, 0, 1, 3, -1]
    m = ancestor_mask(parents)
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {5}}
    for i, anc in expected.items():
        assert {j for j in range(6) if m[i, j]} == anc
    assert forest_depths(parents) == [0, 1, 1, 2, 3, 0]
    assert torch.equal(ancestor_mask([-1, 0, 1]), torch.ones(3, 3, dtype=torch.bool).tril())


def test_forest_parents_puts_tree_under_the_last_pending_token():
    tree = DraftTree()
    tree.add(5, -1, [5], [1.0])
    tree.add(6, 0, [6], [1.0])
    tree.add(7, -1, [7], [1.0])
    assert forest_parents(3, tree) == [-1, 0, 1, 2, 3, 2]
    assert tree.children() == [[0, 2], [1], [], []]
    assert tree.depths() == [1, 2, 1]


@pytest.mark.parametrize("tokens,parents,msg", [
    ([5, 5], [-1, -1], "duplicate sibling"),
    ([5, 6], [-1, 1], "parent 1"),
    ([5, 99], [-1, 0], "outside the vocabulary"),
])
def test_invalid_trees_are_refused(tokens, parents, msg):
    tree = DraftTree(tokens, parents, [[t] for t in tokens], [[1.0] for _ in tokens])
    with pytest.raises(ValueError, match=msg):
        tree.validate(vocab_size=64)


def test_kv_cache_keep_reserve_truncate():
    c = KVCache(layers=2, kv_heads=1, head_dim=2, capacity=4, dtype=torch.float32, device=torch.device("cpu"))
    c.reserve(8)
    assert c.capacity >= 8
    with torch.inference_mode():  # cache tensors are inference tensors, as the forward writes them
        c.k[:, 0, :8, 0] = torch.arange(8.0)
        c.v[:, 0, :8, 0] = -torch.arange(8.0)
    c.length = 8
    c.keep(3, [4, 6, 7])  # overlapping move: slot 3 <- 4, 4 <- 6, 5 <- 7
    assert c.length == 6
    assert c.k[1, 0, :6, 0].tolist() == [0, 1, 2, 4, 6, 7]
    assert c.v[0, 0, :6, 0].tolist() == [0, -1, -2, -4, -6, -7]
    c.reserve(40)  # growing keeps the valid slots
    assert c.k[0, 0, :6, 0].tolist() == [0, 1, 2, 4, 6, 7]
    c.truncate(2)
    assert c.length == 2
    with pytest.raises(ValueError):
        c.truncate(5)


def test_cache_grown_inside_a_forward_can_keep_a_path_outside(tiny_target):
    from services.common.llama import Chunk
    from services.common.loading import load_model

    lm = load_model(str(tiny_target))
    cache = lm.model.new_cache(2)
    lm.model.forward([Chunk(cache, list(range(3, 40)), list(range(-1, 36)), 36)])  # grows the cache
    assert cache.capacity >= 37
    cache.keep(30, [32, 35])
    assert cache.length == 32
