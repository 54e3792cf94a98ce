"""The published NAS-Bench-201 and NAS-Bench-101 tables, read safely and keyed by our samples.

A user downloads a table elsewhere (nothing is downloaded here) and names its file:

- **NAS-Bench-201** (Dong & Yang, ICLR 2020): ``NAS-Bench-201-v1_0-e61699.pth`` or
  ``NAS-Bench-201-v1_1-096897.pth``, a ``torch.save`` of ``{"meta_archs": [arch string] * 15625,
  "arch2infos": {index: {"less": results, "full": results}}, "evaluated_indexes": ...}``; a
  ``results`` is an ``ArchResults`` state dict: ``arch_str``, ``dataset_seed`` ({data set:
  [seeds]}) and ``all_results`` ({(data set, seed): a ``ResultsCount`` state dict with
  ``eval_acc1es`` {"x-valid@11": %, ...}, ``train_times`` {epoch: s}, ``eval_times``}).
  ``less`` is the 12-epoch schedule, ``full`` the 200-epoch one.
- **NAS-Bench-101** (Ying et al., ICML 2019): ``nasbench_only108.tfrecord`` (or
  ``nasbench_full.tfrecord``, of which the 108-epoch records are read): each TFRecord is the
  JSON list ``[module hash, epochs, adjacency as "0110...", "input,conv3x3-bn-relu,...,output",
  base64 of a ModelMetrics protobuf]``, one record per training run (3 per cell).

Both are read by :mod:`retiarii.published_formats` (no unpickling of anything but plain data,
our own TFRecord and protobuf decoders). A :class:`Table` keeps what a search replay needs per
architecture: the search budget's runs (each a curve of validation accuracy per step, and the
seconds of each step) and the figures the papers report for a selected architecture (mean
over runs, in %). :meth:`Table.key_of` maps a sample of ``model_spaces/nasbench201.py`` or
``model_spaces/nasbench101.py`` (their choices' labels) to the table's key.

Example::

    >>> table = load("nasbench201", "NAS-Bench-201-v1_0-e61699.pth")
    >>> table.optimum("cifar10 test")          # the paper: 94.37
    ('|nor_conv_3x3~0|+|nor_conv_3x3~0|nor_conv_3x3~1|+|skip_connect~0|...', 94.37)
    >>> table.entry({"edge_01": "nor_conv_3x3", ...}).reported["cifar100 test"]
"""
from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import statistics
import struct
from typing import Any

from .published_formats import decode_protobuf, load_torch_pickle, read_tfrecords

__all__ = ["BENCHMARKS", "Entry", "Run", "Table", "TableError", "load", "load_nasbench101", "prune",
           "load_nasbench201", "nb101_hash", "nb101_key"]

BENCHMARKS = ("nasbench201", "nasbench101")
NB201_OPS = ("none", "skip_connect", "nor_conv_1x1", "nor_conv_3x3", "avg_pool_3x3")
NB201_EDGES = tuple(f"edge_{i}{j}" for j in range(1, 4) for i in range(j))
NB101_OPS = ("conv3x3-bn-relu", "conv1x1-bn-relu", "maxpool3x3")  # the table's label order
NB201_FILES = ("NAS-Bench-201-v1_0-e61699.pth", "NAS-Bench-201-v1_1-096897.pth")
NB101_FILES = ("nasbench_only108.tfrecord", "nasbench_full.tfrecord")
# NAS-Bench-201's reported figures: (data set of the file, its evaluation set) per column of
# the paper's Table 5 (CIFAR-10's validation column is the model trained on the train split)
NB201_REPORTED = {"cifar10 valid": ("cifar10-valid", "x-valid"),
                  "cifar10 test": ("cifar10", "ori-test"),
                  "cifar100 valid": ("cifar100", "x-valid"),
                  "cifar100 test": ("cifar100", "x-test"),
                  "ImageNet16-120 valid": ("ImageNet16-120", "x-valid"),
                  "ImageNet16-120 test": ("ImageNet16-120", "x-test")}


class TableError(ValueError):
    """A file that is not the benchmark table it is given as, or a sample it lacks."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run under the search budget: validation accuracy (%) after each step and
    the simulated seconds each step costs."""

    accuracy: tuple[float, ...]
    seconds: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Entry:
    """One architecture of a table."""

    key: str  # NAS-Bench-201's architecture string, NAS-Bench-101's module hash
    runs: tuple[Run, ...]  # the search budget's runs (a replay draws one)
    reported: dict  # column -> mean over runs (%), what the papers report for a selection


@dataclasses.dataclass
class Table:
    """A published table: ``entries`` by key, and how our samples map to keys."""

    benchmark: str  # "nasbench201" or "nasbench101"
    source: str  # the file it was read from
    entries: dict[str, Entry]
    steps: int  # steps of a run (NAS-Bench-201: 12 epochs; NAS-Bench-101: halfway, final)
    signal: str  # what the search is told, in words

    def key_of(self, sample: dict) -> str:
        """The table's key of a sample of our space of the same benchmark."""
        return nb201_key(sample) if self.benchmark == "nasbench201" else nb101_key(sample)

    def entry(self, sample: dict) -> Entry:
        key = self.key_of(sample)
        if key not in self.entries:
            raise TableError(f"{self.source} has no row for {key} (sample {sample}): "
                             f"{self._why_missing()}")
        return self.entries[key]

    def _why_missing(self) -> str:
        if self.benchmark == "nasbench101":
            return ("its cell is outside NAS-Bench-101 (no input -> output path: our space "
                    "builds the bare shortcut, which the benchmark does not list)")
        return "the file lists fewer than the 15,625 cells (an incomplete download?)"

    def optimum(self, column: str) -> tuple[str, float]:
        """``(key, value)`` of the best architecture by ``column`` (e.g. "cifar10 test")."""
        have = [(e.reported[column], k) for k, e in self.entries.items() if column in e.reported]
        if not have:
            raise TableError(f"{self.source}: no architecture reports {column!r}; columns: "
                             f"{self.columns()}")
        value, key = max(have)
        return key, value

    def columns(self) -> list[str]:
        seen: dict[str, None] = {}
        for entry in self.entries.values():
            seen.update(dict.fromkeys(entry.reported))
        return list(seen)


# ---- NAS-Bench-201 ---------------------------------------------------------------------------


def nb201_key(sample: dict) -> str:
    """NAS-Bench-201's architecture string of a sample (labels ``edge_ij``), e.g.
    ``|nor_conv_3x3~0|+|none~0|skip_connect~1|+|...~0|...~1|...~2|``."""
    missing = [label for label in NB201_EDGES if label not in sample]
    if missing:
        raise TableError(f"a NAS-Bench-201 sample names every edge {NB201_EDGES}; {sample} "
                         f"lacks {missing} (a sub-space: fill it with "
                         f"model_spaces.nasbench201.full_sample)")
    return "+".join("|" + "|".join(f"{sample[f'edge_{i}{j}']}~{i}" for i in range(j)) + "|"
                    for j in range(1, 4))


def _need(mapping: Any, key: Any, where: str, path: str) -> Any:
    if not isinstance(mapping, dict) or key not in mapping:
        raise TableError(f"{path}: not a NAS-Bench-201 table ({where} has no {key!r}; the "
                         f"supported files are {', '.join(NB201_FILES)})")
    return mapping[key]


def _nb201_runs(less: dict, path: str) -> tuple[Run, ...]:
    """The 12-epoch runs on cifar10-valid: validation accuracy per epoch, and per epoch its
    training time plus, at the last epoch, one evaluation (the cost NAS-Bench-201's
    baselines charge: train-all-time + valid-per-time)."""
    seeds = _need(_need(less, "dataset_seed", "'less'", path), "cifar10-valid",
                  "'less' dataset_seed", path)
    runs = []
    for seed in seeds:
        result = _need(_need(less, "all_results", "'less'", path), ("cifar10-valid", seed),
                       "'less' all_results", path)
        epochs = int(_need(result, "epochs", "a run", path))
        accs, evals = result["eval_acc1es"], result.get("eval_times") or {}
        train = result.get("train_times")
        if not train:
            raise TableError(f"{path}: the 12-epoch run of {less.get('arch_str')} (seed {seed}) "
                             f"has no training times, which the simulated clock needs")
        eval_s = statistics.fmean(evals.get(f"x-valid@{e}", 0.0) for e in range(epochs))
        seconds = [float(train[e]) for e in range(epochs)]
        seconds[-1] += eval_s
        runs.append(Run(tuple(float(accs[f"x-valid@{e}"]) for e in range(epochs)),
                        tuple(seconds)))
    return tuple(runs)


def _nb201_reported(full: dict) -> dict:
    out = {}
    for column, (dataset, setname) in NB201_REPORTED.items():
        seeds = full.get("dataset_seed", {}).get(dataset, [])
        values = []
        for seed in seeds:
            result = full["all_results"][(dataset, seed)]
            key = f"{setname}@{int(result['epochs']) - 1}"
            if key in result.get("eval_acc1es", {}):
                values.append(float(result["eval_acc1es"][key]))
        if values:
            out[column] = statistics.fmean(values)
    return out


def load_nasbench201(path: str) -> Table:
    """Read a NAS-Bench-201 ``.pth`` (see the module docstring) into a :class:`Table`."""
    data = load_torch_pickle(path)
    archs = _need(data, "meta_archs", "the file", path)
    infos = _need(data, "arch2infos", "the file", path)
    entries = {}
    for index, info in infos.items():
        less, full = _need(info, "less", f"arch {index}", path), _need(
            info, "full", f"arch {index}", path)
        key = archs[int(index)]
        entries[key] = Entry(key, _nb201_runs(less, path), _nb201_reported(full))
    steps = {len(run.accuracy) for entry in entries.values() for run in entry.runs}
    if len(steps) != 1:
        raise TableError(f"{path}: runs of {sorted(steps)} epochs; a table has one schedule")
    return Table("nasbench201", path, entries, steps.pop(),
                 "CIFAR-10 validation accuracy after 12 epochs (one run drawn per evaluation)")


# ---- NAS-Bench-101 ---------------------------------------------------------------------------


def nb101_hash(matrix: list[list[int]], labels: list[int]) -> str:
    """NAS-Bench-101's module hash: the same for isomorphic labelled DAGs. Each vertex starts
    from the md5 of (out-degree, in-degree, label), then, once per vertex, becomes the md5 of
    its in-neighbours' hashes, its out-neighbours' (each sorted) and its own; the fingerprint
    is the md5 of the sorted final hashes (written as Python writes the list)."""
    n = len(matrix)
    ins = [sum(matrix[w][v] for w in range(n)) for v in range(n)]
    outs = [sum(matrix[v]) for v in range(n)]
    hashes = [hashlib.md5(str((outs[v], ins[v], labels[v])).encode()).hexdigest()
              for v in range(n)]
    for _ in range(n):
        hashes = [hashlib.md5(("".join(sorted(hashes[w] for w in range(n) if matrix[w][v]))
                               + "|" + "".join(sorted(hashes[w] for w in range(n)
                                                      if matrix[v][w]))
                               + "|" + hashes[v]).encode()).hexdigest() for v in range(n)]
    return hashlib.md5(str(sorted(hashes)).encode()).hexdigest()


def prune(num_vertices: int, edges: set[tuple[int, int]]) -> tuple[set[int], set[tuple]]:
    """The vertices and edges on some input -> output path (NAS-Bench-101's pruning); with no
    such path, only the edge (input, output)."""
    out = num_vertices - 1
    forward, backward = {0}, {out}
    for i, j in sorted(edges):
        if i in forward:
            forward.add(j)
    for i, j in sorted(edges, reverse=True):
        if j in backward:
            backward.add(i)
    kept = forward & backward
    if out not in kept:
        return {0, out}, {(0, out)}
    return kept, {(i, j) for i, j in edges if i in kept and j in kept}


def nb101_key(sample: dict, num_vertices: int = 7) -> str:
    """The module hash of a sample of ``model_spaces/nasbench101.py`` (labels ``op{v}`` and
    ``edge{i}{j}``), pruned as the benchmark prunes (vertices off every input -> output path
    go; with no such path, the bare input -> output edge our space builds)."""
    out = num_vertices - 1
    kept_set, edges = prune(num_vertices, {(i, j) for j in range(1, num_vertices)
                                           for i in range(j) if sample.get(f"edge{i}{j}", 0)})
    kept = sorted(kept_set)
    matrix = [[1 if (i, j) in edges else 0 for j in kept] for i in kept]
    try:
        labels = [-1] + [NB101_OPS.index(sample[f"op{v}"]) for v in kept[1:-1]] + [-2]
    except (KeyError, ValueError) as err:
        raise TableError(f"a NAS-Bench-101 sample names op1..op{out - 1} among {NB101_OPS}; "
                         f"{sample}: {err}") from None
    return nb101_hash(matrix, labels)


def _metrics(raw: str, path: str, index: int) -> tuple[list[dict], int]:
    """A base64 ModelMetrics protobuf -> ([EvaluationData as dicts], trainable parameters)."""
    names = {1: "epoch", 2: "training_time", 3: "train", 4: "valid", 5: "test"}
    fields = decode_protobuf(base64.b64decode(raw))
    evaluations = []
    for blob in fields.get(1, []):
        sub = decode_protobuf(blob)
        evaluations.append({name: struct.unpack("<d", sub[n][-1])[0]
                            for n, name in names.items() if n in sub})
    if len(evaluations) < 3:
        raise TableError(f"{path}: record {index} holds {len(evaluations)} evaluations; "
                         f"NAS-Bench-101 records hold 3 (start, halfway, end)")
    return evaluations, int(fields.get(2, [0])[-1])


def load_nasbench101(path: str, epochs: int = 108, check_crc: bool = True) -> Table:
    """Read a NAS-Bench-101 ``.tfrecord`` (see the module docstring): its ``epochs`` records
    (108: the paper's budget) into a :class:`Table` keyed by module hash."""
    runs: dict[str, list[Run]] = {}
    finals: dict[str, list[tuple[float, float]]] = {}
    for index, record in enumerate(read_tfrecords(path, check_crc)):
        try:
            key, record_epochs, adjacency, operations, raw = json.loads(record.decode())
        except (UnicodeDecodeError, ValueError, TypeError) as err:
            raise TableError(f"{path}: record {index} is not NAS-Bench-101's JSON list "
                             f"[hash, epochs, adjacency, operations, metrics] ({err}); the "
                             f"supported files are {', '.join(NB101_FILES)}") from None
        if int(record_epochs) != epochs:
            continue
        evaluations, _ = _metrics(raw, path, index)
        half, final = evaluations[1], evaluations[2]
        run = Run((100 * half["valid"], 100 * final["valid"]),
                  (half["training_time"], final["training_time"] - half["training_time"]))
        runs.setdefault(key, []).append(run)
        finals.setdefault(key, []).append((100 * final["valid"], 100 * final["test"]))
    if not runs:
        raise TableError(f"{path}: no record of {epochs} epochs")
    entries = {key: Entry(key, tuple(r), {
        "cifar10 valid": statistics.fmean(v for v, _ in finals[key]),
        "cifar10 test": statistics.fmean(t for _, t in finals[key])}) for key, r in runs.items()}
    return Table("nasbench101", path, entries, 2,
                 f"CIFAR-10 validation accuracy after {epochs // 2} and {epochs} epochs (one "
                 f"run of 3 drawn per evaluation)")


def load(benchmark: str, path: str) -> Table:
    """The table of ``benchmark`` ("nasbench201" or "nasbench101") read from ``path``."""
    if benchmark == "nasbench201":
        return load_nasbench201(path)
    if benchmark == "nasbench101":
        return load_nasbench101(path)
    raise TableError(f"no published table for {benchmark!r}; these are read: {BENCHMARKS}")
