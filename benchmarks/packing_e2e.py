"""Benchmark: a MnasNet search end to end, exclusive vs packed vs packed and merged (issue #13,
paper Fig. 16: 1000 models in 20 batches of 50, 2.57x over exclusive execution).

The same sequence of models (random search, seeded) from the MnasNet space's small preset
(``model_spaces/mnasnet.py``) trains one epoch each on the digits, three ways, in this process,
on local worker processes (on a CPU-only machine each worker slot is a device):

- ``exclusive``: ``optimize=False``: one model per job, one job per worker at a time;
- ``pack``: ``optimize="pack"``: up to ``--batch-models`` models per job, placed per worker by
  their profiles (``packing=True``), each trained alone in its job (packing without merging);
- ``ours``: ``optimize=True, packing=True``: the same packs, each merged (one data pipeline,
  the plan's passes; grouped jobs);
- ``even`` (only when asked, ``--modes ... even``): merged, but each batch split over the
  workers as evenly as it goes, without profiles (``packing=False``): what packing adds.

``--data jpeg`` (the default) writes ``--images-per-class`` digits of each class once as
``--jpeg-size`` px RGB JPEG files (``benchmarks/out/digits-jpeg-<size>-<per class>``), read by
``rt.ImageFolderTrainer`` through ``--loader torch`` (DataLoader worker processes decoding with
PIL) or ``--loader dali`` (a DALI pipeline: on the CPU, or decoding on the GPU with ``--device
cuda``; ``retiarii/engine/data.py``): every sample decoded, randomly cropped to ``--crop`` px,
flipped and normalized, each epoch. In a merged pack one pipeline decodes what every model of
the pack reads. The JPEGs are large next to the crop the models see (as photos are next to a
224 px crop), so loading costs about what training does: what packing and merging share on a
CPU, where the models of a pack train one after another. The script measures both per image
before the runs and prints them. ``--data tensors`` feeds the 8x8 digits from memory
(``rt.Trainer(dataset="digits")``: nothing to share but the slicing of a tensor).

Every mode must give every model the same metrics (exactly on the CPU; within ``--rtol`` on a
GPU). It prints one line per mode (wall time, ratio to exclusive, what the plans table says)
and writes ``benchmarks/out/packing_e2e-<tensors|dataloader|dali>-<device>.csv`` and ``.png``.

Example::

    .venv/bin/python benchmarks/packing_e2e.py --quick                  # a minute: a smoke test
    .venv/bin/python benchmarks/packing_e2e.py                          # 200 models, the CPU figure
    .venv/bin/python benchmarks/packing_e2e.py --loader dali            # the same through DALI
    .venv/bin/python benchmarks/packing_e2e.py --device cuda --models 1000 [--loader dali]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import retiarii as rt  # noqa: E402 (after the path: runs from a checkout without installing)
from _out import pyplot, write_csv  # noqa: E402
from model_spaces.mnasnet import small  # noqa: E402
from retiarii.engine.storage.plans_table import PlanTable  # noqa: E402
from retiarii.engine.storage.store import Store  # noqa: E402

# The workers import this file anew (the space is "path:SPACE"): its shape comes from the
# environment main() sets before the experiments start.
_IMAGE = int(os.environ.get("PACKING_E2E_IMAGE", "0"))  # 0: the 8x8 digits tensors
SPACE = small(in_channels=3, image_size=_IMAGE) if _IMAGE else small()
MODES = {"exclusive": dict(optimize=False, batch_models=1),
         "pack": dict(optimize="pack", packing=True),
         "ours": dict(optimize=True, packing=True),
         "even": dict(optimize=True, packing=False)}  # merged, batches split evenly (no profiles)


def _digits_folder(size: int, per_class: int) -> str:
    """The first ``per_class`` digits of each class as ``size`` px RGB JPEGs in the
    ImageFolder layout (written once)."""
    import numpy as np
    from PIL import Image

    root = os.path.join(HERE, "out", f"digits-jpeg-{size}-{per_class}")
    stamp = os.path.join(root, "made.json")
    if os.path.exists(stamp):
        return root
    x, y = rt.engine.trainer.load_dataset("digits")
    fewest = int(torch.bincount(torch.as_tensor(y)).min())
    if per_class > fewest:
        raise SystemExit(f"--images-per-class {per_class}: the digits have only {fewest} images "
                         f"in their smallest class; ask for at most {fewest}")
    written: dict[int, int] = {}
    for i, (img, label) in enumerate(zip(x, y)):
        label = int(label)
        if written.get(label, 0) >= per_class:
            continue
        written[label] = written.get(label, 0) + 1
        folder = os.path.join(root, f"class{label}")
        os.makedirs(folder, exist_ok=True)
        pixels = (img[0].numpy() * 255).astype(np.uint8)  # (8, 8) in [0, 255]
        Image.fromarray(pixels).convert("RGB").resize((size, size), Image.BILINEAR).save(
            os.path.join(folder, f"{i:04d}.jpg"), quality=90)
    with open(stamp, "w") as f:
        json.dump({"size": size, "per_class": per_class, "images": sum(written.values())}, f)
    return root


def _label(args) -> str:
    """The data's name in the output files: tensors, dataloader or dali."""
    return "tensors" if args.data == "tensors" else "dataloader" if args.loader == "torch" else "dali"


def _trainer(args) -> rt.Trainer:
    if args.data == "tensors":
        return rt.Trainer(dataset="digits", epochs=args.epochs, batch_size=args.batch_size)
    return rt.ImageFolderTrainer(
        dataset=_digits_folder(args.jpeg_size, args.images_per_class), loader=args.loader,
        num_workers=args.loader_workers, dali_threads=args.loader_workers,
        dali_device="gpu" if args.device == "cuda" else "cpu", image_size=args.crop,
        batch_size=args.batch_size, epochs=args.epochs, val_fraction=0.2)


def _costs(args) -> dict:
    """Milliseconds per image of loading (decode and augment, in this process) and of training
    one model (forward, backward, Adam step on a batch of the crops; the median of 3 models of
    the space): what one pipeline shared by a pack saves, against what it cannot."""
    import statistics

    from retiarii.sampler import RandomSampler

    device = torch.device(args.device)
    trainer, hparams = _trainer(args), {}
    start = time.perf_counter()
    images = sum(int(x.shape[0]) for x, _ in trainer.train_dataloader(hparams, 0))
    load = (time.perf_counter() - start) * 1000 / images
    x = torch.randn(args.batch_size, 3, args.crop, args.crop, device=device)  # (B, 3, C, C)
    y = torch.arange(args.batch_size, device=device) % 10
    train = []
    for i in range(3):
        model = SPACE.build(SPACE.sample(RandomSampler(i)).sample).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(4):  # one warm-up step, three timed
            if step == 1:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        train.append((time.perf_counter() - start) * 1000 / (3 * args.batch_size))
    return {"load_ms_per_image": round(load, 3),
            "train_ms_per_image": round(statistics.median(train), 3), "train_images": images}


def run_mode(mode: str, args, folder: str) -> dict:
    """One search; its wall time, its models' curves (by sample) and the plans summary."""
    db = os.path.join(folder, f"{mode}.db")
    options = {"batch_models": args.batch_models, **MODES[mode]}
    exp = rt.Experiment(f"{os.path.abspath(__file__)}:SPACE", rt.strategies.Random(seed=0),
                        _trainer(args), store=db, workers=args.workers,
                        devices=[] if args.device == "cpu" else None, max_models=args.models,
                        seed=0, fuse=False, **options)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    exp.run()
    wall = time.perf_counter() - start
    load = (load, os.getloadavg()[0])  # before and after: other users of the machine
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        curves = {json.dumps(t["spec"]["choices"], sort_keys=True):
                  [v for _, v in store.learning_curve(t["id"], "val_loss")] for t in store.trials()}
        plans = PlanTable(store).summary()
    return {"mode": mode, "wall_s": wall, "curves": curves, "plans": plans, "load": load}


def _largest_difference(a: dict, b: dict) -> float:
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for key in a:
        if len(a[key]) != len(b[key]):
            return float("inf")
        for u, v in zip(a[key], b[key]):
            worst = max(worst, abs(u - v) / max(abs(v), 1e-12))
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=200)
    p.add_argument("--batch-models", type=int, default=50, help="models per batch (the paper's 50)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="worker slots (devices)")
    p.add_argument("--data", choices=("jpeg", "tensors"), default="jpeg",
                   help="JPEG files decoded per sample, or the 8x8 digits in memory")
    p.add_argument("--loader", choices=("torch", "dali"), default="torch",
                   help="--data jpeg: DataLoader worker processes (PIL) or a DALI pipeline")
    p.add_argument("--jpeg-size", type=int, default=640, help="side of the digits' JPEG files")
    p.add_argument("--images-per-class", type=int, default=30,
                   help="digits of each class written (80%% train, 20%% validation)")
    p.add_argument("--crop", type=int, default=8,
                   help="side of the crop the models see (8: the digits' own resolution)")
    p.add_argument("--loader-workers", type=int, default=1,
                   help="DataLoader workers (DALI threads) of each pipeline")
    p.add_argument("--modes", nargs="+", choices=tuple(MODES), default=["exclusive", "pack", "ours"])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rtol", type=float, default=None,
                   help="relative tolerance of val_loss between modes (default: exact on the "
                        "CPU, 1e-2 on cuda, whose kernels are not bit-reproducible)")
    p.add_argument("--quick", action="store_true",
                   help="4 models, batches of 2, 10 images per class of 64 px: a smoke test")
    args = p.parse_args()
    if args.quick:
        args.models, args.batch_models, args.images_per_class, args.jpeg_size = 4, 2, 10, 64
    for name in ("models", "batch_models", "epochs", "batch_size", "workers", "jpeg_size",
                 "images_per_class", "crop", "loader_workers"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give a number >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU")
    if args.data == "jpeg" and args.loader == "dali":
        from retiarii.engine.trainers.data import dali_available

        if not dali_available():
            raise SystemExit("--loader dali: NVIDIA DALI is not installed (pip install -e .[dali])")
    image = 0 if args.data == "tensors" else args.crop
    if image != _IMAGE:  # the space's input shape is read at import, by us and the workers
        os.environ["PACKING_E2E_IMAGE"] = str(image)
        os.execv(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]])
    rtol = args.rtol if args.rtol is not None else (0.0 if args.device == "cpu" else 1e-2)
    # a smoke test writes apart: it never replaces the figures of a real run
    suffix = "-quick" if args.quick else ""
    folder = os.path.join(HERE, "out", f"packing_e2e{suffix}")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    label = _label(args)
    setting = (f"{args.images_per_class * 10} JPEGs of {args.jpeg_size} px, {args.crop} px crops"
               if args.data == "jpeg" else "8x8 tensors")
    print(f"MnasNet small on digits ({label}: {setting}), {args.models} models x {args.epochs} "
          f"epoch, batches of {args.batch_models}, {args.workers} workers, {args.device}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    costs = {}
    if args.data == "jpeg":
        from retiarii.threads import one_thread

        with one_thread():  # as each worker trains (cores // workers threads, 1 here)
            costs = _costs(args)
        print(f"  per image: loading {costs['load_ms_per_image']:.2f} ms, training one model "
              f"{costs['train_ms_per_image']:.2f} ms"
              f"{' (one thread)' if args.device == 'cpu' else ''}", flush=True)
    runs = []
    for mode in args.modes:
        runs.append(run_mode(mode, args, folder))
        print(f"  {mode}: {runs[-1]['wall_s']:.1f} s (load {runs[-1]['load'][0]:.1f} before, "
              f"{runs[-1]['load'][1]:.1f} after)", flush=True)
    base = next((r for r in runs if r["mode"] == "exclusive"), runs[0])
    rows, failed = [], False
    for r in runs:
        ratio = base["wall_s"] / r["wall_s"]
        diff = _largest_difference(r["curves"], base["curves"])
        same = diff <= rtol
        failed |= not same
        plans = r["plans"]
        packing = plans.get("packing") or {}
        measured = (plans.get("speedup") or {}).get("median")
        print(f"{label} {args.device} {r['mode']:<9} {r['wall_s']:8.1f} s  {ratio:5.2f}x over "
              f"exclusive  models {len(r['curves'])}  same results: {'yes' if same else 'NO'} "
              f"({diff:.1e})  packs {packing.get('packs', 0)}, balance {packing.get('balance')}, "
              f"measured merged speed-up {measured}", flush=True)
        rows.append({"mode": r["mode"], "data": label, "device": args.device,
                     "models": len(r["curves"]), "batch_models": args.batch_models,
                     "jpeg_size": args.jpeg_size if args.data == "jpeg" else None,
                     "images": args.images_per_class * 10 if args.data == "jpeg" else None,
                     "crop": args.crop if args.data == "jpeg" else None,
                     "load_ms_per_image": costs.get("load_ms_per_image"),
                     "train_ms_per_image": costs.get("train_ms_per_image"),
                     "workers": args.workers, "wall_s": round(r["wall_s"], 2),
                     "ratio_to_exclusive": round(ratio, 3), "same_results": same,
                     "max_rel_diff": diff, "packs": packing.get("packs", 0),
                     "models_per_pack": packing.get("models_per_pack"),
                     "balance": packing.get("balance"), "measured_speedup": measured,
                     "jobs": json.dumps(plans["jobs"]), "load_before": round(r["load"][0], 2),
                     "load_after": round(r["load"][1], 2)})
    name = f"packing_e2e-{label}-{args.device}{suffix}"
    print(f"wrote {write_csv(rows, name)}")
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar([r["mode"] for r in rows], [r["wall_s"] for r in rows], color="#4878a8")
        for i, r in enumerate(rows):
            ax.text(i, r["wall_s"], f"{r['ratio_to_exclusive']:.2f}x", ha="center", va="bottom")
        ax.set_ylabel("wall-clock seconds")
        ax.set_title(f"{args.models} MnasNets, {label}, {args.device}")
        fig.tight_layout()
        fig.savefig(os.path.join(HERE, "out", f"{name}.png"), dpi=120)
    if failed:
        print("a mode's metrics differ from exclusive execution", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
