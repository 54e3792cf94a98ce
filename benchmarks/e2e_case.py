"""Diagnostics: one whole search of an ``optimize_e2e.py`` case, its wall time and what every
grouped unit of its plans table measured and decided (issue #26 items 4 and 5).

One torch thread per worker, ``workers=1``, as ``optimize_e2e.py --threads 1``. Run modes
interleaved in a shell loop to compare them on a shared machine. ``--judge-sample N`` sets
``retiarii.engine.runner.planner.JUDGE_SAMPLE`` (how many of a later job's models a decided key
profiles alone) in this driver, for a side-by-side of that cut (a large N: every model).

Example::

    for m in off auto off auto; do .venv/bin/python benchmarks/e2e_case.py c512 --mode $m; done
    .venv/bin/python benchmarks/e2e_case.py d --judge-sample 1000000    # every model profiled
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as optimize_e2e.py on a CPU

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import optimize_e2e as e2e  # noqa: E402
import retiarii as rt  # noqa: E402
from retiarii.engine import grouping  # noqa: E402
from retiarii.engine.executors.local import LocalExecutor  # noqa: E402
from retiarii.engine.storage.plans_table import PlanTable  # noqa: E402
from retiarii.engine.storage.store import Store  # noqa: E402


def unit_line(status: str, unit: dict) -> str:
    """One grouped unit: layout, size, verdict, the choice's speed-ups and measuring time,
    alone profiles, the loader's pace and starts, the batches judged."""
    choice = unit.get("choice") or {}
    speedups = {k: round(v, 2) for k, v in (choice.get("speedups") or {}).items() if v}
    return (f"{status:<11} {unit.get('layout')!s:<9} models {len(unit.get('trials') or ()):>2}"
            f"  verdict {unit.get('verdict')}  choice {speedups}"
            f"  probe_s {choice.get('probe_s') or 0.0:.3f}  setup_s {unit.get('setup_s') or 0.0:.3f}"
            f"  alone {len(unit.get('alone_s') or {})}  produce_s {unit.get('produce_s') or 0.0:.4f}"
            f"  start_s {unit.get('start_s') or 0.0:.4f}  judged {unit.get('judged_batches')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case", choices=[c for cases in e2e.CASES.values() for c in cases])
    parser.add_argument("--mode", choices=list(e2e.MODES), default="auto")
    parser.add_argument("--judge-sample", type=int, default=None)
    args = parser.parse_args()
    if args.judge_sample is not None:
        grouping.JUDGE_SAMPLE = args.judge_sample
    setup_args = argparse.Namespace(quick=False, threads=1, workers=1, device="cpu")
    folder = tempfile.mkdtemp(prefix="e2e-case-")
    setup = e2e.setup_case(args.case, setup_args, folder)
    db = os.path.join(folder, "search.db")
    executor = LocalExecutor(1, [], threads_per_worker=1)
    kwargs = {} if e2e.MODES[args.mode] is None else {"optimize": e2e.MODES[args.mode]}
    exp = rt.Experiment(setup["space"], setup["strategy"](), setup["trainer"], store=db,
                        workers=1, devices=[], max_models=setup["models"], seed=0,
                        executor=executor, **kwargs)
    start = time.perf_counter()
    try:
        exp.run()
    finally:
        wall = time.perf_counter() - start
        executor.close()
    print(f"{args.case} {args.mode} judge_sample={grouping.JUDGE_SAMPLE}: {wall:.2f} s, "
          f"load {os.getloadavg()[0]:.1f}")
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        for row in PlanTable(store).rows():
            for unit in row["units"]:
                if unit.get("merged") or unit.get("choice"):
                    print(unit_line(row["status"], unit))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
