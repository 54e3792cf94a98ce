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

from .cli_one_shot import ONE_SHOT

STRATEGIES = ("random", "grid", "evolution", "rl", "tpe", "predictor", *ONE_SHOT)
SCHEDULERS = ("none", "asha", "median")


class CliError(Exception):
    """A problem the user can fix: printed as one line (culprit and fix), exit status 2."""


# ---- building an experiment from flags (run) or from the store (resume) -------------------------


def _strategy(name: str, seed: int, epochs: int | None = None):
    from . import strategies as s

    if name in ONE_SHOT:
        from .cli_one_shot import one_shot_strategy

        return one_shot_strategy(name, epochs, seed, CliError)

    factories = {"random": lambda: s.Random(seed=seed), "grid": lambda: s.GridSearch(seed=seed),
                 "evolution": lambda: s.RegularizedEvolution(population_size=16, sample_size=4,
                                                             seed=seed),
                 "rl": lambda: s.PolicyBasedRL(seed=seed), "tpe": lambda: s.TPE(seed=seed),
                 "predictor": lambda: s.Predictor(seed=seed)}
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
        raise CliError(f"{ref} is neither 'demo' nor a Python file: give the path of a .py "
                       f"file that defines a module-level `space`")
    try:
        # loaded as the module the workers will load too
        return path, load_file_module(path)
    except SyntaxError as err:
        raise CliError(f"{ref} line {err.lineno}: syntax error ({err.msg}); fix the space "
                       f"file") from None
    except Exception as err:  # noqa: BLE001 (the user's code failed while it was imported)
        raise CliError(f"{ref} failed while it was imported: {type(err).__name__}: {err}; "
                       f"run `python {ref}` to see the traceback") from None


def _space_for_store(space: str, store: str) -> str:
    """The space argument as a store records it: a file relative to the store's folder, so
    that the run directory can be moved or copied with its space file and resumed."""
    if space == "demo":
        return space
    return os.path.relpath(os.path.abspath(space), os.path.dirname(os.path.abspath(store)))


def _space_from_store(space: str, store: str) -> str:
    """The space file a store recorded, found relative to the store (older stores recorded
    it relative to the directory `run` was started in: tried next)."""
    if space == "demo" or os.path.isabs(space):
        return space
    beside = os.path.join(os.path.dirname(os.path.abspath(store)), space)
    if os.path.isfile(beside) or not os.path.isfile(space):
        return beside
    return space


def _build(space_arg: str, flags: dict, recorded_space: str):
    """An Experiment from the CLI flags (also what `resume` rebuilds from the store);
    ``recorded_space`` is the space argument as the store keeps it."""
    from .engine.experiment import Experiment
    from .engine.trainer import ClassifierTrainer

    ref, module = _load_space_file(space_arg)
    if not hasattr(module, "space"):
        raise CliError(f"{space_arg} defines no module-level `space`: add `space = "
                       f"rt.ModelSpace(...)` at the top level of the file")
    trainer = getattr(module, "trainer", None)
    one_shot_flag = flags["strategy"] in ONE_SHOT
    if trainer is not None and flags.get("epochs") is not None and not one_shot_flag:
        raise CliError(f"--epochs applies to the default trainer, but {space_arg} defines its "
                       f"own `trainer`: set its epochs there, or leave --epochs out")
    if trainer is None:
        # a one-shot strategy's --epochs are its segments; its trainer gives the batches
        epochs = None if one_shot_flag else flags.get("epochs")
        trainer = ClassifierTrainer(dataset="digits", epochs=5 if epochs is None else epochs)
    strategy = getattr(module, "strategy", None)
    if isinstance(strategy, str):
        raise CliError(f"{space_arg} sets `strategy = {strategy!r}`, a string: assign a strategy "
                       f"object (e.g. rt.strategies.Random(seed=0)), or drop it and pass "
                       f"--strategy {strategy}")
    strategy = _strategy(flags["strategy"], flags["seed"], flags.get("epochs")) \
        if flags["strategy"] else strategy or _strategy("evolution", flags["seed"])
    one_shot = getattr(strategy, "one_shot", False) or bool(flags.get("weight_sharing"))
    max_models = flags["max_models"]
    if one_shot and max_models is not None:
        raise CliError("--max-models applies to multi-trial searches; a one-shot search's "
                       "segments decide how many models it evaluates: leave it out")
    if not one_shot and max_models is None:
        max_models = 30
    ranks = flags.get("ranks") or 1
    if ranks > 1 and not one_shot:
        raise CliError(f"--ranks {ranks} runs each segment of a one-shot search on several "
                       f"ranks: give a one-shot --strategy (spos, enas) or --weight-sharing")
    shared = flags.get("shared")
    weight_sharing = bool(flags.get("weight_sharing"))
    if shared:
        if weight_sharing:
            weight_sharing = list(shared)
        elif flags["strategy"] in ("spos", "enas"):
            from .strategies.shared_training import check_shared

            strategy.shared = check_shared(type(strategy).__name__, shared)
        else:
            raise CliError("--shared annotates the operators whose weights are shared: give it "
                           "with --weight-sharing or --strategy spos / enas")
    if one_shot and flags["scheduler"] != "none":
        raise CliError(f"--scheduler {flags['scheduler']}: a one-shot search trains one "
                       f"super-network, no trial to stop early; leave --scheduler out")
    scheduler = _scheduler(flags["scheduler"], trainer.epochs, "val_acc")
    executor = flags.get("executor") or "local"  # stores from before --executor: local
    if flags.get("address"):
        if executor != "ray":
            raise CliError("--address names a Ray cluster: add --executor ray")
        from .engine.executors.ray import RayExecutor

        # connects on first use, disconnects at exit (RayExecutor.close runs at exit)
        executor = RayExecutor(flags["workers"], address=flags["address"], ranks=ranks)
    return Experiment(f"{ref}:space", strategy, trainer, store=flags["store"],
                      workers=flags["workers"], max_models=max_models,
                      seed=flags["seed"], scheduler=scheduler, executor=executor,
                      optimize={**_OPTIMIZE, "pack": "pack"}[flags.get("optimize") or "auto"],
                      packing=_OPTIMIZE[flags.get("packing") or "auto"],
                      batch_models=flags.get("batch_models") or 8,
                      # left out (None): "auto" under --optimize auto, else off
                      fuse=_OPTIMIZE[flags["fuse"]] if flags.get("fuse") else None,
                      batching=_OPTIMIZE[flags["batching"]] if flags.get("batching") else None,
                      progress=_Progress(max_models),
                      weight_sharing=weight_sharing, ranks=ranks,
                      device_memory=flags.get("device_memory"),
                      origin={"cli": {"space": recorded_space, **flags}})


_OPTIMIZE = {"auto": "auto", "on": True, "off": False}  # --optimize, --fuse: Experiment(...)


class _Progress:
    """A one-line progress bar with the best value so far, redrawn after each trial."""

    def __init__(self, total: int | None):
        self.total = total
        self.tty = sys.stderr.isatty()

    def __call__(self, summary: dict) -> None:
        if "one_shot" in summary:
            from .cli_one_shot import progress_line

            print(progress_line(summary), file=sys.stderr, flush=True)
            return
        done = sum(v for k, v in summary["trials"].items() if k in ("TERMINATED", "ERRORED"))
        total = self.total or max(done, 1)
        width = 30
        filled = min(width, int(width * done / total))
        # summary["best"] ranks finished trials only: the best never goes down
        best = f"{summary['best'][0]['value']:.4f}" if summary["best"] else "-"
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} trials done, "
                f"{summary.get('running', 0)} running, best {best}")
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


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise CliError(f"{flag} must be 1 or more, got {value}")


def cmd_run(args) -> int:
    _positive(args.workers, "--workers")
    _positive(args.max_models, "--max-models")
    _positive(args.epochs, "--epochs")
    _positive(args.batch_models, "--batch-models")
    _positive(args.ranks, "--ranks")
    flags = {"strategy": args.strategy, "seed": args.seed, "max_models": args.max_models,
             "workers": args.workers, "store": args.store, "epochs": args.epochs,
             "scheduler": args.scheduler, "executor": args.executor, "address": args.address,
             "optimize": args.optimize, "batch_models": args.batch_models, "fuse": args.fuse,
             "weight_sharing": args.weight_sharing, "ranks": args.ranks,
             "batching": args.batching, "packing": args.packing,
             "device_memory": args.device_memory, "shared": args.shared}
    exp = _build(args.space, flags, recorded_space=_space_for_store(args.space, args.store))
    summary = exp.run()
    print(file=sys.stderr)
    _print_best(summary)
    print(f"\nstore: {exp.path}   (retiarii status {exp.path})")
    return 0


def cmd_resume(args) -> int:
    _positive(args.workers, "--workers")
    _positive(args.max_models, "--max-models")
    store = _open(args.db)
    try:
        origin = store.get_experiment()["config"].get("origin") or {}
    finally:
        store.close()
    if "nas" in origin:  # `retiarii nas run NAME`: the row rebuilds it
        from .cli_nas import resume_nas

        return resume_nas(dict(origin["nas"]), args)
    try:
        cli = dict(origin["cli"])
    except (KeyError, TypeError):
        raise CliError(f"the last experiment of {args.db} was started from Python, not from "
                       f"`retiarii run`; resume it with Experiment(...same arguments...)"
                       f".resume()") from None
    recorded = cli.pop("space")
    space = _space_from_store(recorded, args.db)
    cli["store"] = args.db  # the store given is the store resumed (a copy resumes the copy)
    if args.workers:
        cli["workers"] = args.workers
    if args.max_models:
        cli["max_models"] = args.max_models  # a budget may change between runs
    if args.address:
        cli["address"] = args.address  # the cluster's head may have moved
    exp = _build(space, cli, recorded_space=recorded)
    summary = exp.resume()
    print(file=sys.stderr)
    _print_best(summary)
    return 0


def _print_best(summary: dict) -> None:
    if "one_shot" in summary:
        from .cli_one_shot import print_result

        print_result(summary, _table)
    else:
        print(_best_table(summary["best"]))


def _open(db: str):
    """The store ``db`` (which must exist: nothing is created), on its latest experiment."""
    from .engine.store import Store

    if not os.path.exists(db):
        raise CliError(f"{db} does not exist: give the SQLite file of a run (retiarii run "
                       f"... --store FILE)")
    if not os.path.isfile(db):
        raise CliError(f"{db} is not a file: give the SQLite file of a run")
    if not os.access(db, os.R_OK):
        raise CliError(f"{db}: permission denied: make it readable "
                       f"(e.g. chmod u+r {db})")
    store = Store(db)
    experiments = store.experiments()
    if not experiments:
        store.close()
        raise CliError(f"{db} holds no experiment: start one with `retiarii run`")
    store.use_experiment(experiments[-1]["id"])
    return store


def _metric(store) -> tuple[str, str]:
    config = store.get_experiment()["config"]
    return config.get("metric", "val_acc"), config.get("mode", "max")


def cmd_status(args) -> int:
    from .cli_one_shot import is_one_shot, print_status

    store = _open(args.db)
    exp = store.get_experiment()
    if is_one_shot(exp["config"]):
        print_status(store, args.db, args.json, _table)
        return 0
    metric, mode = _metric(store)
    errored = [t for t in store.trials() if t["state"] == "ERRORED"]
    out = {"store": args.db, "experiment": exp["id"], "status": exp["status"],
           "seed": exp["seed"], "trials": store.counts_by_state(),
           "models": len(store.models()), "best": store.best_models(metric, mode, args.top),
           "errors": [{"trial_id": t["id"], "model_id": t["model_id"],
                       "error": t["error"] or ""} for t in errored]}
    from .engine.plans import PlanTable

    plans = PlanTable(store).summary()
    if plans["jobs"]:
        out["optimization"] = plans
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.db}: experiment {out['experiment']} ({out['status']}), {out['models']} models")
    print(_table([[k, v] for k, v in out["trials"].items()], ["state", "trials"]))
    print(f"\nbest by {metric} ({mode}):")
    print(_best_table(out["best"]) if out["best"] else "(no finished result yet)")
    if errored:
        print(f"\nerrored trials ({len(errored)}):")
        for e in out["errors"]:
            lines = e["error"].strip().splitlines() or ["(no reason recorded)"]
            if args.errors:
                print(f"- {e['trial_id']} (model {e['model_id']}):")
                print("    " + "\n    ".join(lines))
            else:
                print(f"- {e['trial_id']} (model {e['model_id']}): {_reason(lines)}")
        if not args.errors:
            print("(retiarii status --errors shows each whole traceback)")
    if "optimization" in out:
        print("\n" + _optimization_line(out["optimization"]))
    return 0


def _optimization_line(plans: dict) -> str:
    """One paragraph on cross-model optimization: grouped jobs, merged models, speed-up."""
    jobs = ", ".join(f"{n} {status}" for status, n in sorted(plans["jobs"].items()))
    text = f"cross-model optimization: grouped jobs {jobs}; {plans['merged_trials']} trials trained merged"
    if "speedup" in plans:
        s = plans["speedup"]
        text += (f"; measured speed-up {s['median']}x (median of {s['measured_jobs']} jobs, "
                 f"{s['min']}x-{s['max']}x)")
    if plans.get("fused_trials"):
        text += f"; {plans['fused_trials']} trained fused"
    if plans.get("unfused_after_revert"):
        text += f"; fusion reverted for {plans['unfused_after_revert']}"
    if plans.get("alone_after_revert_or_failure"):
        text += f"; {plans['alone_after_revert_or_failure']} trials train alone after a revert or failure"
    for line in plans.get("layouts", []):
        text += f"\n  layout {line}"
    packing = plans.get("packing")
    if packing:
        text += (f"\n  packing: {packing['packs']} packs, {packing['models_per_pack']} models per "
                 f"pack (median), slowest slot {packing['balance']}x the mean (median)")
        if packing.get("unmerged_packs"):
            text += f"; {packing['unmerged_packs']} packed without merging"
    for why in plans.get("why_not_merged", []):
        text += f"\n  apart: {why}"
    return text


def _reason(lines: list[str]) -> str:
    """The line of an error that says what happened: a traceback's last line, else the
    first."""
    if lines[0].startswith("Traceback"):
        return lines[-1]
    return lines[0]


def cmd_export(args) -> int:
    import torch

    from .engine.checkpoint import CheckpointError
    from .engine.checkpoint import load as load_checkpoint
    from .graph import Graph
    from .refs import RefError, TrustedRefs, only_trusted

    _positive(args.top, "--top")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise CliError(f"--out {args.out} is a file; give a folder (created if missing)")
    store = _open(args.db)
    from .cli_one_shot import export, is_one_shot

    if is_one_shot(store.get_experiment()["config"]):
        return export(store, args.db, args.out, CliError, _check_attributes)
    metric, mode = _metric(store)
    # A store is code: its graphs may name only torch, operator, math and the space's own code.
    rule = TrustedRefs((store.get_experiment()["config"].get("space") or {}).get("ref"))
    best = store.best_models(metric, mode, args.top)
    if not best:
        raise CliError(f"{args.db} has no model with a result yet: nothing to export")
    os.makedirs(args.out, exist_ok=True)
    for rank, row in enumerate(best, 1):
        model = store.get_model(row["model_id"])
        name = f"model_{row['model_id']}"
        try:
            with only_trusted(rule):
                graph = Graph.from_data(model["graph"])
                _check_attributes(graph, rule)
                source = graph.to_source(f"Model{row['model_id']}")
        except RefError as e:
            raise CliError(f"model {row['model_id']} of {args.db}: {e}") from None
        with open(os.path.join(args.out, name + ".py"), "w") as f:
            f.write(source)
        files = f"{name}.py"
        ckpt = store.last_checkpoint(row["trial_id"])
        if ckpt is not None:
            try:
                weights = load_checkpoint(ckpt["path"])["model"]
            except (CheckpointError, OSError, KeyError) as err:
                print(f"warning: {name}: its checkpoint {ckpt['path']} cannot be read ({err}); "
                      f"exported without weights", file=sys.stderr)
            else:
                torch.save(weights, os.path.join(args.out, name + ".pt"))
                files += f", {name}.pt"
        with open(os.path.join(args.out, name + ".json"), "w") as f:
            json.dump({"rank": rank, metric: row["value"], "sample": row["sample"],
                       "hash": row["hash"]}, f, indent=2)
        print(f"{rank}. {files}  ({metric} {row['value']:.4f})")
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
    from matplotlib.ticker import MaxNLocator

    if os.path.isdir(args.out):
        raise CliError(f"--out {args.out} is a folder; give the PNG file to write")
    store = _open(args.db)
    from .cli_one_shot import is_one_shot, plot

    if is_one_shot(store.get_experiment()["config"]):
        plot(store, args.db, args.out, plt, CliError)
        print(f"wrote {args.out}")
        return 0
    metric, mode = _metric(store)
    better = max if mode == "max" else min
    finals = [f for f in store.final_values(metric) if f[2] is not None]
    curves = {t: c for t, c in store.learning_curves(metric).items() if c}
    if not finals and not curves:
        raise CliError(f"{args.db} has no {metric} values yet: nothing to plot")
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
    for curve in curves.values():
        # markers: a trial stopped after one epoch is a single point, invisible as a line
        axes[2].plot([s for s, _ in curve], [v for _, v in curve], alpha=0.4, lw=1,
                     marker=".", markersize=4)
    axes[2].set(xlabel="epoch", ylabel=metric, title="learning curves")
    for ax in (axes[0], axes[2]):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # models and epochs count
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0


def parser() -> argparse.ArgumentParser:
    from .cli_nas import cmd_nas_list, cmd_nas_run, cmd_nas_show

    p = argparse.ArgumentParser(prog="retiarii", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="search a space: `demo` or a .py file defining `space`")
    run.add_argument("space", help="'demo' or a Python file with a module-level `space`")
    run.add_argument("--strategy", choices=STRATEGIES, default=None,
                     help="exploration strategy (default: the file's `strategy`, else "
                          "evolution); darts, gumbel, proxyless, spos and enas are one-shot "
                          "(docs/weight_sharing.md)")
    run.add_argument("--weight-sharing", action="store_true",
                     help="train the models a multi-trial strategy proposes on one "
                          "super-network's shared weights (a one-shot search)")
    run.add_argument("--ranks", type=int, default=1,
                     help="one-shot searches: run each segment on K local ranks with mixed "
                          "parallelism, each rank training its own sampled model (default 1)")
    run.add_argument("--shared", action="append", default=None, metavar="PATTERN",
                     help="with --weight-sharing or --strategy spos/enas: share the weights of "
                          "the operators whose module path matches (fnmatch, repeatable); the "
                          "others are private to each architecture (default: all shared)")
    run.add_argument("--device-memory", default=None, metavar="SIZE",
                     help="one-shot searches (spos, enas): bytes of a device the shared weights "
                          "may take, e.g. 20GiB; a larger super-graph is split over the ranks")
    run.add_argument("--max-models", type=int, default=None,
                     help="models to train (default 30; not for one-shot searches)")
    run.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    run.add_argument("--store", default="runs/demo.db", help="SQLite file (default runs/demo.db)")
    run.add_argument("--seed", type=int, default=0, help="seed of the search and of the trials")
    run.add_argument("--epochs", type=int, default=None,
                     help="epochs per model for the default trainer (default 5); an error "
                          "when the space file defines its own `trainer`; for a one-shot "
                          "--strategy, its segments (default 5)")
    run.add_argument("--scheduler", choices=SCHEDULERS, default="none",
                     help="early stopping: none, asha or median (default none)")
    run.add_argument("--executor", choices=("local", "ray"), default="local",
                     help="where models train: local processes, or Ray actors (docs/ray.md)")
    run.add_argument("--optimize", choices=(*_OPTIMIZE, "pack"), default="auto",
                     help="cross-model optimization: models reading the same batches train as "
                          "one job, kept when measured faster (auto, the default), always (on), "
                          "or never (off); pack: packed into jobs but each trained alone (a "
                          "baseline): see docs/optimization.md")
    run.add_argument("--packing", choices=tuple(_OPTIMIZE), default="auto",
                     help="with --optimize: split each batch of models over the workers by "
                          "their profiles (similar ones together, workers equally busy, within "
                          "memory): on, off (as evenly as they go), auto (on when workers use GPUs)")
    run.add_argument("--batch-models", type=int, default=8,
                     help="the most models one job trains when optimizing (default 8)")
    run.add_argument("--fuse", choices=tuple(_OPTIMIZE), default=None,
                     help="with --optimize: models of one architecture in a job train as one "
                          "fused model when measured faster (auto: the default under --optimize "
                          "auto), always (on), or never (off: results bit for bit; the default "
                          "under --optimize on): see docs/optimization.md")
    run.add_argument("--batching", choices=tuple(_OPTIMIZE), default=None,
                     help="with --optimize: frozen layers fed other values by each model run once "
                          "on their inputs concatenated, when measured faster (auto: the default "
                          "under --optimize auto), always (on), or never (off; the default under "
                          "--optimize on): see docs/optimization.md")
    run.add_argument("--address", default=None,
                     help="with --executor ray: the Ray cluster to use (default: a private "
                          "local Ray instance)")
    run.set_defaults(fn=cmd_run)

    status = sub.add_parser("status", help="trials by state and the best models of a store")
    status.add_argument("db", help="the SQLite file of a run")
    status.add_argument("--top", type=int, default=10, help="best models to list (default 10)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--errors", action="store_true",
                        help="show each ERRORED trial's whole traceback (default: one line)")
    status.set_defaults(fn=cmd_status)

    resume = sub.add_parser("resume", help="continue a run after Ctrl-C, a crash or SIGKILL")
    resume.add_argument("db", help="the SQLite file of a run started with `retiarii run`")
    resume.add_argument("--workers", type=int, default=None, help="override the worker count")
    resume.add_argument("--max-models", type=int, default=None,
                        help="a new model budget (default: the one the run was started with)")
    resume.add_argument("--address", default=None,
                        help="the Ray cluster to continue on, for runs started with --executor "
                             "ray (default: the address the run was started with)")
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

    nas = sub.add_parser("nas", help="the 27 NAS solutions of the literature: list, show, run one")
    nas_sub = nas.add_subparsers(dest="nas_command", required=True)
    nas_list = nas_sub.add_parser("list", help="name, space, strategy, paper, status of each")
    nas_list.set_defaults(fn=cmd_nas_list)
    nas_show = nas_sub.add_parser("show", help="one row: its space, paper, the strategy that "
                                               "runs it and how (one-shot or multi-trial)")
    nas_show.add_argument("name", help="a row's name (see `retiarii nas list`)")
    nas_show.set_defaults(fn=cmd_nas_show)
    nas_run = nas_sub.add_parser("run", help="search one row's space on the digits data set")
    nas_run.add_argument("name", help="a row's name (see `retiarii nas list`)")
    nas_run.add_argument("--preset", choices=("small", "paper"), default="small",
                         help="small (trains in seconds, default) or paper (published sizes)")
    nas_run.add_argument("--max-models", type=int, default=None,
                         help="models to train (default 8; not for one-shot rows)")
    nas_run.add_argument("--epochs", type=int, default=2,
                         help="epochs per model, or a one-shot row's segments (default 2)")
    nas_run.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    nas_run.add_argument("--store", default=None,
                         help="SQLite file (default runs/nas-NAME-PRESET.db)")
    nas_run.add_argument("--seed", type=int, default=0, help="seed of the search and trials")
    nas_run.set_defaults(fn=cmd_nas_run)
    return p


def main(argv: list[str] | None = None) -> int:
    from .engine.experiment import ExperimentError
    from .engine.store import StoreError

    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("\ninterrupted; continue with: retiarii resume " +
              getattr(args, "store", getattr(args, "db", "")), file=sys.stderr)
        return 130
    except (CliError, ExperimentError, StoreError) as err:
        print(f"retiarii {args.command}: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `retiarii status DB | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")  # (so the interpreter's final flush stays quiet)
        return 0
    except PermissionError as err:  # not "corrupt": say which file and what to do
        print(f"retiarii {args.command}: permission denied on {err.filename}: make it (and its "
              f"folder) writable by this user", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
