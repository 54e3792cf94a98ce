"""``retiarii retrain DB --model ID``: one stored architecture trained again from scratch, as
a new experiment in the same store whose ``origin`` names the model (and experiment) it
retrains. A one-shot search's model gets its trainer hyper-parameters searched (the search
held them at their defaults); a multi-trial model keeps the ones it was trained with. The
experiment is rebuilt from what the source experiment stored (its space reference, its
trainer's settings), so it works for searches started by ``run``, ``nas run`` or Python."""
from __future__ import annotations

import dataclasses
import sys

from .cli_common import CliError, open_store, positive_flag, print_best, Progress

__all__ = ["cmd_retrain", "resume_retrain", "retrain_experiment"]


def _trainer(config: dict, epochs: int | None):
    """The source experiment's trainer, its ValueChoices (the fingerprint's ``hparams`` that
    are its settings) restored, ``epochs`` overriding its epochs."""
    from .choices import ValueChoice
    from .refs import resolve_ref

    spec = config.get("trainer")
    if isinstance(spec, dict) and "class" in spec:
        cls = resolve_ref(spec["class"])
        settings = dict(spec.get("config") or {})
        labels = (config.get("space") or {}).get("hparam_labels", {})
        for name, values in (config.get("space") or {}).get("hparams", {}).items():
            if name in settings:  # searched: a choice again, under the label it had
                settings[name] = ValueChoice(list(values), label=labels.get(name, name))
        if epochs is not None:
            settings["epochs"] = epochs
        return cls(**settings)
    trainer = resolve_ref(spec)  # a trainer object of the user's module
    if epochs is None:
        return trainer
    if not dataclasses.is_dataclass(getattr(trainer, "config", None)):
        raise CliError(f"--epochs: the trainer {spec} has no settings to change; set its "
                       f"epochs where it is defined, or leave --epochs out")
    return type(trainer)(trainer.config, epochs=epochs)


def retrain_experiment(db: str, settings: dict):
    """The experiment that retrains model ``settings["model"]`` of ``db`` (settings: model,
    epochs, workers, seed; kept as the experiment's ``origin["retrain"]``)."""
    from .cli_one_shot import is_one_shot
    from .engine.driver.experiment import Experiment
    from .strategies.multi_trial.fixed import FixedArchitecture

    store = open_store(db)
    try:
        row = store.db.execute("SELECT experiment_id FROM models WHERE id = ?",
                               [settings["model"]]).fetchone()
        if row is None:
            raise CliError(f"--model {settings['model']}: {db} has no such model "
                           f"(retiarii status {db} lists them)")
        store.use_experiment(row[0])
        source, model = store.get_experiment(), store.get_model(settings["model"])
    finally:
        store.close()
    if model["graph"] is None:
        raise CliError(f"--model {model['id']} could not be built (retiarii status {db} "
                       f"--errors says why): there is nothing to retrain")
    config = source["config"]
    one_shot = is_one_shot(config)
    sample = dict(model["sample"])
    if one_shot:  # held at their defaults by the weight-sharing search: searched now
        space = config.get("space") or {}
        labels = space.get("hparam_labels", {})
        trainer_labels = {labels.get(name, name) for name in space.get("hparams", {})}
        sample = {k: v for k, v in sample.items() if k not in trainer_labels}
    trainer = _trainer(config, settings.get("epochs"))
    strategy = FixedArchitecture(sample, seed=settings.get("seed", 0))
    return Experiment(config["space"]["ref"], strategy, trainer, store=db,
                      workers=settings.get("workers") or 2, seed=settings.get("seed", 0),
                      metric=config.get("metric", "val_acc"), mode=config.get("mode", "max"),
                      progress=Progress(None),
                      origin={"retrain": {**settings, "experiment": source["id"],
                                          "one_shot": one_shot}})


def cmd_retrain(args) -> int:
    positive_flag(args.epochs, "--epochs")
    positive_flag(args.workers, "--workers")
    settings = {"model": args.model, "epochs": args.epochs, "workers": args.workers,
                "seed": args.seed}
    exp = retrain_experiment(args.db, settings)
    summary = exp.run()
    print(file=sys.stderr)
    print_best(summary)
    source, new = exp.origin["retrain"]["experiment"], exp.store.experiment_id
    print(f"\nretrained model {args.model} (experiment {source}) from scratch as experiment "
          f"{new} of {args.db}   (retiarii status {args.db} --experiment {new})")
    return 0


def resume_retrain(recorded: dict, args) -> int:
    """``retiarii resume`` of a ``retrain`` experiment: rebuilt from its recorded settings."""
    settings = {k: recorded.get(k) for k in ("model", "epochs", "workers", "seed")}
    if args.workers:
        settings["workers"] = args.workers
    exp = retrain_experiment(args.db, settings)
    summary = exp.resume(experiment=getattr(args, "experiment", None))
    print(file=sys.stderr)
    print_best(summary)
    return 0


def add_retrain_parser(sub) -> None:
    """``retiarii retrain DB --model ID``: the subcommand's arguments (``sub``: the CLI's
    subparsers)."""
    retrain = sub.add_parser("retrain", help="train one stored model's architecture again from "
                             "scratch, as a new experiment of the same store")
    retrain.add_argument("db", help="the SQLite file of a run")
    retrain.add_argument("--model", type=int, required=True, metavar="ID",
                         help="the model to retrain (an id of `retiarii status`)")
    retrain.add_argument("--epochs", type=int, default=None,
                         help="epochs to train (default: the search's trainer's)")
    retrain.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    retrain.add_argument("--seed", type=int, default=0, help="seed of the trials (default 0)")
    retrain.set_defaults(fn=cmd_retrain)
