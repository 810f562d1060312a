"""Model loading: the GGUF path of the real default model, the cache, manifests, vocab checks."""

import os
import shutil

import pytest
import torch

from services.common.loading import gguf_to_safetensors, default_gguf_path, load_model, manifest_path
from services.common.manifest import IntegrityError
from services.common.vocab import VocabularyMismatch, check_same_vocabulary
from services.draft.factory import build_proposer
from tests import tiny


def test_default_model_through_gguf_cache_and_manifest(tmp_path, monkeypatch):
    """A fresh home: dequantize the shipped GGUF, cache it, write the manifest, reload from the
    cache, then refuse a tampered cache file."""
    monkeypatch.setenv("SPECSERVE_HOME", str(tmp_path))
    gguf = default_gguf_path()
    ckpt = gguf_to_safetensors(gguf)
    assert ckpt.parent == tmp_path / "models" and (ckpt / "model.safetensors").exists()
    first = load_model("default")
    assert first.path == ckpt and manifest_path(ckpt).exists()
    assert first.config.num_layers == 30 and first.config.vocab_size == 49152
    assert first.tokenizer.decode(first.tokenizer("Hello world")["input_ids"]) == "Hello world"
    second = load_model("default")  # from the cache: no dequantization, manifest checked
    ids = torch.arange(0, 49152, 97)
    assert torch.equal(second.model.embedding(ids), first.model.embedding(ids))
    weights = ckpt / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(os.path.getsize(weights) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="model.safetensors"):
        load_model("default")


def test_user_checkpoint_manifest_lives_in_our_home(tmp_path, home):
    ckpt = tiny.make_checkpoint(tmp_path / "user-model", seed=4)
    load_model(str(ckpt))
    manifest = manifest_path(ckpt)
    assert home in manifest.parents and manifest.exists()
    assert not (ckpt / "specserve-manifest.json").exists()  # the user's directory is not written
    (ckpt / "extra.json").write_text("{}")
    with pytest.raises(IntegrityError, match="extra.json"):
        load_model(str(ckpt))


def test_mismatched_vocabulary_names_the_first_differing_token(tmp_path, home):
    target = tiny.make_checkpoint(tmp_path / "t", seed=1)
    draft = tiny.make_checkpoint(tmp_path / "d", seed=2, rename={17: "zebra"})
    t = load_model(str(target))
    with pytest.raises(VocabularyMismatch, match=r"token id 17 is 'w17' in the target and 'zebra' in the draft"):
        build_proposer(str(draft), t)
    check_same_vocabulary(t.tokenizer, t.tokenizer)  # same tokenizer: no error


def test_unsupported_or_missing_models_are_refused(tmp_path, home):
    with pytest.raises(FileNotFoundError, match="expected 'default'"):
        load_model(str(tmp_path / "nowhere"))
    ckpt = tiny.make_checkpoint(tmp_path / "gelu", seed=1, hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act"):
        load_model(str(ckpt))
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(ckpt), dtype="float8")


def test_bfloat16_weights(home, tiny_target):
    from services.common.llama import Chunk

    ids = list(range(3, 20))
    outs = []
    for dtype in ("bfloat16", "float32"):
        lm = load_model(str(tiny_target), dtype=dtype)
        assert lm.model.embed.dtype == getattr(torch, dtype)
        outs.append(lm.model.forward([Chunk(lm.model.new_cache(32), ids, list(range(-1, 16)), 0)])[0])
    assert float((outs[0] - outs[1]).abs().max() / outs[1].abs().max()) < 5e-2
