"""What every benchmark does with its results: a CSV in ``benchmarks/out/`` and, when
matplotlib is installed, a figure beside it.

Example::

    from _out import pyplot, write_csv     # benchmarks/ is the script's folder
    path = write_csv(rows, "fusion-cpu")   # benchmarks/out/fusion-cpu.csv
    plt = pyplot()                         # None without matplotlib
"""
from __future__ import annotations

import csv
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def write_csv(rows: list[dict], name: str) -> str:
    """Write ``rows`` (dicts with the same keys) to ``benchmarks/out/NAME.csv``; its path."""
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, f"{name}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (said so) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("no matplotlib: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
