"""Benchmark: the default ``optimize="auto"`` on searches it was not tuned for (issue #26 item 5:
``auto`` never loses).

The workloads of ``optimize_e2e.py`` are the ones the engine's decisions were fitted and
measured on. These four are written afresh, the way a new user would write them from the
README, and were run only after the engine's constants were set:

- ``lr8``: one small CNN on digits, 8 learning rates (a trainer ``ValueChoice``), grid search:
  8 models of one architecture, nothing frozen;
- ``rnn``: sequence classification on synthetic sequences, a ``LayerChoice`` between a GRU
  and an LSTM, two hidden sizes, two learning rates: 8 models;
- ``tfm``: a one-layer transformer encoder over synthetic tokens, its heads and feed-forward
  width chosen, two learning rates: 8 models;
- ``depth``: a small residual CNN on synthetic 32x32 images, 1 to 3 blocks of one of two
  widths: 6 models, trained from scratch (nothing frozen).

Each is searched start to end by ``Experiment.run()`` on local workers (``--workers``: 2, the
default of ``Experiment``, or 1),
``off`` (``optimize=False``), ``on`` (``optimize=True``) and ``auto`` (the default),
``--runs`` times interleaved. Prints each run, then per workload the medians, ``auto`` over
the best of ``off`` and ``on`` (the issue's bar: >= 0.95), whether ``auto``'s metrics equal
``off``'s bit for bit, and whether reruns are identical. Writes
``benchmarks/out/held_out-wW.csv`` (``--out``: another folder).

Example::

    .venv/bin/python benchmarks/held_out.py                      # 4 workloads x 3 modes x 3 runs
    .venv/bin/python benchmarks/held_out.py --workload rnn --runs 5 --workers 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

if __name__ == "__main__":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU's figures, as optimize_e2e.py

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from torch import nn  # noqa: E402

import retiarii as rt  # noqa: E402

ITEM5 = 0.95  # auto / best of (off, on)


# ---- the spaces, as a user writes them ------------------------------------------------------


class SmallCNN(nn.Module):
    """conv-bn-relu x 2 -> pool -> linear, on (B, 1, 8, 8) digits."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc(self.pool(self.features(x)).flatten(1))


class LastStep(nn.Module):
    """A recurrent layer whose output is its last time step: (B, T, F) -> (B, H)."""

    def __init__(self, kind: str, features: int, hidden: int):
        super().__init__()
        self.rnn = (rt.nn.GRU if kind == "gru" else rt.nn.LSTM)(features, hidden, batch_first=True)

    def forward(self, x):
        out, _ = self.rnn(x)
        return out[:, -1]


class SeqNet(nn.Module):
    def __init__(self, hidden=rt.ValueChoice([32, 64], label="hidden")):
        super().__init__()
        self.cell = rt.LayerChoice({"gru": LastStep("gru", 16, hidden),
                                    "lstm": LastStep("lstm", 16, hidden)}, label="cell")
        self.fc = rt.nn.Linear(hidden, 4)

    def forward(self, x):
        return self.fc(self.cell(x))


class TinyTransformer(nn.Module):
    def __init__(self, heads=rt.ValueChoice([2, 4], label="heads"),
                 ff=rt.ValueChoice([64, 128], label="ff")):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.encoder = rt.nn.TransformerEncoderLayer(32, heads, dim_feedforward=ff,
                                                     dropout=0.0, batch_first=True)
        self.fc = nn.Linear(32, 4)

    def forward(self, tokens):
        return self.fc(self.encoder(self.embed(tokens)).mean(1))


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv1 = rt.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = rt.nn.BatchNorm2d(width)
        self.conv2 = rt.nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = rt.nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class DepthNet(nn.Module):
    def __init__(self, width=rt.ValueChoice([16, 32], label="width")):
        super().__init__()
        self.stem = rt.nn.Conv2d(3, width, 3, stride=2, padding=1)
        self.blocks = rt.Repeat(lambda i: Block(width), depth=(1, 3), label="depth")
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = rt.nn.Linear(width, 10)

    def forward(self, x):
        return self.fc(self.pool(self.blocks(torch.relu(self.stem(x)))).flatten(1))


def _sequences(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 24, 16) sequences whose class is the sign pattern of two feature sums."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 24, 16, generator=g)
    y = (x[:, :, :8].sum((1, 2)) > 0).long() * 2 + (x[:, -6:, 8:].sum((1, 2)) > 0).long()
    return x, y


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 20) tokens of 50; the class is which of four token ranges is most frequent."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 50, (n, 20), generator=g)
    y = torch.stack([((x >= 12 * k) & (x < 12 * k + 12)).sum(1) for k in range(4)], 1).argmax(1)
    return x, y


def _images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 3, 32, 32) noise images with a class-dependent mean pattern."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=g)
    pattern = torch.randn(10, 3, 32, 32, generator=g)
    return pattern[y] * 0.5 + torch.randn(n, 3, 32, 32, generator=g), y


def _build(name: str):
    quick = name.endswith("_QUICK")  # the smoke test's size: a few hundred examples, 1 epoch
    name = name.removesuffix("_QUICK")
    n, epochs = (256, 1) if quick else (None, None)
    if name == "SPACE_LR8":
        return rt.ModelSpace(SmallCNN(), example_input=torch.zeros(2, 1, 8, 8))
    if name == "TRAINER_LR8":
        return rt.Trainer(dataset="digits", epochs=epochs or 10, lr=rt.ValueChoice(
            [3e-4, 1e-3, 2e-3, 3e-3, 5e-3, 1e-2, 2e-2, 3e-2], label="lr"))
    if name == "SPACE_RNN":
        return rt.ModelSpace(SeqNet(), example_input=torch.zeros(2, 24, 16)).with_hparams(
            {"lr": rt.ValueChoice([1e-3, 3e-3], label="lr")})
    if name == "TRAINER_RNN":
        return rt.Trainer(dataset=_sequences(n or 4096, 1), epochs=epochs or 3, batch_size=64)
    if name == "SPACE_TFM":
        return rt.ModelSpace(TinyTransformer(),
                             example_input=torch.zeros(2, 20, dtype=torch.long)).with_hparams(
            {"lr": rt.ValueChoice([1e-3, 3e-3], label="lr")})
    if name == "TRAINER_TFM":
        return rt.Trainer(dataset=_tokens(n or 4096, 2), epochs=epochs or 3, batch_size=64)
    if name == "SPACE_DEPTH":
        return rt.ModelSpace(DepthNet(), example_input=torch.zeros(2, 3, 32, 32))
    if name == "TRAINER_DEPTH":
        return rt.Trainer(dataset=_images(n or 2048, 3), epochs=epochs or 2, batch_size=64)
    raise AttributeError(f"module 'held_out' has no attribute {name!r}")


def __getattr__(name: str):
    obj = _build(name)
    globals()[name] = obj  # module-level from now on: ref_of finds it by this name
    return obj


WORKLOADS = ("lr8", "rnn", "tfm", "depth")


# ---- the benchmark ---------------------------------------------------------------------------


def setup(name: str, quick: bool = False) -> dict:
    from retiarii.refs import resolve_ref

    # by reference, as workers rebuild them: this file's module-level names
    tail = "_QUICK" if quick else ""
    space = f"{os.path.abspath(__file__)}:SPACE_{name.upper()}"
    trainer = resolve_ref(f"{os.path.abspath(__file__)}:TRAINER_{name.upper()}{tail}")
    size = resolve_ref(space).with_hparams(trainer.value_choices()).size()
    return {"space": space, "strategy": rt.strategies.GridSearch, "trainer": trainer,
            "models": size}


def main(argv: list[str] | None = None) -> None:
    import optimize_e2e as e2e
    from _out import write_csv

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    p.add_argument("--runs", type=int, default=3, help="interleaved runs per mode (median)")
    p.add_argument("--workers", type=int, choices=[1, 2], default=2)
    p.add_argument("--out", help="folder of the CSV (default benchmarks/out)")
    p.add_argument("--quick", action="store_true",
                   help="a few hundred examples and one epoch per search (a smoke test)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    if args.out:
        import _out

        _out.OUT = args.out
    run_args = argparse.Namespace(threads=None, workers=args.workers, device="cpu", quick=False)
    folder = tempfile.mkdtemp(prefix="held-out-")
    print(f"held-out searches: {', '.join(args.workload)}; off, on, auto; {args.runs} runs "
          f"each, workers={args.workers}, torch {torch.__version__}, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    print(f"  workers' server started (untimed): {e2e.warm_server():.2f} s", flush=True)
    rows, verdicts = [], {}
    for name in args.workload:
        case = setup(name, args.quick)
        print(f"\n== {name}: {case['models']} models", flush=True)
        results: dict[str, list[dict]] = {m: [] for m in e2e.MODES}
        for rnd in range(args.runs):
            for mode in e2e.MODES:
                r = e2e.run_search(name, mode, case, run_args, folder)
                results[mode].append(r)
                print(f"  {name} run {rnd + 1}/{args.runs} {mode:4} {r['wall']:7.2f} s "
                      f"(load {r['load']:.1f})  {e2e.plans_text(r['plans'])}", flush=True)
        med = {m: statistics.median(r["wall"] for r in runs) for m, runs in results.items()}
        ref = results["off"][0]["curves"]
        best = min(med["off"], med["on"])
        item5 = best / med["auto"]
        same = all(r["curves"] == ref for r in results["auto"])
        diff = max(e2e.max_rel_diff(r["curves"], ref) for r in results["auto"])
        reruns = {m: all(r["curves"] == runs[0]["curves"] for r in runs)
                  for m, runs in results.items()}
        verdicts[name] = item5 >= ITEM5
        print(f"{name}: medians off {med['off']:.2f} s, on {med['on']:.2f} s, auto "
              f"{med['auto']:.2f} s; auto {med['off'] / med['auto']:.2f}x of off, "
              f"{item5:.2f} of the best (>= {ITEM5}: {'PASS' if verdicts[name] else 'FAIL'}); "
              f"auto vs off: {'bit-identical' if same else f'max relative {diff:.2g}'}; reruns "
              f"identical: {', '.join(m + (' yes' if v else ' no') for m, v in reruns.items())}",
              flush=True)
        for mode, runs in results.items():
            for i, r in enumerate(runs):
                rows.append({"workload": name, "mode": mode, "run": i + 1,
                             "wall_s": round(r["wall"], 3), "ratio_to_off": None,
                             "of_best": None, "same_as_off": r["curves"] == ref,
                             "reruns_identical": None, "load": round(r["load"], 2),
                             "plans": e2e.plans_text(r["plans"])})
            rows.append({"workload": name, "mode": mode, "run": "median",
                         "wall_s": round(med[mode], 3), "ratio_to_off":
                         round(med["off"] / med[mode], 3), "of_best": round(best / med[mode], 3),
                         "same_as_off": all(r["curves"] == ref for r in runs),
                         "reruns_identical": reruns[mode],
                         "load": round(statistics.median(r["load"] for r in runs), 2),
                         "plans": ""})
    print(f"\nwrote {write_csv(rows, f'held_out-w{args.workers}')}")
    print("item 5 (auto >= 0.95 of the best): " + ", ".join(
        f"{n} {'PASS' if v else 'FAIL'}" for n, v in verdicts.items()))


if __name__ == "__main__":
    main()
