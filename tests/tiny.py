"""Tiny random Llama-family checkpoints built inside the tests, saved as real checkpoint directories
(config.json, safetensors, tokenizer) so they go through the real loading code."""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["<unk>", "<s>", "</s>"]
EOS_ID = 2


def make_tokenizer(vocab_size: int, rename: dict[int, str] | None = None):
    """A word-level tokenizer over the words w3 .. w{vocab_size-1} plus three specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(len(SPECIALS), vocab_size)]
    for i, w in (rename or {}).items():
        words[i] = w
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    # A minimal chat template: w3 opens each message, w4 asks for the assistant's turn.
    fast.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}w4{% endif %}")
    return fast


def make_byte_tokenizer(vocab_size: int, merges: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer (as GPT-2's and SmolLM2's): three specials, the 256 bytes, then
    one token per merged pair in `merges` (two-character strings), padded to `vocab_size` with
    tokens no text produces. Any text encodes; the grammar engine reads it (structured outputs)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet())
    pairs = [(m[0], m[1]) for m in merges]
    words += [a + b for a, b in pairs]
    words += [f"<unused{i}>" for i in range(vocab_size - len(words))]
    assert len(words) == vocab_size, f"a byte-level vocabulary needs at least {len(SPECIALS) + 256 + len(pairs)} ids"
    tok = Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, pairs, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return fast


def make_checkpoint(path: Path, model_type: str = "llama", vocab_size: int = 64, seed: int = 0,
                    hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    init_std: float = 0.3, max_positions: int = 256, noise_from: Path | None = None,
                    noise_std: float = 0.0, rename: dict[int, str] | None = None,
                    merges: tuple[str, ...] | None = None, **extra) -> Path:
    """Save a random model of `model_type` (llama, qwen2, qwen3, mistral) into `path`.

    With `noise_from`, start from that checkpoint's weights plus Gaussian noise (a draft that
    agrees with its target often but not always). With `merges`, the tokenizer is byte-level
    (make_byte_tokenizer) instead of word-level.
    """
    import transformers as tf

    cfg_cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
               "mistral": tf.MistralConfig}[model_type]
    cfg = cfg_cls(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, initializer_range=init_std,
                  bos_token_id=1, eos_token_id=EOS_ID, pad_token_id=0, tie_word_embeddings=True,
                  **extra)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if noise_from is not None:
        src = tf.AutoModelForCausalLM.from_pretrained(noise_from, dtype=torch.float32)
        model.load_state_dict(src.state_dict())
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise_std)
    else:
        with torch.no_grad():  # norms and biases away from their 1 and 0, for a sharper test
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.1)
                elif name.endswith("norm.weight"):
                    p.normal_(1.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer = make_tokenizer(vocab_size, rename) if merges is None else make_byte_tokenizer(vocab_size, merges)
    tokenizer.save_pretrained(path)
    return path


def hf_model(path: Path):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], max_new: int, eos: int | None = EOS_ID) -> list[int]:
    """The target's own greedy decoding (HF generate, do_sample=False)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def make_head(loaded, layers=(0, 1), kept=None, seed: int = 0):
    """A feature head for a loaded tiny target, started from the target (services/draft/feature_head.py)
    and not trained; `kept`: its reduced vocabulary (target ids), all ids by default."""
    from services.common.loading import load_weights
    from services.common.vocab import vocabulary_digest
    from services.draft.feature_head import FeatureHead, HeadConfig, init_from_target

    torch.manual_seed(seed)
    kept = torch.arange(loaded.config.vocab_size) if kept is None else kept
    cfg = HeadConfig.for_target(loaded.config, tuple(layers), len(kept), "tiny", vocabulary_digest(loaded.tokenizer))
    head = FeatureHead(cfg)
    init_from_target(head, load_weights(loaded.path), loaded.config.num_layers, kept)
    return head.eval()


def head_proposer(loaded, head):
    from services.common.loading import load_weights
    from services.draft.head_proposer import HeadProposer

    return HeadProposer(head, load_weights(loaded.path)["model.embed_tokens.weight"], loaded.config.vocab_size)


def native(loaded, layer_kind: str = "Q4_1", embed_kind: str = "Q8_0"):
    """The same checkpoint as a quantized GGUF model runs it: every linear weight and the
    embedding quantized into GGUF blocks by the gguf package's own quantizer, and handed to
    LlamaModel as `load_model` hands a GGUF file's blocks (a copy of `loaded` with that model)."""
    import dataclasses

    import gguf
    from gguf.quants import quantize

    from services.common.gguf_blocks import BlockTensor
    from services.common.llama import LlamaModel
    from services.common.loading import load_weights

    weights = load_weights(loaded.path)
    blocks = {}
    for name, w in weights.items():
        if name.endswith("proj.weight") or name == "model.embed_tokens.weight":
            kind = embed_kind if "embed" in name else layer_kind
            raw = quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
            blocks[name] = BlockTensor(kind, torch.from_numpy(raw))
    rest = {n: w for n, w in weights.items() if n not in blocks}
    model = LlamaModel(loaded.config, rest, torch.device("cpu"), torch.float32, blocks)
    return dataclasses.replace(loaded, model=model)


def target_states(loaded, ids: list[int], layers=(0, 1)) -> torch.Tensor:
    """The loaded target's states of every position of ids: [len(ids), layers * hidden]."""
    model = loaded.model
    _, states = model.forward_states([tiny_chunk(model, ids)], layers)
    return states[0]


def tiny_chunk(model, ids):
    """One chunk feeding ids from position 0 into a fresh cache (logits of the last row)."""
    from services.common.llama import Chunk

    return Chunk(model.new_cache(len(ids) + 4), ids, list(range(-1, len(ids) - 1)), logits_from=len(ids) - 1)
