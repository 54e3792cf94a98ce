"""Module specs: how a module node records the module it calls, so it can be re-created anywhere.

A spec is JSON: ``{"cls": "torch.nn.modules.conv:Conv2d", "args": [...], "kwargs": {...}}``.

* Built-in ``torch.nn`` layers are read back from their attributes (``Conv2d.in_channels``,
  ``Linear.bias is not None``, ...), guided by the constructor's signature. Every spec read this
  way is *verified*: the module it builds (on the meta device, so no memory or init cost) must
  have the same ``repr`` and the same state-dict names and shapes as the original.
* User modules marked with :func:`leaf` record their constructor arguments when constructed.

Example::

    >>> spec = module_spec(torch.nn.Conv2d(3, 8, 3, padding=1, bias=False))
    >>> spec["kwargs"]
    {'padding': 1, 'bias': False}
    >>> build_module(spec)
    Conv2d(3, 8, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1), bias=False)
"""
from __future__ import annotations

import functools
import inspect
import json
from typing import Any, Callable

import torch
from torch import nn

from .codec import EncodeError, decode, encode, ref_of, resolve_ref

_SKIPPED_PARAMS = {"self", "device", "dtype"}


class SpecError(ValueError):
    """A module whose constructor arguments cannot be recovered or recorded."""


# ---- recording user modules ----------------------------------------------------------------


def leaf(cls: type[nn.Module]) -> type[nn.Module]:
    """Class decorator: trace treats the module as one opaque node and records its constructor
    arguments, so the node can be re-created (and exported) from JSON.

    Example::

        @retiarii.leaf
        class SepConv(nn.Module):
            def __init__(self, channels, kernel_size=3): ...

    The arguments must be JSON-encodable (numbers, strings, tuples, lists, dicts, dtypes,
    module-level functions, or other modules that are themselves re-creatable).
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"@retiarii.leaf decorates nn.Module subclasses, not {cls!r}")
    original_init = cls.__init__

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):  # noqa: N807 (wraps the class's own __init__)
        # Only the outermost constructor records: a subclass calling super().__init__ with
        # other arguments must not overwrite what the user passed to the subclass.
        if type(self) is cls:
            self.__dict__["_retiarii_init"] = (args, kwargs)
        original_init(self, *args, **kwargs)

    cls.__init__ = __init__
    cls._retiarii_leaf = True
    return cls


def is_marked_leaf(module: nn.Module) -> bool:
    return bool(getattr(type(module), "_retiarii_leaf", False))


def is_torch_builtin(module: nn.Module) -> bool:
    """Layers of torch.nn that torch.fx treats as leaves (containers are traced through)."""
    mod = type(module).__module__
    return (mod.startswith("torch.nn") or mod.startswith("torch.ao.nn")) and not isinstance(
        module, (nn.Sequential, nn.ModuleList, nn.ModuleDict))


# ---- reading constructor arguments back from attributes --------------------------------------

# Constructor parameters that no attribute of the same name holds.
_OVERRIDES: dict[str, dict[str, Callable[[nn.Module], Any]]] = {
    "MultiheadAttention": {
        "bias": lambda m: m.in_proj_bias is not None,
        "add_bias_kv": lambda m: m.bias_k is not None,
        "kdim": lambda m: None if m.kdim == m.embed_dim else m.kdim,
        "vdim": lambda m: None if m.vdim == m.embed_dim else m.vdim,
    },
    "TransformerEncoderLayer": {
        "d_model": lambda m: m.self_attn.embed_dim,
        "nhead": lambda m: m.self_attn.num_heads,
        "dim_feedforward": lambda m: m.linear1.out_features,
        "dropout": lambda m: m.dropout.p,
        "layer_norm_eps": lambda m: m.norm1.eps,
        "batch_first": lambda m: m.self_attn.batch_first,
        "bias": lambda m: m.linear1.bias is not None,
    },
    "Embedding": {"_weight": lambda m: None, "_freeze": lambda m: not m.weight.requires_grad},
}
_OVERRIDES["TransformerDecoderLayer"] = _OVERRIDES["TransformerEncoderLayer"]
# The stacks keep deep copies of the layer they were given, never the argument itself; the
# first copy re-creates it (the verification checks that every layer has its structure).
_OVERRIDES["TransformerEncoder"] = {"encoder_layer": lambda m: m.layers[0]}
_OVERRIDES["TransformerDecoder"] = {"decoder_layer": lambda m: m.layers[0]}


@functools.lru_cache(maxsize=None)  # inspect.signature is slow; classes are few
def _signature(cls: type) -> inspect.Signature:
    if issubclass(cls, nn.RNNBase):
        # LSTM/GRU/RNN take *args, **kwargs and forward them to RNNBase(mode, ...).
        sig = inspect.signature(nn.RNNBase.__init__)
        params = [p for p in sig.parameters.values() if p.name != "mode"]
        if issubclass(cls, nn.RNN):
            params.insert(4, inspect.Parameter("nonlinearity", inspect.Parameter.KEYWORD_ONLY,
                                               default="tanh"))
            params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if i >= 4 else p
                      for i, p in enumerate(params)]
        return sig.replace(parameters=[p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                       if p.kind != inspect.Parameter.KEYWORD_ONLY else p
                                       for p in params])
    return inspect.signature(cls.__init__)


def _collapse(v: Any) -> Any:
    """(3, 3) -> 3: the short form torch accepts for repeated per-dimension values."""
    if isinstance(v, tuple) and v and all(x == v[0] for x in v) and isinstance(v[0], int) \
            and not isinstance(v[0], bool):
        return v[0]
    return v


def _from_attributes(module: nn.Module, collapse: bool) -> tuple[list, dict]:
    cls = type(module)
    overrides = _OVERRIDES.get(cls.__name__, {})
    args: list = []
    kwargs: dict = {}
    for p in _signature(cls).parameters.values():
        if p.name in _SKIPPED_PARAMS or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        has_default = p.default is not p.empty
        if p.name in overrides:
            value = overrides[p.name](module)
        elif hasattr(module, p.name):
            value = getattr(module, p.name)
        elif has_default:
            continue
        else:
            raise SpecError(f"{cls.__name__} has no attribute {p.name!r} to read the "
                            f"constructor argument of the same name from")
        if isinstance(p.default, bool) and (value is None or isinstance(value, torch.Tensor)):
            value = value is not None  # bias=True <-> a bias Parameter exists
        elif isinstance(value, torch.Tensor):
            continue  # an initial-value argument (weights are loaded, not re-created)
        if collapse:
            value = _collapse(value)
        if has_default and _same(value, p.default):
            continue
        if has_default or p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = value
        else:
            args.append(value)
    return args, kwargs


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b) or (a is None and b is None)
    except Exception:  # noqa: BLE001 - e.g. comparing tensors; treat as different
        return False


def _fingerprint(module: nn.Module) -> tuple:
    def shape(v):  # lazy modules hold uninitialized parameters until their first call
        return None if isinstance(v, nn.parameter.UninitializedTensorMixin) else tuple(v.shape)
    return (repr(module), [(k, shape(v), v.dtype) for k, v in module.state_dict().items()])


@functools.lru_cache(maxsize=4096)
def _verified(spec_json: str, expected: str) -> bool:
    spec = json.loads(spec_json)
    try:
        with torch.device("meta"):
            rebuilt = build_module(spec)
    except Exception:  # noqa: BLE001 - any failure means "this spec does not re-create it"
        return False
    return repr(_fingerprint(rebuilt)) == expected


# ---- public --------------------------------------------------------------------------------


def module_spec(module: nn.Module) -> dict:
    """The JSON spec that re-creates ``module`` (fresh weights, same structure).

    Raises :class:`SpecError` when the constructor arguments cannot be recorded or read back.
    """
    cls = type(module)
    recorded = module.__dict__.get("_retiarii_init")
    try:
        # retiarii.nn layers stand for the torch.nn class they wrap (exports need only torch)
        cls_ref = ref_of(getattr(cls, "_retiarii_base", cls))
    except EncodeError as e:
        raise SpecError(f"module class {cls.__qualname__} is not importable: {e}") from None
    if recorded is not None:
        args, kwargs = recorded
        try:
            return {"cls": cls_ref, "args": encode(list(args), module_spec),
                    "kwargs": {k: encode(v, module_spec) for k, v in kwargs.items()}}
        except EncodeError as e:
            raise SpecError(f"the constructor arguments of {cls.__qualname__} cannot be "
                            f"recorded: {e}. Pass JSON-like values (numbers, strings, tuples, "
                            f"dtypes, module-level functions) to the constructor") from None
    expected = repr(_fingerprint(module))
    last_error = None
    for collapse in (True, False):
        try:
            args, kwargs = _from_attributes(module, collapse)
            spec = {"cls": cls_ref, "args": encode(args, module_spec),
                    "kwargs": {k: encode(v, module_spec) for k, v in kwargs.items()}}
        except (SpecError, EncodeError) as e:
            last_error = e
            continue
        if _verified(json.dumps(spec, sort_keys=True), expected):
            return spec
    hint = f" ({last_error})" if last_error else ""
    raise SpecError(
        f"cannot re-create {cls.__qualname__} from its attributes{hint}. Decorate the class "
        f"with @retiarii.leaf so its constructor arguments are recorded, or let trace go "
        f"through it (do not mark it a leaf)")


def build_module(spec: dict) -> nn.Module:
    """Construct a fresh module from a spec made by :func:`module_spec`."""
    cls = resolve_ref(spec["cls"])
    args = decode(spec.get("args", []), module_decoder=build_module)
    kwargs = {k: decode(v, module_decoder=build_module) for k, v in spec.get("kwargs", {}).items()}
    module = cls(*args, **kwargs)
    if spec.get("frozen"):  # see is_frozen: its values come from the base model (space.py)
        module.requires_grad_(False)
    return module


def is_frozen(module: nn.Module) -> bool:
    """Whether the trace records ``module`` as *frozen*: it has parameters, none of them
    trains (``requires_grad=False``), and every persistent buffer it keeps is **running
    statistics** (:func:`running_statistics`: a BatchNorm's or InstanceNorm's, which evolve
    from the module's inputs only). Frozen means weights that do not train: a frozen
    BatchNorm in train mode still normalizes with the batch's statistics and updates its
    running ones, as it does alone (docs/optimization.md, "Frozen parameters"). Any other
    persistent buffer (a user's state, whose updates the engine cannot read) makes the module
    not frozen. A frozen node's spec carries ``"frozen": true``; :func:`build_module` then
    builds it with ``requires_grad=False``, and ``ModelSpace.build`` gives it the base
    model's values, running statistics included."""
    params = list(module.parameters())
    if not params or any(p.requires_grad for p in params):
        return False
    stats = {id(b) for m in module.modules() if running_statistics(m)
             for b in m.buffers(recurse=False)}
    return all(id(b) in stats for name, b in module.named_buffers()
               if name.rpartition(".")[2] not in _owner(module, name)._non_persistent_buffers_set)


def running_statistics(module: nn.Module) -> bool:
    """Whether ``module`` keeps running statistics of its inputs and nothing else as state:
    ``nn.BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ``InstanceNorm*`` with
    ``track_running_stats=True``. Their buffers change in train mode by a rule of the
    module's inputs alone, so two copies that start equal and read equal inputs stay equal."""
    return isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats


def _owner(module: nn.Module, name: str) -> nn.Module:
    path = name.rpartition(".")[0]
    return module.get_submodule(path) if path else module

