"""Trainers: how one model is trained, one epoch (one *step*, one rung) at a time.

A :class:`Trainer` is shaped like a Lightning module minus the model: the engine calls
``configure_optimizers``, ``training_step`` and ``validation_step`` with the model as an argument,
so one trainer object serves every model of a space. :class:`ClassifierTrainer` is the default
(cross-entropy classification on a named data set or on tensors you give it).

A trainer is driven by a :class:`~.trial_run.TrialRun` (``engine/trial_run.py``; ``TrialRun``,
``train_trial`` and ``TrainingError`` are importable from here too).
"""
from __future__ import annotations

import abc
import dataclasses
import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np
import torch
from torch import nn

from ...choices import ValueChoice
from ...codec import ref_of
# One trial's training state lives in trial_run.py; imported from here too.
from .trial_training import TrainingError, TrialRun, check_segment, train_trial
from .torch_datasets import check_dataset, read_dataset

__all__ = ["Trainer", "ClassifierConfig", "ClassifierTrainer", "TrialRun", "TrainingError",
           "chance_of_labels",
           "train_trial", "check_segment", "load_dataset"]


class Trainer(abc.ABC):
    """Base class of trainers; subclass it and write the four abstract methods.

    The data order of an epoch must be a function of the epoch (and your seed) only: that is what
    lets a checkpoint record the data position as (epoch, batch) instead of pickling a loader.

    Example::

        class MyTrainer(Trainer):
            epochs = 3
            def train_dataloader(self, hparams, epoch):
                g = torch.Generator().manual_seed(epoch)
                idx = torch.randperm(len(X), generator=g)
                return [(X[i], Y[i]) for i in idx.split(32)]
            def val_dataloader(self, hparams):
                return [(Xv, Yv)]
            def training_step(self, model, batch, hparams):
                x, y = batch
                return F.cross_entropy(model(x), y)
            def validation_step(self, model, batch):
                x, y = batch
                return {"val_acc": (model(x).argmax(1) == y).float().mean()}
    """

    epochs: int = 1  # steps of a full trial; a trial's hparams["epochs"] overrides it

    def steps_draw_random(self) -> bool:
        """Whether ``training_step`` or ``validation_step`` may draw random numbers besides
        what the model draws (a random augmentation, a sampled loss). A grouped job runs each
        trial's steps in that trial's RNG streams only when they may (swapping streams costs
        about 0.2 ms); the model's own draws are found by the engine itself. True by default:
        say False only when your steps draw nothing, or trials' draws would mix."""
        return True

    def num_epochs(self, hparams: dict) -> int:
        """Epochs of a full trial under ``hparams``."""
        return int(hparams.get("epochs", self.epochs))

    def value_choices(self) -> dict[str, ValueChoice]:
        """This trainer's settings that are ValueChoices, by name: an experiment explores them
        as choices and hands each trial its values in ``hparams[name]``. By default, the
        instance attributes that are ValueChoices."""
        return {k: v for k, v in vars(self).items() if isinstance(v, ValueChoice)}

    def to_spec(self) -> dict | None:
        """How a worker rebuilds this trainer without importing the object, as JSON
        ``{"class": "pkg.module:Class", "config": {...}}`` (``Class(**config)``), or None (the
        default): the worker then imports this very object by reference, so it must be a
        module-level variable of an importable module or script."""
        return None

    def data_key(self, hparams: dict) -> str | None:
        """What decides this trainer's training batches under ``hparams``, as a string, or
        None (the default): models trained with equal keys read the same batches at the same
        (epoch, batch) position, so cross-model optimization may feed them from one data
        pipeline (docs/optimization.md). The batches must then not depend on the trial's own
        seed or RNG streams. None shares nothing: say what your batches depend on to share."""
        return None

    def configure_optimizers(self, model: nn.Module, hparams: dict) -> Any:
        """An optimizer; or ``(optimizer, lr_scheduler)``; or Lightning's dict
        ``{"optimizer": o, "lr_scheduler": s | {"scheduler": s, "interval": "epoch" | "step"}}``.
        The default is Adam with ``hparams["lr"]`` (1e-3 when absent)."""
        return torch.optim.Adam(model.parameters(), lr=float(hparams.get("lr", 1e-3)))

    def preprocessing(self) -> str | None:
        """How this trainer turns the raw data into model inputs, in words a user follows to
        feed an exported model (``retiarii export`` writes it into the model file's header):
        scaling, shapes, dtypes, crops, normalization, label encoding. None (the default):
        not described, and the export says so."""
        return None

    def chance_level(self, metric: str) -> dict | None:
        """What ``metric`` is at chance on the validation data, as
        ``{"metric", "value", "n", "how"}`` (``n``: validation examples, for the standard
        error), or None (the default: unknown). A one-shot search whose selection is not
        better than it is flagged by ``retiarii status`` (docs/weight_sharing.md)."""
        return None

    @abc.abstractmethod
    def train_dataloader(self, hparams: dict, epoch: int) -> Iterable:
        """The batches of ``epoch`` (0-based), in an order determined by the epoch."""

    @abc.abstractmethod
    def val_dataloader(self, hparams: dict) -> Iterable:
        """The validation batches."""

    @abc.abstractmethod
    def training_step(self, model: nn.Module, batch: Any, hparams: dict) -> torch.Tensor:
        """The scalar loss of one batch; the engine runs backward and the optimizer step."""

    @abc.abstractmethod
    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        """Metrics of one batch; averaged over the epoch, weighted by batch size."""


# ---- the default trainer: classification --------------------------------------------------

_DATASETS: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per-process cache


def _load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    # Read scikit-learn's bundled CSV directly: importing sklearn costs ~2 s per worker process.
    spec = importlib.util.find_spec("sklearn")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz") \
        if spec and spec.origin else ""
    if os.path.exists(path):
        data = np.loadtxt(path, delimiter=",")
        pixels, target = data[:, :-1], data[:, -1]
    else:  # a future layout: the public loader gives the same arrays
        from sklearn.datasets import load_digits
        digits = load_digits()
        pixels, target = digits.data, digits.target
    x = torch.tensor(pixels / 16.0, dtype=torch.float32).reshape(-1, 1, 8, 8)  # (N, 64) -> (N, 1, 8, 8)
    y = torch.tensor(target, dtype=torch.int64)
    return x, y


def chance_of_labels(metric: str, labels: Any) -> dict | None:
    """An accuracy at chance on validation ``labels`` (class indices): the majority class's
    share, with the number of examples and classes (see :meth:`Trainer.chance_level`)."""
    y = torch.as_tensor(labels).long().reshape(-1)
    if len(y) == 0 or int(y.min()) < 0:
        return None
    counts = torch.bincount(y)
    share = float(counts.max()) / len(y)
    return {"metric": metric, "value": share, "n": int(len(y)),
            "how": f"always its most frequent class ({int((counts > 0).sum())} classes "
                   f"among {len(y)} validation examples)"}


_LOADERS: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {"digits": _load_digits}


def load_dataset(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A named data set as ``(X, y)`` tensors, cached per process.

    Example::

        x, y = load_dataset("digits")   # x: (1797, 1, 8, 8) in [0, 1], y: (1797,) int64

    Args:
        name: one of ``"digits"`` (scikit-learn's 8x8 handwritten digits, 10 classes).
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown dataset {name!r}; known: {sorted(_LOADERS)}, or give "
                         "ClassifierTrainer(dataset=(X, y)) with your own tensors")
    if name not in _DATASETS:
        _DATASETS[name] = _LOADERS[name]()
    return _DATASETS[name]


def _logits(out: Any) -> torch.Tensor:
    """The model's output as the classifier's logits, or a TypeError saying what to do."""
    if isinstance(out, torch.Tensor):
        return out
    raise TypeError(
        f"ClassifierTrainer trains a model whose forward returns its logits, one tensor of "
        f"shape (batch, classes); this one returns {type(out).__name__}"
        f"{f' of {len(out)}' if isinstance(out, (tuple, list, dict)) else ''}: return the "
        f"logits alone, or subclass rt.Trainer and override training_step and "
        f"validation_step to use the rest (an auxiliary head's loss)")


@dataclass
class ClassifierConfig:
    """Settings of :class:`ClassifierTrainer`. A trial's hparams override any field by name,
    which is how a ValueChoice over, say, the learning rate reaches the trainer."""

    dataset: Any = "digits"  # a name for load_dataset, an (X, y) pair of tensors, or a Dataset
    batch_size: int = 64  # small: digits has 1437 training images, so ~23 steps per epoch
    epochs: int = 10  # steps of a full trial (the scheduler's max_t)
    optimizer: str = "adam"  # "adam", "adamw", "sgd", "nesterov" (SGD's); Adam needs the least tuning
    lr: float = 1e-3  # Adam's customary default
    weight_decay: float = 0.0  # off by default: the tiny models of a search rarely overfit in 10 epochs
    momentum: float = 0.9  # SGD and Nesterov only
    lr_schedule: str | None = None  # None (constant) or "cosine" (annealed to 0 over `epochs`)
    val_fraction: float = 0.2  # held-out share for val_acc / val_loss
    split_seed: int = 0  # fixes the train/val split: every trial must be judged on the same images
    seed: int = 0  # data order: epoch e is shuffled by a generator seeded from (seed, e)


_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
               "nesterov": torch.optim.SGD}  # (with nesterov=True: the DenseNet recipes')


class ClassifierTrainer(Trainer):
    """The default trainer: cross-entropy classification; reports ``train_loss``, ``val_loss``
    and ``val_acc`` after every epoch.

    Example::

        trainer = ClassifierTrainer(dataset="digits", epochs=4, lr=3e-3)
        run = TrialRun(lambda: MyCNN(), trainer, hparams={"batch_size": 32})
        metrics = run.train_epoch()      # {"train_loss": ..., "val_loss": ..., "val_acc": ...}

    Args:
        config: a :class:`ClassifierConfig`; keyword arguments override its fields.
    """

    config_class: type = ClassifierConfig  # a subclass with its own settings names its own

    def __init__(self, config: ClassifierConfig | None = None, **overrides: Any):
        names = {f.name for f in dataclasses.fields(self.config_class)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"{type(self).__name__} got unknown settings {unknown}; "
                            f"known: {sorted(names)}")
        self.config = dataclasses.replace(config or self.config_class(), **overrides)
        self._splits: dict[tuple, tuple] = {}
        if hasattr(self.config, "dataset"):  # (a subclass's own config may have none)
            check_dataset(type(self).__name__, self.config.dataset)

    @property
    def epochs(self) -> int:  # type: ignore[override]
        return self.config.epochs

    def value(self, name: str, hparams: dict) -> Any:
        """Setting ``name``: the trial's ``hparams[name]`` when given, else the config's."""
        value = hparams.get(name, getattr(self.config, name))
        plain = (str, int, float, type(None)) if name != "dataset" else (
            str, tuple, list, torch.utils.data.Dataset)
        if not isinstance(value, plain) or isinstance(
                value, (bool, torch.utils.data.IterableDataset)):
            raise TypeError(
                f"ClassifierTrainer setting {name}={value!r} is not a plain value; a ValueChoice "
                f"must be sampled by the engine into the trial's hparams[{name!r}]")
        return value

    def num_epochs(self, hparams: dict) -> int:
        return int(self.value("epochs", hparams))

    def value_choices(self) -> dict[str, ValueChoice]:
        return {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
                if isinstance(getattr(self.config, f.name), ValueChoice)}

    def to_spec(self) -> dict | None:
        """``{"class": ClassifierTrainer, "config": ...}`` with ValueChoices at their defaults;
        None for a subclass (it may hold more than its config) or a config that is not JSON
        (a dataset given as tensors)."""
        if type(self) is not ClassifierTrainer:
            return None
        config = dataclasses.asdict(self.config)
        config.update({k: v.default for k, v in self.value_choices().items()})
        try:
            json.dumps(config)
        except TypeError:
            return None
        return {"class": ref_of(ClassifierTrainer), "config": config}

    def preprocessing(self) -> str | None:
        """For ``dataset="digits"``: the 1/16 scaling of its 0..16 pixels and the (N, 1, 8, 8)
        shape; for tensors: none (the model gets them as given)."""
        dataset = self.config.dataset
        split = (f"; validation: {self.config.val_fraction:.0%} of the examples held out "
                 f"(split_seed {self.config.split_seed})")
        if dataset == "digits":
            return ("scikit-learn's 8x8 digits (sklearn.datasets.load_digits): each image's 64 "
                    "pixel values, integers 0..16, divided by 16 (to [0, 1]), as float32 of "
                    "shape (N, 1, 8, 8) (x = torch.tensor(digits.data / 16.0, "
                    "dtype=torch.float32).reshape(-1, 1, 8, 8)); labels: the digit 0..9 as "
                    "int64; the model outputs 10 logits, the prediction is their argmax" + split)
        if isinstance(dataset, str):
            return f"the data set {dataset!r} as load_dataset gives it" + split
        if isinstance(dataset, torch.utils.data.Dataset):
            return (f"the (input, label) items of the {type(dataset).__name__} given to the "
                    f"trainer, as its __getitem__ returns them (its own transforms applied), "
                    f"fed to the model as given: prepare new inputs as that Dataset does; the "
                    f"prediction is the argmax of the outputs" + split)
        return ("the (X, y) tensors given to the trainer, fed to the model as given (the "
                "trainer applies no preprocessing): prepare new inputs as X was prepared; "
                "the prediction is the argmax of the outputs" + split)

    def chance_level(self, metric: str) -> dict | None:
        """``val_acc`` at chance: the share of the validation split's most frequent class
        (what always answering it scores; 1/classes for balanced classes)."""
        if metric != "val_acc":
            return None
        _, (_, y) = self._split({})
        return chance_of_labels(metric, y)

    def data_key(self, hparams: dict) -> str | None:
        """The data set (its name, or a hash of the tensors given), the split (``val_fraction``,
        ``split_seed``), ``batch_size`` and the data ``seed``: what ``train_dataloader`` reads.
        The trial's own seed is not in it: the data order never depends on it. None for a
        subclass that loads its batches in its own way."""
        if type(self).train_dataloader is not ClassifierTrainer.train_dataloader \
                or type(self)._split is not ClassifierTrainer._split:
            return None
        dataset = self.value("dataset", hparams)
        parts = {"dataset": dataset if isinstance(dataset, str) else self._tensor_digest(
            self._tensors(dataset)),
                 **{k: self.value(k, hparams)
                    for k in ("val_fraction", "split_seed", "batch_size", "seed")}}
        return "ClassifierTrainer:" + json.dumps(parts, sort_keys=True)

    def _tensor_digest(self, dataset: Any) -> str:
        """sha256 of a dataset given as tensors (cached: the config holds the same objects)."""
        cache = self.__dict__.setdefault("_digests", {})
        if id(dataset) not in cache:
            digest = hashlib.sha256()
            for t in dataset:
                t = torch.as_tensor(t).detach().cpu().contiguous()
                digest.update(f"{t.dtype}|{list(t.shape)}|".encode())
                digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            cache[id(dataset)] = (dataset, "sha256:" + digest.hexdigest())
        return cache[id(dataset)][1]

    def _tensors(self, dataset: Any) -> Any:
        """A Dataset's items read once into an ``(X, y)`` pair of tensors (cached per object:
        every trial of the process reads the same); any other dataset as it is."""
        if not isinstance(dataset, torch.utils.data.Dataset):
            return dataset
        cache = self.__dict__.setdefault("_read", {})
        if id(dataset) not in cache:
            cache[id(dataset)] = (dataset, read_dataset(dataset, type(self).__name__))
        return cache[id(dataset)][1]

    def _split(self, hparams: dict) -> tuple[tuple, tuple]:
        dataset, fraction, seed = (self.value(k, hparams)
                                   for k in ("dataset", "val_fraction", "split_seed"))
        key = (dataset if isinstance(dataset, str) else id(dataset), fraction, seed)
        if key not in self._splits:
            if isinstance(dataset, str):
                x, y = load_dataset(dataset)
            else:
                dataset = self._tensors(dataset)
                if len(dataset) != 2 or len(dataset[0]) != len(dataset[1]):
                    raise ValueError("ClassifierTrainer(dataset=...) takes a name, an (X, y) "
                                     "pair of tensors with one label per example, or a "
                                     "map-style torch Dataset of (input, label) items")
                x, y = (torch.as_tensor(t) for t in dataset)
            order = np.random.default_rng(seed).permutation(len(x))
            n_val = int(round(len(x) * float(fraction)))
            if not 0 < n_val < len(x):
                raise ValueError(f"val_fraction={fraction} leaves no training or no validation "
                                 f"example out of {len(x)}")
            val, train = torch.from_numpy(order[:n_val]), torch.from_numpy(order[n_val:])
            self._splits[key] = ((x[train], y[train]), (x[val], y[val]))
        return self._splits[key]

    def train_dataloader(self, hparams: dict, epoch: int) -> list:
        (x, y), _ = self._split(hparams)
        batch_size = int(self.value("batch_size", hparams))
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        # SeedSequence([seed, epoch]) is platform independent: the order is a pure function.
        order = np.random.default_rng([int(self.value("seed", hparams)), epoch]).permutation(len(x))
        idx = torch.from_numpy(order)
        return [(x[i], y[i]) for i in idx.split(batch_size)]

    def val_dataloader(self, hparams: dict) -> list:
        _, (x, y) = self._split(hparams)
        return [(x[i:i + 512], y[i:i + 512]) for i in range(0, len(x), 512)]

    def configure_optimizers(self, model: nn.Module, hparams: dict) -> Any:
        name = str(self.value("optimizer", hparams)).lower()
        if name not in _OPTIMIZERS:
            raise ValueError(f"unknown optimizer {name!r}; choose one of {sorted(_OPTIMIZERS)}")
        kwargs = {"lr": float(self.value("lr", hparams)),
                  "weight_decay": float(self.value("weight_decay", hparams))}
        if name in ("sgd", "nesterov"):
            kwargs["momentum"] = float(self.value("momentum", hparams))
            kwargs["nesterov"] = name == "nesterov"
        optimizer = _OPTIMIZERS[name](model.parameters(), **kwargs)
        schedule = self.value("lr_schedule", hparams)
        if schedule is None:
            return optimizer
        if schedule != "cosine":
            raise ValueError(f"unknown lr_schedule {schedule!r}; use None or 'cosine'")
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.num_epochs(hparams))
        return optimizer, sched

    def steps_draw_random(self) -> bool:
        """False: these steps draw nothing (a subclass that overrides a step is asked again:
        True unless it says otherwise)."""
        cls = type(self)
        return not (cls.training_step is ClassifierTrainer.training_step
                    and cls.validation_step is ClassifierTrainer.validation_step)

    def training_step(self, model: nn.Module, batch: Any, hparams: dict) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(_logits(model(x)), y)

    def validation_step(self, model: nn.Module, batch: Any) -> dict[str, Any]:
        x, y = batch
        logits = _logits(model(x))  # (B, classes)
        return {"val_loss": nn.functional.cross_entropy(logits, y),
                "val_acc": (logits.argmax(dim=1) == y).float().mean()}
