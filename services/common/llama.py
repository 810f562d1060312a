"""A lean forward pass for Llama-family causal LMs (Llama, Mistral, Qwen2, Qwen3, SmolLM2).

Runs on weights loaded by `services.common.loading`, with transformers as the numeric reference.
One call processes a packed batch of sequence chunks: the linear layers see every new token of
every sequence at once (one read of the weights per step), attention runs per sequence over its
own preallocated KV cache with a tree mask built once per step. On native (GGUF block) weights a
forward of few rows per sequence (decoding, verifying drafts) runs the whole decoder stack in one
call to the CPU kernels (`layers.cpp`), the same ops this module runs one by one otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.common import quant
from services.common.gguf_blocks import BlockTensor
from services.common.kv_cache import KVCache
from services.common.matmul import Matmul, Weight
from services.common.model_config import ModelConfig
from services.common.qmatmul import KINDS, TILES, BlockWeight, TileWeight, block_rows
from services.common.quant import Int4Weight
from services.common.tree import ancestor_mask, forest_depths


@dataclass
class Chunk:
    """New tokens of one sequence in one forward.

    tokens: the new token ids, written to cache slots cache.length, cache.length + 1, ...
    parents: the forest over the step's tree space, the slots tree_start .. cache.length +
        len(tokens) - 1 (slots already cached by earlier forwards of this step, then the new
        tokens). -1 = attends to the prefix (slots before tree_start) only; a plain causal
        chunk is [-1, 0, 1, ...]. Position of a slot = tree_start + its depth in the forest.
    logits_from: logits are returned for new tokens logits_from .. len(tokens) - 1 (none when
        it is len(tokens): a prompt chunk that ends nothing).
    tree_start: first slot of the tree space; None = cache.length (the common case).
    """

    cache: KVCache
    tokens: list[int]
    parents: list[int]
    logits_from: int
    tree_start: int | None = None


class Plan(NamedTuple):
    """Where one chunk's rows sit in a forward, and how they attend."""

    offset: int  # its first row in the packed batch
    n: int  # its new tokens
    start: int  # its cache length before this forward
    tree_start: int
    mask: torch.Tensor | None  # torch's attention: [group * n, start + n] bool, None = all
    visible: torch.Tensor | None  # attention.cpp's [n, m] (NO_MASK: causal); None = torch's

NO_MASK = torch.empty(0, dtype=torch.bool)


def pick_tree_attention(device: torch.device, dtype: torch.dtype, head_dim: int):
    """The CuPy tree-attention kernel when the model runs on CUDA in fp16/bf16 with a head_dim
    it supports and CuPy imports; None otherwise (attention then runs per sequence with torch
    SDPA and an explicit mask, the reference semantics)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or head_dim not in (64, 128):
        return None
    from services.kernels import kernel_available
    from services.kernels.tree_attention import tree_attention_cuda

    return tree_attention_cuda if kernel_available() else None


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, blocks: dict[str, BlockTensor] | None = None):
        """weights: the float tensors; blocks: quantized weights read as stored from a GGUF file
        (CPU only), which run natively where a native route takes them and replace their
        entries in `weights` (a block none takes is dequantized here)."""
        self.config = c = config
        self.device, self.dtype = device, dtype
        self.matmul = Matmul(device, dtype)
        self.tree_attention = pick_tree_attention(device, dtype, config.head_dim)
        blocks = blocks or {}

        def w(name: str) -> torch.Tensor:
            t = weights[name] if name in weights else blocks[name].dequantize()
            return t.to(device=device, dtype=dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def linear(*names: str) -> Weight:
            """The weights of `names` stacked along their outputs (one matmul for q, k and v)."""
            parts = [blocks.get(n) for n in names]
            if all(parts) and len({p.kind for p in parts}) == 1:
                fused = BlockTensor.cat(parts) if len(parts) > 1 else parts[0]
                native = quant.native_weight(fused)
                if native is not None:
                    return Weight(None, None, native)
            return self.matmul.weight(torch.cat([w(n) for n in names]))

        embed = "model.embed_tokens.weight"
        head = embed if c.tie_word_embeddings else "lm_head.weight"
        # A quantized embedding stays in its blocks: the rows a forward looks up are decoded.
        self.embed_blocks = blocks.get(embed)
        self.embed = None if self.embed_blocks is not None else w(embed)  # [vocab, hidden]
        self.head_blocks = blocks.get(head)  # the SlimSpec head takes rows of it (None: dense)
        tied_dense = c.tie_word_embeddings and self.embed is not None
        self.lm_head = self.matmul.weight(self.embed) if tied_dense else linear(head)
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_b = [opt(a + f"{x}_proj.bias") for x in "qkv"]
            self.layers.append({
                "ln1": w(p + "input_layernorm.weight"),
                "wqkv": linear(*(a + f"{x}_proj.weight" for x in "qkv")),  # [(heads + 2 kv_heads) d, hidden]
                "bqkv": torch.cat(qkv_b) if qkv_b[0] is not None else None,
                "q_norm": opt(a + "q_norm.weight"),
                "k_norm": opt(a + "k_norm.weight"),
                "wo": linear(a + "o_proj.weight"),  # [hidden, heads * head_dim]
                "ln2": w(p + "post_attention_layernorm.weight"),
                "wgu": linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),  # [2 intermediate, hidden]
                "wd": linear(p + "mlp.down_proj.weight"),  # [hidden, intermediate]
            })
        self.matmul.tune(self.linear_weights())
        # int4 matmuls round their inputs to bfloat16, which turns attention's last-bit differences
        # between row counts (a decode row, a verify tree) into different tokens; in float64 the
        # float32 results agree bitwise, so plain decoding and verification see the same logits.
        rounds = any(isinstance(w.native, Int4Weight) for w in self.linear_weights())
        self.attention_dtype = torch.float64 if rounds else dtype
        # On the CPU kernels' matmuls, the norms, RoPE, silu * up and attention also take their
        # one-call versions, and a forward runs the whole stack in one call (layers.cpp); a
        # float32 model keeps torch's ops: its greedy output is compared with transformers'.
        self.rowwise = any(isinstance(w.native, (BlockWeight, TileWeight)) for w in self.linear_weights())
        self.attend_cpu = self.rowwise and dtype == torch.float32 and c.head_dim % 32 == 0
        self.silu_mul = self.rowwise and c.intermediate_size % 16 == 0
        self.stack = self._native_stack()
        positions = torch.arange(c.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * c.inv_freq[None, :].float()  # [max_positions, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * c.rope_scaling).to(device=device, dtype=dtype)  # [max_pos, head_dim]
        self.sin = (emb.sin() * c.rope_scaling).to(device=device, dtype=dtype)

    def _native_stack(self) -> tuple | None:
        """layers.cpp's arguments for this model's layers (norms, blocks, kinds) when every layer
        runs on the CPU kernels alone (block weights, no biases, no q/k norms); else None."""
        if not (self.attend_cpu and self.silu_mul):
            return None
        norms, blocks, kinds = [], [], []
        for L in self.layers:
            weights = [L[k].native for k in ("wqkv", "wo", "wgu", "wd")]
            if L["bqkv"] is not None or L["q_norm"] is not None or \
                    not all(isinstance(w, (BlockWeight, TileWeight)) for w in weights):
                return None
            norms += [L["ln1"], L["ln2"]]
            blocks += [w.tiles if isinstance(w, TileWeight) else w.block.raw for w in weights]
            kinds += [TILES if isinstance(w, TileWeight) else KINDS[w.block.kind] for w in weights]
        return norms, blocks, kinds

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), hidden] rows of the token embedding."""
        if self.embed_blocks is None:
            return self.embed[ids]
        return block_rows(self.embed_blocks, ids).to(device=self.device, dtype=self.dtype)

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[len(ids), hidden] rows of the LM head, dense in the model's dtype."""
        if self.lm_head.dense is not None:
            return self.lm_head.dense.index_select(0, ids.to(self.device))
        return block_rows(self.head_blocks, ids).to(device=self.device, dtype=self.dtype)

    def weight_bytes(self) -> int:
        """Bytes of every weight held: dense tensors once each (a tied head shares the
        embedding), oneDNN's blocked copies, int4 planes and GGUF blocks as stored."""
        tensors = [self.norm, self.embed] + [t for L in self.layers for t in L.values()]
        tensors += [w.dense for w in self.linear_weights()]
        unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)}
        held = sum(unique.values())
        for w in self.linear_weights():
            held += w.nbytes() - (w.dense.numel() * w.dense.element_size() if w.dense is not None else 0)
        # the embedding's blocks, unless a native head multiplies by those very blocks (tied)
        native = {id(getattr(w.native, "block", None)) for w in self.linear_weights()}
        kept = {id(b): b.nbytes() for b in (self.embed_blocks, self.head_blocks)
                if b is not None and id(b) not in native}
        return held + sum(kept.values())

    def linear_weights(self) -> list[Weight]:
        """Every weight one forward multiplies by, in order: each layer's, then the head."""
        return [L[k] for L in self.layers for k in ("wqkv", "wo", "wgu", "wd")] + [self.lm_head]

    def new_cache(self, capacity: int) -> KVCache:
        c = self.config
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, capacity, self.dtype, self.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        eps = self.config.rms_norm_eps
        if self.rowwise:
            return torch.ops.specserve_q.rms_norm(x, weight, eps)
        return F.rms_norm(x, (self.config.hidden_size,), weight, eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[N, 2 intermediate] -> silu(gate) * up [N, intermediate]."""
        if self.silu_mul:
            return torch.ops.specserve_q.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [n, heads, head_dim]; cos, sin: [n, 1, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _rotated_qk(self, qkv: torch.Tensor, L: dict, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, heads, head_dim] and k [N, kv_heads, head_dim] of qkv [N, hq + 2 hk], RoPE applied
        at the rows' positions (cos, sin [N, head_dim])."""
        c, d = self.config, self.config.head_dim
        hq, hk = c.num_heads * d, c.num_kv_heads * d
        if L["q_norm"] is None and self.rowwise:  # q and k rotated in place, one call
            torch.ops.specserve_q.rope_(qkv, cos, sin, c.num_heads + c.num_kv_heads, d)
            return qkv[:, :hq].view(-1, c.num_heads, d), qkv[:, hq : hq + hk].view(-1, c.num_kv_heads, d)
        cos, sin = cos[:, None], sin[:, None]
        if L["q_norm"] is None:  # rotate q and k together: [N, heads + kv_heads, head_dim]
            qk = self._rope(qkv[:, : hq + hk].view(-1, c.num_heads + c.num_kv_heads, d), cos, sin)
            return qk[:, : c.num_heads], qk[:, c.num_heads :]
        # Qwen3: per-head RMSNorm on q and k before RoPE
        q = F.rms_norm(qkv[:, :hq].view(-1, c.num_heads, d), (d,), L["q_norm"], c.rms_norm_eps)
        k = F.rms_norm(qkv[:, hq : hq + hk].view(-1, c.num_kv_heads, d), (d,), L["k_norm"], c.rms_norm_eps)
        return self._rope(q, cos, sin), self._rope(k, cos, sin)

    def _attention(self, li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   parts: list[tuple[Chunk, Plan]], kernel_parents: torch.Tensor | None
                   ) -> torch.Tensor:
        """Write this layer's new k, v [N, kv_heads, head_dim] into each cache, then attend:
        q [N, heads, head_dim] -> [N, heads, head_dim]."""
        c = self.config
        group, d = c.num_heads // c.num_kv_heads, c.head_dim
        torch_parts = [(ch, p) for ch, p in parts if p.visible is None]
        for ch, (off, n, start, *_) in torch_parts:  # torch's kernel reads them from the caches
            ch.cache.k[li][:, start : start + n] = k[off : off + n].transpose(0, 1)
            ch.cache.v[li][:, start : start + n] = v[off : off + n].transpose(0, 1)
        if kernel_parents is not None:  # one CUDA launch for every request of the batch
            return self.tree_attention(
                q, [ch.cache.k[li] for ch, _ in parts], [ch.cache.v[li] for ch, _ in parts],
                [p.start for _, p in parts], [p.n for _, p in parts], kernel_parents,
                check_parents=(li == 0))
        attn = torch.empty_like(q)
        few = [(ch, p) for ch, p in parts if p.visible is not None]
        if few:  # attention.cpp: the cache writes and every (row, head) of these parts, one call
            torch.ops.specserve_q.attend_(
                attn, q, k, v, [ch.cache.k[li] for ch, _ in few], [ch.cache.v[li] for ch, _ in few],
                [p.offset for _, p in few], [p.n for _, p in few], [p.start for _, p in few],
                [p.tree_start for _, p in few], [p.visible for _, p in few], d ** -0.5)
        for ch, (off, n, start, _, mask, _) in torch_parts:
            kc, vc = ch.cache.k[li], ch.cache.v[li]  # [kv_heads, capacity, head_dim]
            # Query heads of one KV group share its keys: [kv_heads, group * n, head_dim]
            qs = q[off : off + n].view(n, c.num_kv_heads, group, d).permute(1, 2, 0, 3)
            qs = qs.reshape(c.num_kv_heads, group * n, d)
            # 4-D inputs take torch's fused CPU kernel (3-D ones fall back to the math path).
            at = self.attention_dtype
            o = F.scaled_dot_product_attention(qs[None].to(at), kc[None, :, : start + n].to(at),
                                               vc[None, :, : start + n].to(at), attn_mask=mask)[0].to(q.dtype)
            o = o.view(c.num_kv_heads, group, n, d).permute(2, 0, 1, 3)  # [n, kv_heads, group, head_dim]
            if len(parts) == 1:  # one part: no packed output to fill
                return o.reshape(n, c.num_heads, d)
            attn[off : off + n] = o.reshape(n, c.num_heads, d)
        return attn

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                parts: list[tuple[Chunk, Plan]], kernel_parents: torch.Tensor | None,
                layers: tuple[int, ...]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decoder layers op by op: x [N, hidden] -> the last layer's output and those of
        `layers`."""
        c = self.config
        hq, hk, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        captured = []  # [N, hidden] per layer of `layers`, in layer order
        for li, L in enumerate(self.layers):
            h = self._norm(x, L["ln1"])
            qkv = self.matmul(h, L["wqkv"], L["bqkv"])  # [N, hq + 2 hk]
            v = qkv[:, hq + hk :].view(-1, c.num_kv_heads, d)
            q, k = self._rotated_qk(qkv, L, cos, sin)
            attn = self._attention(li, q, k, v, parts, kernel_parents)  # [N, heads, head_dim]
            x = x + self.matmul(attn.reshape(-1, hq), L["wo"])
            h = self._norm(x, L["ln2"])
            x = x + self.matmul(self._silu_mul(self.matmul(h, L["wgu"])), L["wd"])
            if li in layers:
                captured.append(x)
        return x, captured

    def _plan(self, ch: Chunk, offset: int, start: int, tree_start: int, group: int) -> Plan:
        """How the chunk's rows attend. On the CPU kernels every row takes attention.cpp, where a
        row's bits depend only on the slots it sees: so a position's keys, values and logits are
        the same whether it is decoded alone, verified in a draft tree, or prefilled with its
        prompt whole, in chunks (chunked prefill) or after a prefix copied from another request
        (torch's kernel, blocked by the chunk's shape, gave prompts other bits in each case).
        Elsewhere every row takes torch's kernel."""
        n, m = len(ch.tokens), len(ch.parents)
        if self.attend_cpu:  # [n, m] tree slots each row sees (NO_MASK: causal)
            causal = tree_start == start and all(p == i - 1 for i, p in enumerate(ch.parents))
            visible = NO_MASK if causal else ancestor_mask(ch.parents)[m - n :].contiguous()
            return Plan(offset, n, start, tree_start, None, visible)
        mask = None  # [group * n, start + n] bool; rows ordered (head in group, token)
        tree = ancestor_mask(ch.parents)[m - n :]
        if m > 1 and (n > 1 or not bool(tree.all())):
            prefix = torch.ones(n, tree_start, dtype=torch.bool)
            mask = torch.cat([prefix, tree], 1).repeat(group, 1).to(self.device)
        return Plan(offset, n, start, tree_start, mask, None)

    def forward(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Run the new tokens of every chunk; returns per chunk logits [rows, vocab] (float32)."""
        return self.forward_states(chunks, ())[0]

    @torch.inference_mode()
    def forward_states(self, chunks: list[Chunk], layers: tuple[int, ...]
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """forward, also returning per chunk the residual stream after each decoder layer in
        `layers` for every new token: [len(tokens), len(layers) * hidden] (the model's dtype;
        a feature-level draft head reads them). No layers: empty states."""
        c = self.config
        group = c.num_heads // c.num_kv_heads
        tokens, positions, parts, logit_rows = [], [], [], []  # parts: (chunk, Plan)
        offset = 0
        for ch in chunks:
            n, start = len(ch.tokens), ch.cache.length
            tree_start = start if ch.tree_start is None else ch.tree_start
            m = len(ch.parents)
            assert tree_start + m == start + n, "parents must cover the tree space exactly"
            depths = forest_depths(ch.parents)[m - n :]
            if tree_start + max(depths) >= c.max_positions:
                raise ValueError(f"position {tree_start + max(depths)} exceeds the context of "
                                 f"{c.max_positions} tokens")
            ch.cache.reserve(start + n)
            tokens.extend(ch.tokens)
            positions.extend(tree_start + d for d in depths)
            parts.append((ch, self._plan(ch, offset, start, tree_start, group)))
            logit_rows.extend(range(offset + ch.logits_from, offset + n))
            offset += n

        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        cos, sin = self.cos[pos], self.sin[pos]  # [N, head_dim]
        x = self.embedding(ids)  # [N, hidden]
        kernel_parents = None  # [N] local parents, when the CUDA kernel takes this batch
        if self.tree_attention is not None and all(p.tree_start == p.start and p.n <= 256
                                                   for _, p in parts):
            kernel_parents = torch.tensor([p for ch in chunks for p in ch.parents],
                                          dtype=torch.int32, device=self.device)
        if self.stack is not None:  # every part on attention.cpp (_plan)
            x, *captured = torch.ops.specserve_q.layers(
                x, cos, sin, *self.stack, [ch.cache.k for ch, _ in parts], [ch.cache.v for ch, _ in parts],
                *zip(*[(p.offset, p.n, p.start, p.tree_start, p.visible) for _, p in parts]),
                c.num_heads, c.num_kv_heads, c.rms_norm_eps, sorted(set(layers)))
        else:
            x, captured = self._layers(x, cos, sin, parts, kernel_parents, layers)
        for ch, plan in parts:
            ch.cache.length = plan.start + plan.n
        if logit_rows:
            if len(logit_rows) < len(tokens):  # prompt chunks: only their last rows
                x = x[torch.tensor(logit_rows, dtype=torch.long, device=self.device)]
            h = self._norm(x, self.norm)
            logits = self.matmul(h, self.lm_head).float()  # [rows, vocab]
        else:  # prompt chunks only (chunked prefill): the LM head has no row to compute
            logits = torch.empty(0, c.vocab_size, device=self.device)
        sizes = [len(ch.tokens) - ch.logits_from for ch in chunks]
        logits = list(logits.split(sizes)) if len(chunks) > 1 else [logits]  # torch ops run cold after a kernel
        if not layers:
            return logits, []
        states = torch.cat(captured, dim=-1)  # [N, len(layers) * hidden]
        return logits, list(states.split([len(ch.tokens) for ch in chunks]))
