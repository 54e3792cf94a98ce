"""The ``retiarii`` command: run, status, resume, export, plot, dashboard.

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
import os
import sys
from typing import Any

from .cli_common import (CliError, Progress, open_store, passes_flag, positive_flag, print_best,
                         print_failures)
from .cli_inspect import cmd_export, cmd_plot, cmd_status
from .tensorboard_log import with_tensorboard
from .cli_inspect import optimization_line  # noqa: F401 (tests import it from here)
from . import registry

__all__ = ["CliError", "main", "parser"]

STRATEGIES = registry.strategy_names()
SCHEDULERS = ("none", *registry.names("scheduler"))


def _strategy(name: str, seed: int, epochs: int | None = None):
    """--strategy NAME as the registry builds it (a one-shot one: --epochs are its segments)."""
    try:
        return registry.make_strategy(name, seed, epochs if registry.is_one_shot(name) else None)
    except (registry.UnknownName, ValueError) as err:
        raise CliError(f"--strategy {name}: {err}") from None


def _name_of(kind: str):
    """An argparse type: a name of the registry, refused with the valid ones and "did you
    mean" (argparse's ``choices`` would list them without the near miss)."""
    def check(value: str) -> str:
        if kind == "scheduler" and value == "none":
            return value
        try:
            return registry.entry(kind, value).name
        except registry.UnknownName as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    check.__name__ = kind  # argparse says "invalid <name> value"
    return check


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
        raise CliError(_import_failure(ref, path, err)) from None


def _import_failure(ref: str, path: str, err: Exception) -> str:
    """Why a space file failed to import, at the line of the user's code that failed (the
    file's folder was importable, as under ``python FILE``: a sibling module is found)."""
    import traceback

    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(os.path.dirname(os.path.abspath(__file__)))]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    text = f"{ref} failed while it was imported: {type(err).__name__}: {err}{where}"
    if isinstance(err, ModuleNotFoundError):
        text += (f"; {err.name!r} is neither installed nor a module in {os.path.dirname(path)} "
                 f"(the space file's folder, importable as under `python {ref}`)")
    return text


def _shipped_folder(ref: str, store: str) -> dict | None:
    """The Ray runtime environment that ships a space file's folder to a cluster's nodes
    (None for ``demo``, installed with retiarii); the run's own files stay behind."""
    if ref == "retiarii.demo":
        return None
    folder = os.path.dirname(ref)
    excludes = ["*.db", "*.db-wal", "*.db-shm", "*.lock", "*.checkpoints/", "__pycache__/",
                ".git/"]
    run = os.path.relpath(os.path.dirname(os.path.abspath(store)), folder)
    if run != "." and not run.startswith(".."):  # the run folder inside it: not shipped
        excludes.append(f"/{run}/")
    return {"working_dir": folder, "excludes": excludes}


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
    from .engine.driver.experiment import Experiment
    from .engine.trainers.trainer import ClassifierTrainer

    from .engine.trainers.function_trainer import FunctionTrainer

    ref, module = _load_space_file(space_arg)
    trainer = getattr(module, "trainer", None)
    space_ref: str | None = f"{ref}:space"
    if getattr(module, "space", None) is None and isinstance(trainer, FunctionTrainer):
        space_ref = None  # a model-free search of the function's hyper-parameters
    elif not hasattr(module, "space"):
        raise CliError(f"{space_arg} defines no module-level `space`: add `space = "
                       f"rt.ModelSpace(...)` at the top level of the file (or, for a "
                       f"model-free search, a `trainer = rt.FunctionTrainer(...)`)")
    one_shot_flag = bool(flags["strategy"]) and registry.is_one_shot(flags["strategy"])
    if trainer is not None and flags.get("epochs") is not None and not one_shot_flag:
        raise CliError(f"--epochs applies to the default trainer, but {space_arg} defines its "
                       f"own `trainer`: set its epochs there, or leave --epochs out")
    if trainer is None:
        # a one-shot strategy's --epochs are its segments; its trainer gives the batches
        epochs = None if one_shot_flag else flags.get("epochs")
        trainer = ClassifierTrainer(dataset="digits", epochs=5 if epochs is None else epochs)
    strategy = getattr(module, "strategy", None)
    if isinstance(strategy, str) and not flags["strategy"]:
        # a name, as --strategy takes it
        try:
            registry.entry("strategy", strategy)
        except registry.UnknownName as err:
            raise CliError(f"{space_arg} sets `strategy = {strategy!r}`: {err}") from None
        strategy = _strategy(strategy, flags["seed"])
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
            from .strategies.one_shot.shared_training import check_shared

            strategy.shared = check_shared(type(strategy).__name__, shared)
        else:
            raise CliError("--shared annotates the operators whose weights are shared: give it "
                           "with --weight-sharing or --strategy spos / enas")
    if one_shot and flags["scheduler"] != "none":
        raise CliError(f"--scheduler {flags['scheduler']}: a one-shot search trains one "
                       f"super-network, no trial to stop early; leave --scheduler out")
    metrics = flags.get("metric") or "val_acc"  # stores from before --metric: val_acc, max
    metric = metrics.split(",") if "," in metrics else metrics
    modes = flags.get("mode") or "max"
    mode = modes.split(",") if "," in modes else modes
    executor = flags.get("executor") or "local"  # stores from before --executor: local
    if flags.get("address"):
        if executor != "ray":
            raise CliError("--address names a Ray cluster: add --executor ray")
        from .engine.executors.ray import RayExecutor

        # connects on first use, disconnects at exit (RayExecutor.close runs at exit); the
        # space file's folder travels with the job (Ray's working_dir), so that every node
        # imports the file and its sibling modules (docs/ray.md)
        executor = RayExecutor(flags["workers"], address=flags["address"], ranks=ranks,
                               runtime_env=_shipped_folder(ref, flags["store"]))
    return Experiment(space_ref, strategy, trainer, store=flags["store"],
                      workers=flags["workers"], max_models=max_models,
                      seed=flags["seed"], executor=executor,
                      # a name: built on the objectives and the trainer's epochs as horizon
                      scheduler=flags["scheduler"],
                      optimize={**_OPTIMIZE, "pack": "pack"}[flags.get("optimize") or "auto"],
                      packing=_OPTIMIZE[flags.get("packing") or "auto"],
                      batch_models=flags.get("batch_models") or 8,
                      # left out (None): "auto" under --optimize auto, else off
                      fuse=_LAYOUT[flags["fuse"]] if flags.get("fuse") else None,
                      batching=_LAYOUT[flags["batching"]] if flags.get("batching") else None,
                      passes=passes_flag(flags.get("passes")),
                      progress=with_tensorboard(Progress(max_models), flags),
                      weight_sharing=weight_sharing, ranks=ranks,
                      device_memory=flags.get("device_memory"),
                      deterministic=bool(flags.get("deterministic")),  # stores before it: off
                      metric=metric, mode=mode, constraints=flags.get("constraint") or None,
                      origin={"cli": {"space": recorded_space, **flags}})


_OPTIMIZE = {"auto": "auto", "on": True, "off": False}  # --optimize, --fuse: Experiment(...)
_LAYOUT = {**_OPTIMIZE, "measure": "measure"}  # --fuse, --batching


# ---- commands ---------------------------------------------------------------------------------


def cmd_run(args) -> int:
    positive_flag(args.workers, "--workers")
    positive_flag(args.max_models, "--max-models")
    positive_flag(args.epochs, "--epochs")
    positive_flag(args.batch_models, "--batch-models")
    positive_flag(args.ranks, "--ranks")
    flags = {"strategy": args.strategy, "seed": args.seed, "max_models": args.max_models,
             "workers": args.workers, "store": args.store, "epochs": args.epochs,
             "scheduler": args.scheduler, "executor": args.executor, "address": args.address,
             "optimize": args.optimize, "batch_models": args.batch_models, "fuse": args.fuse,
             "weight_sharing": args.weight_sharing, "ranks": args.ranks,
             "batching": args.batching, "passes": args.passes, "packing": args.packing,
             "device_memory": args.device_memory, "shared": args.shared,
             "deterministic": args.deterministic, "metric": args.metric, "mode": args.mode,
             "constraint": args.constraint, "tensorboard": args.tensorboard}
    exp = _build(args.space, flags, recorded_space=_space_for_store(args.space, args.store))
    summary = exp.run()
    print(file=sys.stderr)
    print_best(summary)
    print_failures(summary, exp.path)
    print(f"\nstore: {exp.path}   (retiarii status {exp.path})")
    return 0


def cmd_resume(args) -> int:
    positive_flag(args.workers, "--workers")
    positive_flag(args.max_models, "--max-models")
    store = open_store(args.db, args.experiment)
    try:
        exp = store.get_experiment()
        origin = exp["config"].get("origin") or {}
    finally:
        store.close()
    if args.tensorboard and ({"retrain", "nas", "nas_retrain"} & set(origin)):
        raise CliError("--tensorboard applies to searches started with `retiarii run`")
    if "retrain" in origin:  # `retiarii retrain DB --model ID`: rebuilt from the model
        from .cli_retrain import resume_retrain

        return resume_retrain(dict(origin["retrain"]), args)
    if "nas_retrain" in origin:  # the retraining phase of `retiarii nas run NAME`
        from .cli_nas import resume_nas_retrain

        return resume_nas_retrain(dict(origin["nas_retrain"]), args)
    if "nas" in origin:  # `retiarii nas run NAME`: the row rebuilds it
        from .cli_nas import resume_nas

        return resume_nas(dict(origin["nas"]), args)
    try:
        cli = dict(origin["cli"])
    except (KeyError, TypeError):
        raise CliError(f"experiment {exp['id']} of {args.db} was started from Python, not "
                       f"from `retiarii run`; resume it with Experiment(...same arguments...)"
                       f".resume(experiment={exp['id']})") from None
    recorded = cli.pop("space")
    space = _space_from_store(recorded, args.db)
    cli["store"] = args.db  # the store given is the store resumed (a copy resumes the copy)
    if args.workers:
        cli["workers"] = args.workers
    if args.max_models:
        cli["max_models"] = args.max_models  # a budget may change between runs
    if args.executor:  # move the run to the other executor (e.g. off a lost Ray cluster)
        cli["executor"] = args.executor
        if args.executor == "local":
            if args.address:
                raise CliError("--address names a Ray cluster: resume with --executor ray, "
                               "or leave --address out")
            cli["address"] = None  # the recorded cluster is not used on local workers
    if args.address:
        cli["address"] = args.address  # the cluster's head may have moved
    cli["tensorboard"] = args.tensorboard or cli.get("tensorboard")  # else the run's folder
    exp = _build(space, cli, recorded_space=recorded)
    summary = exp.resume(experiment=args.experiment)
    print(file=sys.stderr)
    print_best(summary)
    print_failures(summary, args.db)
    return 0


def parser() -> argparse.ArgumentParser:
    from .cli_nas import add_nas_parser
    from .cli_retrain import add_retrain_parser
    from .dashboard.cli import add_watch_parsers

    p = argparse.ArgumentParser(prog="retiarii", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="search a space: `demo` or a .py file defining `space`")
    run.add_argument("space", help="'demo' or a Python file with a module-level `space`")
    run.add_argument("--strategy", type=_name_of("strategy"), default=None,
                     metavar="{" + ",".join(STRATEGIES) + "}",
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
    run.add_argument("--scheduler", type=_name_of("scheduler"), default="none",
                     metavar="{" + ",".join(SCHEDULERS) + "}",
                     help="early stopping: none, asha or median (default none)")
    run.add_argument("--executor", type=_name_of("executor"), default="local",
                     metavar="{" + ",".join(registry.names("executor")) + "}",
                     help="where models train: local processes, or Ray actors (docs/ray.md)")
    run.add_argument("--optimize", choices=(*_OPTIMIZE, "pack"), default="auto",
                     help="cross-model optimization: models reading the same batches train as "
                          "one job, kept when measured faster (auto, the default), always (on), "
                          "or never (off); pack: packed into jobs but each trained alone (a "
                          "baseline): see docs/optimization.md")
    run.add_argument("--packing", choices=tuple(_OPTIMIZE), default="auto",
                     help="with --optimize: split each batch of models over the workers by "
                          "their profiles (similar ones together, workers equally busy, within "
                          "memory): on, off (as evenly as they go), auto (on when workers use GPUs "
                          "or when two CPU workers or more share the batch)")
    run.add_argument("--batch-models", type=int, default=8,
                     help="the most models one job trains when optimizing (default 8)")
    run.add_argument("--fuse", choices=tuple(_LAYOUT), default=None,
                     help="with --optimize: a job's models of one architecture train fused when "
                          "the device model predicts it faster (auto), when measured faster "
                          "(measure), always (on) or never (off): see docs/optimization.md")
    run.add_argument("--batching", choices=tuple(_LAYOUT), default=None,
                     help="with --optimize: frozen layers fed other values by each model run once "
                          "on their inputs concatenated, when the device model says so (auto), "
                          "when measured faster (measure), always (on) or never (off): see "
                          "docs/optimization.md")
    run.add_argument("--passes", default=None, metavar="NAME=SETTING,...",
                     help="with --optimize: settings of the optional plan passes, each on, off, "
                          "auto or measure (e.g. batching=auto,mypass=on; a pass registered by a module "
                          "the space file imports): see docs/optimization.md, 'Adding a pass'")
    run.add_argument("--address", default=None,
                     help="with --executor ray: the Ray cluster to use (default: a private "
                          "local Ray instance)")
    run.add_argument("--metric", default="val_acc", metavar="NAME[,NAME...]",
                     help="the metric to optimize, or several separated by commas "
                          "(val_acc,latency_ms): a multi-objective search, its result a Pareto "
                          "front; costs the engine measures (params, flops, peak_mem_mb, "
                          "latency_ms, latency_batch_ms) may be named (default val_acc; a "
                          "FunctionTrainer's search names what its function reports)")
    run.add_argument("--mode", default="max", metavar="max|min[,...]",
                     help="the direction of each metric, separated by commas (max,min); one "
                          "applies to all (default max)")
    run.add_argument("--constraint", action="append", default=None, metavar="'METRIC<=N'",
                     help="a condition every result must meet (latency_ms<=5); repeat it for "
                          "several")
    run.add_argument("--deterministic", action="store_true",
                     help="train with deterministic kernels only (no TF32, no cuDNN "
                          "benchmarking) in every worker: two runs give the same metrics on "
                          "a GPU too, slower; resume keeps it (docs/engine.md)")
    run.set_defaults(fn=cmd_run)

    status = sub.add_parser("status", help="trials by state and the best models of a store")
    status.add_argument("db", help="the SQLite file of a run")
    status.add_argument("--experiment", type=int, default=None, metavar="N",
                        help="the experiment of the store to read (default: its "
                             "latest; `retiarii status DB` lists them)")
    status.add_argument("--top", type=int, default=10, help="best models to list (default 10)")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--pareto", action="store_true",
                        help="a search of several objectives: list the models of its Pareto "
                             "front with their values")
    status.add_argument("--model", type=int, default=None, metavar="ID",
                        help="one model in full: its whole sample, value, why it failed, its "
                             "trials' curves (the table cuts long samples)")
    status.add_argument("--errors", action="store_true",
                        help="show each ERRORED trial's whole traceback (default: one line)")
    status.set_defaults(fn=cmd_status)

    resume = sub.add_parser("resume", help="continue a run after Ctrl-C, a crash or SIGKILL")
    resume.add_argument("db", help="the SQLite file of a run started with `retiarii run`")
    resume.add_argument("--experiment", type=int, default=None, metavar="N",
                        help="the experiment of the store to continue (default: its "
                             "latest; `retiarii status DB` lists them)")
    resume.add_argument("--workers", type=int, default=None, help="override the worker count")
    resume.add_argument("--max-models", type=int, default=None,
                        help="a new model budget (default: the one the run was started with)")
    resume.add_argument("--address", default=None,
                        help="the Ray cluster to continue on, for runs started with --executor "
                             "ray (default: the address the run was started with)")
    resume.add_argument("--executor", choices=("local", "ray"), default=None,
                        help="continue on local worker processes or on Ray, whichever the run "
                             "started on (default: the executor it was started with)")
    resume.set_defaults(fn=cmd_resume)

    export = sub.add_parser("export", help="standalone .py + state_dict of the best models")
    export.add_argument("db", help="the SQLite file of a run")
    export.add_argument("--experiment", type=int, default=None, metavar="N",
                        help="the experiment of the store to read (default: its "
                             "latest; `retiarii status DB` lists them)")
    export.add_argument("--top", type=int, default=3, help="how many models (default 3)")
    export.add_argument("--out", required=True, help="output folder")
    export.add_argument("--pareto", action="store_true",
                        help="a search of several objectives: export every model of its "
                             "Pareto front (instead of --top)")
    export.set_defaults(fn=cmd_export)

    add_retrain_parser(sub)

    plot = sub.add_parser("plot", help="best-so-far curves and learning curves to a PNG")
    plot.add_argument("db", help="the SQLite file of a run")
    plot.add_argument("--experiment", type=int, default=None, metavar="N",
                        help="the experiment of the store to read (default: its "
                             "latest; `retiarii status DB` lists them)")
    plot.add_argument("--out", required=True, help="the PNG file to write")
    plot.set_defaults(fn=cmd_plot)

    add_nas_parser(sub)
    add_watch_parsers(sub, run, resume)  # `dashboard`; --tensorboard of run and resume
    return p


def main(argv: list[str] | None = None) -> int:
    from .engine.driver.experiment import ExperimentError, SearchFailed
    from .engine.storage.store import StoreError

    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print("\ninterrupted; continue with: retiarii resume " +
              getattr(args, "store", getattr(args, "db", "")), file=sys.stderr)
        return 130
    except SearchFailed as err:  # the search ran, and every model failed
        print(f"retiarii {args.command}: {err}", file=sys.stderr)
        return 1
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
