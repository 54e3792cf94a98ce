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
import os
import sys
from typing import Any

from .cli_common import CliError, _Progress, _open, _positive, _print_best
from .cli_inspect import cmd_export, cmd_plot, cmd_status
from .cli_inspect import _optimization_line  # noqa: F401 (tests import it from here)
from .cli_one_shot import ONE_SHOT

__all__ = ["CliError", "main", "parser"]

STRATEGIES = ("random", "grid", "evolution", "rl", "tpe", "predictor", *ONE_SHOT)
SCHEDULERS = ("none", "asha", "median")


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


# ---- commands ---------------------------------------------------------------------------------


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
    if args.executor:  # move the run to the other executor (e.g. off a lost Ray cluster)
        cli["executor"] = args.executor
        if args.executor == "local":
            if args.address:
                raise CliError("--address names a Ray cluster: resume with --executor ray, "
                               "or leave --address out")
            cli["address"] = None  # the recorded cluster is not used on local workers
    if args.address:
        cli["address"] = args.address  # the cluster's head may have moved
    exp = _build(space, cli, recorded_space=recorded)
    summary = exp.resume()
    print(file=sys.stderr)
    _print_best(summary)
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
    resume.add_argument("--executor", choices=("local", "ray"), default=None,
                        help="continue on local worker processes or on Ray, whichever the run "
                             "started on (default: the executor it was started with)")
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
