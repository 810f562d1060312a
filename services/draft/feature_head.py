"""The feature-level draft head (EAGLE-3 style): one decoder layer reading the target's states.

For a committed position t the head takes the target's residual stream after three layers (a
low, a middle and a high one), each RMS-normalized and fused by a linear layer into one state
g_t [hidden], and the embedding of the next token x_{t+1} (the target's own, frozen). Both are
normalized and projected into the input of one Llama decoder layer; its output o_t, through a
final norm and an LM head over a reduced vocabulary (SlimSpec: the ids the target generates
most, with a draft-to-target id map), predicts x_{t+2}. Deeper draft positions feed the head's
own output o in place of g, so draft position t+1 reads (o_t, x_{t+2}) and predicts x_{t+3}.

Training (services/draft/training/head_trainer.py) unrolls that feedback for a few steps
(training-time test); serving (services/draft/head_proposer.py) runs the same layer over a
per-request KV cache of one layer.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from services.common import cpu_kernels, qmatmul
from services.common.gguf_blocks import BlockTensor
from services.common.matmul import Matmul
from services.common.quant import HEAD_WEIGHT_KINDS, HEAD_WEIGHTS_ENV

CONFIG_NAME = "head_config.json"
WEIGHTS_NAME = "head.safetensors"
LINEARS = ("fuse", "input_proj", "wqkv", "wo", "wgu", "wd", "lm_head")


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_positions: int
    target_layers: tuple[int, ...]  # the target layers whose output states the head reads
    draft_vocab: int  # ids the head scores (its d2t map has this many entries)
    target_vocab: int
    inv_freq: tuple[float, ...]  # the target's RoPE frequencies [head_dim / 2]
    rope_scaling: float  # factor on cos and sin (1.0 for plain RoPE)
    target: str = ""  # the target checkpoint's name (a label; the vocabulary check decides)
    vocabulary_digest: str = ""  # services/common/vocab.vocabulary_digest of the target's tokenizer

    @classmethod
    def for_target(cls, config, layers: tuple[int, ...], draft_vocab: int, target: str = "",
                   digest: str = "") -> "HeadConfig":
        """The head's shapes follow the target's (services/common/model_config.ModelConfig)."""
        return cls(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.intermediate_size, config.rms_norm_eps, config.max_positions, tuple(layers),
                   draft_vocab, config.vocab_size, tuple(config.inv_freq.tolist()),
                   float(config.rope_scaling), target, digest)

    @property
    def state_size(self) -> int:
        return len(self.target_layers) * self.hidden_size


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class FeatureHead(nn.Module):
    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = c = config
        h, n = c.hidden_size, len(c.target_layers)
        self.feature_norm = nn.Parameter(torch.ones(n, h))  # one RMSNorm per target layer
        self.fuse = nn.Linear(n * h, h, bias=False)  # [hidden, layers * hidden]
        self.embed_norm = nn.Parameter(torch.ones(h))
        self.state_norm = nn.Parameter(torch.ones(h))
        self.input_proj = nn.Linear(2 * h, h, bias=False)  # (embedding, state) -> layer input
        self.ln1 = nn.Parameter(torch.ones(h))
        self.wqkv = nn.Linear(h, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.wo = nn.Linear(c.num_heads * c.head_dim, h, bias=False)
        self.ln2 = nn.Parameter(torch.ones(h))
        self.wgu = nn.Linear(h, 2 * c.intermediate_size, bias=False)  # gate and up
        self.wd = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, c.draft_vocab, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab, dtype=torch.long))  # draft id -> target id
        self.register_buffer("inv_freq", torch.tensor(c.inv_freq), persistent=False)  # [head_dim / 2]
        self._routes: dict | None = None  # serving: per linear, x [rows, in] -> [rows, out] (prepare_serving)
        self._matmul: Matmul | None = None  # the float routes' chooser
        # serving on the native kernels: head.cpp's arguments (norms, blocks, kinds) for the draft forward
        self.native: tuple | None = None
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # serving: cos, sin [positions, d]

    def prepare_serving(self) -> None:
        """Serve with frozen weights (inference only). With the native CPU kernels each linear is
        rounded to blocks (HEAD_WEIGHTS_ENV: q4 = Q4_1 tiles on q8matmul.cpp, q8 = Q8_0 on
        qmatmul.cpp's block kernel): a draft token streams an eighth or a quarter of the float32
        bytes, and the rounding moves only what the head proposes, never what is accepted.
        Otherwise (`float`, or an input size off the blocks of 32) the engine's float routes."""
        kind = os.environ.get(HEAD_WEIGHTS_ENV, "auto").strip() or "auto"
        if kind not in HEAD_WEIGHT_KINDS:
            raise ValueError(f"{HEAD_WEIGHTS_ENV} must be one of {', '.join(HEAD_WEIGHT_KINDS)}, not {kind!r}")
        if kind == "auto":
            kind = "q4" if cpu_kernels.available() else "float"
        self._matmul = Matmul(torch.device("cpu"), torch.float32)
        self._routes, floats, native = {}, [], {}
        with torch.inference_mode():
            for name in LINEARS:
                w = getattr(self, name).weight.detach().float().contiguous()
                if kind != "float" and w.shape[1] % 32 == 0:
                    native[name], self._routes[name] = _block_route(w, kind)
                else:
                    floats.append(self._matmul.weight(w))
                    self._routes[name] = lambda x, fw=floats[-1]: self._matmul(x, fw)
        self._matmul.tune(floats)
        self.native = self._native_args(native)

    def _native_args(self, native: dict) -> tuple | None:
        """head.cpp's arguments (norms, blocks, kinds) when the fusion, the projection into the layer,
        its four linears and the LM head all run native (the layer's unpadded) and attention.cpp
        takes the head size; else None."""
        names = ("input_proj", "wqkv", "wo", "wgu", "wd", "lm_head", "fuse")
        weights = [native.get(n) for n in names]
        if self.config.head_dim % 32 or any(w is None for w in weights) or any(
                w.shape != getattr(self, n).weight.shape for w, n in zip(weights[1:5], names[1:5])):
            return None
        blocks = [w.tiles if isinstance(w, qmatmul.TileWeight) else w.block.raw for w in weights]
        kinds = [qmatmul.TILES if isinstance(w, qmatmul.TileWeight) else qmatmul.KINDS["Q8_0"] for w in weights]
        norms = [self.embed_norm, self.state_norm, self.ln1, self.ln2, self.norm, self.feature_norm]
        return [n.detach() for n in norms], blocks, kinds

    def _linear(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if self._routes is None:
            return getattr(self, name)(x)
        return self._routes[name](x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)

    # -- the pieces, shared by training and serving ------------------------------------------------

    def fuse_states(self, states: torch.Tensor) -> torch.Tensor:
        """The target's states [..., layers * hidden] -> g [..., hidden]."""
        c = self.config
        parts = states.float().unflatten(-1, (len(c.target_layers), c.hidden_size))
        parts = F.rms_norm(parts, (c.hidden_size,), eps=c.rms_norm_eps) * self.feature_norm
        return self._linear("fuse", parts.flatten(-2))

    def layer_input(self, state: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        """(state [..., hidden], next token's embedding [..., hidden]) -> the layer's input."""
        eps, h = self.config.rms_norm_eps, (self.config.hidden_size,)
        e = F.rms_norm(embedding.float(), h, self.embed_norm, eps)
        s = F.rms_norm(state, h, self.state_norm, eps)
        return self._linear("input_proj", torch.cat([e, s], dim=-1))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., head_dim]."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.config.rope_scaling, emb.sin() * self.config.rope_scaling

    def rope_table(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [at least `positions` (up to max_positions), d]: every position's rope so far,
        grown by doubling, so that a draft forward looks its rows up instead of computing them."""
        if self._rope_table is None or len(self._rope_table[0]) < positions:
            have = 0 if self._rope_table is None else len(self._rope_table[0])
            self._rope_table = self.rope(torch.arange(min(max(positions, 2 * have, 1024), self.config.max_positions)))
        return self._rope_table

    def rope_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rope(positions), from rope_table."""
        cos, sin = self.rope_table(int(positions.max()) + 1)
        return cos[positions], sin[positions]

    def qkv(self, u: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """u [..., T, hidden] -> q [..., heads, T, d], k, v [..., kv_heads, T, d] (RoPE applied)."""
        c = self.config
        x = F.rms_norm(u, (c.hidden_size,), self.ln1, c.rms_norm_eps)
        q, k, v = self._linear("wqkv", x).split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                                      c.num_kv_heads * c.head_dim], dim=-1)
        q = q.unflatten(-1, (c.num_heads, c.head_dim)).transpose(-3, -2)
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim)).transpose(-3, -2)
        v = v.unflatten(-1, (c.num_kv_heads, c.head_dim)).transpose(-3, -2)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)
        return _rope(q, cos, sin), _rope(k, cos, sin), v

    def finish(self, u: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual stream after the layer: u [..., hidden], attention output [..., heads * d]."""
        c = self.config
        x = u + self._linear("wo", attn)
        gate, up = self._linear("wgu", F.rms_norm(x, (c.hidden_size,), self.ln2, c.rms_norm_eps)).chunk(2, dim=-1)
        return x + self._linear("wd", F.silu(gate) * up)

    def final_norm(self, out: torch.Tensor) -> torch.Tensor:
        """Output states [..., hidden] -> the LM head's input [..., hidden]."""
        return F.rms_norm(out, (self.config.hidden_size,), self.norm, self.config.rms_norm_eps)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Output states [..., hidden] -> draft-vocabulary logits [..., draft_vocab]."""
        return self._linear("lm_head", self.final_norm(out))

    def group(self) -> int:
        return self.config.num_heads // self.config.num_kv_heads

    # -- checkpoint -------------------------------------------------------------------------------

    def save(self, out: Path) -> None:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHTS_NAME))
        (out / CONFIG_NAME).write_text(json.dumps(asdict(self.config), indent=1))

    @classmethod
    def load(cls, path: Path) -> "FeatureHead":
        from safetensors.torch import load_file

        raw = json.loads((Path(path) / CONFIG_NAME).read_text())
        raw["target_layers"], raw["inv_freq"] = tuple(raw["target_layers"]), tuple(raw["inv_freq"])
        head = cls(HeadConfig(**raw))
        tensors = {k: v.float() if v.is_floating_point() else v
                   for k, v in load_file(str(Path(path) / WEIGHTS_NAME)).items()}
        head.load_state_dict(tensors)
        return head.eval()


def _block_route(w: torch.Tensor, kind: str):
    """w [out, in] -> (the native weight, a function x [rows, in] -> [rows, out] on it)."""
    if kind == "q8":
        weight = qmatmul.BlockWeight(BlockTensor.quantize(w, "Q8_0"))
        return weight, weight.linear
    out = w.shape[0]
    pad = -out % qmatmul.TILE  # tiles hold 16 outputs: zero rows, sliced off
    tiles = qmatmul.pack_tiles(BlockTensor.quantize(F.pad(w, (0, 0, 0, pad)), "Q4_1"))
    return tiles, (tiles.linear if not pad else lambda x: tiles.linear(x)[:, :out])


def is_head_checkpoint(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / CONFIG_NAME).exists() and (p / WEIGHTS_NAME).exists()


def init_from_target(head: FeatureHead, weights: dict[str, torch.Tensor], num_layers: int, kept: torch.Tensor) -> None:
    """Start the decoder layer from the target's last layer and the LM head from the target's
    rows of the kept ids (`kept` [draft_vocab] target ids, which become d2t)."""
    p = f"model.layers.{num_layers - 1}."
    a = p + "self_attn."
    with torch.no_grad():
        head.ln1.copy_(weights[p + "input_layernorm.weight"].float())
        head.wqkv.weight.copy_(torch.cat([weights[a + f"{x}_proj.weight"] for x in "qkv"]).float())
        head.wo.weight.copy_(weights[a + "o_proj.weight"].float())
        head.ln2.copy_(weights[p + "post_attention_layernorm.weight"].float())
        head.wgu.weight.copy_(torch.cat([weights[p + "mlp.gate_proj.weight"],
                                         weights[p + "mlp.up_proj.weight"]]).float())
        head.wd.weight.copy_(weights[p + "mlp.down_proj.weight"].float())
        head.norm.copy_(weights["model.norm.weight"].float())
        lm = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        head.lm_head.weight.copy_(lm[kept].float())
        head.d2t.copy_(kept)
        for lin in (head.fuse, head.input_proj):
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))


def init_from_head(head: FeatureHead, trained: FeatureHead) -> None:
    """Continue from a trained head of the same target and layers (a longer run on more data): all
    its weights, and its LM-head rows for the ids both vocabularies keep (new ids keep the target's)."""
    a, b = head.config, trained.config
    if (a.target_layers, a.hidden_size, a.target_vocab) != (b.target_layers, b.hidden_size, b.target_vocab):
        raise ValueError(f"cannot continue from a head for layers {b.target_layers}, hidden {b.hidden_size}, "
                         f"vocabulary {b.target_vocab}: this one has {a.target_layers}, {a.hidden_size}, {a.target_vocab}")
    old = {t: j for j, t in enumerate(trained.d2t.tolist())}
    pairs = [(j, old[t]) for j, t in enumerate(head.d2t.tolist()) if t in old]  # (new row, old row)
    with torch.no_grad():
        mine = head.state_dict()
        for name, value in trained.state_dict().items():
            if name not in ("lm_head.weight", "d2t"):
                mine[name].copy_(value)
        rows = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
        head.lm_head.weight[rows[:, 0]] = trained.lm_head.weight[rows[:, 1]]
