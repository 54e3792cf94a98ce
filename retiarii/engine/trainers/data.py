"""Image folders as batches: a PyTorch DataLoader or an NVIDIA DALI pipeline, both deterministic.

A folder in the ImageFolder layout (one subfolder per class, JPEG or PNG files) is read by
:func:`scan_folder`; :func:`torch_batches` and :func:`dali_batches` turn its files into the
batches of one epoch: decoded, randomly cropped and resized, flipped and normalized for
training (:class:`Augment`), resized and center-cropped for validation. Every random number of
an epoch comes from ``(seed, epoch)`` (the order) and ``(seed, epoch, index)`` (a sample's crop
and flip, torch) or from a pipeline seeded by ``(seed, epoch)`` (DALI), never from the
caller's RNG streams: two trials reading the same folder with the same settings get the same
batches, which is what lets one pipeline feed both (``ImageFolderTrainer.data_key``).

:func:`make_jpeg_folder` writes a small synthetic data set in that layout (the tests and
``benchmarks/shared_pipeline.py`` use it; nothing can be downloaded here).
"""
from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

__all__ = ["Augment", "Folder", "scan_folder", "make_jpeg_folder", "epoch_order",
           "torch_batches", "dali_batches", "dali_available", "DALI_MISSING"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
DALI_MISSING = ("loader='dali' needs NVIDIA DALI, which is not installed: "
                "pip install -e .[dali] (or ./dev setup dali)")


@dataclass(frozen=True)
class Folder:
    """The image files of a folder in the ImageFolder layout, sorted, with their labels."""

    root: str  # absolute path
    classes: tuple[str, ...]  # subfolder names, sorted; label i is classes[i]
    files: tuple[str, ...]  # absolute paths, sorted by (class, file name)
    labels: tuple[int, ...]
    fingerprint: str  # sha256 of every file's relative path, size and mtime: cheap, no reading

    def subset(self, indices: Sequence[int]) -> Folder:
        return Folder(self.root, self.classes, tuple(self.files[i] for i in indices),
                      tuple(self.labels[i] for i in indices), self.fingerprint)


def scan_folder(root: str, classes: Sequence[str] | None = None) -> Folder:
    """The images under ``root/<class>/``; ``classes`` fixes the label order (a validation
    folder must use its training folder's classes).

    Example::

        folder = scan_folder("data/train")   # folder.classes == ("cat", "dog"), folder.labels ...

    Args:
        root: the folder; each subfolder is a class, each .jpg/.jpeg/.png file in it an image.
        classes: the class names in label order (default: the sorted subfolder names).
    """
    root = os.path.abspath(root)
    if not os.path.isdir(root):
        raise FileNotFoundError(f"image folder {root} does not exist")
    found = sorted(e.name for e in os.scandir(root) if e.is_dir())
    classes = tuple(classes) if classes is not None else tuple(found)
    missing, extra = sorted(set(classes) - set(found)), sorted(set(found) - set(classes))
    if missing or extra:  # a validation folder whose classes are not the training folder's
        raise FileNotFoundError(f"image folder {root} has other classes than {list(classes)}: "
                                f"{missing} missing, {extra} extra")
    digest = hashlib.sha256()
    files, labels = [], []
    for label, name in enumerate(classes):
        entries = sorted((e for e in os.scandir(os.path.join(root, name))
                          if e.is_file() and e.name.lower().endswith(IMAGE_SUFFIXES)),
                         key=lambda e: e.name)
        for e in entries:
            st = e.stat()
            digest.update(f"{name}/{e.name}|{st.st_size}|{st.st_mtime_ns}\n".encode())
            files.append(e.path)
            labels.append(label)
    if not files:
        raise FileNotFoundError(f"image folder {root} has no .jpg/.jpeg/.png file in a class "
                                "subfolder (the ImageFolder layout: root/<class>/<image>)")
    return Folder(root, classes, tuple(files), tuple(labels), "sha256:" + digest.hexdigest())


@dataclass(frozen=True)
class Augment:
    """How a training image becomes a model input, and how a validation one does."""

    size: int = 32  # side of the square crop the model sees
    min_scale: float = 0.35  # random resized crop: area share in [min_scale, 1], aspect in [3/4, 4/3]
    flip: bool = True  # horizontal flip with probability 1/2
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)  # per channel, on [0, 1] pixels (ImageNet's)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    val_resize: float = 1.14  # validation: shorter side to size * val_resize, then a center crop


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of an epoch's samples: a permutation from ``(seed, epoch)`` alone."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def _crop_box(width: int, height: int, min_scale: float, rng: np.random.Generator):
    """A random resized crop's box ``(left, top, right, bottom)``: torchvision's recipe (ten
    tries at an area share and a log-uniform aspect ratio, else the central largest square)."""
    area = width * height
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        ratio = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * ratio))), int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            return left, top, left + w, top + h
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


class ImageDataset(torch.utils.data.Dataset):
    """One image per index, decoded with PIL in the DataLoader's worker processes.

    A training item is asked for as ``(epoch, index)``: its crop and flip come from a generator
    seeded with ``(seed, epoch, index)``, so which worker decodes it, and in which order, does
    not matter. A validation item is asked for by its index (no randomness).
    """

    def __init__(self, folder: Folder, augment: Augment, seed: int, train: bool):
        self.folder, self.augment, self.seed, self.train = folder, augment, seed, train
        self._mean = torch.tensor(augment.mean).view(-1, 1, 1)
        self._std = torch.tensor(augment.std).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.folder.files)

    def __getitem__(self, item):
        from PIL import Image

        a = self.augment
        epoch, index = item if self.train else (None, item)
        with Image.open(self.folder.files[index]) as f:
            img = f.convert("RGB")
        if self.train:
            rng = np.random.default_rng([self.seed, epoch, index])
            box = _crop_box(img.width, img.height, a.min_scale, rng)
            img = img.resize((a.size, a.size), Image.BILINEAR, box=box)
            if a.flip and rng.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            scale = a.size * a.val_resize / min(img.width, img.height)
            w, h = max(a.size, round(img.width * scale)), max(a.size, round(img.height * scale))
            left, top = (w - a.size) // 2, (h - a.size) // 2
            img = img.resize((w, h), Image.BILINEAR).crop((left, top, left + a.size, top + a.size))
        x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())  # (H, W, 3) uint8
        x = x.permute(2, 0, 1).float().div_(255)  # (H, W, 3) -> (3, H, W) in [0, 1]
        return (x - self._mean) / self._std, self.folder.labels[index]


def _loader_context():
    """How a DataLoader starts its decoding processes: forked on Linux, whatever the start
    method of the process that asks (None elsewhere: the platform's default).

    An engine worker is started with ``spawn`` (local executor), and a spawned process makes
    spawn its own default, so its DataLoaders would start every decoding process afresh:
    importing torch and this package, each epoch, for training and validation (2.7 s per
    epoch on a loaded 2-core machine against 0.1 s forked: it was most of a small model's
    job). Forking is safe here: the items decode with PIL on the CPU and touch no CUDA
    context or lock of the parent, and their crops come from ``(seed, epoch, index)``, so the
    batches do not depend on how the processes started.
    """
    import multiprocessing
    import sys

    return multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None


class _TorchEpoch:
    """The batches of one epoch through a DataLoader, made when iterated (a resumed epoch that
    skips batches still decodes them: the position is cheap to find, not to skip)."""

    def __init__(self, dataset: ImageDataset, batches: list[list], num_workers: int):
        self.dataset, self.batches, self.num_workers = dataset, batches, num_workers

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=self.batches, num_workers=self.num_workers,
            # The iterator draws a worker base seed; from the global generator by default,
            # which would move the caller's torch stream (a trial alone would then draw other
            # dropout masks than in a group). Our items do not read that seed anyway.
            generator=torch.Generator().manual_seed(0),
            multiprocessing_context=_loader_context() if self.num_workers else None,
            persistent_workers=False, pin_memory=False)
        for x, y in loader:
            yield x, y.to(torch.int64)


def torch_batches(folder: Folder, augment: Augment, *, batch_size: int, seed: int,
                  epoch: int | None, num_workers: int = 2) -> _TorchEpoch:
    """One epoch of training batches (``epoch`` given) or the validation batches (``epoch``
    None, in file order), decoded by a DataLoader with ``num_workers`` worker processes.

    Example::

        for x, y in torch_batches(scan_folder("data"), Augment(size=32), batch_size=64,
                                  seed=0, epoch=0, num_workers=2):
            ...   # x: (64, 3, 32, 32) float32 normalized, y: (64,) int64

    Args:
        folder: the images (:func:`scan_folder`).
        augment: crop size, scale, flip and normalization.
        batch_size: images per batch; the last batch holds the rest.
        seed: the data seed: the order and every sample's crop and flip follow from it.
        epoch: the epoch (0-based) for training batches; None for validation batches.
        num_workers: DataLoader worker processes (0 decodes in this process).
    """
    n = len(folder.files)
    if epoch is None:
        order, items = range(n), list(range(n))
    else:
        order = epoch_order(n, seed, epoch)
        items = [(epoch, int(i)) for i in order]
    batches = [items[i:i + batch_size] for i in range(0, n, batch_size)]
    return _TorchEpoch(ImageDataset(folder, augment, seed, epoch is not None), batches, num_workers)


# ---- DALI ---------------------------------------------------------------------------------


def dali_available() -> bool:
    """Whether ``nvidia.dali`` imports (the ``dali`` extra)."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def _dali_seed(seed: int, epoch: int) -> int:
    # A pipeline seed per (seed, epoch): DALI derives every operator's per-sample generators
    # from it, so a pipeline built again with it draws the same crops and flips.
    return int(np.random.default_rng([seed, epoch, 0xDA11]).integers(0, 2**31 - 1))


class _DaliEpoch:
    """The batches of one epoch through a DALI pipeline, built when iterated."""

    def __init__(self, files: list[str], labels: list[int], augment: Augment, batch_size: int,
                 pipeline_seed: int, train: bool, gpu: bool, threads: int):
        self.files, self.labels, self.augment = files, labels, augment
        self.batch_size, self.pipeline_seed, self.train = batch_size, pipeline_seed, train
        self.gpu, self.threads = gpu, threads

    def __len__(self) -> int:
        return -(-len(self.files) // self.batch_size)

    def _pipeline(self):
        from nvidia.dali import fn, types
        from nvidia.dali.pipeline import Pipeline

        a = self.augment
        device_id = torch.cuda.current_device() if self.gpu else None  # None: a CPU-only pipeline
        pipe = Pipeline(batch_size=self.batch_size, num_threads=self.threads, device_id=device_id,
                        seed=self.pipeline_seed)
        with pipe:
            # The order is ours (files listed in the epoch's order, no shuffling by the
            # reader); the last batch is padded with its last file and trimmed on the way out.
            jpegs, labels = fn.readers.file(files=self.files, labels=self.labels,
                                            random_shuffle=False, pad_last_batch=True,
                                            name="reader")
            decoder = "mixed" if self.gpu else "cpu"
            if self.train:
                # ROI decoding: only the crop window is decoded (DALI's ImageNet recipe)
                images = fn.decoders.image_random_crop(
                    jpegs, device=decoder, output_type=types.RGB,
                    random_area=[a.min_scale, 1.0], random_aspect_ratio=[3 / 4, 4 / 3])
                images = fn.resize(images, resize_x=a.size, resize_y=a.size)
                mirror = fn.random.coin_flip(probability=0.5) if a.flip else 0
                crop = None
            else:
                images = fn.decoders.image(jpegs, device=decoder, output_type=types.RGB)
                images = fn.resize(images, resize_shorter=a.size * a.val_resize)
                mirror, crop = 0, (a.size, a.size)
            images = fn.crop_mirror_normalize(
                images, dtype=types.FLOAT, output_layout="CHW", crop=crop, mirror=mirror,
                mean=[255 * m for m in a.mean], std=[255 * s for s in a.std])
            pipe.set_outputs(images, labels)
        pipe.build()
        return pipe

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        from nvidia.dali.plugin.pytorch import feed_ndarray

        pipe = self._pipeline()
        device = torch.device("cuda", torch.cuda.current_device()) if self.gpu else torch.device("cpu")
        stream = torch.cuda.current_stream() if self.gpu else None
        try:
            left = len(self.files)
            for _ in range(len(self)):
                images, labels = pipe.run()
                shape = [len(images), *images.as_tensor().shape()[1:]]  # (B, 3, size, size)
                x = torch.empty(shape, dtype=torch.float32, device=device)
                feed_ndarray(images.as_tensor(), x, cuda_stream=stream)
                y = torch.from_numpy(np.array(labels.as_tensor()).reshape(-1).astype(np.int64))
                keep = min(left, self.batch_size)
                left -= keep
                yield x[:keep], y[:keep]
        finally:
            del pipe  # its threads and buffers go now, not at the next collection


def dali_batches(folder: Folder, augment: Augment, *, batch_size: int, seed: int,
                 epoch: int | None, gpu: bool = False, threads: int = 2) -> _DaliEpoch:
    """:func:`torch_batches` through an NVIDIA DALI pipeline: the file reader, the image
    decoder (``"cpu"``, or ``"mixed"``: decoded on the GPU when ``gpu``), a random resized crop
    (decoding only the window) and flip for training, a resize and center crop for validation,
    and normalization. The batches are torch tensors (on the GPU when ``gpu``).

    Example::

        for x, y in dali_batches(scan_folder("data"), Augment(size=32), batch_size=64,
                                 seed=0, epoch=0):
            ...   # x: (64, 3, 32, 32) float32 normalized, y: (64,) int64

    Args:
        folder, augment, batch_size, seed, epoch: as for :func:`torch_batches`; the crops and
            flips follow from a pipeline seed derived from ``(seed, epoch)``.
        gpu: decode and augment on the current CUDA device (``device_id`` of the pipeline);
            False builds a CPU-only pipeline (``device_id=None``).
        threads: the pipeline's CPU threads.
    """
    if not dali_available():
        raise ImportError(DALI_MISSING)
    n = len(folder.files)
    order = range(n) if epoch is None else epoch_order(n, seed, epoch)
    files = [folder.files[i] for i in order]
    labels = [folder.labels[i] for i in order]
    pipeline_seed = 0 if epoch is None else _dali_seed(seed, epoch)  # validation draws nothing
    return _DaliEpoch(files, labels, augment, batch_size, pipeline_seed, epoch is not None,
                      gpu, threads)


# ---- a synthetic data set -------------------------------------------------------------------


def make_jpeg_folder(path: str, classes: int = 4, per_class: int = 16, size: int = 64,
                     seed: int = 0, quality: int = 90) -> str:
    """Write ``classes * per_class`` JPEG images in the ImageFolder layout and return ``path``.

    Class ``c`` draws a grating at its own angle and colour over noise; the phase, frequency,
    contrast and brightness vary per image, so a small CNN can learn the classes but not
    trivially. The same arguments write the same bytes (a fixed generator per image).

    Example::

        root = make_jpeg_folder("/tmp/jpegs", classes=4, per_class=16, size=64)
        # /tmp/jpegs/class0/000.jpg ... /tmp/jpegs/class3/015.jpg

    Args:
        path: the folder to write (created; existing files of the same names are replaced).
        classes: number of class subfolders.
        per_class: images per class.
        size: side of the square images, in pixels.
        seed: the images' generator seed.
        quality: JPEG quality.
    """
    from PIL import Image

    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size  # (size, size) each
    for c in range(classes):
        folder = os.path.join(path, f"class{c}")
        os.makedirs(folder, exist_ok=True)
        angle = math.pi * c / classes
        colour = np.array([0.5 + 0.5 * math.cos(2 * math.pi * (c / classes + k / 3))
                           for k in range(3)], dtype=np.float32)
        for i in range(per_class):
            rng = np.random.default_rng([seed, c, i])
            freq = rng.uniform(3, 6)
            wave = np.sin(2 * math.pi * freq * (xx * math.cos(angle) + yy * math.sin(angle))
                          + rng.uniform(0, 2 * math.pi))
            contrast, brightness = rng.uniform(0.25, 0.5), rng.uniform(0.35, 0.65)
            img = brightness + contrast * wave[..., None] * colour  # (size, size, 3)
            img = img + rng.normal(0, 0.08, size=img.shape)
            pixels = (np.clip(img, 0, 1) * 255).astype(np.uint8)
            Image.fromarray(pixels, "RGB").save(os.path.join(folder, f"{i:03d}.jpg"),
                                                quality=quality)
    return path
