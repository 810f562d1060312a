"""The quantized blocks of a GGUF file, read as stored, under the Hugging Face tensor names.

A GGUF linear weight is a row-major array of blocks of 32 values along the input dimension, one
row per output feature. This module reads the block types the native matmul runs on (Q4_0, Q4_1,
Q8_0) without dequantizing them, and decodes blocks to float32 where a caller needs values (the
embedding lookup, references). llama.cpp's converter stores the rows of q_proj and k_proj
permuted for its RoPE layout; they are put back in Hugging Face's order here, as transformers
does when it dequantizes the same file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.model_config import ModelConfig

BLOCK = 32  # values per block, for every type read here
# bytes per block: fp16 scale (+ fp16 min for Q4_1), then the quants
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class BlockTensor:
    """One quantized 2-D weight: `raw` [out, blocks * BLOCK_BYTES[kind]] uint8, as in the file."""

    kind: str  # Q4_0, Q4_1 or Q8_0
    raw: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:  # (out, in)
        return self.raw.shape[0], self.raw.shape[1] // BLOCK_BYTES[self.kind] * BLOCK

    def decode(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q [n, in] int16, scale [n, blocks] float32, min [n, blocks] float32 or None) of the
        selected rows (all by default): value = q * scale (+ min). Q4 quants are 0..15, Q8_0's
        -128..127; Q4_0's offset of 8 is already subtracted."""
        raw = self.raw if rows is None else self.raw.index_select(0, rows)
        b = raw.view(raw.shape[0], -1, BLOCK_BYTES[self.kind])  # [n, blocks, bytes]
        scale = b[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
        if self.kind == "Q8_0":
            q = b[..., 2:].contiguous().view(torch.int8).to(torch.int16)
            return q.flatten(1), scale, None
        nibbles = b[..., 4:] if self.kind == "Q4_1" else b[..., 2:]  # [n, blocks, 16]
        # low nibbles hold values 0..15 of a block, high nibbles 16..31
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).to(torch.int16)
        if self.kind == "Q4_0":
            return (q - 8).flatten(1), scale, None
        low = b[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        return q.flatten(1), scale, low

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [n, in] values of the selected rows (all by default)."""
        q, scale, low = self.decode(rows)
        w = q.view(q.shape[0], -1, BLOCK).float() * scale[..., None]
        if low is not None:
            w = w + low[..., None]
        return w.flatten(1)

    @staticmethod
    def quantize(w: torch.Tensor, kind: str) -> "BlockTensor":
        """A float weight [out, in] (in a multiple of 32) rounded to Q8_0 (d = amax / 127 per
        block) or Q4_1 (d = (max - min) / 15, m = min), as llama.cpp's quantizers do."""
        out, k = w.shape
        x = w.detach().float().reshape(out, k // BLOCK, BLOCK)
        if kind == "Q8_0":
            d = (x.abs().amax(-1) / 127).half()  # [out, blocks]
            inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
            q = (x * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
            parts = [d[..., None].view(torch.uint8), q]
        elif kind == "Q4_1":
            lo, hi = x.amin(-1), x.amax(-1)
            d, m = ((hi - lo) / 15).half(), lo.half()
            inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
            q = ((x - m.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
            parts = [d[..., None].view(torch.uint8), m[..., None].view(torch.uint8), q[..., :16] | (q[..., 16:] << 4)]
        else:
            raise ValueError(f"cannot quantize to {kind}: Q8_0 or Q4_1")
        return BlockTensor(kind, torch.cat(parts, -1).reshape(out, -1).contiguous())

    @staticmethod
    def cat(parts: list["BlockTensor"]) -> "BlockTensor":
        """Stack weights of one kind along the output dimension (fused q/k/v, gate/up)."""
        assert len({p.kind for p in parts}) == 1
        return BlockTensor(parts[0].kind, torch.cat([p.raw for p in parts]))

    def nbytes(self) -> int:
        return self.raw.numel()


def _hf_name(name: str) -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    return None


def _unpermute_rows(out: int, heads: int) -> torch.Tensor:
    """The file row that holds each Hugging Face row of q_proj / k_proj: llama.cpp interleaves
    the two RoPE halves of every head ([heads, 2, half] -> [heads, half, 2])."""
    half = out // heads // 2
    return torch.arange(out).view(heads, half, 2).transpose(1, 2).reshape(out)


def read_blocks(path: Path, config: ModelConfig) -> tuple[dict[str, BlockTensor], dict[str, str]]:
    """The quantized linear weights and embedding of a GGUF file, keyed by Hugging Face name, and
    the other 2-D weights' types by name (those load dequantized)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    blocks: dict[str, BlockTensor] = {}
    other: dict[str, str] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        if kind not in BLOCK_BYTES:
            other[name] = kind
            continue
        raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # copied out of the file's map
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            raw = raw.index_select(0, _unpermute_rows(raw.shape[0], heads))
        blocks[name] = BlockTensor(kind, raw.contiguous())
    return blocks, other
