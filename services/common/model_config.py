"""The architecture facts the lean forward needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    inv_freq: torch.Tensor  # [head_dim / 2] float32
    rope_scaling: float  # factor applied to cos and sin (1.0 for plain RoPE)
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        """Build from a transformers PretrainedConfig; refuse what the lean forward cannot run."""
        if hf.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {hf.model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(hf, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf.hidden_act!r} (only silu)")
        if getattr(hf, "mlp_bias", False):
            raise ValueError("mlp_bias is not supported")
        heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        inv_freq, scaling = _rope_frequencies(hf, head_dim)
        max_positions = hf.max_position_embeddings
        window = getattr(hf, "sliding_window", None)
        if window and getattr(hf, "use_sliding_window", True):
            # Within the window, sliding-window attention is plain causal attention: stay there.
            max_positions = min(max_positions, window)
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            model_type=hf.model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers,
            num_heads=heads, num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rms_norm_eps=hf.rms_norm_eps, max_positions=max_positions,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            inv_freq=inv_freq, rope_scaling=scaling, eos_token_ids=eos_ids)


def _rope_frequencies(hf, head_dim: int) -> tuple[torch.Tensor, float]:
    params = getattr(hf, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (theta ** exponents), 1.0
    # Scaled variants (linear, llama3, yarn, ...): transformers computes them, as it does for HF.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type == "dynamic":
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv_freq.float(), float(scaling)
