"""PNG pictures without a plotting library: an RGB array written as a PNG, and the tuning
trade-off (throughput against the goal's latency, one point per candidate, the
recommendation marked). matplotlib is used when installed, for axes and labels."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np

from jaxserve.tuning.search import Goal, Trial

BLUE, RED, ORANGE, GREY = (31, 119, 180), (214, 39, 40), (255, 127, 14), (160, 160, 160)


def write_png(path: str, img: np.ndarray) -> None:
    """`img`: [H, W, 3] uint8."""
    h, w, _ = img.shape
    raw = b"".join(b"\x00" + row.tobytes() for row in np.ascontiguousarray(img, np.uint8))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def _label(t: Trial) -> str:
    return ", ".join(f"{k}={v}" for k, v in t.settings.items())


def save_tradeoff_plot(path: str, trials: Sequence[Trial], goal: Goal, chosen: Trial | None,
                       closest: Trial | None = None) -> str:
    """x: output tokens/s; y: the goal's latency (TTFT p99 for a throughput goal); the
    recommendation red, or, when none meets the goal, the closest candidate orange. Returns a
    line saying what was written."""
    marked, mark = (chosen, "tab:red") if chosen is not None else (closest, "tab:orange")
    metric = goal.metric if goal.limit_s is not None else "ttft-p99"
    pts = [(t.report.output_throughput, t.report.metric(metric) * 1000, t) for t in trials if t.report is not None]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _plain(path, pts, goal, marked, RED if chosen is not None else ORANGE)
        return (f"plot: {path} (no matplotlib: blue candidates, red the recommendation or orange the closest, "
                "grey the goal's bound)")
    fig, ax = plt.subplots(figsize=(8, 5))
    for x, y, t in pts:
        ax.scatter([x], [y], color=mark if t is marked else "tab:blue", s=60 if t is marked else 20)
        ax.annotate(_label(t), (x, y), fontsize=6, alpha=0.7)
    if goal.limit_s is not None:
        ax.axhline(goal.limit_s * 1000, color="grey", linestyle="--", label=str(goal))
        ax.legend()
    ax.set_xlabel("output tokens/s")
    ax.set_ylabel(f"{metric} (ms)")
    ax.grid(alpha=0.3)
    ax.set_title("jaxserve tune: candidates (red: recommended; orange: closest, none meets the goal)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"plot: {path}"


def _plain(path: str, pts, goal: Goal, marked: Trial | None, color, w: int = 640, h: int = 400) -> None:
    img = np.full((h, w, 3), 255, np.uint8)
    pad = 20
    img[h - pad, pad:w - pad] = 0
    img[pad:h - pad, pad] = 0
    if pts:
        xs = np.array([p[0] for p in pts])
        ys = np.array([p[1] for p in pts])
        top = max(ys.max(), goal.limit_s * 1000 if goal.limit_s else 0) * 1.1 or 1.0
        right = xs.max() * 1.1 or 1.0

        def at(x: float, y: float) -> tuple[int, int]:
            return int(pad + x / right * (w - 2 * pad)), int(h - pad - y / top * (h - 2 * pad))

        if goal.limit_s is not None:
            _, gy = at(0, goal.limit_s * 1000)
            img[gy, pad:w - pad:4] = GREY
        for x, y, t in pts:
            px, py = at(x, y)
            r = 5 if t is marked else 2
            img[max(py - r, 0):py + r + 1, max(px - r, 0):px + r + 1] = color if t is marked else BLUE
    write_png(path, img)
