"""Benchmark: whole searches with cross-model optimization off, on and by default (issue #26
item 7; issue #12 for the demo).

Each workload is a space a user writes (``e2e_workloads.py``) searched start to end by
``Experiment.run()`` on local worker processes (``--workers``, default 1), three ways, run
``--runs`` times each, interleaved (off, on, auto, off, on, auto, ...) so a busy neighbour
slows every mode alike:

- ``off``: ``optimize=False``, every model trains alone (the baseline);
- ``on``: ``optimize=True``, grouped jobs, nothing measured, never reverted;
- ``auto``: ``optimize`` not passed, the default (``"auto"``): grouped, layouts measured.

Workloads (``--workload``; ``all`` runs every one):

- ``a``: N heads (``--heads``: 4 and 8) on a frozen ResNet-18-style trunk whose BatchNorms
  train; 4096 32x32 images, 1 epoch; cases ``a4``, ``a8``;
- ``b``: a residual adapter after one of 8 blocks of a frozen MobileNetV2 (train-mode
  BatchNorm), 2048 images, and the same frozen with ``rt.freeze``; cases ``b``, ``bfreeze``;
- ``c64``, ``c512``: 16 MLPs 64-W-W-10 whose space chooses the activation at two places;
- ``d``: a MnasNet-like space (kernel, expansion, squeeze-excite at two stages: 64 models)
  trained on 512 JPEGs read by a DataLoader (``ImageFolderTrainer``, the paper's setting);
- ``e``: the demo (``retiarii.demo``), 16 models by seeded random search, 3 epochs.

It prints every run's wall time, each mode's running median and ratio ``off / mode`` as it
goes, then per case: whether every model's metrics (every epoch's train_loss, val_loss,
val_acc) equal ``off``'s bit for bit (else the largest relative difference of a final metric),
whether the reruns of one mode gave identical metrics, what the plans table says (grouped
jobs, fused trials, measured speed-up, groups kept though measured slower), and PASS/FAIL of
the default against the issue's target. Writes ``benchmarks/out/optimize_e2e-DEVICE-wW.csv``
(one row per run, then one ``median`` row per case and mode) and a ``.png`` (median ratio per
case and mode, the target drawn).

Example::

    .venv/bin/python benchmarks/optimize_e2e.py --workload a --heads 4     # 5 x 3 searches
    .venv/bin/python benchmarks/optimize_e2e.py --workload all --runs 5
    .venv/bin/python benchmarks/optimize_e2e.py --workload all --quick --runs 1   # smoke test
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

if __name__ == "__main__" and "cuda" not in sys.argv:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a worker takes the GPU when it sees one

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # retiarii and model_spaces from this checkout
sys.path.insert(0, HERE)

import retiarii as rt  # noqa: E402
from retiarii.engine.executors.local import LocalExecutor  # noqa: E402
from retiarii.engine.storage.plans_table import PlanTable  # noqa: E402
from retiarii.engine.storage.store import Store  # noqa: E402
from retiarii.refs import resolve_ref  # noqa: E402

WORKLOADS_FILE = os.path.join(HERE, "e2e_workloads.py")
MODES = {"off": False, "on": True, "auto": None}  # None: the argument is left out
METRICS = ("train_loss", "val_loss", "val_acc")
CASES = {"a": ("a4", "a8"), "b": ("b", "bfreeze"), "c64": ("c64",), "c512": ("c512",),
         "d": ("d",), "e": ("e",)}
DESCRIBE = {"a4": "4 heads on a frozen ResNet-18 trunk (train-mode BN)",
            "a8": "8 heads on a frozen ResNet-18 trunk (train-mode BN)",
            "b": "adapters after 8 blocks of a frozen MobileNetV2 (train-mode BN)",
            "bfreeze": "the same, backbone frozen with rt.freeze",
            "c64": "16 MLPs 64-64-64-10 choosing activations",
            "c512": "16 MLPs 64-512-512-10 choosing activations",
            "d": "MnasNet-like space, 64 models, JPEGs through a DataLoader",
            "e": "the demo, 16 models by random search"}
# The issue's targets for the default (auto / off, median of the runs), by (device, workers).
TARGETS = {("cpu", 1): {"a4": 2.5, "a8": 4.0, "b": 1.2, "bfreeze": 2.5, "c64": 1.5,
                        "c512": 0.95, "d": 1.5, "e": 0.97},
           ("cpu", 2): {"a4": 1.6, "a8": 2.5},
           ("cuda", 1): {"a8": 3.0}}


def _ref(name: str) -> str:
    return f"{WORKLOADS_FILE}:{name}"


def setup_case(case: str, args, folder: str) -> dict:
    """The experiment's arguments of one case, made once (data and JPEGs included)."""
    q = "_QUICK" if args.quick else ""
    s = resolve_ref(_ref("QUICK" if args.quick else "FULL"))
    if case == "e":
        return {"space": "retiarii.demo:space", "strategy": lambda: rt.strategies.Random(seed=0),
                "trainer": rt.Trainer(dataset="digits", epochs=s.e_epochs, batch_size=64),
                "models": s.e_models}
    if case == "d":
        root = resolve_ref(_ref("write_jpegs"))(os.path.join(folder, "jpegs"), s.d_per_class)
        trainer = resolve_ref(_ref("jpeg_trainer"))(root, s)
    else:
        trainer = resolve_ref(_ref(f"TRAINER_{case[0].upper()}{q}"))
    space = _ref(f"SPACE_{case.upper()}{q}")
    return {"space": space, "strategy": rt.strategies.GridSearch, "trainer": trainer,
            "models": resolve_ref(space).size()}


def run_search(case: str, mode: str, setup: dict, args, folder: str) -> dict:
    """One whole search: its wall seconds, every model's curves and the plans summary."""
    db = os.path.join(folder, f"{case}-{mode}-{time.monotonic_ns()}.db")
    kwargs = {} if MODES[mode] is None else {"optimize": MODES[mode]}
    devices = [] if args.device == "cpu" else None
    executor = None
    if args.threads is not None:  # the engine's local workers, with other torch threads
        executor = LocalExecutor(args.workers, devices, threads_per_worker=args.threads)
    exp = rt.Experiment(setup["space"], setup["strategy"](), setup["trainer"], store=db,
                        workers=args.workers, devices=devices, max_models=setup["models"],
                        seed=0, executor=executor, **kwargs)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        exp.run()
    finally:
        wall = time.perf_counter() - start
        if executor is not None:  # given, not made by the experiment: ours to close
            executor.close()
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        curves = {}
        for t in store.trials():
            key = json.dumps(t["spec"]["choices"], sort_keys=True)
            curves[key] = {m: [v for _, v in store.learning_curve(t["id"], m)] for m in METRICS}
        plans = PlanTable(store).summary()
    os.remove(db)
    return {"wall": wall, "curves": curves, "plans": plans, "load": load}


def warm_server() -> float:
    """Start the local workers' server (one per process: it imports torch and retiarii, then
    forks every worker of every search) and wait until it forked a process; its seconds.
    Untimed, so the first search measured does not carry what every later one is spared (the
    first ``off`` run of a process took 2-3 s more; ``e2e_overhead.py`` measures that cost)."""
    from retiarii.engine.executors.warm import worker_context

    start = time.perf_counter()
    child = worker_context().Process(target=os.getpid)
    child.start()
    child.join()
    return time.perf_counter() - start


def max_rel_diff(a: dict, b: dict) -> float:
    """The largest relative difference of a model's final metric between two runs; inf when
    the models or their epochs differ."""
    if a.keys() != b.keys():
        return math.inf
    worst = 0.0
    for key in a:
        for m in METRICS:
            x, y = a[key][m], b[key][m]
            if len(x) != len(y):
                return math.inf
            if x and x[-1] != y[-1]:
                worst = max(worst, abs(x[-1] - y[-1]) / max(abs(y[-1]), 1e-12))
    return worst


def plans_text(plans: dict) -> str:
    jobs = ", ".join(f"{n} {s}" for s, n in sorted(plans["jobs"].items())) or "no grouped job"
    if plans.get("fused_trials"):
        jobs += f", {plans['fused_trials']} trials fused"
    if "speedup" in plans:
        jobs += (f"; measured {plans['speedup']['median']}x median "
                 f"({plans['speedup']['min']}-{plans['speedup']['max']})")
    if plans.get("slower_kept"):
        jobs += f"; {plans['slower_kept']} kept though measured slower"
    return jobs


def _ratio(base: float, wall: float) -> float:
    return base / wall if wall > 0 else math.nan


def measure_case(case: str, args, folder: str) -> list[dict]:
    """``--runs`` interleaved rounds of the modes; the CSV rows of every run and the medians."""
    setup = setup_case(case, args, folder)
    target = TARGETS.get((args.device, args.workers), {}).get(case)
    print(f"\n== {case}: {DESCRIBE[case]}{' (quick)' if args.quick else ''}; "
          f"{setup['models']} models, workers={args.workers}, target "
          f"{'none' if target is None else f'>= {target}x'}", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in args.modes}
    for rnd in range(args.runs):
        for mode in args.modes:
            r = run_search(case, mode, setup, args, folder)
            results[mode].append(r)
            print(f"  {case} run {rnd + 1}/{args.runs} {mode:4} {r['wall']:7.2f} s "
                  f"(load {r['load']:.1f})  {plans_text(r['plans'])}", flush=True)
        med = {m: statistics.median(x["wall"] for x in results[m]) for m in args.modes}
        base = med.get("off")
        print("  medians so far: " + " | ".join(
            f"{m} {med[m]:.2f} s" + ("" if base is None or m == "off"
                                     else f" {_ratio(base, med[m]):.2f}x") for m in args.modes),
              flush=True)
    return _rows(case, setup, results, target, args)


def _rows(case: str, setup: dict, results: dict, target, args) -> list[dict]:
    """Compare metrics, print the case's summary, and make its CSV rows."""
    ref = results["off"][0]["curves"] if "off" in results else None
    base = statistics.median(r["wall"] for r in results["off"]) if "off" in results else None
    common = {"case": case, "workers": args.workers, "threads": args.threads or "default",
              "device": args.device,
              "models": setup["models"], "quick": args.quick, "target": target}
    rows, verdict = [], {}
    for mode, runs in results.items():
        first = runs[0]["curves"]
        reruns_same = all(r["curves"] == first for r in runs[1:])
        for i, r in enumerate(runs):
            same = None if ref is None else r["curves"] == ref
            rows.append({**common, "mode": mode, "run": i + 1, "wall_s": round(r["wall"], 3),
                         "ratio_to_off": None if base is None else round(_ratio(base, r["wall"]), 3),
                         "same_as_off": same,
                         "max_rel_diff_vs_off": None if ref is None else
                         float(f"{max_rel_diff(r['curves'], ref):.3g}"),
                         "same_as_first_run": r["curves"] == first,
                         "grouped_jobs": json.dumps(r["plans"]["jobs"], sort_keys=True),
                         "merged_trials": r["plans"].get("merged_trials", 0),
                         "fused_trials": r["plans"].get("fused_trials", 0),
                         "measured_speedup": (r["plans"].get("speedup") or {}).get("median"),
                         "slower_kept": r["plans"].get("slower_kept", 0),
                         "load": round(r["load"], 2), "passes": None})
        med = statistics.median(r["wall"] for r in runs)
        ratio = None if base is None else _ratio(base, med)
        diffs = [] if ref is None else [max_rel_diff(r["curves"], ref) for r in runs]
        same_all = ref is not None and all(r["curves"] == ref for r in runs)
        passes = None if target is None or ratio is None or mode != "auto" else ratio >= target
        verdict[mode] = passes
        rows.append({**rows[-1], "run": "median", "wall_s": round(med, 3),
                     "ratio_to_off": None if ratio is None else round(ratio, 3),
                     "same_as_off": None if ref is None else same_all,
                     "max_rel_diff_vs_off": max(diffs) if diffs else None,
                     "same_as_first_run": reruns_same,
                     "measured_speedup": _median([r["plans"].get("speedup", {}).get("median")
                                                  for r in runs]),
                     "slower_kept": sum(r["plans"].get("slower_kept", 0) for r in runs),
                     "load": round(statistics.median(r["load"] for r in runs), 2),
                     "passes": passes})
        vs_off = ("" if ref is None or mode == "off" else
                  "; metrics vs off: " + ("bit-identical" if same_all else
                                          f"differ, max relative {max(diffs):.2g}"))
        print(f"{case} {mode:4} median {med:7.2f} s"
              + ("" if ratio is None else f"  {ratio:.2f}x of off")
              + f"  reruns identical: {'yes' if reruns_same else 'no'}{vs_off}"
              + ("" if passes is None else f"  target >= {target}x: {'PASS' if passes else 'FAIL'}"),
              flush=True)
    return rows


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def write(rows: list[dict], args) -> None:
    """The CSV and the figure: the median ratio per case and mode, the target marked."""
    import _out

    if args.out:
        _out.OUT = args.out
    name = f"optimize_e2e-{args.device}-w{args.workers}" + ("-quick" if args.quick else "")
    path = _out.write_csv(rows, name)
    plt = _out.pyplot()
    if plt is None:
        print(f"wrote {path}")
        return
    medians = [r for r in rows if r["run"] == "median" and r["mode"] != "off"]
    cases = list(dict.fromkeys(r["case"] for r in medians))
    modes = [m for m in args.modes if m != "off"]
    fig, ax = plt.subplots(figsize=(1.3 * len(cases) + 2.5, 4))
    width = 0.8 / max(len(modes), 1)
    for k, mode in enumerate(modes):
        xs = [i + width * (k - (len(modes) - 1) / 2) for i in range(len(cases))]
        ys = [next((r["ratio_to_off"] or 0 for r in medians
                    if r["case"] == c and r["mode"] == mode), 0) for c in cases]
        ax.bar(xs, ys, width=width, label="optimize=True" if mode == "on" else "default (auto)")
    for i, c in enumerate(cases):
        target = TARGETS.get((args.device, args.workers), {}).get(c)
        if target is not None:
            ax.hlines(target, i - 0.45, i + 0.45, colors="red",
                      label="target" if i == next(j for j, x in enumerate(cases) if TARGETS.get(
                          (args.device, args.workers), {}).get(x) is not None) else None)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("median speed-up over optimize=False")
    ax.set_title(f"Whole searches, workers={args.workers}, {args.device}, median of {args.runs}"
                 + (" (quick)" if args.quick else ""))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(_out.OUT, f"{name}.png"), dpi=100)
    plt.close(fig)
    print(f"wrote {path} and .png")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", nargs="+", choices=[*CASES, "all"], default=["all"])
    p.add_argument("--heads", type=int, nargs="+", choices=[4, 8], default=[4, 8],
                   help="workload a's N (default both)")
    p.add_argument("--runs", type=int, default=5, help="interleaved runs per mode (median)")
    p.add_argument("--workers", type=int, choices=[1, 2], default=1)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per worker (default: the engine's, cores // workers); "
                        "1 keeps a machine other jobs load from thrashing")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes (few models, 1 epoch, small images): a smoke test")
    p.add_argument("--out", help="folder of the CSV and PNG (default benchmarks/out)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    names = list(CASES) if "all" in args.workload else args.workload
    cases = [c for w in names for c in CASES[w] if w != "a" or int(c[1:]) in args.heads]
    import torch

    print(f"whole searches: {', '.join(cases)}; modes {', '.join(args.modes)}; {args.runs} runs "
          f"each, workers={args.workers}, threads {args.threads or 'default'}, {args.device}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    folder = tempfile.mkdtemp(prefix="optimize_e2e-")
    rows: list[dict] = []
    try:
        print(f"  workers' server started (untimed): {warm_server():.2f} s", flush=True)
        if args.device == "cuda":  # untimed: the workers' CUDA and cuDNN start (an H200 took
            # 16.5 s for a8's first search, 3.7 s for the next: the median of 3 carried it)
            warm = run_search(cases[0], "off", setup_case(cases[0], args, folder), args, folder)
            print(f"  warm-up search (untimed): {warm['wall']:.2f} s", flush=True)
        for case in cases:
            rows += measure_case(case, args, folder)
            write(rows, args)  # after every case: a long run keeps what it measured
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("\nsummary (default vs off, median):")
    for r in rows:
        if r["run"] == "median" and r["mode"] == "auto":
            verdict = "no target" if r["passes"] is None else ("PASS" if r["passes"] else "FAIL")
            print(f"  {r['case']:8} {r['ratio_to_off']}x (target {r['target']}): {verdict}")


if __name__ == "__main__":
    main()
