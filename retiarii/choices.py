"""Inline choices: a space written inside the model, compiled into mutators at trace time.

``LayerChoice`` (pick one of several modules), ``InputChoice`` (pick which inputs to merge),
``ValueChoice`` (a constructor argument or hyper-parameter picked from values) and ``Repeat``
(a block repeated a chosen number of times). Each behaves as its first option when the model
runs eagerly; ``ModelSpace`` traces the model and turns every inline choice into a mutator
over the graph, so inline spaces and mutator spaces are one thing to strategies and engine.

Example::

    class Cell(nn.Module):
        def __init__(self):
            super().__init__()
            self.op = rt.LayerChoice({"conv": nn.Conv2d(16, 16, 3, padding=1),
                                      "pool": nn.MaxPool2d(3, 1, 1)})
            self.width = rt.ValueChoice([32, 64])
            self.fc = rt.nn.LazyLinear(self.width)     # ValueChoice args need retiarii.nn layers
            self.blocks = rt.Repeat(lambda i: Block(), depth=(1, 3))

Labels default to the module path (``"cell.op"``, ``"stage.blocks.1.op"`` inside a repeated
block), or for a ValueChoice to the first place it is used (``"fc.out_features"``); one
ValueChoice object is one choice wherever it is used. Give the same label to tie choices.

This module holds the classes users write; :mod:`.choice_mutators` the mutators they compile
to, and :mod:`.choice_tracing` the trace hooks that compile them (``trace_space``).
"""
from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Sequence

from torch import nn

from . import ops
from .codec import encode, evaluate_choice
from .mutator import Mutator, candidate_keys

# ---- ValueChoice -----------------------------------------------------------------------------

# torch.nn's constructors check their arguments in Python (``p < 0``, ``if bias``): a choice
# reaching one of them was passed to the plain layer instead of its recording twin
_TWIN_HINT = ("if a torch.nn layer's constructor raised this, give the choice to its "
              "retiarii.nn twin instead (rt.nn.Dropout(p=rt.ValueChoice([0.1, 0.3])), "
              "rt.nn.Linear(64, width)), which records it and builds the chosen layer")


class Expr:
    """Arithmetic on ValueChoices (``ratio * channels``), evaluated once values are chosen."""

    def _binary(name, reverse=False):  # noqa: N805 - builds the dunder methods below
        def method(self, other):
            args = [other, self] if reverse else [self, other]
            return ChoiceExpr(name, args)
        return method

    __add__, __radd__ = _binary("add"), _binary("add", True)
    __sub__, __rsub__ = _binary("sub"), _binary("sub", True)
    __mul__, __rmul__ = _binary("mul"), _binary("mul", True)
    __truediv__, __rtruediv__ = _binary("truediv"), _binary("truediv", True)
    __floordiv__, __rfloordiv__ = _binary("floordiv"), _binary("floordiv", True)
    __mod__, __rmod__ = _binary("mod"), _binary("mod", True)
    __pow__ = _binary("pow")

    def __bool__(self):
        raise TypeError("a ValueChoice has no truth value until a model is sampled: do not "
                        "branch on it in __init__ (use a LayerChoice or a mutator instead); "
                        f"{_TWIN_HINT}")

    def __index__(self):
        raise TypeError("a ValueChoice is not an int until a model is sampled; pass it to a "
                        "retiarii.nn layer's constructor instead of using it in Python code")

    def _order(self, other):
        raise TypeError(f"a ValueChoice cannot be compared with {other!r} until a model is "
                        f"sampled; {_TWIN_HINT}")

    __lt__ = __le__ = __gt__ = __ge__ = _order


class ValueChoice(Expr):
    """One value among ``values``: a constructor argument of a ``retiarii.nn`` layer, an
    argument in forward, a ``Repeat`` depth, or a trainer hyper-parameter.

    Example::

        >>> width = rt.ValueChoice([16, 32, 64], label="width")
        >>> conv = rt.nn.Conv2d(3, width, 3)       # records the choice, runs as 16 eagerly
        >>> bn = rt.nn.BatchNorm2d(width)          # same object: tied to the conv's width

    Args:
        values: JSON-like candidates (numbers, strings, bools, None).
        label: the choice's name in samples (default: from where it is first used).
    """

    def __init__(self, values: Sequence, label: str | None = None):
        self.values = list(values)
        if not self.values:
            raise ValueError("ValueChoice needs at least one value")
        self.label = label

    @property
    def default(self) -> Any:
        return self.values[0]

    def __retiarii_encode__(self) -> dict:
        return {"__choice__": {"id": id(self), "label": self.label,
                               "values": [encode(v) for v in self.values]}}

    def choose_in(self, ctx) -> Any:
        """Make this choice inside a space being sampled (trainer hyper-parameters)."""
        return _HParamChooser(self.label).run(ctx, self.values)

    def __repr__(self):
        return f"ValueChoice({self.values!r}, label={self.label!r})"


class ChoiceExpr(Expr):
    def __init__(self, op: str, args: list):
        self.op, self.args = op, args

    @property
    def default(self) -> Any:
        return evaluate_choice(self.__retiarii_encode__()["__choice__"], None)

    def __retiarii_encode__(self) -> dict:
        return {"__choice__": {"op": self.op, "args": [encode(a) for a in self.args]}}


class _HParamChooser(Mutator):
    def run(self, ctx, values):
        self._ctx, self._calls = ctx, 0
        try:
            return self.choose(values, label=self.label)
        finally:
            self._ctx = None


# ---- retiarii.nn: torch.nn layers that accept ValueChoice arguments ----------------------------

_WRAPPED: dict[type, type] = {}


def has_choice(value: Any) -> bool:
    if isinstance(value, Expr):
        return True
    if isinstance(value, (list, tuple)):
        return any(has_choice(v) for v in value)
    if isinstance(value, dict):
        return any(has_choice(v) for v in value.values())
    return False


def _defaults(value: Any) -> Any:
    if isinstance(value, Expr):
        return value.default
    if isinstance(value, (list, tuple)):
        return type(value)(_defaults(v) for v in value)
    if isinstance(value, dict):
        return {k: _defaults(v) for k, v in value.items()}
    return value


def wrap_layer(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass of ``cls`` that accepts ValueChoices as constructor arguments (it is built
    with their defaults and records the choices)."""
    if cls in _WRAPPED:
        return _WRAPPED[cls]

    def __init__(self, *args, **kwargs):  # noqa: N807 (it becomes the class's __init__)
        self.__dict__["_retiarii_init"] = (args, kwargs)
        cls.__init__(self, *_defaults(args), **_defaults(kwargs))

    wrapped = type(cls.__name__, (cls,), {"__init__": __init__, "_retiarii_leaf": True,
                                          "_retiarii_base": cls, "__module__": "retiarii.nn",
                                          "__qualname__": cls.__name__})
    _WRAPPED[cls] = wrapped
    return wrapped


# ---- the inline choice modules ------------------------------------------------------------------


class LayerChoice(nn.Module):
    """One of several modules. Runs as the first candidate eagerly.

    Example::

        self.op = rt.LayerChoice({"conv3x3": nn.Conv2d(16, 16, 3, padding=1),
                                  "sep": SepConv(16), "pool": nn.MaxPool2d(3, 1, 1)})

    Args:
        candidates: a list of modules, or a dict of name -> module (names are the sample keys;
            for a list the keys are the class names). A candidate may itself hold inline
            choices: they exist only in models where it is chosen.
        label: the choice's name (default: the module path).
    """

    def __init__(self, candidates: Sequence[nn.Module] | dict[str, nn.Module],
                 label: str | None = None):
        super().__init__()
        if isinstance(candidates, dict):
            keys, mods = [str(k) for k in candidates], list(candidates.values())
        else:
            keys, mods = candidate_keys(list(candidates))  # class names, as mutators use
        if not mods:
            raise ValueError("LayerChoice needs at least one candidate")
        bad = [k for k in keys if "." in k or not k]
        if bad:
            raise ValueError(f"LayerChoice candidate names cannot contain '.': {bad}")
        self.keys = keys
        self.options = nn.ModuleList(mods)
        self.label = label

    def forward(self, *args, **kwargs):
        return self.options[0](*args, **kwargs)


class InputChoice(nn.Module):
    """Choose ``n_chosen`` of ``n_candidates`` inputs and merge them.

    Example::

        self.skip = rt.InputChoice(n_candidates=3, n_chosen=1)
        ...
        out = self.skip([x0, x1, x2])

    The kept inputs are merged in their order in the list, so a choice is a set of indices
    (a multiset with ``distinct=False``): ``C(n_candidates, n_chosen)`` candidates, or
    ``C(n_candidates + n_chosen - 1, n_chosen)`` with repeats. The inputs that are not kept
    are not computed: what only they used leaves the model, and the choices inside it leave
    the sample.

    Args:
        n_candidates: how many tensors the list passed to forward holds.
        n_chosen: how many are kept.
        reduction: "sum", "mean" or "concat" (along dim 1) of the kept inputs; "none" when
            ``n_chosen == 1``.
        distinct: the kept inputs are different ones (default, as in DARTS-like cells: summing
            one input twice only rescales it). ``False`` lets one input be kept several times
            (``n_chosen`` may then exceed ``n_candidates``).
        label: the choice's name (default: the module path).
    """

    _REDUCTIONS = ("sum", "mean", "concat", "none")

    def __init__(self, n_candidates: int, n_chosen: int = 1, reduction: str = "sum",
                 label: str | None = None, distinct: bool = True):
        super().__init__()
        if reduction not in self._REDUCTIONS:
            raise ValueError(f"reduction {reduction!r} is not one of {self._REDUCTIONS}")
        if n_candidates < 1 or n_chosen < 1 or (distinct and n_chosen > n_candidates):
            raise ValueError(f"n_chosen={n_chosen} must be in [1, n_candidates={n_candidates}]"
                             + ("" if distinct else " (or more, with distinct=False)"))
        if reduction == "none" and n_chosen != 1:
            raise ValueError("reduction='none' keeps a single input: use n_chosen=1")
        self.n_candidates, self.n_chosen, self.reduction, self.label = \
            n_candidates, n_chosen, reduction, label
        self.distinct = distinct

    def subsets(self) -> list[tuple[int, ...]]:
        """The candidates of the choice: tuples of kept indices, the first one the default."""
        pick = itertools.combinations if self.distinct else itertools.combinations_with_replacement
        return list(pick(range(self.n_candidates), self.n_chosen))

    def merge_module(self) -> nn.Module:
        return {"sum": ops.Sum, "none": ops.Sum, "mean": ops.Mean,
                "concat": ops.Concat}[self.reduction]()

    def forward(self, inputs: list):
        first = range(self.n_chosen) if self.distinct else [0] * self.n_chosen
        return self.merge_module()(*(inputs[i] for i in first))


class Repeat(nn.Module):
    """A block repeated a chosen number of times, in sequence.

    Example::

        self.stage = rt.Repeat(lambda i: Block(32 if i == 0 else 64, 64), depth=(1, 4))

    Args:
        blocks: a module (deep-copied for each position), a list of modules, or a function
            ``index -> module``.
        depth: an int, a ``(min, max)`` range, a list of depths, or a ValueChoice of depths;
            the first listed is the default (the eager run and the base model), as every
            choice's first candidate.
        label: the choice's name (default: the module path + ".depth").
    """

    def __init__(self, blocks: nn.Module | Sequence[nn.Module] | Callable[[int], nn.Module],
                 depth: int | tuple | list | ValueChoice, label: str | None = None):
        super().__init__()
        if isinstance(depth, ValueChoice):
            label = label or depth.label
            depths = list(depth.values)
        elif isinstance(depth, tuple):
            depths = list(range(depth[0], depth[1] + 1))
        elif isinstance(depth, int):
            depths = [depth]
        else:
            depths = list(depth)
        if not depths or min(depths) < 0 or max(depths) < 1:
            raise ValueError(f"Repeat depth {depth!r}: need depths >= 0 with a maximum >= 1")
        n = max(depths)
        if isinstance(blocks, nn.Module):
            mods = [blocks] + [copy.deepcopy(blocks) for _ in range(n - 1)]
        elif callable(blocks):
            mods = [blocks(i) for i in range(n)]
        else:
            mods = list(blocks)
            if len(mods) < n:
                raise ValueError(f"Repeat got {len(mods)} blocks for a depth up to {n}")
        self.depths, self.label = list(depths), label  # in the given order: [0] the default
        self.blocks = nn.ModuleList(mods[:n])

    def forward(self, x):
        for block in self.blocks[:self.depths[0]]:
            x = block(x)
        return x
