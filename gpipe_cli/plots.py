"""Plotting helpers shared by `gpipe report` and `gpipe bench` (sweep and trace; matplotlib, imported lazily)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from gpipe_cli.files import atomic_write

DPI = 100
_MISSING = "matplotlib is not installed (pip install 'gpipe-cli[plot]')"
_why_not = _MISSING


def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None when it cannot be imported (`why_not` says why)."""
    global _why_not
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed: figures only go to files
        matplotlib.rcParams["text.parse_math"] = False  # a run's folder named with two $ is a name, not TeX
        import matplotlib.pyplot as plt
    except ImportError as exc:
        if not (isinstance(exc, ModuleNotFoundError) and exc.name == "matplotlib"):  # e.g. built for another numpy
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _why_not = (f"matplotlib is installed but cannot be imported ({first}); reinstall it "
                        "(pip install -U 'gpipe-cli[plot]')")
        return None
    return plt


def why_not() -> str:
    """Why `pyplot` gave None."""
    return _why_not


def figure(plt: Any, width_px: int, height_px: int, rows: int, cols: int, title: str) -> tuple[Any, Any]:
    """A figure of exactly width_px x height_px pixels with a rows x cols grid of axes."""
    fig, axes = plt.subplots(rows, cols, figsize=(width_px / DPI, height_px / DPI), dpi=DPI, squeeze=False)
    fit_width(fig, fig.suptitle(title))
    return fig, axes


def fits(fig: Any, text: Any) -> bool:
    """Whether a text of the figure is no wider than the figure (a centred one then stays within both edges)."""
    return bool(text.get_window_extent(fig.canvas.get_renderer()).width <= fig.bbox.width * 0.98)


def fit_width(fig: Any, text: Any) -> None:
    """Break a figure's text between its comma-separated items where one line would run past the figure's edges."""
    items = text.get_text().split(", ")
    lines = [items[0]]
    for item in items[1:]:
        text.set_text(f"{lines[-1]}, {item}")
        if fits(fig, text):
            lines[-1] += f", {item}"
        else:
            lines[-1] += ","
            lines.append(item)
    text.set_text("\n".join(lines))


FORMATS = ("png", "pdf", "svg")  # what a figure can be written as, named by the file's suffix


def save(plt: Any, fig: Any, path: Path, laid_out: bool = False) -> Path:
    """Write the figure at its own pixel size (no tight bounding box, which would change it), as its suffix says."""
    if not laid_out:  # a caller that placed figure-wide artists has laid out the panels around them
        fig.tight_layout()
    write(plt, fig, path, DPI)
    return path


def write(plt: Any, fig: Any, path: Path, dpi: int) -> None:
    """Write the figure as its suffix says (PNG, PDF or SVG; PNG without one), whole or not at all, and release it."""
    kind = path.suffix.lower().lstrip(".")
    try:
        atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format=kind if kind in FORMATS else "png"))
    finally:
        plt.close(fig)


def grouped_bars(ax: Any, groups: Sequence[str], bars: Mapping[str, Sequence[float | None]], ylabel: str,
                 hatched: Sequence[str] = ()) -> None:
    """Bars side by side in each group; a None value leaves a gap; `hatched` series are drawn hatched."""
    width = 0.8 / max(len(bars), 1)
    for i, (label, values) in enumerate(bars.items()):
        xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(groups))]
        ax.bar([x for x, v in zip(xs, values) if v is not None], [v for v in values if v is not None], width,
               label=label, hatch="//" if label in hatched else None, alpha=0.6 if label in hatched else 1.0)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)


def line(style: str, color: str, marker: str | None = None) -> Any:
    """A line of that style, colour and marker to stand for curves in a legend (it is drawn nowhere)."""
    from matplotlib.lines import Line2D

    return Line2D([], [], linestyle=style, color=color, marker=marker)  # type: ignore[arg-type]  # any style
