"""The journal's cost per trial as a search grows: incremental saved states vs full rewrites.

The trial runner saves the scheduler's state (and the experiment the strategy's) after every
decision, so that a killed driver resumes exactly. A state that grows with the search (every
result ASHA or median stopping has seen, every sample a strategy proposed) then costs more to
save the longer the search runs, unless only what is new is written: the store keeps the lists
a state names in ``append_only`` one row per item and writes only new items (docs/store.md).

This script runs a real :class:`~retiarii.engine.runner.trial_runner.TrialRunner` on the
:class:`~retiarii.engine.executors.simulated.SimulatedExecutor` (virtual time: no training),
journaled to a real :class:`~retiarii.engine.storage.store.Store` on disk, side by side:

- ``full``:  a Store that drops ``append_only`` before saving, so every save rewrites the whole
             state as one JSON row (what the store did before, and what a naive journal does);
- ``ours``:  the Store as it is.

For each scheduler it reports the driver's wall time per trial over consecutive blocks of
trials (how the cost grows) and the ratio. Writes ``benchmarks/out/journal.csv``.

    .venv/bin/python benchmarks/journal.py [--trials 1000] [--block 250]
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import shutil
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from retiarii.engine.executors.simulated import SimulatedExecutor  # noqa: E402
from retiarii.engine.storage.store import Store  # noqa: E402
from retiarii.engine.runner.trial_runner import TrialRunner  # noqa: E402
from retiarii.strategies import ASHA, Hyperband, MedianStopping  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
STEPS = 9  # epochs a trial may train


def _strip(state):
    if isinstance(state, dict):
        return {k: _strip(v) for k, v in state.items() if k != "append_only"}
    return state


class FullRewriteStore(Store):
    """The baseline: every saved state is one JSON row, rewritten whole each time."""

    def _save_state(self, table, state):
        super()._save_state(table, _strip(state))


def curve(spec, step):
    noise = random.Random(f"{spec['id']}/{step}").uniform(-0.02, 0.02)
    return {"loss": spec["floor"] + (1.2 - spec["floor"]) * (1 - step / STEPS) ** 1.6 + noise}


SCHEDULERS = {
    "ASHA": lambda: ASHA("loss", "min", grace_period=1, max_t=STEPS, reduction_factor=3),
    "MedianStopping": lambda: MedianStopping("loss", "min", grace_period=2,
                                             min_samples_required=3),
    "Hyperband": lambda: Hyperband("loss", "min", max_t=STEPS, reduction_factor=3),
}


def run(kind: str, name: str, trials: int, block: int) -> list[float]:
    """Seconds of driver time per trial, one figure per block of ``block`` finished trials."""
    folder = os.path.join(OUT, "journal-db")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{kind}-{name}.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(path + suffix):
            os.remove(path + suffix)
    store = (FullRewriteStore if kind == "full" else Store)(path)
    store.add_experiment({"benchmark": "journal"}, seed=0)
    rng = random.Random(0)
    executor = SimulatedExecutor(8, curve)
    ended: list[float] = []
    runner = TrialRunner(executor, SCHEDULERS[name](), store, max_steps=STEPS,
                         on_trial_end=lambda trial: ended.append(time.perf_counter()))
    for i in range(trials):
        runner.add_trial({"id": i, "floor": rng.uniform(0.15, 0.95)}, trial_id=f"t{i:05d}")
    start = time.perf_counter()
    runner.run()
    store.close()
    shutil.rmtree(folder, ignore_errors=True)
    marks = [start] + ended
    return [(marks[min(i + block, len(marks) - 1)] - marks[i]) / block
            for i in range(0, len(marks) - 1, block)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=1000)
    parser.add_argument("--block", type=int, default=250)
    args = parser.parse_args()
    table = []
    for name in SCHEDULERS:
        got = {kind: run(kind, name, args.trials, args.block) for kind in ("full", "ours")}
        for b, (full, ours) in enumerate(zip(got["full"], got["ours"])):
            first, last = b * args.block + 1, min((b + 1) * args.block, args.trials)
            table.append({"scheduler": name, "trials": f"{first}-{last}",
                          "full_ms_per_trial": round(full * 1e3, 3),
                          "ours_ms_per_trial": round(ours * 1e3, 3),
                          "ratio": round(full / ours, 2)})
    print(f"{'scheduler':<16}{'trials':>12}{'full ms/trial':>15}{'ours ms/trial':>15}{'ratio':>8}")
    for row in table:
        print(f"{row['scheduler']:<16}{row['trials']:>12}{row['full_ms_per_trial']:>15.3f}"
              f"{row['ours_ms_per_trial']:>15.3f}{row['ratio']:>8.2f}")
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "journal.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {os.path.join(OUT, 'journal.csv')}")


if __name__ == "__main__":
    main()
