"""The dashboard's model page: one stored model drawn from its graph IR (Graphviz ``dot``), the
nodes it changed against a reference model highlighted, its parameter count and costs, and its
exported source and weights.

A store is code: the dashboard never imports what it names. The drawing reads the IR as JSON
data; the source is the one ``retiarii export`` writes, its references resolved under
:class:`~retiarii.refs.TrustedRefs` with no space (torch, operator, math and retiarii's layers
only: a graph naming the space's own code gets a note to run ``retiarii export`` instead);
weights are read with ``torch.load(weights_only=True)`` (tensors only).
"""
from __future__ import annotations

import html
import io
import json
import shutil
import subprocess

from ..engine.storage.base_graphs import base_graph
from .store_view import NotInStore, experiment, loads_json, table

__all__ = ["model", "flops", "graph_rows", "render_svg", "source", "weights"]

NO_DOT = ("Graphviz's `dot` is not installed, so the architecture is listed as a table; install "
          "it (Debian: apt-get install graphviz) to see it drawn")
COLORS = {"added": "#ffcc80", "changed": "#ffd54f", "same": "#e3f2fd",
          "input": "#c8e6c9", "output": "#c8e6c9"}


def _model_row(db, exp_id: int, model_id: int) -> dict:
    rows = db.execute("SELECT id, experiment_id, sample, graph, hash, parent, status, value "
                      "FROM models WHERE id = ?", [model_id]).fetchall()
    if not rows or rows[0][1] != exp_id:
        raise NotInStore(f"model {model_id} is not in experiment {exp_id}: pick one on the "
                               f"trials or overview page")
    keys = ["id", "experiment_id", "sample", "graph", "hash", "parent", "status", "value"]
    row = dict(zip(keys, rows[0]))
    row["sample"], row["graph"] = loads_json(row["sample"], {}), loads_json(row["graph"])
    return row


def _what(node: dict) -> str:
    """What a node computes, in a few words: its class, function or method."""
    op = node["op"]
    if op["kind"] == "module":
        return (op.get("spec") or {}).get("cls", "?").rsplit(":", 1)[-1]
    if op["kind"] in ("function", "method"):
        return str(op.get("target", "?")).rsplit(":", 1)[-1]
    return op["kind"]


def _signature(node: dict) -> str:
    """What makes two nodes of one name compute the same thing (inputs apart)."""
    op = node["op"]
    return json.dumps([op["kind"], op.get("target"), op.get("spec"), op.get("args"),
                       op.get("kwargs")], sort_keys=True, default=str)


def graph_rows(graph: dict, reference: dict | None) -> tuple[list[dict], list[list], list[str]]:
    """The top-level nodes of ``graph`` (each with ``diff``: added, changed or same against
    ``reference``), its edges ``[src, dst, port]`` and the reference's nodes it lacks."""
    ref = {n["name"]: _signature(n) for n in (reference or {}).get("nodes", [])}
    nodes = []
    for n in graph.get("nodes", []):
        diff = "same"
        if reference is not None:
            diff = "added" if n["name"] not in ref else (
                "changed" if ref[n["name"]] != _signature(n) else "same")
        nodes.append({"uid": n["uid"], "name": n["name"], "kind": n["op"]["kind"],
                      "what": _what(n), "shape": (n.get("meta") or {}).get("shape"),
                      "diff": diff})
    names = {n["name"] for n in graph.get("nodes", [])}
    removed = [name for name in ref if name not in names]
    return nodes, [list(e) for e in graph.get("edges", [])], removed


def _dot_source(nodes: list[dict], edges: list[list]) -> str:
    lines = ["digraph model {", "rankdir=TB;", 'node [shape=box, style="rounded,filled", '
             'fontname="Helvetica", fontsize=10];', 'edge [color="#607d8b"];']
    for n in nodes:
        shape = "x".join(str(d) for d in n["shape"]) if isinstance(n["shape"], list) else ""
        label = "\\n".join(x for x in (n["name"], n["what"], shape) if x).replace('"', "'")
        fill = COLORS.get(n["kind"]) if n["diff"] == "same" else COLORS[n["diff"]]
        fill = fill or COLORS["same"]
        pen = ', penwidth=2.5, color="#e65100"' if n["diff"] != "same" else ""
        lines.append(f'n{n["uid"]} [label="{label}", fillcolor="{fill}", '
                     f'tooltip="{html.escape(n["diff"])}"{pen}];')
    for src, dst, port in edges:
        lines.append(f"n{src} -> n{dst}" + (f' [label="{port}"]' if port else "") + ";")
    lines.append("}")
    return "\n".join(lines)


def render_svg(dot_source: str) -> tuple[str | None, str | None]:
    """``(svg, None)`` drawn by Graphviz's ``dot``, or ``(None, why not)``."""
    exe = shutil.which("dot")
    if exe is None:
        return None, NO_DOT
    try:
        out = subprocess.run([exe, "-Tsvg"], input=dot_source.encode(), capture_output=True,
                             timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"Graphviz's dot failed ({err}); the architecture is listed as a table"
    if out.returncode != 0:
        return None, f"Graphviz's dot failed: {out.stderr.decode(errors='replace')[:300]}"
    svg = out.stdout.decode()
    return svg[svg.find("<svg"):], None  # the inline SVG, without its XML prologue


def _reference(db, exp_id: int, row: dict, vs: int | None) -> dict | None:
    """What the model is compared against: model ``vs`` when given, else the base model it was
    built from (stored since schema 10: ``id`` None), else, in older files, its parent (what an
    evolution mutated) or the experiment's first model with a graph."""
    if vs is not None:
        return _model_row(db, exp_id, vs)
    base = base_graph(db, exp_id, row["sample"])
    if base is not None:
        return {"id": None, "graph": base}
    ref_id = row["parent"]
    if ref_id is None:
        ref_id = db.execute("SELECT min(id) FROM models WHERE experiment_id = ? AND graph IS "
                            "NOT NULL AND id != ?", [exp_id, row["id"]]).fetchone()[0]
    return None if ref_id is None else _model_row(db, exp_id, ref_id)


_FLOPS: dict[str, tuple] = {}  # structural hash -> (flops, why not); the page polls at 1 Hz


def flops(graph: dict | None, model_hash: str | None) -> tuple[float | None, str | None]:
    """``(FLOPs of one example's forward pass, None)`` by torch's flop counter, or ``(None,
    why)``: the model is built from its stored graph on the meta device (no memory, no
    values) with its references resolved under :class:`~retiarii.refs.TrustedRefs` and no
    space, so the space's own code is never imported; the input's shape is the one the
    engine recorded on the graph's input node, at batch 1."""
    key = model_hash or json.dumps(graph, sort_keys=True)[:4096]
    if key not in _FLOPS:
        if len(_FLOPS) > 512:
            _FLOPS.clear()
        _FLOPS[key] = _count_flops(graph)
    return _FLOPS[key]


def _count_flops(graph: dict | None) -> tuple[float | None, str | None]:
    if graph is None:
        return None, "the model has no stored graph"
    shapes = [(n.get("meta") or {}).get("shape") for n in graph.get("nodes", [])
              if n["op"]["kind"] == "input"]
    if not shapes or not all(isinstance(s, list) and s for s in shapes):
        return None, "its graph records no input shape (a store written before shapes were)"
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from ..cli_source import check_attributes
    from ..graph import Graph
    from ..refs import RefError, TrustedRefs, only_trusted

    rule = TrustedRefs(None)
    try:
        with only_trusted(rule), torch.device("meta"):
            g = Graph.from_data(graph)
            check_attributes(g, rule)
            module = g.to_module()
            inputs = [torch.empty([1, *s[1:]]) for s in shapes]
            with FlopCounterMode(display=False) as counter:
                module(*inputs)
        return float(counter.get_total_flops()), None
    except RefError as err:
        return None, f"{err}: the dashboard never imports the space's own code"
    except Exception as err:  # noqa: BLE001 (a graph this version cannot rebuild)
        return None, f"cannot count: {type(err).__name__}: {err}"


def _costs(db, model_hash: str | None) -> dict:
    if model_hash is None or not db.execute("SELECT 1 FROM sqlite_master WHERE name = "
                                            "'costs'").fetchone():
        return {}
    return {f"{name} ({device})": value for name, device, value in db.execute(
        "SELECT name, device, value FROM costs WHERE hash = ? ORDER BY name", [model_hash])}


def checkpoint_file(db, model_id: int, checkpoint_dir: str) -> str | None:
    """The file of the latest checkpoint of the model's last trial, or None."""
    from ..engine.storage.checkpoint import CheckpointDir, CheckpointPathError, legacy_name

    row = db.execute("SELECT c.path FROM checkpoints c JOIN trials t ON t.id = c.trial_id WHERE "
                     "t.model_id = ? ORDER BY t.seq DESC, c.step DESC LIMIT 1",
                     [model_id]).fetchone()
    if row is None:
        return None
    try:
        return CheckpointDir(checkpoint_dir).path(legacy_name(row[0], checkpoint_dir))
    except CheckpointPathError:  # a name reaching outside the run's folder: not followed
        return None


def weights(db, model_id: int, checkpoint_dir: str) -> dict | None:
    """The model's trained weights (its state dict), or None when no checkpoint is readable."""
    from ..engine.storage.checkpoint import CheckpointError
    from ..engine.storage.checkpoint import load as load_checkpoint

    path = checkpoint_file(db, model_id, checkpoint_dir)
    if path is None:
        return None
    try:
        return load_checkpoint(path)["model"]
    except (CheckpointError, OSError, KeyError, RuntimeError):
        return None


def weights_bytes(state: dict) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def source(graph: dict | None, model_id: int) -> tuple[str | None, str | None]:
    """``(source, None)``, the standalone file ``retiarii export`` writes, or ``(None, why)``."""
    from ..cli_source import trusted_source
    from ..refs import TrustedRefs

    if graph is None:
        return None, "the model has no stored graph (it could not be built)"
    try:
        return trusted_source(graph, f"Model{model_id}", TrustedRefs(None), f"model {model_id}",
                              ValueError), None
    except ValueError as err:
        return None, (f"{err}: the dashboard never imports the space's own code; `retiarii "
                      f"export` writes this model's file")
    except Exception as err:  # noqa: BLE001 (a stored graph this version cannot read)
        return None, f"the stored graph cannot be turned into source: {type(err).__name__}: {err}"


def model(db, exp_id: int, model_id: int, checkpoint_dir: str, vs: int | None = None) -> dict:
    """The model page's data: nodes, edges, the drawing, the diff, parameters, costs, source."""
    experiment(db, exp_id)
    row = _model_row(db, exp_id, model_id)
    if row["graph"] is None:
        nodes, edges, removed, reference = [], [], [], None
    else:
        reference = _reference(db, exp_id, row, vs)
        nodes, edges, removed = graph_rows(row["graph"], reference and reference["graph"])
    svg, note = render_svg(_dot_source(nodes, edges)) if nodes else (None, None)
    state = weights(db, model_id, checkpoint_dir)
    params = None if state is None else int(sum(
        t.numel() for k, t in state.items() if hasattr(t, "numel") and "running_" not in k
        and not k.endswith("num_batches_tracked")))
    code, why = source(row["graph"], model_id)
    n_flops, flops_note = flops(row["graph"], row["hash"])
    trials = [list(r) for r in db.execute("SELECT id, state, step FROM trials WHERE model_id = ? "
                                          "ORDER BY seq", [model_id])]
    return {"model": model_id, "status": row["status"], "value": row["value"],
            "sample": row["sample"], "hash": row["hash"], "parent": row["parent"],
            "reference": reference and reference["id"],
            "reference_is_base": bool(reference) and reference["id"] is None, "removed": removed,
            "changed": sum(n["diff"] != "same" for n in nodes), "svg": svg, "svg_note": note,
            "params": params, "has_weights": state is not None, "costs": _costs(db, row["hash"]),
            "flops": n_flops, "flops_note": flops_note,
            "source": code, "source_note": why,
            "tables": {"choices": table(["choice", "value"], [
                           [k, v if isinstance(v, (str, int, float)) or v is None else json.dumps(v)]
                           for k, v in (row["sample"] or {}).items()]),
                       "nodes": table(["uid", "name", "kind", "what", "shape", "diff"],
                                      [[n["uid"], n["name"], n["kind"], n["what"],
                                        json.dumps(n["shape"]), n["diff"]] for n in nodes]),
                       "edges": table(["from", "to", "port"], edges),
                       "trials": table(["trial", "state", "epochs"], trials)}}
