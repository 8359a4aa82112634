"""``--plot FILE.png``: each loader at its best setting, with min-max whiskers and ceiling lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class PlotUnavailable(Exception):
    """matplotlib is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib") from exc
    return plt


def plot(document: dict[str, Any], path: Path) -> None:
    """One panel per cache state: GB/s bars (median), whiskers from the slowest to the fastest run."""
    plt = _pyplot()
    sections = [s for s in document["sections"] if s["best"]]
    if not sections:
        sections = document["sections"][:1]
    fig, axes = plt.subplots(
        1, max(1, len(sections)), figsize=(6.5 * max(1, len(sections)), 4.8), squeeze=False
    )
    gib = document["checkpoint"]["tensor_bytes"] / 2**30
    loader_colors = {
        "streamer": "tab:blue",
        "safetensors": "tab:orange",
        "runai": "tab:green",
        "fastsafetensors": "tab:red",
        "instanttensor": "tab:purple",
        "tensorizer": "tab:brown",
        "boto3": "tab:gray",
        "gcs_sdk": "tab:gray",
        "azure_sdk": "tab:gray",
        "baseline": "lightsteelblue",
    }
    line_style = {  # one look per ceiling, the same in every panel
        "read_buffered": ("black", "--"),
        "read_direct": ("tab:gray", ":"),
        "memcpy": ("tab:olive", "-."),
        "first_touch": ("tab:cyan", "--"),
        "first_touch_hugepage": ("tab:pink", "-."),
        "page_fill": ("tab:purple", "--"),
        "h2d_pinned": ("darkgoldenrod", ":"),
        "s3_ranged_get": ("black", "--"),
        "sdk_read": ("black", "--"),
    }
    for ax, sec in zip(axes[0], sections, strict=False):
        best = sec["best"]
        labels = [f"{b['loader']}\n{b['setting']}" for b in best]
        rates = [b["gbps"] for b in best]
        low = [b["gbps"] - b["bytes"] / b["max_s"] / 1e9 for b in best]  # slowest run
        high = [b["bytes"] / b["min_s"] / 1e9 - b["gbps"] for b in best]  # fastest run
        ax.bar(labels, rates, yerr=[low, high], capsize=6, color=[loader_colors[b["loader"]] for b in best])
        lines = [c for c in sec["ceilings"] + document["memory_ceilings"] if c["gbps"]]
        for c in lines:
            color, style = line_style.get(c["name"], ("black", ":"))
            ax.axhline(
                c["gbps"],
                linestyle=style,
                color=color,
                linewidth=1,
                label=f"{c['name']} {c['gbps']:.2f} GB/s",
            )
        state = "S3" if sec["cache"] == "remote" else f"{sec['cache']} cache"
        ax.set_title(
            f"{state} — {document['options']['device']}, "
            f"{gib:.2f} GiB, median of {document['options']['repeat']}"
        )
        ax.set_ylabel("GB/s (higher is better)")
        if lines:
            ax.legend(fontsize="small", loc="upper right")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
