"""Search, then retrain: a row of :mod:`retiarii.nas` run as its paper reports it.

A NAS paper's figure is the accuracy of the architecture its search selects, *retrained from
scratch* with a longer recipe, and the search's cost. :func:`search_and_retrain` runs the
row's search (:func:`retiarii.nas.experiment`), takes the architecture it selected (a
one-shot search's result, the choice a multi-trial strategy names, as EfficientNet's scaled
model, or else a multi-trial search's best model), and retrains it from scratch
as a second experiment of the same store whose ``origin["nas_retrain"]`` names the search
experiment and model it retrains; ``retiarii resume`` continues either phase. The recipe is
the row's paper's, scaled to the digits (:data:`RECIPES`; ``retrain_epochs`` epochs); a
recipe may build the same architecture otherwise (:attr:`Recipe.space`: WANN retrains its
selected topology with each connection's own weights, the paper's "trained weights").

Example::

    >>> from retiarii import nas_retrain
    >>> result = nas_retrain.search_and_retrain("nasbench201", max_models=3,
    ...                                          retrain_epochs=10, store="runs/nb201.db")
    >>> result.line()     # 'nasbench201: search 41 s, 3 models; retrained 10 epochs: val_acc 0.95'
"""
from __future__ import annotations

import dataclasses
from typing import Any

from . import nas

__all__ = ["NasResult", "RECIPES", "RETRAIN_SPACES", "Recipe", "recipe", "retrain_experiment",
           "run_metrics", "runs_mean", "search_and_retrain", "selected_model", "space_ref"]

DEFAULT_RETRAIN_EPOCHS = 20  # digits: ~23 steps an epoch; 20 epochs reach the floor (0.9)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a row's paper retrains its selected architecture, scaled to the digits."""

    optimizer: str  # ClassifierTrainer's optimizer name
    lr: float
    weight_decay: float
    lr_schedule: str | None  # "cosine" as most of these papers
    paper: str  # the paper's own recipe, in a few words
    # keyword arguments of the row's space builder for the retraining, as (key, value) pairs:
    # () retrains the searched space's model; WANN's (("trained", True),) gives the same
    # architecture each connection's own weights (the paper's trained-weights setting)
    space: tuple = ()

    def trainer_settings(self, epochs: int) -> dict:
        return {"optimizer": self.optimizer, "lr": self.lr, "weight_decay": self.weight_decay,
                "lr_schedule": self.lr_schedule, "epochs": epochs}


# The cell papers (NASNet, AmoebaNet, PNAS, DARTS, ENAS, NAS-Bench-201...) retrain with SGD,
# momentum 0.9, a cosine schedule and weight decay ~3e-4 (batch 64-128, lr 0.025-0.1, for
# hundreds of epochs): the same here, for retrain_epochs.
CELL = Recipe("sgd", 0.05, 3e-4, "cosine",
              "SGD momentum 0.9, cosine from 0.025-0.1, weight decay 3e-4, 600 epochs (DARTS)")
RECIPES: dict[str, Recipe] = {
    # DARTS' language model trains with SGD at lr 20 then ASGD on perplexity, which does not
    # carry over to classifying digit rows; Adam with a cosine schedule does
    "darts_rnn": Recipe("adam", 3e-3, 0.0, "cosine",
                        "SGD lr 20 then ASGD, 8,000 epochs on Penn Treebank (not transferable)"),
    "enas_rnn": Recipe("adam", 3e-3, 0.0, "cosine", "SGD lr 20, Penn Treebank"),
    "textnas": Recipe("adam", 3e-3, 0.0, "cosine", "Adam, text classification"),
    # WANN's one parameter is the shared weight: retraining that alone is not the paper's.
    # Gaier & Ha also report their networks with "trained weights": the same topology, each
    # connection its own weight, trained by gradient descent (model_spaces/wann.py Connection).
    # Adam moves each `own` by ~lr, a connection's weight by ~lr / sqrt(fan-in) (the masks'
    # scale): lr 3e-2 is Adam's usual 3e-3 on the weights of 64 inputs (3e-3: 0.53 val_acc on
    # the selection of a default run, 3e-2: 0.95)
    "wann": Recipe("adam", 3e-2, 0.0, "cosine",
                   "the selected topology with trained weights: each connection its own "
                   "weight, starting at the shared value, trained by gradient descent "
                   "(the paper's 'trained weights' column)", space=(("trained", True),)),
    # path-level NAS trains its DenseNets as DenseNet-BC does (model_spaces/path_level.py)
    "path_level": Recipe("nesterov", 0.1, 1e-4, "cosine",
                         "SGD, Nesterov momentum 0.9, cosine from 0.1, weight decay 1e-4, "
                         "batch 64 (DenseNet-BC's)"),
}


# ``RETRAIN_SPACES.<name>.<preset>``: a row's space as its recipe retrains it (its
# :attr:`Recipe.space` arguments), an import reference workers resolve, as nas.SPACES
RETRAIN_SPACES = type(nas.SPACES)(options=lambda name: recipe(name).space)


def space_ref(name: str, preset: str) -> str:
    """The import reference of the space row ``name`` retrains in (its search's unless its
    recipe builds it otherwise)."""
    if recipe(name).space:
        return f"retiarii.nas_retrain:RETRAIN_SPACES.{name}.{preset}"
    return f"retiarii.nas:SPACES.{name}.{preset}"


def recipe(name: str) -> Recipe:
    """Row ``name``'s retraining recipe (the cell recipe unless :data:`RECIPES` says else)."""
    nas.get(name)
    return RECIPES.get(name, CELL)


@dataclasses.dataclass
class NasResult:
    """The two phases of one ``nas run``: the search's cost and the retrained accuracy."""

    name: str
    store: str
    search_experiment: int
    retrain_experiment: int
    search_seconds: float  # the search experiment's wall time (created -> last update)
    search_models: int  # models it trained or evaluated
    selected: dict  # the sample it selected
    search_value: float | None  # the selected model's metric in the search
    retrained: dict  # the retrained model's last metrics (val_acc, val_loss...); runs: mean
    retrain_epochs: int
    metric: str = "val_acc"
    runs: list = dataclasses.field(default_factory=list)  # each retraining run's last metrics

    def spread(self, metric: str | None = None) -> float | None:
        """The sample standard deviation of ``metric`` (default :attr:`metric`) over the
        retraining runs; None with fewer than 2."""
        import statistics

        values = [r[metric or self.metric] for r in self.runs if (metric or self.metric) in r]
        return statistics.stdev(values) if len(values) > 1 else None

    def line(self) -> str:
        value = self.retrained.get(self.metric)
        shown = f"{value:.4f}" if isinstance(value, (int, float)) else "-"
        if self.spread() is not None:
            shown += f" ± {self.spread():.4f} (mean ± sd of {len(self.runs)} runs)"
        return (f"{self.name}: search {self.search_seconds:.0f} s, {self.search_models} models "
                f"(experiment {self.search_experiment}); retrained from scratch "
                f"{self.retrain_epochs} epochs (experiment {self.retrain_experiment}): "
                f"{self.metric} {shown}")


def selected_model(store: str, experiment: int) -> tuple[int, dict, float | None]:
    """(model id, sample, metric value) of what search ``experiment`` of ``store`` selected:
    its result model (a one-shot search's result, or the choice a multi-trial strategy names
    with a ``selected()`` method: EfficientNet's best scaled model), else the best finished
    model by the experiment's (first) metric."""
    from .engine.storage.store import Store

    with Store(store) as db:
        db.use_experiment(experiment)
        exp = db.get_experiment()
        config = exp["config"]
        metric, mode = config.get("metric", "val_acc"), config.get("mode", "max")
        if isinstance(metric, (list, tuple)):  # several objectives: the first ranks
            metric, mode = metric[0], mode[0] if isinstance(mode, (list, tuple)) else mode
        model_id = exp.get("result_model")
        if model_id is not None:
            model = db.get_model(model_id)
            metrics = model.get("metrics")
            # a one-shot candidate's metrics, or the value a multi-trial strategy was told
            value = metrics.get(metric) if isinstance(metrics, dict) else model.get("value")
            return model_id, dict(model["sample"]), value
        if (config.get("strategy") or {}).get("one_shot"):
            raise ValueError(f"{store}: the one-shot search (experiment {experiment}) has no "
                             f"result yet: resume it (retiarii resume {store})")
        best = db.best_models(metric, mode, 1, finished=True)
        if not best:
            raise ValueError(f"{store}: the search (experiment {experiment}) finished no model: "
                             f"there is nothing to retrain")
        return best[0]["model_id"], dict(best[0]["sample"]), best[0]["value"]


def retrain_experiment(settings: dict, **kwargs: Any):
    """The experiment retraining the selected model of ``settings`` (its keys: name, preset,
    store, search_experiment, model, sample, retrain_epochs, workers, seed, and optionally
    retrain_seeds: independent runs, seeds seed, seed + 1, ...; kept as
    ``origin["nas_retrain"]``) from scratch with the row's recipe."""
    from .engine.driver.experiment import Experiment
    from .engine.trainers.trainer import ClassifierTrainer
    from .strategies.multi_trial.fixed import FixedArchitecture

    name = settings["name"]
    trainer = ClassifierTrainer(dataset="digits",
                                **recipe(name).trainer_settings(settings["retrain_epochs"]))
    if settings.get("deterministic"):  # as its search ran (--deterministic)
        kwargs.setdefault("deterministic", True)
    runs = int(settings.get("retrain_seeds", 1))
    if runs > 1:  # the same architecture trained `runs` times: each run a model of its own
        kwargs.setdefault("dedup", False)
    return Experiment(space_ref(name, settings["preset"]),
                      FixedArchitecture(settings["sample"], repeats=runs,
                                        seed=settings["seed"]), trainer,
                      store=settings["store"], workers=settings["workers"],
                      seed=settings["seed"], origin={"nas_retrain": dict(settings)}, **kwargs)


def _search_cost(store: str, experiment: int) -> tuple[float, int]:
    from .engine.storage.store import Store

    with Store(store) as db:
        exp = db.get_experiment(experiment)
        count = db.db.execute("SELECT count(*) FROM models WHERE experiment_id = ?",
                              [experiment]).fetchone()[0]
    return float(exp["updated"] - exp["created"]), int(count)


def run_metrics(store: str, experiment: int) -> list[dict]:
    """Each finished run of retrain ``experiment`` of ``store`` (one per ``retrain_seeds``),
    its last epoch's val_acc, val_loss and train_loss; a run that failed is no result."""
    from .engine.storage.store import Store
    from .enums import TrialState

    runs = []
    with Store(store) as db:
        db.use_experiment(experiment)
        for trial in db.trials(states=[TrialState.TERMINATED]):
            metrics = {}
            for metric in ("val_acc", "val_loss", "train_loss"):
                curve = [v for _, v in db.learning_curve(trial["id"], metric)
                         if isinstance(v, (int, float))]
                if curve:
                    metrics[metric] = curve[-1]
            if metrics:
                runs.append(metrics)
    return runs


def runs_mean(runs: list[dict]) -> dict:
    """The mean of each metric every run of ``runs`` (:func:`run_metrics`) reports."""
    return {k: sum(r[k] for r in runs) / len(runs) for k in (runs[0] if runs else {})
            if all(k in r for r in runs)}


def finish(settings: dict, retrain_summary: dict | None = None) -> NasResult:
    """The :class:`NasResult` of a retrain phase whose experiment has run (``settings``: its
    ``origin["nas_retrain"]``)."""
    from .engine.storage.store import Store

    seconds, models = _search_cost(settings["store"], settings["search_experiment"])
    with Store(settings["store"]) as db:
        ids = [e["id"] for e in db.experiments()
               if (e["config"].get("origin") or {}).get("nas_retrain", {}).get(
                   "search_experiment") == settings["search_experiment"]]
        retrain_id = ids[-1]
    runs = run_metrics(settings["store"], retrain_id)
    mean = runs_mean(runs)
    return NasResult(settings["name"], settings["store"], settings["search_experiment"],
                     retrain_id, seconds, models, settings["sample"], settings.get("value"),
                     mean, settings["retrain_epochs"], runs=runs)


def retrain_selected(store: str, search_experiment: int, name: str, preset: str = "small",
                     retrain_epochs: int = DEFAULT_RETRAIN_EPOCHS, workers: int = 2,
                     seed: int = 0, deterministic: bool = False, retrain_seeds: int = 1,
                     **kwargs: Any) -> NasResult:
    """Retrain what search ``search_experiment`` of ``store`` selected, then report both
    (``deterministic``: in deterministic mode, as the search ran; ``retrain_seeds``:
    independent runs of the retraining, reported as their mean and spread)."""
    _check_runs(retrain_seeds)
    model_id, sample, value = selected_model(store, search_experiment)
    settings = {"name": name, "preset": preset, "store": store,
                "search_experiment": search_experiment, "model": model_id, "sample": sample,
                "value": value, "retrain_epochs": retrain_epochs, "workers": workers,
                "seed": seed}
    if retrain_seeds > 1:  # recorded only when asked: older stores resume as they ran
        settings["retrain_seeds"] = retrain_seeds
    if deterministic:  # recorded only when on: a resume rebuilds from these settings
        settings["deterministic"] = True
    exp = retrain_experiment(settings, **kwargs)
    summary = exp.run()
    return finish(settings, summary)


def _check_runs(retrain_seeds: Any) -> None:
    if isinstance(retrain_seeds, bool) or not isinstance(retrain_seeds, int) or retrain_seeds < 1:
        raise ValueError(f"retrain_seeds={retrain_seeds!r}: give the number of independent "
                         f"retraining runs (1 or more)")


def search_and_retrain(name: str, preset: str = "small", max_models: int | None = None,
                       epochs: int = 2, retrain_epochs: int = DEFAULT_RETRAIN_EPOCHS,
                       store: str | None = None, workers: int = 2, seed: int = 0,
                       options: dict | None = None, retrain_kwargs: dict | None = None,
                       retrain_seeds: int = 1, **kwargs: Any) -> NasResult:
    """Search row ``name`` (as :func:`retiarii.nas.experiment`), then retrain its selection from
    scratch for ``retrain_epochs`` with the row's :func:`recipe`, in the same store.

    Args:
        name, preset, max_models, epochs, workers, seed, options: the search's, as for
            :func:`retiarii.nas.experiment`.
        retrain_epochs: epochs of the retraining (default 20).
        retrain_seeds: independent runs of the retraining (seeds ``seed``, ``seed + 1``...),
            reported as their mean (:attr:`NasResult.retrained`) and spread
            (:meth:`NasResult.spread`), as the papers report a retrained cell; on the digits
            one run's val_acc moves by about 2 images of 359 from seed to seed.
        store: the SQLite file holding both phases (default ``runs/nas-{name}-{preset}.db``).
        retrain_kwargs: passed to the retrain's :class:`~retiarii.Experiment` (``executor``...).
        kwargs: passed to the search's :class:`~retiarii.Experiment`.

    Raises:
        ValueError: ``retrain_epochs`` or ``retrain_seeds`` below 1; what
            :func:`retiarii.nas.experiment` raises.
    """
    if retrain_epochs < 1:
        raise ValueError(f"retrain_epochs must be at least 1, got {retrain_epochs}")
    _check_runs(retrain_seeds)
    store = store or f"runs/nas-{name}-{preset}.db"
    exp = nas.experiment(name, preset, max_models, epochs, store, workers, seed, options,
                         **kwargs)
    exp.run()
    return retrain_selected(exp.path, exp.store.experiment_id, name, preset, retrain_epochs,
                            workers, seed, deterministic=bool(kwargs.get("deterministic")),
                            retrain_seeds=retrain_seeds, **(retrain_kwargs or {}))
