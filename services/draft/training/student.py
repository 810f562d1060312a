"""The draft being trained: a few Llama decoder layers initialized from the target's, on the
target's frozen (tied) embedding, trained to match the target's next-token distribution.

A plain differentiable forward (the serving forward runs in inference mode); the names of its
weights are the Hugging Face ones, so the result can be written as an ordinary checkpoint.
"""

from __future__ import annotations

import logging
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from services.common.model_config import ModelConfig

log = logging.getLogger(__name__)

LAYER_WEIGHTS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                 "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                 "mlp.down_proj.weight")


class Student(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], source_layers: list[int]):
        super().__init__()
        self.config = c = config
        if getattr(config, "q_norm", None) is not None or config.model_type == "qwen3":
            raise ValueError("draft training supports Llama-style layers (no q/k norm)")
        self.source_layers = list(source_layers)
        self.register_buffer("embed", weights["model.embed_tokens.weight"].float().clone())  # [vocab, hidden]
        self.norm = nn.Parameter(weights["model.norm.weight"].float().clone())
        self.layers = nn.ModuleList()
        for src in source_layers:
            layer = nn.ParameterDict()
            for name in LAYER_WEIGHTS:
                layer[name.replace(".", "__")] = nn.Parameter(
                    weights[f"model.layers.{src}.{name}"].float().clone())
            self.layers.append(layer)
        pos = torch.arange(c.max_positions, dtype=torch.float32)
        freqs = pos[:, None] * c.inv_freq[None, :].float()
        emb = torch.cat([freqs, freqs], -1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos() * c.rope_scaling)
        self.register_buffer("sin", emb.sin() * c.rope_scaling)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [batch, seq] (right-padded) -> final normed hidden states [batch, seq, hidden]."""
        c = self.config
        b, t = ids.shape
        d = c.head_dim
        cos, sin = self.cos[:t][None, None], self.sin[:t][None, None]  # [1, 1, seq, head_dim]
        x = self.embed[ids]
        for L in self.layers:
            p = {k.replace("__", "."): v for k, v in L.items()}
            h = F.rms_norm(x, (c.hidden_size,), p["input_layernorm.weight"], c.rms_norm_eps)
            q = F.linear(h, p["self_attn.q_proj.weight"]).view(b, t, c.num_heads, d).transpose(1, 2)
            k = F.linear(h, p["self_attn.k_proj.weight"]).view(b, t, c.num_kv_heads, d).transpose(1, 2)
            v = F.linear(h, p["self_attn.v_proj.weight"]).view(b, t, c.num_kv_heads, d).transpose(1, 2)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               enable_gqa=c.num_heads != c.num_kv_heads)
            x = x + F.linear(o.transpose(1, 2).reshape(b, t, -1), p["self_attn.o_proj.weight"])
            h = F.rms_norm(x, (c.hidden_size,), p["post_attention_layernorm.weight"], c.rms_norm_eps)
            gate, up = F.linear(h, p["mlp.gate_proj.weight"]), F.linear(h, p["mlp.up_proj.weight"])
            x = x + F.linear(F.silu(gate) * up, p["mlp.down_proj.weight"])
        return F.rms_norm(x, (c.hidden_size,), self.norm, c.rms_norm_eps)

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The trained weights under Hugging Face names (layer i of the draft = model.layers.i)."""
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm.detach()}
        for i, L in enumerate(self.layers):
            for k, v in L.items():
                out[f"model.layers.{i}.{k.replace('__', '.')}"] = v.detach()
        return out


def make_batches(samples, max_tokens: int, rng: torch.Generator) -> list[list[int]]:
    """Shuffled batches of sample indices, similar lengths together, <= max_tokens padded tokens."""
    order = torch.randperm(len(samples), generator=rng).tolist()
    pool = 64 * 8
    batches = []
    for s in range(0, len(order), pool):
        part = sorted(order[s : s + pool], key=lambda i: len(samples[i].ids))
        cur: list[int] = []
        for i in part:
            longest = max([len(samples[j].ids) for j in cur] + [len(samples[i].ids)])
            if cur and longest * (len(cur) + 1) > max_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=rng).tolist()
    return [batches[i] for i in perm]


def batch_tensors(samples, idx: list[int]):
    """-> ids [b, t], row positions (batch, pos) of teacher rows, teacher ids/logp [rows, k]."""
    t = max(len(samples[i].ids) for i in idx)
    ids = torch.zeros(len(idx), t, dtype=torch.long)
    bi, pi, tid, tlp = [], [], [], []
    for r, i in enumerate(idx):
        s = samples[i]
        ids[r, : len(s.ids)] = torch.tensor(s.ids)
        n = s.top_ids.shape[0]
        bi.append(torch.full((n,), r, dtype=torch.long))
        pi.append(torch.arange(s.prompt_len - 1, s.prompt_len - 1 + n))
        tid.append(s.top_ids.long())
        tlp.append(s.top_logp.float())
    return ids, torch.cat(bi), torch.cat(pi), torch.cat(tid), torch.cat(tlp)


def distill_loss(student: Student, ids, bi, pi, tid, tlp, row_chunk: int = 1024, bf16: bool = True):
    """Cross-entropy of the student against the teacher's top-k probabilities (= KL up to the
    teacher's entropy), and the top-1 agreement. Rows are scored in chunks to bound memory."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # AMX/AVX512-BF16 matmuls
        h = student.hidden(ids)[bi, pi]  # [rows, hidden]
    p = tlp.exp()  # [rows, k]
    total, agree = 0.0, 0
    for s in range(0, h.shape[0], row_chunk):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = F.linear(h[s : s + row_chunk], student.embed)  # [chunk, vocab]
        logq = logits.float().log_softmax(-1)
        total = total - (p[s : s + row_chunk] * logq.gather(1, tid[s : s + row_chunk])).sum()
        agree += int((logq.argmax(-1) == tid[s : s + row_chunk, 0]).sum())
    return total / h.shape[0], agree / h.shape[0]


def train(student: Student, samples, eval_samples, steps: int, lr: float, batch_tokens: int,
          seed: int, deadline: float | None = None, log_every: int = 20) -> dict:
    """AdamW with warmup and cosine decay over `steps` optimizer steps or until `deadline`,
    whichever comes first: progress = max(step / steps, elapsed / budget), so a slow or shared
    machine still ends with a fully decayed learning rate."""
    rng = torch.Generator().manual_seed(seed)
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = 0.04
    batches: list[list[int]] = []
    started = time.monotonic()
    budget = None if deadline is None else max(1.0, deadline - started)
    history = []
    done = 0
    for step in range(steps):
        progress = step / steps
        if budget is not None:
            progress = max(progress, (time.monotonic() - started) / budget)
        if progress >= 1.0:
            log.warning("training time budget reached after %d of %d steps", step, steps)
            break
        if not batches:
            batches = make_batches(samples, batch_tokens, rng)
        scale = progress / warmup if progress < warmup else 0.5 * (1 + math.cos(math.pi * (progress - warmup) / (1 - warmup)))
        scale = max(scale, 0.02)
        for g in opt.param_groups:
            g["lr"] = lr * scale
        loss, agree = distill_loss(student, *batch_tensors(samples, batches.pop()))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        done += 1
        if step % log_every == 0:
            log.info("step %d/%d loss %.4f top1 %.3f (%.0f s)", step, steps, loss.item(), agree,
                     time.monotonic() - started)
            history.append((step, loss.item(), agree))
    return {"steps": done, "seconds": time.monotonic() - started, "history": history,
            "eval": evaluate(student, eval_samples, batch_tokens)}


@torch.no_grad()
def evaluate(student: Student, samples, batch_tokens: int) -> dict:
    """Mean distillation loss and top-1 agreement with the target over held-out samples."""
    rng = torch.Generator().manual_seed(0)
    rows, loss_sum, agree_sum = 0, 0.0, 0.0
    for idx in make_batches(samples, batch_tokens, rng):
        tensors = batch_tensors(samples, idx)
        n = tensors[1].shape[0]
        loss, agree = distill_loss(student, *tensors)
        rows += n
        loss_sum += float(loss) * n
        agree_sum += agree * n
    return {"rows": rows, "loss": loss_sum / max(1, rows), "top1_agreement": agree_sum / max(1, rows)}
