"""Graph IR -> standalone source, through libcst (:func:`to_source`).

``to_source`` writes a model as one readable class that imports only torch; the source of the
user's own leaf modules (and what they use) is copied in before it (``inline.py``)::

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.layer1 = nn.ModuleDict({
                '0': nn.ModuleDict({
                    'conv1': nn.Conv2d(64, 64, 3, padding=1, bias=False),
            ...
        def forward(self, x):
            conv1 = self.conv1(x)
            ...
"""
from __future__ import annotations

import builtins
import math
import operator
import os
from typing import Any

import libcst as cst
import torch
from torch import nn

from ..codec import decode, ref_of, resolve_ref
from ..graph import Graph, GraphError, Node
from ..inline import InlineError, Inliner
from ..interpreter import Interpreter
from .fx_backend import owned_by_module, owner_paths, PyNames, registration_rank

__all__ = ["to_source"]


# ---- to_source -----------------------------------------------------------------------------

_INFIX = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/",
          operator.floordiv: "//", operator.mod: "%", operator.pow: "**", operator.matmul: "@",
          operator.and_: "&", operator.or_: "|", operator.xor: "^", operator.lshift: "<<",
          operator.rshift: ">>", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
          operator.le: "<=", operator.gt: ">", operator.ge: ">="}
_PREFIX = {operator.neg: "-", operator.pos: "+", operator.invert: "~"}
_DICT_ATTRS = set(dir(nn.ModuleDict))


class _Source:
    """Renders one class; collects the imports the rendered expressions need, and the source
    of the user's own classes it uses (copied in, so the file needs only torch)."""

    def __init__(self):
        self.imports: set[str] = set()
        self.needs: set[str] = set()  # what the file imports besides torch, for its header
        self.inliner = Inliner({"torch": "module:torch", "nn": "module:torch.nn"})
        for name, module in (("F", "torch.nn.functional"), ("operator", "operator"),
                             ("math", "math")):  # what the rendered expressions may import
            self.inliner.bind(name, f"module:{module}")

    # -- references and literals
    def ref(self, obj: Any) -> str:
        name = getattr(obj, "__name__", None)
        if obj is getattr(nn, name or "", None) and isinstance(obj, type):
            return f"nn.{name}"
        if getattr(torch.nn.functional, name or "", None) is obj:
            self.imports.add("import torch.nn.functional as F")
            return f"F.{name}"
        if getattr(torch, name or "", None) is obj:
            return f"torch.{name}"
        if getattr(operator, name or "", None) is obj:
            self.imports.add("import operator")
            return f"operator.{name}"
        if getattr(math, name or "", None) is obj:
            self.imports.add("import math")
            return f"math.{name}"
        if getattr(builtins, name or "", None) is obj:
            return name
        module, qual = obj.__module__, obj.__qualname__
        if module.split(".")[0] == "torch":
            return f"{module}.{qual}"
        try:
            inlined = self.inliner.add(obj)
        except InlineError as e:
            inlined = None
            self.needs.add(f"{qual} ({e})")
        if inlined is not None:
            return inlined
        where = ref_of(obj).rpartition(":")[0]
        if where.endswith(".py"):  # the user's script: importable by its file name, if at all
            module = os.path.splitext(os.path.basename(where))[0]
            self.needs.add(f"{where} importable as {module}")
        else:
            self.needs.add(f"the module {module}")
        top = qual.split(".")[0]
        self.imports.add(f"from {module} import {top}")
        return qual

    def literal(self, data: Any, inputs: list[str], index: bool = False) -> str:
        """Render an encoded value; ``index`` renders a top-level tuple/slice as in ``x[...]``."""
        if isinstance(data, list):
            return "[" + ", ".join(self.literal(v, inputs) for v in data) + "]"
        if not isinstance(data, dict):
            return repr(data)
        (tag, p), = data.items()
        if tag == "__in__":
            return inputs[p]
        if tag == "__tuple__":
            items = [self.literal(v, inputs, index=index) for v in p]
            if index and items:
                return ", ".join(items)
            return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
        if tag == "__slice__":
            a, b, c = ("" if v is None else self.literal(v, inputs) for v in p)
            if index:
                return f"{a}:{b}" + (f":{c}" if c else "")
            return f"slice({a or None}, {b or None}, {c or None})"
        if tag == "__ellipsis__":
            return "..."
        if tag == "__size__":
            return f"torch.Size({p!r})"
        if tag == "__dict__":
            return "{" + ", ".join(f"{self.literal(k, inputs)}: {self.literal(v, inputs)}"
                                   for k, v in p) + "}"
        if tag == "__float__":
            return f"float({p!r})"
        if tag in ("__dtype__", "__torchattr__"):
            return f"torch.{p}"
        if tag == "__device__":
            return f"torch.device({p!r})"
        if tag == "__tensor__":
            values = decode(data)
            return (f"torch.tensor({_tensor_list(values)!s}, dtype=torch.{p['dtype']})"
                    + (f".reshape({tuple(p['shape'])!r})" if values.numel() == 0 else ""))
        if tag == "__ref__":
            return self.ref(resolve_ref(p))
        if tag == "__module__":
            return self.constructor(p)
        raise GraphError(f"cannot render encoded value {data!r}")

    def constructor(self, spec: dict) -> str:
        cls = self.ref(resolve_ref(spec["cls"]))
        args = [self.literal(v, []) for v in spec.get("args", [])]
        args += [f"{k}={self.literal(v, [])}" for k, v in spec.get("kwargs", {}).items()]
        return f"{cls}({', '.join(args)})"

    def call(self, node: Node, inputs: list[str], module_expr: str | None) -> str:
        op = node.op
        args = [self.literal(v, inputs) for v in op.args]
        kwargs = [f"{k}={self.literal(v, inputs)}" for k, v in op.kwargs.items()]
        if op.kind in ("module", "subgraph"):
            return f"{module_expr}({', '.join(args + kwargs)})"
        if op.kind == "method":
            return f"{args[0]}.{op.target}({', '.join(args[1:] + kwargs)})"
        fn = resolve_ref(op.target)
        if not kwargs and fn in _INFIX and len(args) == 2:
            return f"{args[0]} {_INFIX[fn]} {args[1]}"
        if not kwargs and fn in _PREFIX and len(args) == 1:
            return f"{_PREFIX[fn]}{args[0]}"
        if fn is operator.getitem and not kwargs and len(args) == 2:
            return f"{args[0]}[{self.literal(op.args[1], inputs, index=True)}]"
        if fn is getattr and len(op.args) == 2 and isinstance(op.args[1], str) \
                and op.args[1].isidentifier():
            return f"{args[0]}.{op.args[1]}"
        return f"{self.ref(fn)}({', '.join(args + kwargs)})"


def _tensor_list(t: torch.Tensor) -> Any:
    def fmt(v):
        if isinstance(v, list):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        if isinstance(v, float) and not math.isfinite(v):
            return f"float('{v}')"
        return repr(v)
    return fmt(t.tolist())


def _access(path: str) -> str:
    first, *rest = path.split(".")
    out = f"self.{first}" if first.isidentifier() else f"getattr(self, {first!r})"
    for part in rest:  # below the root, containers are nn.ModuleDicts
        out += f".{part}" if part.isidentifier() and part not in _DICT_ATTRS else f"[{part!r}]"
    return out


class _Tree:
    """Nested containers of the emitted class: path part -> constructor text or subtree."""

    def __init__(self):
        self.children: dict[str, Any] = {}

    def put(self, path: str, expr: str) -> None:
        *parents, leaf = path.split(".")
        tree = self
        for part in parents:
            tree = tree.children.setdefault(part, _Tree())
            if not isinstance(tree, _Tree):
                raise GraphError(f"module path {path!r} lies inside the module {part!r}")
        tree.children[leaf] = expr

    def ensure(self, path: str) -> None:
        """Create the (possibly empty) container at ``path``: it holds a parameter."""
        tree = self
        for part in path.split(".") if path else []:
            tree = tree.children.setdefault(part, _Tree())
            if not isinstance(tree, _Tree):
                raise GraphError(f"a parameter under {path!r} lies inside the module {part!r}")

    def sort(self, rank, prefix: str = "") -> None:
        """Order children by ``rank`` of their full path (stable for equal ranks)."""
        self.children = dict(sorted(self.children.items(), key=lambda kv: rank(prefix + kv[0])))
        for key, child in self.children.items():
            if isinstance(child, _Tree):
                child.sort(rank, f"{prefix}{key}.")

    def render(self, indent: int) -> str:
        pad = " " * indent
        if not self.children:
            return "nn.ModuleDict()"
        items = []
        for key, child in self.children.items():
            if key in _DICT_ATTRS:
                raise GraphError(f"submodule name {key!r} clashes with an nn.ModuleDict "
                                 f"attribute; rename the node")
            text = child.render(indent + 4) if isinstance(child, _Tree) else child
            items.append(f"{pad}    {key!r}: {text},")
        return "nn.ModuleDict({\n" + "\n".join(items) + f"\n{pad}}})"


def to_source(graph: Graph, class_name: str = "Model") -> str:
    """Standalone Python source of one ``nn.Module`` class; see the module docstring."""
    if not class_name.isidentifier():
        raise ValueError(f"class name {class_name!r} is not a Python identifier")
    src = _Source()
    names = PyNames()
    tree = _Tree()
    params: list[str] = []
    body: list[str] = []
    signature: list[str] = []
    _SourceEmitter(graph, "", src, names, tree, params, body, signature, None).run()
    tree.sort(registration_rank(graph))

    init = ["super().__init__()"]
    for key, child in tree.children.items():
        text = child.render(0) if isinstance(child, _Tree) else child  # libcst indents it
        init.append(f"self.{key} = {text}" if key.isidentifier()
                    else f"self.add_module({key!r}, {text})")
    init += params
    try:
        src.inliner.bind(class_name, "the exported model")
    except InlineError:
        raise GraphError(f"class name {class_name!r} is taken by a class the model uses; "
                         f"choose another") from None
    imports = ["import torch", "import torch.nn as nn"] + sorted(src.imports
                                                                 | src.inliner.imports)
    cls = cst.ClassDef(
        name=cst.Name(class_name),
        bases=[cst.Arg(cst.parse_expression("nn.Module"))],
        body=cst.IndentedBlock(body=[
            _function("__init__", ["self"], init),
            _function("forward", ["self"] + signature, body),
        ]),
        leading_lines=[cst.EmptyLine(), cst.EmptyLine()],
    )
    needs = ("Needs only torch." if not src.needs else
             "Needs torch and, as imported below: " + "; ".join(sorted(src.needs)) + ".")
    header = cst.parse_module(
        f'"""{class_name}: generated by retiarii from the graph IR. {needs}"""\n'
        + "\n".join(imports) + "\n")
    copied, simple_before = [], False
    for block in src.inliner.blocks:  # the user's own code, as written, before the model
        first, *rest = cst.parse_module(block).body
        simple = isinstance(first, cst.SimpleStatementLine)  # a constant
        gap = 0 if simple and simple_before else 1 if simple else 2
        copied += [first.with_changes(leading_lines=[cst.EmptyLine()] * gap)] + rest
        simple_before = simple
    return header.with_changes(body=list(header.body) + copied
                               + [cls]).code


def _function(name: str, params: list[str], lines: list[str]) -> cst.FunctionDef:
    stmts = [cst.parse_statement(line + "\n") for line in lines] or [cst.parse_statement("pass\n")]
    return cst.FunctionDef(
        name=cst.Name(name),
        params=cst.parse_expression(f"lambda {', '.join(params)}: 0").params,
        body=cst.IndentedBlock(body=stmts),
        leading_lines=[] if name == "__init__" else [cst.EmptyLine(indent=False)],
    )


class _SourceEmitter(Interpreter):
    """Runs the graph on source text: every node appends its statement to ``body`` and
    becomes the name of the variable holding its value. A cell (subgraph) is written inline,
    its names and module paths under its own path."""

    def __init__(self, graph: Graph, prefix: str, src: _Source, names: PyNames, tree: _Tree,
                 params: list[str], body: list[str], signature: list[str],
                 cell_inputs: list[str] | None):
        super().__init__(graph)
        self.prefix, self.src, self.names, self.tree = prefix, src, names, tree
        self.params, self.body, self.signature = params, body, signature
        self.cell_inputs = cell_inputs  # a cell's input variables; None at the top level
        self.owners = {prefix + p for p in owner_paths(graph)}
        self.declared: set[str] = set()
        self.inputs_seen = 0
        self.returned = False

    def run(self) -> str | None:
        out = super().run()
        if not self.returned:
            raise GraphError("graph has no output node")
        return out

    def fetch_inputs(self, node: Node) -> list:
        return [] if self.returned else super().fetch_inputs(node)

    def run_node(self, node: Node, inputs: list) -> str | None:
        if self.returned:  # nothing after the return statement
            return None
        return super().run_node(node, inputs)

    def fresh(self, node: Node) -> str:
        return self.names.fresh(self.prefix + node.name)

    def on_input(self, node, inputs):
        if self.cell_inputs is not None:
            self.inputs_seen += 1
            return self.cell_inputs[self.inputs_seen - 1]
        var = self.names.fresh(node.op.target or node.name)
        spec = node.op.spec or {}
        self.signature.append(var + (f"={self.src.literal(spec['default'], [])}"
                                     if "default" in spec else ""))
        return var

    def on_output(self, node, inputs):
        out = self.src.literal(node.op.args[0], inputs)
        self.returned = True
        if self.cell_inputs is None:
            self.body.append(f"return {out}")
            return None
        var = self.names.fresh(self.prefix.rstrip(".") or "out")
        self.body.append(f"{var} = {out}")
        return var

    def on_subgraph(self, node, inputs):
        return _SourceEmitter(node.op.graph, self.prefix + node.attr + ".", self.src, self.names,
                              self.tree, self.params, self.body, self.signature, inputs).run()

    def on_module(self, node, inputs):
        var, path = self.fresh(node), self.prefix + node.attr
        inline = _inline_expr(node, inputs)
        if inline is not None:  # a weightless merge (retiarii.ops): plain torch code
            self.body.append(f"{var} = {inline}")
            return var
        if path not in self.declared:
            self.tree.put(path, self.src.constructor(node.op.spec))
            self.declared.add(path)
        self.body.append(f"{var} = {self.src.call(node, inputs, _access(path))}")
        return var

    def on_param(self, node, inputs):
        var, path = self.fresh(node), self.prefix + node.attr
        if not owned_by_module(path, self.owners) and path not in self.declared:
            self.declared.add(path)
            self.tree.ensure(path.rpartition(".")[0])
            self.params.append(_param_line(path, node.op.spec, self.src))
        owner, _, leaf = path.rpartition(".")  # a tensor, not a submodule: no [key]
        owner_expr = _access(owner) if owner else "self"
        plain = leaf.isidentifier() and leaf not in _DICT_ATTRS
        self.body.append(f"{var} = {owner_expr}.{leaf}" if plain
                         else f"{var} = getattr({owner_expr}, {leaf!r})")
        return var

    def on_constant(self, node, inputs):
        var = self.fresh(node)
        self.body.append(f"{var} = {self.src.literal(node.op.spec['value'], [])}")
        return var

    def on_function(self, node, inputs):
        var = self.fresh(node)
        self.body.append(f"{var} = {self.src.call(node, inputs, None)}")
        return var

    on_method = on_function


def _inline_expr(node: Node, inputs: list[str]) -> str | None:
    """Modules that say how to write themselves as an expression (``export_expr``, e.g. the
    merges of :mod:`retiarii.ops`) are exported inline, so the file needs only torch."""
    cls = resolve_ref(node.op.spec["cls"])
    render = getattr(cls, "export_expr", None)
    if render is None or node.op.kwargs or any(not _is_port(a) for a in node.op.args):
        return None
    kwargs = {k: decode(v) for k, v in node.op.spec.get("kwargs", {}).items()}
    return render([inputs[a["__in__"]] for a in node.op.args], kwargs)


def _is_port(data) -> bool:
    return isinstance(data, dict) and len(data) == 1 and "__in__" in data


def _param_line(path: str, spec: dict, src: _Source) -> str:
    owner, _, leaf = path.rpartition(".")
    owner_expr = _access(owner) if owner else "self"
    if "init" in spec:
        value = src.literal(spec["init"], [])
    elif spec["buffer"] or not getattr(torch, spec["dtype"]).is_floating_point:
        value = f"torch.zeros({tuple(spec['shape'])!r}, dtype=torch.{spec['dtype']})"
    else:
        value = (f"nn.init.trunc_normal_(torch.empty({tuple(spec['shape'])!r}, "
                 f"dtype=torch.{spec['dtype']}), std=0.02)")
    if spec["buffer"]:
        persistent = "" if spec.get("persistent", True) else ", persistent=False"
        return f"{owner_expr}.register_buffer({leaf!r}, {value}{persistent})"
    grad = "" if spec.get("requires_grad", True) else ", requires_grad=False"
    return f"{owner_expr}.register_parameter({leaf!r}, nn.Parameter({value}{grad}))"
