"""Train the feature-level head on teacher data, with training-time test.

Objective: cross-entropy to the target's top-k next-token distribution at every answer position
(restricted to the head's vocabulary), at each of `unroll` steps. Step 0 reads the target's states;
step s reads the head's own output states of step s - 1, shifted one position, so position t at
step s is what a draft at depth s + 1 sees: the target's states up to t - s, then its own outputs.
Attention follows the same rule: at step s a query at t sees step 0's keys at positions <= t - s
and step i's key (1 <= i <= s) at position t - s + i only, the keys a tree path of the draft holds.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.draft.feature_head import FeatureHead
from services.draft.training.distill_loss import picked_log_softmax
from services.draft.training.student import make_batches

log = logging.getLogger(__name__)


@dataclass
class Batch:
    states: torch.Tensor  # [B, T, layers * hidden] float32: the target's states at positions 0..T-1
    next_ids: torch.Tensor  # [B, T] long: x_{t+1}, the token the head reads at position t
    rows: torch.Tensor  # [R] long: flat b * T + t of the positions with a teacher distribution for x_{t+2}
    row_t: torch.Tensor  # [R] long: their t
    teacher_ids: torch.Tensor  # [R, k] long: draft-vocabulary ids of the teacher's top-k (0 where not kept)
    teacher_p: torch.Tensor  # [R, k] float32: their probabilities (0 where not kept)
    teacher_top1: torch.Tensor  # [R] long: the target's most likely next token (target id)


def make_batch(samples, t2d: torch.Tensor) -> Batch:
    """Pad samples into one batch. t2d [target_vocab] long: draft id of each target id, -1 if not kept."""
    T = max(len(s.ids) - 1 for s in samples)
    width = samples[0].states.shape[1]
    states = torch.zeros(len(samples), T, width)
    next_ids = torch.zeros(len(samples), T, dtype=torch.long)
    rows, row_t, ids, logp = [], [], [], []
    for b, s in enumerate(samples):
        n = len(s.ids) - 1
        states[b, :n] = s.states[:n].float()
        next_ids[b, :n] = torch.tensor(s.ids[1:])
        t, i, lp = _teacher_rows(s)
        rows.append(b * T + t)
        row_t.append(t)
        ids.append(i)
        logp.append(lp)
    return Batch(states, next_ids, torch.cat(rows), torch.cat(row_t), *_targets(torch.cat(ids), torch.cat(logp), t2d))


def _teacher_rows(s) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A sample's teacher rows the head learns from: (t [r], target ids [r, k] long, logp [r, k]).
    Row r is at position prompt_len - 1 + r and gives x_{prompt_len + r}, which the head predicts
    from position t = prompt_len - 2 + r (t >= 0 only)."""
    t = torch.arange(len(s.top_ids)) + s.prompt_len - 2
    keep = t >= 0
    return t[keep], s.top_ids[keep].long(), s.top_logp[keep].float()


def _targets(ids: torch.Tensor, logp: torch.Tensor, t2d: torch.Tensor):
    """Target ids [R, k] and log-probabilities -> Batch's teacher_ids, teacher_p, teacher_top1."""
    draft_ids = t2d[ids]
    return draft_ids.clamp(min=0), logp.exp() * (draft_ids >= 0), ids[:, 0]


class DeviceSamples:
    """Every sample concatenated on one device, so that a batch is a few gathers there: on a GPU,
    make_batch's padding on the CPU costs more than the training step. batch(idx) equals
    make_batch([samples[i] for i in idx], t2d) moved to the device."""

    def __init__(self, samples, t2d: torch.Tensor, device):
        fed = [len(s.ids) - 1 for s in samples]
        self.lens = torch.tensor(fed)
        self.start = torch.cumsum(self.lens, 0) - self.lens  # [S]: first position of each sample
        self.states = torch.cat([s.states[:n] for s, n in zip(samples, fed)]).to(device)  # [P, width] fp16
        self.next_ids = torch.cat([torch.tensor(s.ids[1:]) for s in samples]).to(device)  # [P]
        row_t, ids, logp = zip(*[_teacher_rows(s) for s in samples])
        self.row_count = torch.tensor([len(t) for t in row_t])
        self.row_start = torch.cumsum(self.row_count, 0) - self.row_count  # [S]
        self.row_t = torch.cat(row_t).to(device)  # [R]
        targets = _targets(torch.cat(ids), torch.cat(logp), t2d)
        self.teacher_ids, self.teacher_p, self.teacher_top1 = (x.to(device) for x in targets)
        self.device = device

    def batch(self, idx: list[int]) -> Batch:
        sel = torch.tensor(idx)
        lens, T = self.lens[sel], int(self.lens[sel].max())
        t = torch.arange(T)
        valid = t[None, :] < lens[:, None]  # [B, T]
        pos = torch.where(valid, self.start[sel][:, None] + t[None, :], 0).to(self.device)
        valid = valid.to(self.device)
        rows = torch.cat([torch.arange(a, a + n) for a, n in zip(self.row_start[sel].tolist(),
                                                                  self.row_count[sel].tolist())]).to(self.device)
        row_b = torch.repeat_interleave(torch.arange(len(idx)), self.row_count[sel]).to(self.device)
        row_t = self.row_t[rows]
        return Batch(self.states[pos].float() * valid[..., None], self.next_ids[pos] * valid, row_b * T + row_t,
                     row_t, self.teacher_ids[rows], self.teacher_p[rows], self.teacher_top1[rows])


def batches_of(samples, t2d: torch.Tensor, device) -> Callable[[list[int]], Batch]:
    """idx -> Batch on `device`: padded on the CPU there, gathered on the device elsewhere."""
    if torch.device(device).type == "cpu":
        return lambda idx: make_batch([samples[i] for i in idx], t2d)
    data = DeviceSamples(samples, t2d, device)
    return data.batch


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [..., T, d] -> y with y[t] = x[t - by] (zeros for t < by)."""
    if by == 0:
        return x
    return F.pad(x[..., : x.shape[-2] - by, :], (0, 0, by, 0))


def _attend(q, k0, v0, extra, group: int) -> torch.Tensor:
    """Training-time-test attention at step s = len(extra): q [B, H, T, d]; k0, v0 [B, KV, T, d]
    (step 0's); extra[i - 1] = (k, v) of step i. Returns [B, T, H * d]."""
    B, H, T, d = q.shape
    s = len(extra)
    k0, v0 = k0.repeat_interleave(group, 1), v0.repeat_interleave(group, 1)
    scores = [q @ k0.transpose(-1, -2) / math.sqrt(d)]  # [B, H, T, T]
    t = torch.arange(T, device=q.device)
    scores[0] = scores[0].masked_fill(t[None, :] > (t[:, None] - s), float("-inf"))
    shifted_v = []
    for i, (k, v) in enumerate(extra, start=1):
        off = s - i  # step i's key for query t sits at position t - off
        k = _shift(k.repeat_interleave(group, 1), off)
        sc = (q * k).sum(-1, keepdim=True) / math.sqrt(d)  # [B, H, T, 1]
        scores.append(sc.masked_fill((t < off)[:, None], float("-inf")))
        shifted_v.append(_shift(v.repeat_interleave(group, 1), off))
    w = torch.cat(scores, dim=-1).softmax(-1)
    out = w[..., :T] @ v0
    for i, v in enumerate(shifted_v):
        out = out + w[..., T + i : T + i + 1] * v
    return out.transpose(1, 2).flatten(2)


def unroll(head: FeatureHead, embed: torch.Tensor, batch: Batch, steps: int) -> list[torch.Tensor]:
    """The head's output states [B, T, hidden] at each of `steps` unrolled steps."""
    B, T, _ = batch.states.shape
    cos, sin = head.rope(torch.arange(T, device=batch.states.device))  # [T, d]
    emb = embed[batch.next_ids]  # [B, T, hidden]
    state = head.fuse_states(batch.states)
    keys, outs = [], []
    for s in range(steps):
        u = head.layer_input(state, emb)
        q, k, v = head.qkv(u, cos, sin)
        attn = _attend(q, *(keys[0] if keys else (k, v)), keys[1:] + ([(k, v)] if keys else []), head.group())
        keys.append((k, v))
        out = head.finish(u, attn)
        outs.append(out)
        state = _shift(out, 1)  # position t reads the output of t - 1
    return outs


def step_losses(head: FeatureHead, outs: list[torch.Tensor], batch: Batch) -> list[dict]:
    """Per step: loss (cross-entropy to the teacher), top-1 agreement with the target, and the
    T = 1 acceptance estimate sum_k min(p_k, q_k) over the teacher's top-k."""
    result = []
    for s, out in enumerate(outs):
        ok = batch.row_t >= s  # positions whose input state exists at this step
        x = head.final_norm(out.flatten(0, 1)[batch.rows[ok]])  # [R, hidden]
        p, ids = batch.teacher_p[ok], batch.teacher_ids[ok]
        picked, best = picked_log_softmax(x, head.lm_head.weight, ids)  # [R, k], [R]
        loss = -(p * picked).sum(-1).mean()
        with torch.no_grad():
            top1 = (head.d2t[best] == batch.teacher_top1[ok]).float().mean()
            accept = torch.minimum(p, picked.exp()).sum(-1).mean()
        result.append({"loss": loss, "top1": float(top1), "accept": float(accept), "rows": int(ok.sum())})
    return result


@dataclass
class TrainPlan:
    steps: int  # optimizer steps (at most)
    unroll: int
    lr: float
    batch_tokens: int
    seed: int
    step_weight: float = 0.8  # loss weight of unrolled step s: step_weight ** s
    minutes: float = 60.0  # training budget of this run (stops early, keeps its state)
    device: str = "cpu"  # where the head trains (the samples stay on the CPU; batches move)
    precision: str = "auto"  # matmuls in fp32 or bf16 (autocast); auto: choose_precision


@torch.no_grad()
def evaluate(head: FeatureHead, embed: torch.Tensor, samples, t2d: torch.Tensor, plan: TrainPlan) -> list[dict]:
    """Held-out metrics per unrolled step (= draft depth - 1), weighted by rows."""
    totals = [{"loss": 0.0, "top1": 0.0, "accept": 0.0, "rows": 0} for _ in range(plan.unroll)]
    batch_of = batches_of(samples, t2d, plan.device)
    for idx in make_batches(samples, plan.batch_tokens, torch.Generator().manual_seed(0)):
        batch = batch_of(idx)
        for tot, m in zip(totals, step_losses(head, unroll(head, embed, batch, plan.unroll), batch)):
            for key in ("loss", "top1", "accept"):
                tot[key] += float(m[key]) * m["rows"]
            tot["rows"] += m["rows"]
    return [{k: (v / t["rows"] if k != "rows" else v) for k, v in t.items()} for t in totals]


def train(head: FeatureHead, embed: torch.Tensor, samples, t2d: torch.Tensor, plan: TrainPlan,
          state_path: Path | None = None) -> dict:
    """AdamW with warmup and cosine decay over at most plan.steps steps, fewer when the budget
    (plan.minutes, timed over the first steps) allows fewer; saves its state to `state_path`
    every 25 steps and at the end, and resumes from it when it exists."""
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=plan.lr,
                            betas=(0.9, 0.95), weight_decay=0.01)
    run = {"step": 0, "total": plan.steps, "seconds": 0.0, "history": []}
    if state_path is not None and state_path.exists():
        saved = torch.load(state_path, weights_only=False)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["opt"])
        run = saved["run"]
        log.info("resumed training at step %d of %d (%.0f s so far)", run["step"], run["total"], run["seconds"])
    batch_of = batches_of(samples, t2d, plan.device)
    if "precision" not in run:
        first = make_batches(samples, plan.batch_tokens, torch.Generator().manual_seed(plan.seed))[0]
        run["precision"] = choose_precision(head, embed, lambda: batch_of(first), plan)
        log.info("training in %s", run["precision"])
    rng = torch.Generator().manual_seed(plan.seed + run["step"])
    started = time.monotonic()
    queue: list = []

    def save():
        if state_path is not None:
            state = {"head": head.state_dict(), "opt": opt.state_dict(),
                     "run": {**run, "seconds": run["seconds"] + time.monotonic() - started}}
            torch.save(state, state_path.with_suffix(".tmp"))
            state_path.with_suffix(".tmp").rename(state_path)

    head.train()
    while run["step"] < run["total"] and time.monotonic() < started + 60 * plan.minutes:
        if not queue:
            queue = make_batches(samples, plan.batch_tokens, rng)
        batch = batch_of(queue.pop())
        loss, metrics = _step(head, embed, batch, opt, plan, run)
        run["step"] += 1
        run["history"].append([run["step"], loss] + [m["top1"] for m in metrics])
        if run["seconds"] == 0.0 and (run["step"] == 3 or run["step"] % 25 == 0):
            _fit_schedule(run, plan, time.monotonic() - started)
        if run["step"] % 25 == 0 or run["step"] == run["total"]:
            log.info("step %d/%d loss %.3f top1 per depth %s", run["step"], run["total"], loss,
                     " ".join(f"{m['top1']:.2f}" for m in metrics))
            save()
    save()
    head.eval()
    return {"steps": run["step"], "seconds": run["seconds"] + time.monotonic() - started, "history": run["history"],
            "precision": run["precision"]}


def _fit_schedule(run: dict, plan: TrainPlan, elapsed_s: float) -> None:
    """A fresh run's cosine length: the steps its time budget holds at the mean step time so far,
    refitted as it goes (later steps ran about a quarter slower than the first three on a Xeon, and
    a schedule fitted once stopped with the learning rate at a fifth of its peak)."""
    per_step = elapsed_s / run["step"]
    fits = run["step"] + int(max(0.0, 60 * plan.minutes - elapsed_s) / per_step)
    total = max(4, run["step"] + 1, min(plan.steps, fits))
    if total != run["total"]:
        log.info("%.1f s per step: %d steps fit the %.0f min budget", per_step, total, plan.minutes)
    run["total"] = total


def _step(head, embed, batch: Batch, opt, plan: TrainPlan, run: dict) -> tuple[float, list[dict]]:
    """One optimizer step; returns the weighted loss and the per-depth metrics."""
    step, total = run["step"], run["total"]
    warmup = max(1, total // 20)
    lr = plan.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, step / total))))
    for g in opt.param_groups:
        g["lr"] = lr
    with _autocast(plan.device, run["precision"]):
        metrics = step_losses(head, unroll(head, embed, batch, plan.unroll), batch)
        loss = sum(plan.step_weight ** s * m["loss"] for s, m in enumerate(metrics))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
    opt.step()
    return float(loss.detach()), metrics


def choose_precision(head: FeatureHead, embed: torch.Tensor, probe: Callable[[], Batch], plan: TrainPlan) -> str:
    """plan.precision, or for "auto": bf16 on a GPU (as EAGLE's heads train); on a CPU whichever of
    fp32 and bf16 runs a forward and backward of the batch `probe` builds faster, each timed twice
    (bf16 wins where the CPU has bf16 dot products, and loses where torch emulates them)."""
    if plan.precision != "auto":
        return plan.precision
    if torch.device(plan.device).type == "cuda":
        return "bf16"
    batch = probe()
    best: dict[str, float] = {}
    for precision in ("fp32", "bf16") * 2:
        started = time.perf_counter()
        with _autocast(plan.device, precision):
            loss = sum(m["loss"] for m in step_losses(head, unroll(head, embed, batch, plan.unroll), batch))
        loss.backward()
        best[precision] = min(best.get(precision, math.inf), time.perf_counter() - started)
    head.zero_grad(set_to_none=True)
    log.info("a training step's forward and backward: %s", ", ".join(f"{k} {v:.2f} s" for k, v in best.items()))
    return min(best, key=best.get)


def _autocast(device: str, precision: str):
    """bf16 matmuls under autocast (weights, optimizer state and the softmaxes stay float32), or
    float32 throughout."""
    if precision == "bf16":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
