"""Write the trained draft as an ordinary GGUF file: the target's metadata and tokenizer with the
draft's block count, the target's token embedding bytes as they are (frozen during training, so
they stay exactly the target's Q8_0 values), trained layers quantized to Q8_0, norms in F32."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# Hugging Face name (within a layer) -> GGUF name
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
SKIP_KEYS = ("GGUF.", "general.architecture")


def _rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF q/k rows -> the interleaved-pair row order GGUF (llama.cpp) stores; the GGUF loader of
    transformers undoes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(target_gguf: Path, weights: dict[str, torch.Tensor], num_layers: int, out: Path,
               name: str, heads: int, kv_heads: int, layer_type: str = "Q8_0") -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(str(target_gguf))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith(SKIP_KEYS):
            continue
        if key == f"{arch}.block_count":
            writer.add_uint32(key, num_layers)
        elif key == "general.name":
            writer.add_string(key, name)
        elif key == "general.file_type":
            writer.add_uint32(key, int(gguf.LlamaFileType.MOSTLY_Q8_0))
        else:
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)

    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    writer.add_tensor("token_embd.weight", np.asarray(embd.data), raw_dtype=embd.tensor_type)
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"].float().numpy())
    qtype = getattr(Q, layer_type)
    for i in range(num_layers):
        for hf, gg in LAYER_NAMES.items():
            w = weights[f"model.layers.{i}.{hf}"].float().numpy()
            if hf.endswith("q_proj.weight"):
                w = _rope_permute(w, heads)
            elif hf.endswith("k_proj.weight"):
                w = _rope_permute(w, kv_heads)
            if w.ndim == 1:  # norms stay float32
                writer.add_tensor(f"blk.{i}.{gg}", np.ascontiguousarray(w))
            else:
                writer.add_tensor(f"blk.{i}.{gg}", gguf.quants.quantize(np.ascontiguousarray(w), qtype),
                                  raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
