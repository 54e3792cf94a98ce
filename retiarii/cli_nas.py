"""The ``retiarii nas`` commands: list, show and run the NAS solutions of the literature
(:mod:`retiarii.nas`), and ``retiarii resume`` of a store that ``nas run`` made (it
records its settings as the experiment's origin, ``{"nas": {...}}``, and its retraining's as the
second experiment's, ``{"nas_retrain": {...}}``: :mod:`retiarii.nas_retrain`).
:mod:`retiarii.cli` calls these.
"""
from __future__ import annotations

import json
import sys

from .cli_common import CliError, Progress, positive_flag, print_best, format_table

__all__ = ["cmd_nas_list", "cmd_nas_show", "cmd_nas_run", "resume_nas", "resume_nas_retrain"]


def cmd_nas_list(args) -> int:
    from . import nas

    print(format_table(nas.table(), ["#", "name", "space", "strategy", "paper", "status"]))
    return 0


def cmd_nas_show(args) -> int:
    from . import nas

    try:
        row = nas.get(args.name)
    except KeyError as err:
        raise CliError(str(err).strip('"')) from None
    fields = [("row", f"{row.number}: {row.title} ({row.paper})"), ("space", row.space),
              ("module", row.module or "(not written yet)"),
              ("published strategy", row.strategy), ("runs here", nas.runs(row))]
    if row.module:
        built = nas.strategy(row.name, seed=0)
        fields.append(("strategy", f"{type(built).__name__}({json.dumps(built.config())})"))
        fields.append(("engine", "one-shot: segments of one super-network (--epochs of them)"
                       if row.one_shot else "multi-trial: each model trained alone"))
        if not row.one_shot:
            fields.append(("default budget", f"{nas.default_models(row.name)} models with 2 "
                           f"workers, {nas.default_models(row.name, 1)} with 1 (--max-models)"))
    fields += [("note", row.note),
               ("presets", ", ".join(p for p, _, _ in row.presets)), ("status", row.status)]
    for name, value in fields:
        if value:
            print(f"{name + ':':20} {value}")
    return 0


def cmd_nas_run(args) -> int:
    from . import nas

    for value, flag in ((args.max_models, "--max-models"), (args.epochs, "--epochs"),
                        (args.workers, "--workers"), (args.retrain_seeds, "--retrain-seeds")):
        positive_flag(value, flag)
    if args.retrain_epochs < 0:
        raise CliError(f"--retrain-epochs {args.retrain_epochs}: give the epochs of the "
                       f"retraining (0: search only)")
    try:
        row = nas.get(args.name)
        if row.one_shot and args.max_models is not None:
            raise CliError(f"--max-models: {row.name} runs the one-shot {row.runs_with}, whose "
                           f"segments (--epochs) decide how many models it evaluates; leave "
                           f"--max-models out")
        settings = {"name": args.name, "preset": args.preset, "max_models": args.max_models,
                    "epochs": args.epochs, "workers": args.workers, "seed": args.seed}
        if args.deterministic:  # recorded only when on: resume rebuilds from these settings
            settings["deterministic"] = True
        progress = Progress(None)
        retrain = {"retrain_epochs": args.retrain_epochs}
        if args.retrain_seeds > 1:  # recorded only when asked, as the retraining records it
            retrain["retrain_seeds"] = args.retrain_seeds
        exp = nas.experiment(**settings, store=args.store,
                             origin={"nas": {**settings, **retrain}}, progress=progress)
        progress.total = exp.max_models  # the row's default budget unless --max-models
    except (KeyError, nas.RowNotImplemented) as err:
        raise CliError(str(err).strip('"')) from None
    summary = exp.run()
    print(file=sys.stderr)
    print_best(summary)
    if args.retrain_epochs:
        _retrain(exp.path, exp.store.experiment_id, settings, args.retrain_epochs,
                 args.retrain_seeds)
    print(f"\nstore: {exp.path}   (retiarii status {exp.path})")
    return 0


def _retrain(store: str, search: int, settings: dict, epochs: int, runs: int = 1) -> None:
    """The second phase of ``nas run``: the selected architecture retrained from scratch
    (``runs`` times: --retrain-seeds)."""
    from . import nas_retrain

    times = f", {runs} runs" if runs > 1 else ""
    print(f"\nretraining the selected architecture from scratch for {epochs} epochs{times} "
          f"({nas_retrain.recipe(settings['name']).optimizer}, the row's recipe)", file=sys.stderr)
    try:
        result = nas_retrain.retrain_selected(
            store, search, settings["name"], settings["preset"], epochs,
            settings.get("workers") or 2, settings.get("seed", 0),
            deterministic=bool(settings.get("deterministic")), retrain_seeds=runs,
            progress=Progress(None))
    except ValueError as err:
        raise CliError(str(err)) from None
    print(file=sys.stderr)
    print(result.line())


def resume_nas_retrain(recorded: dict, args) -> int:
    """``retiarii resume`` of the retrain phase of a ``nas run`` store."""
    from . import nas_retrain

    if args.workers:
        recorded["workers"] = args.workers
    exp = nas_retrain.retrain_experiment(recorded, progress=Progress(None))
    exp.resume(experiment=getattr(args, "experiment", None))
    print(file=sys.stderr)
    print(nas_retrain.finish(recorded).line())
    return 0


def resume_nas(recorded: dict, args) -> int:
    """``retiarii resume`` of a ``retiarii nas run`` store: the row's experiment, rebuilt with
    the recorded settings (a changed --workers or --max-models as for ``run``)."""
    from . import nas

    retrain_epochs = recorded.pop("retrain_epochs", 0)
    runs = recorded.pop("retrain_seeds", 1)
    retrain = {"retrain_epochs": retrain_epochs, **({"retrain_seeds": runs} if runs > 1 else {})}
    if args.workers:
        recorded["workers"] = args.workers
    if args.max_models:
        recorded["max_models"] = args.max_models
    if args.address:
        raise CliError("--address: `retiarii nas run` searches on local workers; leave it out")
    if getattr(args, "executor", None) == "ray":
        raise CliError("--executor ray: `retiarii nas run` searches on local workers; leave it "
                       "out")
    try:
        progress = Progress(None)
        exp = nas.experiment(**recorded, store=args.db,
                             origin={"nas": {**recorded, **retrain}}, progress=progress)
        progress.total = exp.max_models
    except (KeyError, nas.RowNotImplemented, ValueError) as err:
        raise CliError(f"{args.db}: {str(err).strip(chr(34))}") from None
    summary = exp.resume(experiment=getattr(args, "experiment", None))
    print(file=sys.stderr)
    print_best(summary)
    if retrain_epochs:  # the search is done now: its retraining follows, as in `nas run`
        _retrain(exp.path, exp.store.experiment_id, recorded, retrain_epochs, runs)
    return 0


def add_nas_parser(sub) -> None:
    """``retiarii nas list|show|run|bench``: the subcommand's arguments (``sub``: the CLI's
    subparsers)."""
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
                         help="models to train (default: the row's, twice what its strategy "
                              "draws before it learns: `nas show NAME`; not for one-shot rows)")
    nas_run.add_argument("--epochs", type=int, default=2,
                         help="epochs per model, or a one-shot row's segments (default 2)")
    nas_run.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    nas_run.add_argument("--store", default=None,
                         help="SQLite file (default runs/nas-NAME-PRESET.db)")
    nas_run.add_argument("--seed", type=int, default=0, help="seed of the search and trials")
    nas_run.add_argument("--retrain-epochs", type=int, default=20,
                         help="then retrain the selected architecture from scratch for this "
                              "many epochs with the row's recipe, as a second experiment of "
                              "the store (default 20; 0: search only)")
    nas_run.add_argument("--retrain-seeds", type=int, default=1,
                         help="independent runs of the retraining (seeds SEED, SEED+1, ...), "
                              "reported as mean ± sd (default 1)")
    nas_run.add_argument("--deterministic", action="store_true",
                         help="deterministic kernels in every worker, as for `run`")
    nas_run.set_defaults(fn=cmd_nas_run)
    from .cli_nas_bench import add_bench_parser  # nas bench: published tables replayed

    add_bench_parser(nas_sub)
