"""Training control in the simulator: run-all vs median stopping, ASHA, Hyperband, successive
halving and HyperTrick, side by side in one process.

The seed chapter's setting: 40 trials, 4 workers, 6 rungs x 5 epochs, losses falling from 1.2
toward hidden floors drawn from U(0.15, 0.95) (the chapter's own ``random.seed(7)`` population),
grace 2 rungs. Two scenarios: ``homogeneous`` (the chapter) and ``heterogeneous`` (worker
speeds 2, 1, 1, 0.5 and a per-trial cost factor U(0.5, 1.5), as when hyper-parameters change
the cost of a step). For each scheduler: compute used (epochs), compute reclaimed vs run-all,
virtual wall-clock, time-to-best (when the run's winner finished), worker occupancy, and
whether it found the run-all winner; then the same over 30 random populations, worker occupancy
over time (PNG), an optional cross-check against Ray Tune's own schedulers run through the same
loop, and the real time the simulator needs for thousands of trials.

Run: ``.venv/bin/python benchmarks/schedulers.py`` (writes ``benchmarks/out/schedulers*.csv``
and ``benchmarks/out/schedulers_occupancy.png``).
"""
from __future__ import annotations

import csv
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from retiarii.engine.executors.simulated import SimulatedExecutor  # noqa: E402
from retiarii.engine.runner.trial_runner import TrialRunner  # noqa: E402
from retiarii.strategies import (  # noqa: E402
    ASHA, HyperTrick, Hyperband, MedianStopping, Scheduler,
)
from retiarii.strategies.schedulers.base import Decision  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "out")
RUNGS, EPOCHS, WORKERS, TRIALS = 6, 5, 4, 40
SCENARIOS = {"homogeneous": None, "heterogeneous": [2.0, 1.0, 1.0, 0.5]}

SCHEDULERS = {
    "run-all": lambda: Scheduler(),
    "median": lambda: MedianStopping("loss", "min", grace_period=2, min_samples_required=3),
    "asha": lambda: ASHA("loss", "min", grace_period=2, max_t=RUNGS, reduction_factor=3),
    "asha-promotion": lambda: ASHA("loss", "min", grace_period=2, max_t=RUNGS,
                                   reduction_factor=2, promotion=True),
    "hyperband": lambda: Hyperband("loss", "min", max_t=RUNGS, reduction_factor=2),
    "sync-SH": lambda: Hyperband("loss", "min", max_t=RUNGS, reduction_factor=2, brackets=1,
                                 bracket_size=TRIALS),
    "hypertrick-r.5": lambda: HyperTrick("loss", "min", num_workers=TRIALS, num_phases=RUNGS,
                                         eviction_rate=0.5),
    "hypertrick-r.25": lambda: HyperTrick("loss", "min", num_workers=TRIALS, num_phases=RUNGS,
                                          eviction_rate=0.25),
}


def population(seed):
    """The chapter's trials for seed 7 (its own draw order), else a fresh population."""
    rng = random.Random(seed)
    trials = []
    for t in range(TRIALS):
        floor = rng.uniform(0.15, 0.95)
        trials.append({"id": t, "floor": floor, "noise": rng.uniform(0.0, 0.05),
                       "cost": random.Random(f"cost/{seed}/{t}").uniform(0.5, 1.5)})
    return trials


def loss(spec, rung):
    noise = random.Random(f"{spec['id']}/{rung}").uniform(-spec["noise"], spec["noise"])
    return {"loss": spec["floor"] + (1.2 - spec["floor"]) * (1 - rung / RUNGS) ** 1.6 + noise}


def run(make_sched, seed, scenario):
    speeds = SCENARIOS[scenario]
    step_time = EPOCHS if speeds is None else (lambda spec, step: EPOCHS * spec["cost"])
    ex = SimulatedExecutor(WORKERS, loss, speeds=speeds, step_time=step_time)
    runner = TrialRunner(ex, make_sched(), max_steps=RUNGS)
    for spec in population(seed):
        runner.add_trial(spec, trial_id=f"#{spec['id']}")
    runner.run()
    done = [t for t in runner.trials.values() if t.step == RUNGS]
    best = min(done, key=lambda t: t.last_result["loss"])
    finished = {e["trial_id"]: e["end"] for e in runner.timeline if not e["failed"]}
    work = sum(h["end"] - h["start"] for h in ex.history)
    return {"epochs": EPOCHS * runner.steps_trained, "wall": ex.now(), "best": best.trial_id,
            "best_loss": best.last_result["loss"], "time_to_best": finished[best.trial_id],
            "occupancy": work / (WORKERS * ex.now()), "completed": len(done),
            "history": ex.history}


def busy_curve(history, wall, points=400):
    """Fraction of workers busy at evenly spaced virtual times."""
    xs = [wall * i / (points - 1) for i in range(points)]
    return xs, [sum(h["start"] <= x < h["end"] for h in history) / WORKERS for x in xs]


def ray_adapters():
    """Ray Tune's MedianStoppingRule and ASHA behind our interface (None if Ray is missing)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        from ray.tune.schedulers import AsyncHyperBandScheduler, MedianStoppingRule
    except ImportError:
        return {}

    class Adapter(Scheduler):
        def __init__(self, ray_sched):
            self.ray, self.trials = ray_sched, {}

        def _t(self, trial_id):
            return self.trials.setdefault(trial_id, type("T", (), {"trial_id": trial_id})())

        def on_trial_add(self, trial_id, config):
            self.ray.on_trial_add(self, self._t(trial_id))

        def on_trial_result(self, trial_id, result):
            return Decision(self.ray.on_trial_result(self, self._t(trial_id), dict(result)))

        def on_trial_complete(self, trial_id, result):
            self.ray.on_trial_complete(self, self._t(trial_id), dict(result))

        def get_live_trials(self):  # the controller Ray's median rule asks: nobody waits
            return []

    return {"ray-median": lambda: Adapter(MedianStoppingRule(
                time_attr="training_iteration", metric="loss", mode="min", grace_period=2,
                min_samples_required=3)),
            "ray-asha": lambda: Adapter(AsyncHyperBandScheduler(
                metric="loss", mode="min", grace_period=2, max_t=RUNGS, reduction_factor=3))}


def main():
    os.makedirs(OUT, exist_ok=True)
    rows, runs = [], {}
    print(f"cluster: {WORKERS} workers, {TRIALS} trials, {RUNGS} rungs x {EPOCHS} epochs; "
          f"the chapter's population (random.seed(7))")
    for scenario in SCENARIOS:
        print(f"\n[{scenario}] speeds={SCENARIOS[scenario]}")
        print(f"{'scheduler':<16} {'epochs':>6} {'reclaimed':>9} {'wall':>7} {'to-best':>7} "
              f"{'occupancy':>9} {'completed':>9} {'winner':>7} same")
        base = None
        for name, make in {**SCHEDULERS, **ray_adapters()}.items():
            r = run(make, 7, scenario)
            base = base or r
            runs[(scenario, name)] = r
            same = r["best"] == base["best"]
            reclaimed = 1 - r["epochs"] / base["epochs"]
            print(f"{name:<16} {r['epochs']:>6} {reclaimed:>9.1%} {r['wall']:>7.1f} "
                  f"{r['time_to_best']:>7.1f} {r['occupancy']:>9.1%} {r['completed']:>9} "
                  f"{r['best']:>7} {same}")
            rows.append({"scenario": scenario, "scheduler": name, "seed": 7,
                         "epochs": r["epochs"], "reclaimed": round(reclaimed, 4),
                         "wall": r["wall"], "time_to_best": r["time_to_best"],
                         "occupancy": round(r["occupancy"], 4), "completed": r["completed"],
                         "winner": r["best"], "same_winner": same})
        for ours, theirs in (("median", "ray-median"), ("asha", "ray-asha")):
            if (scenario, theirs) in runs:
                a, b = runs[(scenario, ours)], runs[(scenario, theirs)]
                match = all(a[k] == b[k] for k in ("epochs", "wall", "best", "completed"))
                print(f"  {ours} == Ray Tune's {theirs[4:]} through the same loop: {match}")

    print("\n[heterogeneous] 30 random populations (seeds 100..129): mean (min) reclaimed, "
          "same-winner rate, mean occupancy")
    many = []
    for seed in range(100, 130):
        base = run(SCHEDULERS["run-all"], seed, "heterogeneous")
        for name, make in SCHEDULERS.items():
            r = base if name == "run-all" else run(make, seed, "heterogeneous")
            many.append({"scheduler": name, "seed": seed,
                         "reclaimed": 1 - r["epochs"] / base["epochs"],
                         "same_winner": r["best"] == base["best"], "occupancy": r["occupancy"],
                         "wall": r["wall"], "time_to_best": r["time_to_best"]})
    for name in SCHEDULERS:
        mine = [m for m in many if m["scheduler"] == name]
        rec = [m["reclaimed"] for m in mine]
        print(f"{name:<16} reclaimed {statistics.mean(rec):6.1%} (min {min(rec):6.1%})  "
              f"same winner {sum(m['same_winner'] for m in mine):>2}/30  "
              f"occupancy {statistics.mean(m['occupancy'] for m in mine):6.1%}  "
              f"wall {statistics.mean(m['wall'] for m in mine):6.1f}")

    t0 = time.perf_counter()
    ex = SimulatedExecutor(16, loss, step_time=EPOCHS)
    big = TrialRunner(ex, ASHA("loss", "min", grace_period=1, max_t=RUNGS, reduction_factor=3),
                      max_steps=RUNGS)
    rng = random.Random(0)
    for i in range(3000):
        big.add_trial({"id": i, "floor": rng.uniform(0.15, 0.95), "noise": 0.02})
    big.run()
    seconds = time.perf_counter() - t0
    print(f"\nsimulator scale: 3000 trials, 16 workers, ASHA: {big.steps_trained} steps, "
          f"{len(ex.history)} jobs in {seconds:.2f} s of real time")

    with open(os.path.join(OUT, "schedulers.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(OUT, "schedulers_seeds.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(many[0]))
        writer.writeheader()
        writer.writerows(many)
    plot(runs)


def plot(runs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(SCHEDULERS)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.4 * len(names)), sharex=True)
    for ax, name in zip(axes, names):
        r = runs[("heterogeneous", name)]
        xs, ys = busy_curve(r["history"], r["wall"])
        ax.fill_between(xs, ys, step="post", alpha=0.6)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
        ax.text(0.99, 0.1, f"occupancy {r['occupancy']:.0%}, wall {r['wall']:.0f}",
                transform=ax.transAxes, ha="right", fontsize=7)
    axes[-1].set_xlabel("virtual time (heterogeneous workers: speeds 2, 1, 1, 0.5)")
    fig.suptitle("Fraction of workers busy over time")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "schedulers_occupancy.png"), dpi=110)
    print(f"wrote {OUT}/schedulers.csv, schedulers_seeds.csv, schedulers_occupancy.png")


if __name__ == "__main__":
    main()
