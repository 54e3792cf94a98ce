"""NAS-Bench-201 / NAS-Bench-101's strategy comparisons replayed from the published tables.

The user downloads the table elsewhere (nothing is downloaded here) and names it:

    .venv/bin/python benchmarks/nasbench_replay.py nasbench201 --table NAS-Bench-201-v1_0-e61699.pth
    .venv/bin/python benchmarks/nasbench_replay.py nasbench101 --table nasbench_only108.tfrecord
    .venv/bin/python benchmarks/nasbench_replay.py nasbench201 --table FILE --engine \
        --strategy random,evolution,rl,tpe,tpe+asha --seeds 20

Each strategy searches on the simulated clock (NAS-Bench-201: told a 12-epoch CIFAR-10
validation accuracy, charged its training seconds, 12,000 s; NAS-Bench-101: the 108-epoch
validation accuracy of one of three runs, 500,000 s), 20 seeds by default, and the figure is
the test accuracy of the architecture it holds against simulated time, next to the means
Dong & Yang print (ICLR 2020, Table 5). Writes benchmarks/out/{benchmark}_replay.csv,
_summary.csv and .png. It is `retiarii nas bench` with this folder as its output.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE)]

from retiarii.cli import main  # noqa: E402

if __name__ == "__main__":
    args = sys.argv[1:]
    if "--out" not in args:
        args += ["--out", os.path.join(HERE, "out")]
    sys.exit(main(["nas", "bench", *args]))
