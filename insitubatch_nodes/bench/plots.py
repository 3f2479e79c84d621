"""PNG plots of benchmark results (matplotlib, Agg backend, small files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import PEER_NAMES


def _plt() -> Any:  # matplotlib.pyplot
    try:
        import matplotlib
    except ImportError as e:
        from ..errors import MissingDependencyError
        from . import MISSING_HINT

        raise MissingDependencyError(MISSING_HINT) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "figure.dpi": 100})
    return plt


def _short(name: str) -> str:
    return (name.replace("insitubatch loader", "loader").replace("(best of epochs ", "(best of ")
            .replace("read floor: StripeReader", "read floor").replace("naive DataLoader", "naive"))


def plot_core(result: dict[str, Any], path: Path) -> None:
    """Samples/s per path (log scale), each bar labelled with its ratio to the read floor."""
    plt = _plt()
    rows = [r for r in result["rows"] if "epoch 1" not in r["name"]]
    names = [_short(r["name"]) for r in rows]
    rates = [r["samples_per_s"] for r in rows]
    colors = ["#1f77b4" if "loader" in n else "#2ca02c" if n.startswith(PEER_NAMES)
              else "#7f7f7f" if "floor" in n or "zarr" in n else "#d62728" for n in names]
    fig, ax = plt.subplots(figsize=(7.0, 0.32 * len(rows) + 1.0))
    y = range(len(rows))
    ax.barh(list(y), rates, color=colors)
    ax.set_yticks(list(y), names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("samples / s (log scale)")
    for i, r in enumerate(rows):
        ax.text(r["samples_per_s"] * 1.05, i, f"{r['samples_per_s']:,.0f}  "
                f"({r['ratio_to_floor']:.2f}x floor)", va="center", fontsize=7)
    ax.set_xlim(min(rates) / 2, max(rates) * 8)
    sp = result["split"]
    ax.set_title(f"{sp['samples']} samples x {sp['sample_nbytes'] / 1e3:,.0f} kB, "
                 f"{sp['samples_per_chunk']} samples/chunk, batch "
                 f"{result['config']['batch_size']}, {result['machine']['nproc']} cores")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_sweep(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per swept knob: throughput, shuffle quality and peak memory against it."""
    plt = _plt()
    written = []
    spc = result.get("samples_per_chunk")
    if spc:
        xs = [p["samples_per_chunk"] for p in spc]
        fig, axes = plt.subplots(1, 3, figsize=(9.5, 2.8))
        axes[0].plot(xs, [p["samples_per_s"] for p in spc], "o-", label="loader")
        axes[0].plot(xs, [p["floor_samples_per_s"] for p in spc], "s--", label="read floor")
        axes[0].set_ylabel("samples / s")
        axes[0].legend()
        axes[1].plot(xs, [p["python_us_per_batch"] for p in spc], "o-", label="per batch")
        axes[1].plot(xs, [p["python_us_per_stripe"] for p in spc], "s--",
                     label="per stripe read")
        axes[1].set_ylabel("consumer-thread µs (no fetch wait)")
        axes[1].legend()
        axes[2].plot(xs, [p["us_per_chunk"] for p in spc], "o-", label="loader, end to end")
        axes[2].plot(xs, [p["floor_us_per_chunk"] for p in spc], "s--", label="read floor")
        axes[2].set_ylabel("wall µs per chunk")
        axes[2].set_yscale("log")
        axes[2].legend()
        for ax in axes:
            ax.set_xscale("log")
            ax.set_xlabel("samples per chunk")
            ax.set_xticks(xs, [str(x) for x in xs])
        fig.suptitle(f"samples per chunk ({result['spc_store']['n_samples']} samples of "
                     f"{result['spc_store']['sample_shape']}, windows of >= "
                     f"{result['spc_store']['window_samples']} samples)", fontsize=9)
        fig.tight_layout()
        written.append(out_dir / "sweep_samples_per_chunk.png")
        fig.savefig(written[-1])
        plt.close(fig)
    for knob, label in (("block_chunks", "block_chunks"), ("max_inflight", "max_inflight")):
        pts = result.get(knob)
        if not pts:
            continue
        xs = [p[knob] for p in pts]
        fig, axes = plt.subplots(1, 3, figsize=(9.5, 2.8))
        axes[0].plot(xs, [p["samples_per_s"] for p in pts], "o-")
        axes[0].set_ylabel("samples / s")
        axes[1].plot(xs, [p["shuffle_quality"] for p in pts], "o-", label="model")
        if pts[0].get("measured_shuffle_quality") is not None:
            axes[1].plot(xs, [p["measured_shuffle_quality"] for p in pts], "s--",
                         label="measured")
        axes[1].set_ylabel("shuffle quality (1 = global)")
        axes[1].set_ylim(0, 1.05)
        axes[1].legend()
        axes[2].plot(xs, [p["rss_growth_bytes"] / 1e6 for p in pts], "o-", label="RSS growth")
        axes[2].plot(xs, [p["ledger_peak_bytes"] / 1e6 for p in pts], "s--",
                     label="decoded resident")
        axes[2].plot(xs, [p["resident_bound_bytes"] / 1e6 for p in pts], ":",
                     label="resident bound")
        axes[2].set_ylabel("peak MB")
        axes[2].legend()
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel(label)
            ax.set_xticks(xs, [str(x) for x in xs])
        fig.suptitle(f"{label} sweep on {result['store']['url']}", fontsize=9)
        fig.tight_layout()
        written.append(out_dir / f"sweep_{knob}.png")
        fig.savefig(written[-1])
        plt.close(fig)
    return written
