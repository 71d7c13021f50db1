"""Cosine to the teacher against weight bytes, every method of one or more ``bench_distill.py`` runs: the frontier a
user reads before choosing how to shrink an encoder.

    .venv/bin/python benchmarks/plot_frontier.py runs/a/results.json runs/b/results.json \\
        --out docs/pretrained_run/cosine_vs_bytes.png

Each point is one cell: x = the encoder weight matrices' bytes / their fp32 bytes, y = mean cosine to the teacher's
sentence embeddings on the other-source text (``--held-out``: on held-out stdlib text). A method run twice at the same
bytes (the same cell in two files) keeps its last figure; ``PATH=OLD>NEW`` keeps a file's cells apart. A distilled
``formats`` cell also plots its untrained start, and a layer-drop cell its groups-of-64 twin (``cell_points``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def points(specs: list[str], key: str) -> dict[str, dict[float, float]]:
    """{method: {bytes ratio: cosine}} over every cell of every results file. A spec ``PATH=OLD>NEW`` shows that
    file's method OLD as NEW (runs of different code versions stay apart)."""
    found: dict[str, dict[float, float]] = {}
    for spec in specs:
        path, _, rename = spec.partition("=")
        old, _, new = rename.partition(">")
        data = json.loads(Path(path).read_text())
        for cell in data["results"] if isinstance(data, dict) else data:
            method = new if rename and cell["method"] == old else cell["method"]
            for name, x, y in cell_points(cell, method, key):
                found.setdefault(name, {})[round(x, 4)] = y
    return found


def cell_points(cell: dict, method: str, key: str) -> list[tuple[str, float, float]]:
    """(method, bytes, cosine) of one cell, plus the points it measured on the way: a distilled ``formats`` cell's
    untrained start (``start_*``, the same bytes: shown as the method without its `` distill…`` suffix) and a
    quantized cell's grouped twin (``g64_*`` at ``g64_bytes_ratio``)."""
    found = []
    if cell.get(key) is not None and cell.get("bytes_ratio") is not None:
        found.append((method, cell["bytes_ratio"], cell[key]))
        if cell.get(f"start_{key}") is not None:
            found.append((method.split(" distill")[0], cell["bytes_ratio"], cell[f"start_{key}"]))
    if cell.get(f"g64_{key}") is not None and cell.get("g64_bytes_ratio") is not None:
        found.append((f"{method} (groups of 64)", cell["g64_bytes_ratio"], cell[f"g64_{key}"]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files; PATH=OLD>NEW renames a method of that file")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--held-out", action="store_true", help="held-out stdlib text instead of other-source text")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "cosine" if args.held_out else "cosine_other"
    fig, ax = plt.subplots(figsize=(7.5, 5))
    markers = "os^DvPX*<>"
    for i, (method, cells) in enumerate(sorted(points(args.results, key).items())):
        xs = sorted(cells)  # 20 colours and 10 markers: no two of up to 20 methods look alike
        ax.plot(xs, [cells[x] for x in xs], marker=markers[i % len(markers)], color=plt.cm.tab20(i % 20), label=method)
        for x in xs:
            print(f"{method:40s} bytes {x:.4f}  cosine {cells[x]:.4f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("encoder weight bytes / fp32 dense (log scale)")
    ax.set_ylabel("mean cosine to the teacher, " + ("held-out stdlib text" if args.held_out else "other-source text"))
    ax.axhline(0.95, color="grey", lw=0.5, ls="--")
    ax.axhline(0.90, color="grey", lw=0.5, ls=":")
    ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
