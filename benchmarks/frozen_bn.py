"""Benchmark: heads on a frozen ResNet-18-style trunk whose BatchNorms train (issue #26 (a)).

The trunk is frozen the usual way: ``requires_grad_(False)`` on it, and training calls
``.train()``, so its BatchNorms normalize each batch with the batch's statistics and update
their running statistics (no ``rt.freeze``). A mutator chooses the trainable head (linear
layers and MLPs of several widths). The trunk is ResNet-18 as CIFAR uses it (3x3 stem, no
max-pool, four stages of two BasicBlocks, 32x32 RGB in, 8x ``--width`` features out),
written here in plain torch (no torchvision, no download), its frozen values initialised
under a fixed seed; the data are synthetic images whose class shifts their colour means.

A whole search, ``Experiment.run()`` with ``GridSearch`` over the N heads and ``workers=1``,
three ways, interleaved (off, on, auto, off, on, auto, ...) so a busy neighbour slows every
mode alike:

- ``off``: ``optimize=False``, each model trains alone;
- ``on``: ``optimize=True``, one grouped job, the trunk computed once per batch;
- ``auto``: ``optimize="auto"``, the default.

It checks that ``on`` gives every model the metrics of ``off`` at every epoch bit for bit
(both exact on a CPU), prints each mode's median wall time, the ratio ``off / mode`` and what
the plans table says (shared nodes per group), and writes
``benchmarks/out/frozen_bn-cpu.csv``.

Example::

    .venv/bin/python benchmarks/frozen_bn.py                          # N = 4 and 8, 3 runs
    .venv/bin/python benchmarks/frozen_bn.py --width 16 --images 1024 --heads 4 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import retiarii as rt  # noqa: E402 (after the path: runs from a checkout without installing)
from retiarii.engine.storage.plans_table import PlanTable  # noqa: E402
from retiarii.engine.storage.store import Store  # noqa: E402

# The workload's size comes from the environment of the process that imports this module:
# run as a script, its flags set it first, so the driver's objects (this module is also the
# one workers import by path) and each worker's are the same.
if __name__ == "__main__":
    _sizes = argparse.ArgumentParser(add_help=False)
    for _flag in ("width", "images", "epochs"):
        _sizes.add_argument(f"--{_flag}")
    for _flag, _value in vars(_sizes.parse_known_args()[0]).items():
        if _value is not None:
            os.environ[f"FROZEN_BN_{_flag.upper()}"] = _value
WIDTH = int(os.environ.get("FROZEN_BN_WIDTH", "64"))  # ResNet-18's: 64-128-256-512
IMAGES = int(os.environ.get("FROZEN_BN_IMAGES", "4096"))
EPOCHS = int(os.environ.get("FROZEN_BN_EPOCHS", "2"))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, a residual connection."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:  # (B, cin, H, W) -> (B, cout, H/s, W/s)
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.down is None else self.down(x)))


class ResNet18Heads(nn.Module):
    """A frozen ResNet-18 trunk (BatchNorms in train mode) and a trainable head."""

    def __init__(self, width: int):
        super().__init__()
        w = width
        self.stem = nn.Sequential(nn.Conv2d(3, w, 3, 1, 1, bias=False), nn.BatchNorm2d(w),
                                  nn.ReLU())
        blocks, cin = [], w
        for cout, stride in ((w, 1), (2 * w, 2), (4 * w, 2), (8 * w, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*blocks)  # (B, 3, 32, 32) -> (B, 8w, 4, 4)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(8 * w, 10)
        self.stem.requires_grad_(False)  # frozen the usual way; BatchNorms still train mode
        self.layers.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def _heads(features: int) -> dict[str, nn.Module]:
    out: dict[str, nn.Module] = {"linear": nn.Linear(features, 10)}
    for hidden in (32, 64, 128, 256):
        out[f"mlp{hidden}"] = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(),
                                            nn.Linear(hidden, 10))
    for hidden in (64, 128, 256):
        out[f"deep{hidden}"] = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(),
                                             nn.Linear(hidden, hidden), nn.ReLU(),
                                             nn.Linear(hidden, 10))
    return out  # 8 heads


HEADS = _heads(8 * WIDTH)
torch.manual_seed(0)  # frozen values: the same in every process that imports this
SPACES = {n: rt.ModelSpace(ResNet18Heads(WIDTH), [rt.apply_mutator("head", rt.mutators.OperatorMutator(
    {k: HEADS[k] for k in sorted(HEADS)[:n]}, label="head"))],
    example_input=torch.randn(2, 3, 32, 32)) for n in (4, 8)}
SPACE4, SPACE8 = SPACES[4], SPACES[8]


def _images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise whose class shifts each colour channel's mean: something a head can learn."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    shift = torch.randn(10, 3, 1, 1, generator=g)
    return torch.randn(n, 3, 32, 32, generator=g) + shift[labels], labels


TRAINER = rt.Trainer(dataset=_images(IMAGES, 1), batch_size=128, epochs=EPOCHS,
                     val_fraction=0.05, lr=3e-3)

MODES = {"off": False, "on": True, "auto": "auto"}


def run_mode(mode: str, heads: int, folder: str) -> dict:
    """One whole search: wall seconds, every model's curves (by sample), its plans rows."""
    from retiarii.refs import resolve_ref

    db = os.path.join(folder, f"{mode}-{heads}-{time.monotonic_ns()}.db")
    here = os.path.abspath(__file__)
    exp = rt.Experiment(f"{here}:SPACE{heads}", rt.strategies.GridSearch(),
                        resolve_ref(f"{here}:TRAINER"), store=db, workers=1, devices=[],
                        max_models=heads, seed=0, optimize=MODES[mode])
    t0 = time.perf_counter()
    exp.run()
    wall = time.perf_counter() - t0
    with Store(db) as store:
        store.use_experiment(store.experiments()[-1]["id"])
        curves = {}
        for t in store.trials():
            curves[str(sorted(t["spec"]["choices"].items()))] = (t["state"], {
                m: store.learning_curve(t["id"], m) for m in ("train_loss", "val_loss")})
        rows = PlanTable(store).rows()
    return {"wall": wall, "curves": curves, "rows": rows}


def _describe(rows: list[dict]) -> str:
    if not rows:
        return "no grouped job"
    units = [u for r in rows for u in r["units"]]
    shared = sorted({u.get("shared_nodes") for u in units if "shared_nodes" in u})
    return (f"{len(rows)} grouped jobs ({', '.join(sorted({r['status'] for r in rows}))}), "
            f"layouts {sorted({str(u.get('layout')) for u in units})}, shared nodes {shared}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[4, 8], choices=[4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--images", type=int, default=IMAGES)
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    print(f"ResNet-18-style trunk width {args.width}, {args.images} images 32x32, "
          f"{args.epochs} epochs, workers=1, load {os.getloadavg()[0]:.1f}")
    from _out import write_csv

    rows_out = []
    folder = tempfile.mkdtemp(prefix="frozen_bn-")
    try:
        for heads in args.heads:
            walls: dict[str, list[float]] = {m: [] for m in args.modes}
            curves: dict[str, dict] = {}
            plans: dict[str, str] = {}
            for rep in range(args.repeats):
                for mode in args.modes:
                    load = os.getloadavg()[0]
                    result = run_mode(mode, heads, folder)
                    walls[mode].append(result["wall"])
                    plans[mode] = _describe(result["rows"])
                    if mode in ("off", "on"):
                        if mode in curves and curves[mode] != result["curves"]:
                            raise SystemExit(f"{mode}: two runs gave other metrics")
                        curves[mode] = result["curves"]
                    print(f"  N={heads} run {rep + 1} {mode:4} {result['wall']:7.1f} s "
                          f"(load {load:.1f})", flush=True)
            if "off" in curves and "on" in curves and curves["off"] != curves["on"]:
                raise SystemExit(f"N={heads}: optimize=True changed the metrics")
            base = statistics.median(walls["off"]) if "off" in walls else None
            for mode in args.modes:
                med = statistics.median(walls[mode])
                ratio = base / med if base else float("nan")
                print(f"N={heads} {mode:4} median {med:7.1f} s  x{ratio:.2f} of off  {plans[mode]}")
                rows_out.append({"heads": heads, "mode": mode, "median_s": round(med, 2),
                                 "runs_s": " ".join(f"{w:.1f}" for w in walls[mode]),
                                 "speedup_vs_off": round(ratio, 3), "width": args.width,
                                 "images": args.images, "epochs": args.epochs,
                                 "plans": plans[mode]})
            if "on" in curves and "off" in curves:
                print(f"N={heads}: optimize=True gives every model the metrics of "
                      f"optimize=False, bit for bit")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("wrote", write_csv(rows_out, "frozen_bn-cpu"))


if __name__ == "__main__":
    main()
