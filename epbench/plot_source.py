"""What produced a figure: a footer and file metadata naming each run drawn and its epbench commit."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

Sources = Sequence[Tuple[str, Dict[str, Any]]]  # (run folder name, its meta.json) of what a figure draws
ATTR = "epbench_sources"  # the figure's attribute that carries them from stamp() to its savefig


def stamp(fig, sources: Optional[Sources]) -> None:
    """What produced the figure, in a small footer and (through plot._save_figure) in the file's
    metadata: each run's folder name and the epbench commit its meta.json recorded."""
    from epbench.smmem import commit_label

    if not sources:
        return
    lines = [f"run {name}: epbench commit {commit_label(meta)}" for name, meta in sources]
    fig.text(0.005, 0.0, "\n".join(lines), ha="left", va="top", fontsize=7, color="0.35")
    setattr(fig, ATTR, {"Run": ", ".join(name for name, _ in sources),
                     "Commit": ", ".join(commit_label(meta) for _, meta in sources),
                     "Source": "; ".join(lines)})


def metadata(fig, fmt: str) -> Optional[Dict[str, str]]:
    """savefig's metadata: the title and the footer's runs and commits, under the keys each
    format takes (PNG: any text key; SVG and PDF: their own; other formats: none)."""
    given = getattr(fig, ATTR, None)
    suptitle = getattr(fig, "_suptitle", None)  # Figure.get_suptitle is matplotlib >= 3.8; 3.7 is allowed
    title = suptitle.get_text() if suptitle is not None else None
    if not given or fmt not in ("png", "svg", "pdf"):
        return None
    keys = {"png": {"Source": "Source", "Run": "Run", "Commit": "Commit"},
            "svg": {"Source": "Source"}, "pdf": {"Source": "Subject"}}[fmt]
    return {**({"Title": title} if title else {}), **{new: given[old] for old, new in keys.items()}}
