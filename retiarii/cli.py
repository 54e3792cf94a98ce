"""The ``retiarii`` command: run, status, resume, export, plot.

Example::

    retiarii run demo --max-models 30 --workers 2 --store runs/demo.db
    retiarii status runs/demo.db
    retiarii export runs/demo.db --top 3 --out best/
    retiarii plot runs/demo.db --out demo.png
    retiarii resume runs/demo.db

``run SPACE`` takes ``demo`` or a Python file that defines a module-level ``space`` (a
ModelSpace) and, optionally, ``trainer`` (default: the classifier trainer on digits) and
``strategy``. Every command documents its flags with ``--help``; docs/cli.md lists them all.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

STRATEGIES = ("random", "grid", "evolution", "rl", "tpe")
SCHEDULERS = ("none", "asha", "median")


# ---- building an experiment from flags (run) or from the store (resume) -------------------------


def _strategy(name: str, seed: int):
    from . import strategies as s

    factories = {"random": lambda: s.Random(seed=seed), "grid": lambda: s.GridSearch(seed=seed),
                 "evolution": lambda: s.RegularizedEvolution(population_size=16, sample_size=4,
                                                             seed=seed),
                 "rl": lambda: s.PolicyBasedRL(seed=seed), "tpe": lambda: s.TPE(seed=seed)}
    return factories[name]()


def _scheduler(name: str, epochs: int, metric: str):
    from . import strategies as s

    if name == "asha":
        return s.ASHA(metric=metric, mode="max", grace_period=1, max_t=epochs, reduction_factor=2)
    if name == "median":
        return s.MedianStopping(metric=metric, mode="max", grace_period=1,
                                min_samples_required=3)
    return None


def _load_space_file(ref: str) -> tuple[str, Any]:
    """(reference of the file's module, the module)."""
    from .refs import load_file_module

    if ref == "demo":
        import retiarii.demo as module

        return "retiarii.demo", module
    path = os.path.abspath(ref)
    if not os.path.isfile(path):
        raise SystemExit(f"retiarii run: {ref} is neither 'demo' nor a Python file")
    return path, load_file_module(path)  # loaded as a module, as the workers will load it


def _build(space_arg: str, flags: dict):
    """An Experiment from the CLI flags (also what `resume` rebuilds from the store)."""
    from .engine.experiment import Experiment
    from .engine.trainer import ClassifierTrainer

    ref, module = _load_space_file(space_arg)
    if not hasattr(module, "space"):
        raise SystemExit(f"retiarii run: {space_arg} defines no module-level `space`")
    trainer = getattr(module, "trainer", None) or ClassifierTrainer(dataset="digits",
                                                                     epochs=flags["epochs"])
    strategy = _strategy(flags["strategy"], flags["seed"]) if flags["strategy"] else \
        getattr(module, "strategy", None) or _strategy("evolution", flags["seed"])
    scheduler = _scheduler(flags["scheduler"], trainer.epochs, "val_acc")
    return Experiment(f"{ref}:space", strategy, trainer, store=flags["store"],
                      workers=flags["workers"], max_models=flags["max_models"],
                      seed=flags["seed"], scheduler=scheduler,
                      progress=_Progress(flags["max_models"]),
                      origin={"cli": {"space": space_arg, **flags}})


class _Progress:
    """A one-line progress bar with the best value so far, redrawn after each trial."""

    def __init__(self, total: int | None):
        self.total = total
        self.tty = sys.stderr.isatty()

    def __call__(self, summary: dict) -> None:
        done = sum(v for k, v in summary["trials"].items() if k in ("TERMINATED", "ERRORED"))
        total = self.total or max(done, 1)
        width = 30
        filled = min(width, int(width * done / total))
        best = summary["best"][0]["value"] if summary["best"] else float("nan")
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} trials done, "
                f"{summary['trials'].get('RUNNING', 0)} running, best {best:.4f}")
        print(("\r" if self.tty else "") + line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)


def _table(rows: list[list], headers: list[str]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _best_table(best: list[dict]) -> str:
    rows = [[i + 1, b["model_id"], b["trial_id"], f"{b['value']:.4f}", b["step"],
             json.dumps(b["sample"])[:90]] for i, b in enumerate(best)]
    return _table(rows, ["rank", "model", "trial", "value", "epoch", "sample"])


# ---- commands ---------------------------------------------------------------------------------


def cmd_run(args) -> int:
    flags = {"strategy": args.strategy, "seed": args.seed, "max_models": args.max_models,
             "workers": args.workers, "store": args.store, "epochs": args.epochs,
             "scheduler": args.scheduler}
    exp = _build(args.space, flags)
    summary = exp.run()
    print(file=sys.stderr)
    print(_best_table(summary["best"]))
    print(f"\nstore: {exp.path}   (retiarii status {exp.path})")
    return 0


def cmd_resume(args) -> int:
    from .engine.store import Store

    with Store(args.db) as store:
        experiments = store.experiments()
    if not experiments:
        raise SystemExit(f"retiarii resume: {args.db} holds no experiment")
    try:
        cli = dict(experiments[-1]["config"]["origin"]["cli"])
    except (KeyError, TypeError):
        raise SystemExit(f"retiarii resume: the last experiment of {args.db} was started from "
                         f"Python, not from `retiarii run`; resume it with "
                         f"Experiment(...same arguments...).resume()") from None
    space = cli.pop("space")
    if args.workers:
        cli["workers"] = args.workers
    exp = _build(space, cli)
    summary = exp.resume()
    print(file=sys.stderr)
    print(_best_table(summary["best"]))
    return 0


def _open(db: str):
    from .engine.store import Store

    if not os.path.isfile(db):
        raise SystemExit(f"retiarii: {db} does not exist")
    store = Store(db)
    experiments = store.experiments()
    if not experiments:
        raise SystemExit(f"retiarii: {db} holds no experiment")
    store.use_experiment(experiments[-1]["id"])
    return store


def cmd_status(args) -> int:
    store = _open(args.db)
    exp = store.get_experiment()
    metric, mode = exp["config"].get("metric", "val_acc"), exp["config"].get("mode", "max")
    out = {"store": args.db, "experiment": exp["id"], "status": exp["status"],
           "seed": exp["seed"], "trials": store.counts_by_state(),
           "models": len(store.models()), "best": store.best_models(metric, mode, args.top)}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.db}: experiment {out['experiment']} ({out['status']}), {out['models']} models")
    print(_table([[k, v] for k, v in out["trials"].items()], ["state", "trials"]))
    print(f"\nbest by {metric} ({mode}):")
    print(_best_table(out["best"]))
    return 0


def cmd_export(args) -> int:
    import torch

    from .engine.checkpoint import load as load_checkpoint
    from .graph import Graph
    from .refs import RefError, TrustedRefs, only_trusted

    store = _open(args.db)
    exp = store.get_experiment()
    metric, mode = exp["config"].get("metric", "val_acc"), exp["config"].get("mode", "max")
    # A store is code: its graphs may name only torch, operator, math and the space's own code.
    rule = TrustedRefs((exp["config"].get("space") or {}).get("ref"))
    os.makedirs(args.out, exist_ok=True)
    for rank, best in enumerate(store.best_models(metric, mode, args.top), 1):
        model = store.get_model(best["model_id"])
        name = f"model_{best['model_id']}"
        try:
            with only_trusted(rule):
                graph = Graph.from_data(model["graph"])
                _check_attributes(graph, rule)
                source = graph.to_source(f"Model{best['model_id']}")
        except RefError as e:
            raise SystemExit(f"retiarii export: model {best['model_id']} of {args.db}: "
                             f"{e}") from None
        with open(os.path.join(args.out, name + ".py"), "w") as f:
            f.write(source)
        ckpt = store.last_checkpoint(best["trial_id"])
        if ckpt is not None:
            torch.save(load_checkpoint(ckpt["path"])["model"], os.path.join(args.out, name + ".pt"))
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump({"rank": rank, metric: best["value"], "sample": best["sample"],
                       "hash": best["hash"]}, f, indent=2)
        print(f"{rank}. {name}.py, {name}.pt  ({metric} {best['value']:.4f})")
    return 0


def _check_attributes(graph, rule) -> None:
    """Refuse the method calls and attribute reads of a stored graph that reach dunders
    (``x.__class__``...): the way out of the references the trust rule allows."""
    import builtins

    from .refs import resolve_ref

    for node in graph.nodes:
        op = node.op
        if op.kind == "method":
            rule.check_attribute(op.target, f"node {node.name}: method")
        elif op.kind == "function" and resolve_ref(op.target) is builtins.getattr:
            rule.check_attribute(op.args[1] if len(op.args) > 1 else None,
                                 f"node {node.name}: attribute")
        elif op.kind == "subgraph" and op.graph is not None:
            _check_attributes(op.graph, rule)


def cmd_plot(args) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    store = _open(args.db)
    exp = store.get_experiment()
    metric, mode = exp["config"].get("metric", "val_acc"), exp["config"].get("mode", "max")
    better = max if mode == "max" else min
    finals = store.final_values(metric)  # (trial_id, end time, value) in end order
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    best, ys, ts = None, [], []
    t0 = finals[0][1] if finals else 0.0
    for _, end, value in finals:
        best = value if best is None else better(best, value)
        ys.append(best)
        ts.append(end - t0)
    axes[0].plot(range(1, len(ys) + 1), ys, drawstyle="steps-post", marker=".")
    axes[0].set(xlabel="models trained", ylabel=f"best {metric}", title="best so far")
    axes[1].plot(ts, ys, drawstyle="steps-post", marker=".")
    axes[1].set(xlabel="wall time (s)", ylabel=f"best {metric}", title="best so far")
    for curve in store.learning_curves(metric).values():
        axes[2].plot([s for s, _ in curve], [v for _, v in curve], alpha=0.4, lw=1)
    axes[2].set(xlabel="epoch", ylabel=metric, title="learning curves")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="retiarii", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="search a space: `demo` or a .py file defining `space`")
    run.add_argument("space", help="'demo' or a Python file with a module-level `space`")
    run.add_argument("--strategy", choices=STRATEGIES, default=None,
                     help="exploration strategy (default: the file's `strategy`, else evolution)")
    run.add_argument("--max-models", type=int, default=30, help="models to train (default 30)")
    run.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    run.add_argument("--store", default="runs/demo.db", help="SQLite file (default runs/demo.db)")
    run.add_argument("--seed", type=int, default=0, help="seed of the search and of the trials")
    run.add_argument("--epochs", type=int, default=5,
                     help="epochs per model for the default trainer (default 5)")
    run.add_argument("--scheduler", choices=SCHEDULERS, default="none",
                     help="early stopping: none, asha or median (default none)")
    run.set_defaults(fn=cmd_run)

    status = sub.add_parser("status", help="trials by state and the best models of a store")
    status.add_argument("db", help="the SQLite file of a run")
    status.add_argument("--top", type=int, default=10, help="best models to list (default 10)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(fn=cmd_status)

    resume = sub.add_parser("resume", help="continue a run after Ctrl-C, a crash or SIGKILL")
    resume.add_argument("db", help="the SQLite file of a run started with `retiarii run`")
    resume.add_argument("--workers", type=int, default=None, help="override the worker count")
    resume.set_defaults(fn=cmd_resume)

    export = sub.add_parser("export", help="standalone .py + state_dict of the best models")
    export.add_argument("db", help="the SQLite file of a run")
    export.add_argument("--top", type=int, default=3, help="how many models (default 3)")
    export.add_argument("--out", required=True, help="output folder")
    export.set_defaults(fn=cmd_export)

    plot = sub.add_parser("plot", help="best-so-far curves and learning curves to a PNG")
    plot.add_argument("db", help="the SQLite file of a run")
    plot.add_argument("--out", required=True, help="the PNG file to write")
    plot.set_defaults(fn=cmd_plot)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("\ninterrupted; continue with: retiarii resume " +
              getattr(args, "store", getattr(args, "db", "")), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
