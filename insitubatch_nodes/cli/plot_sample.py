"""``inspect --sample I --plot PNG``: one field of a sample drawn as a PNG.

A map is drawn on the store's coordinates, north up whichever way the store orders its
latitudes; needs matplotlib (the 'bench' extra), asked for only when a plot is.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def plot_axes(source: Any, key: str) -> list[tuple[str, Any]]:
    """(dim, coordinate values or None) of the last two axes of variable ``key``'s samples
    (``target/`` too), as the store names them; [] for another key."""
    name = key.removeprefix("target/")
    if name not in source.names:
        return []
    dims = source.variable(name).dimension_names or ()
    out = []
    for d in list(dims)[-2:]:
        try:
            values = source.coordinate(d, name) if d else None
        except (KeyError, ValueError):
            values = None
        out.append((str(d), values))
    return out if len(out) == 2 else []


def plot_sample(parser: argparse.ArgumentParser, sample: dict[str, Any], path: Path,
                 key: str | None, where: str, source: Any = None) -> str:
    """One field of ``sample`` as a PNG at ``path`` (axes of size 1 dropped, further leading
    axes at index 0, a 1-D field as a line); returns what was drawn. A map is drawn on its
    coordinates: latitude up the page (north up, whichever way the store orders it or
    which of its axes comes first, as WB2's lon-major grid), longitude across."""
    import textwrap

    import numpy as np

    try:
        from matplotlib.figure import Figure
    except ImportError:
        parser.error("--plot needs matplotlib: pip install 'insitubatch-nodes[bench]'")
    fields = [k for k, t in sample.items() if t.dim() >= 1 and k != "patch"]
    if key is None:
        key = next((k for k in fields if sample[k].squeeze().dim() >= 2), None) or (
            fields[0] if fields else None)
        if key is None:
            parser.error(f"--plot: the sample has no field to plot (keys {list(sample)})")
    elif key not in fields:
        parser.error(f"--plot-key {key!r} is not a field of the sample; fields: {fields}")
    if not path.parent.is_dir():
        parser.error(f"--plot {str(path)!r}: folder {str(path.parent)!r} does not exist")
    x = sample[key].detach().cpu().float().numpy().squeeze()
    what, taken = key, []
    while x.ndim > 2:
        x = x[0]
        taken.append("0")
    if taken:
        what += f"[{', '.join(taken)}]"
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    drawn = ""
    if x.ndim == 2:
        axes = plot_axes(source, key) if source is not None else []
        if axes and tuple(x.shape) != tuple(len(v) for _, v in axes if v is not None):
            axes = []  # patched, or no coordinates: index axes
        if axes and "lat" in axes[1][0].lower():  # (lon, lat): latitude to the rows
            x, axes = x.T, axes[::-1]
        if axes:
            (ydim, yv), (xdim, xv) = axes
            north_up = bool(yv[-1] >= yv[0])  # ascending: first row at the bottom
            extent = (float(xv[0]), float(xv[-1]), float(yv[0]), float(yv[-1]))
            im = ax.imshow(x, aspect="auto", interpolation="nearest",
                           origin="lower" if north_up else "upper",
                           extent=extent if north_up else (extent[0], extent[1], extent[3],
                                                           extent[2]))
            ax.set_xlabel(xdim)
            ax.set_ylabel(ydim)
            drawn = f", {ydim} up x {xdim} across"
        else:
            im = ax.imshow(x, aspect="auto", interpolation="nearest")
        fig.colorbar(im, ax=ax)
    else:
        ax.plot(np.asarray(x).reshape(-1))
    ax.set_title("\n".join(textwrap.wrap(f"{what}, {where}", 80)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return f"{what}, shape {tuple(x.shape)}{drawn}"
