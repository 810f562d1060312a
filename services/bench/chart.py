"""PNG charts of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator  # noqa: E402

from services.bench.decoders import HF_PLAIN, PLAIN  # noqa: E402
from services.bench.spec import ALL  # noqa: E402


def spec_chart(result: dict, path: Path) -> None:
    """Grouped bars: speedup over the same engine's plain decoding, per category and overall.
    With no speculative configuration, tokens/s of the plain decoders instead."""
    groups = list(result["summary"])
    names = [c["name"] for c in result["configs"] if c["name"] not in (PLAIN, HF_PLAIN)]
    key, ylabel = "speedup", "speedup over same-engine plain decoding"
    if not names:
        names, key, ylabel = [c["name"] for c in result["configs"]], "tokens_per_s", "tokens/s"
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, len(groups) * (0.5 + 0.25 * len(names)))), 4.5))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        values = [result["summary"][g][name][key] or 0.0 for g in groups]
        ax.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(groups))], values, width, label=name)
    if key == "speedup":
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), [g if g != ALL else "ALL" for g in groups], rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    s = result["settings"]
    ax.set_title(f"{result['target']}, draft {result['draft']}, T={s['temperature']:g}, "
                 f"max {s['max_tokens']} tokens ({result['meta']['date'][:10]}, {result['meta']['commit']})",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_chart(result: dict, path: Path) -> None:
    """Left: output tokens/s and requests/s against concurrency. Right: TTFT, ITL and end-to-end
    latency (P50 solid, P99 dashed) against concurrency."""
    levels = result["levels"]
    xs = [lvl["concurrency"] for lvl in levels]
    summ = [lvl["summary"] for lvl in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(xs, [s["output_tokens_per_s"] or 0 for s in summ], "o-", label="output tokens/s")
    left.set_xlabel("concurrency")
    left.set_ylabel("output tokens/s")
    left.set_xscale("log", base=2)
    twin = left.twinx()
    twin.plot(xs, [s["requests_per_s"] or 0 for s in summ], "s--", color="tab:orange", label="requests/s")
    twin.set_ylabel("requests/s")
    left.legend(loc="upper left", fontsize=8)
    twin.legend(loc="lower right", fontsize=8)
    left.set_title("throughput")
    measured = False
    for name, color in (("ttft", "tab:blue"), ("itl", "tab:green"), ("e2e", "tab:red")):
        for p, style in (("p50", "o-"), ("p99", "x--")):
            ys = [(s[f"{name}_{p}_s"] or float("nan")) * 1000 for s in summ]
            measured |= any(y > 0 for y in ys)  # NaN > 0 is False
            right.plot(xs, ys, style, color=color, label=f"{name.upper()} {p.upper()}")
    right.set_xscale("log", base=2)
    if measured:
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        right.set_yscale("log")
        right.yaxis.set_minor_locator(LogLocator(subs=(2.0, 5.0)))
        right.yaxis.set_major_formatter(plain)
        right.yaxis.set_minor_formatter(plain)
    else:
        right.text(0.5, 0.5, "no successful request", ha="center", transform=right.transAxes)
    for ax in (left, right):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
    right.set_xlabel("concurrency")
    right.set_ylabel("ms")
    right.set_title("latency")
    right.legend(fontsize=7, ncol=3)
    fig.suptitle(f"{result['settings']['url']} ({result['meta']['date'][:10]}, {result['meta']['commit']})",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
