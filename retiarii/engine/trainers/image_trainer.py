"""A classifier trainer that reads JPEG/PNG files from a folder: PyTorch DataLoader or DALI.

:class:`ImageFolderTrainer` is :class:`~.trainer.ClassifierTrainer` (optimizers, LR schedule,
cross-entropy, ``train_loss`` / ``val_loss`` / ``val_acc``) with its batches read from an image
folder by :mod:`.data`: decoded, randomly resized-cropped, flipped and normalized for training,
center-cropped for validation, by DataLoader worker processes (``loader="torch"``) or an
NVIDIA DALI pipeline (``loader="dali"``). Its batches are a function of its settings and the
epoch only, so it has an honest :meth:`~ImageFolderTrainer.data_key` and grouped jobs feed
several models from one pipeline (docs/optimization.md, "Data pipelines").
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...codec import ref_of
from . import data
from .trainer import ClassifierConfig, ClassifierTrainer, chance_of_labels

__all__ = ["ImageFolderConfig", "ImageFolderTrainer"]

_LOADERS = ("torch", "dali")


@dataclass
class ImageFolderConfig(ClassifierConfig):
    """Settings of :class:`ImageFolderTrainer`: those of ``ClassifierConfig`` (optimizer, lr,
    batch size, epochs, the validation split, the data ``seed``) and how images are read. A
    trial's hparams override any field by name."""

    dataset: Any = ""  # the image folder: root/<class>/<image>.jpg (required)
    val_dataset: str | None = None  # a validation folder with the same classes; None: hold out
    #                                 val_fraction of `dataset` (split by split_seed)
    loader: str = "torch"  # "torch" (DataLoader worker processes) or "dali" (the dali extra)
    num_workers: int = 2  # DataLoader decoding processes: one per spare core is the usual start
    image_size: int = 32  # side of the square crop the model sees
    min_scale: float = 0.35  # random resized crop: area share in [min_scale, 1]; torchvision's 0.08
    #                          is for ImageNet-sized photos, too harsh for small images
    flip: bool = True  # random horizontal flip
    mean: tuple = data.Augment.mean  # normalization on [0, 1] pixels (ImageNet's)
    std: tuple = data.Augment.std
    val_resize: float = 1.14  # validation: shorter side to image_size * 1.14, center crop (256/224)
    dali_threads: int = 2  # DALI pipeline CPU threads (the batches do not depend on it)
    dali_device: str = "auto"  # "cpu" (device_id=None), "gpu" (decode with "mixed"), or "auto":
    #                            the GPU when torch sees one


class ImageFolderTrainer(ClassifierTrainer):
    """Classification on an image folder, decoded and augmented by a DataLoader or by DALI.

    Example::

        root = rt.engine.data.make_jpeg_folder("/tmp/jpegs", classes=4, per_class=32, size=64)
        trainer = rt.ImageFolderTrainer(dataset=root, image_size=32, batch_size=32, epochs=2,
                                        loader="torch", num_workers=2)
        run = TrialRun(lambda: MyCNN(), trainer, seed=0)
        metrics = run.train_epoch()      # {"train_loss": ..., "val_loss": ..., "val_acc": ...}

    Args:
        config: an :class:`ImageFolderConfig`; keyword arguments override its fields
            (``dataset`` is the folder).
    """

    config_class = ImageFolderConfig

    def __init__(self, config: ImageFolderConfig | None = None, **overrides: Any):
        super().__init__(config, **overrides)
        self._folders_cache: dict[tuple, tuple[data.Folder, data.Folder]] = {}

    def value(self, name: str, hparams: dict) -> Any:
        if name in ("flip", "mean", "std", "val_dataset"):  # not the base class's plain types
            value = hparams.get(name, getattr(self.config, name))
            if name == "flip" and not isinstance(value, bool) or \
                    name in ("mean", "std") and not isinstance(value, (tuple, list)) or \
                    name == "val_dataset" and not isinstance(value, (str, type(None))):
                raise TypeError(f"ImageFolderTrainer setting {name}={value!r} has the wrong type "
                                "(a ValueChoice must be sampled into the trial's hparams)")
            return value
        return super().value(name, hparams)

    def to_spec(self) -> dict | None:
        """``{"class": ImageFolderTrainer, "config": ...}`` (ValueChoices at their defaults),
        so a worker rebuilds it from JSON; None for a subclass."""
        if type(self) is not ImageFolderTrainer:
            return None
        config = dataclasses.asdict(self.config)
        config.update({k: v.default for k, v in self.value_choices().items()})
        return {"class": ref_of(ImageFolderTrainer), "config": config}

    def preprocessing(self) -> str | None:
        """The validation transform (what a deployed model gets) and what training adds."""
        c = self.config
        size = c.image_size if not hasattr(c.image_size, "candidates") else "image_size"
        return (f"each image opened with PIL and converted to RGB; for inference (as "
                f"validation): resized (bilinear) so its shorter side is round({size} * "
                f"{c.val_resize}), center-cropped to {size}x{size}, pixel values divided by "
                f"255 (to [0, 1]), then normalized per channel as (x - mean) / std with mean="
                f"{tuple(c.mean)}, std={tuple(c.std)}; float32 of shape (N, 3, {size}, {size}); "
                f"label i is the i-th class subfolder in sorted order; training adds random "
                f"resized crops (area share in [{c.min_scale}, 1]) instead of the resize and "
                f"center crop" + (", and horizontal flips" if c.flip else ""))

    def chance_level(self, metric: str) -> dict | None:
        """``val_acc`` at chance: the majority class's share of the validation images."""
        if metric != "val_acc":
            return None
        return chance_of_labels(metric, list(self._folders({})[1].labels))

    # ---- what the batches depend on ------------------------------------------------------

    def _settings(self, hparams: dict) -> dict[str, Any]:
        """Every setting the training and validation batches depend on, checked, as JSON."""
        v = {k: self.value(k, hparams) for k in (
            "dataset", "val_dataset", "val_fraction", "split_seed", "batch_size", "seed",
            "loader", "image_size", "min_scale", "flip", "mean", "std", "val_resize")}
        if not isinstance(v["dataset"], str) or not v["dataset"]:
            raise ValueError("ImageFolderTrainer needs dataset= the image folder (one subfolder "
                             f"per class), got {v['dataset']!r}")
        if v["loader"] not in _LOADERS:
            raise ValueError(f"unknown loader {v['loader']!r}; use one of {list(_LOADERS)}")
        if int(v["batch_size"]) <= 0 or int(v["image_size"]) <= 0:
            raise ValueError(f"batch_size and image_size must be positive, got "
                             f"{v['batch_size']} and {v['image_size']}")
        if int(v["seed"]) < 0:
            raise ValueError(f"the data seed must be non-negative, got {v['seed']}")
        if not 0 < float(v["min_scale"]) <= 1:
            raise ValueError(f"min_scale must be in (0, 1], got {v['min_scale']}")
        v["mean"], v["std"] = [float(m) for m in v["mean"]], [float(s) for s in v["std"]]
        if v["loader"] == "dali":
            v["dali_device"] = "gpu" if self._dali_gpu(hparams) else "cpu"
        return v

    def data_key(self, hparams: dict) -> str | None:
        """The folders (absolute paths and a fingerprint of their file names, sizes and
        modification times), the split, ``batch_size``, the data ``seed``, the loader (and
        where DALI decodes: the CPU and GPU decoders give slightly different pixels), the
        crop size, scale, flip, normalization and validation resize: everything the batches
        are made of. Not the trial's seed, ``num_workers`` or ``dali_threads``: the batches do
        not depend on them (every random number comes from the data seed and the epoch; DALI
        was checked to give the same batches with any thread count, tests/test_image_trainer.py).
        None for a subclass that loads its batches in its own way."""
        if type(self).train_dataloader is not ImageFolderTrainer.train_dataloader \
                or type(self).val_dataloader is not ImageFolderTrainer.val_dataloader:
            return None
        settings = self._settings(hparams)
        train, val = self._folders(hparams)
        settings["dataset"] = [train.root, train.fingerprint]
        if settings["val_dataset"] is not None:
            settings["val_dataset"] = [val.root, val.fingerprint]
        return "ImageFolderTrainer:" + json.dumps(settings, sort_keys=True)

    def _folders(self, hparams: dict) -> tuple[data.Folder, data.Folder]:
        """(training, validation) images. Scanned once per trainer object: the folders must
        not change while an experiment runs (a new process sees the change in the data key)."""
        root, val_root, fraction, split_seed = (self.value(k, hparams) for k in (
            "dataset", "val_dataset", "val_fraction", "split_seed"))
        key = (root, val_root, fraction, split_seed)
        if key not in self._folders_cache:
            folder = data.scan_folder(root)
            if val_root is not None:
                self._folders_cache[key] = (folder, data.scan_folder(val_root, folder.classes))
            else:
                n = len(folder.files)
                n_val = int(round(n * float(fraction)))
                if not 0 < n_val < n:
                    raise ValueError(f"val_fraction={fraction} leaves no training or no "
                                     f"validation image out of {n} in {folder.root}")
                order = np.random.default_rng(split_seed).permutation(n)
                self._folders_cache[key] = (folder.subset(sorted(order[n_val:])),
                                            folder.subset(sorted(order[:n_val])))
        return self._folders_cache[key]

    def _dali_gpu(self, hparams: dict) -> bool:
        where = self.value("dali_device", hparams)
        if where not in ("auto", "cpu", "gpu"):
            raise ValueError(f"dali_device must be 'auto', 'cpu' or 'gpu', got {where!r}")
        return where == "gpu" or (where == "auto" and torch.cuda.is_available())

    def _batches(self, hparams: dict, epoch: int | None):
        s = self._settings(hparams)
        train, val = self._folders(hparams)
        augment = data.Augment(size=int(s["image_size"]), min_scale=float(s["min_scale"]),
                               flip=s["flip"], mean=tuple(s["mean"]), std=tuple(s["std"]),
                               val_resize=float(s["val_resize"]))
        common = {"batch_size": int(s["batch_size"]), "seed": int(s["seed"]), "epoch": epoch}
        folder = train if epoch is not None else val
        if s["loader"] == "dali":
            return data.dali_batches(folder, augment, gpu=s["dali_device"] == "gpu",
                                     threads=int(self.value("dali_threads", hparams)), **common)
        return data.torch_batches(folder, augment, num_workers=int(self.value("num_workers", hparams)),
                                  **common)

    def train_dataloader(self, hparams: dict, epoch: int):
        """The epoch's batches ``(x, y)``: x ``(B, 3, image_size, image_size)`` float32
        normalized, y ``(B,)`` int64. A trial resumed mid-epoch skips the batches before its
        position by reading them (correct, at the cost of decoding them once more)."""
        return self._batches(hparams, epoch)

    def val_dataloader(self, hparams: dict):
        return self._batches(hparams, None)
