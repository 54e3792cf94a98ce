"""JSON encoding of the Python values that appear in a graph: call arguments, constructor
arguments, constants.

The IR never pickles. Every value a node needs (a kernel size tuple, a dtype, a slice, a
reference to ``torch.cat``, a small tensor constant) is encoded to plain JSON here and decoded
back to an equal value. Tags are one-key dicts whose key starts and ends with ``__``::

    (3, 3)             -> {"__tuple__": [3, 3]}
    torch.float32      -> {"__dtype__": "float32"}
    slice(None, 2)     -> {"__slice__": [null, 2, null]}
    torch.cat          -> {"__ref__": "torch:cat"}
    input port 1       -> {"__in__": 1}

``encode`` raises :class:`EncodeError` naming the value it cannot encode.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable

import torch

from .refs import EncodeError, ref_of, resolve_ref

MAX_INLINE_TENSOR = 4096  # elements; larger tensors are described (shape, dtype), not stored


class PortRef:
    """Stands for "the value arriving on input port ``index``" inside an argument template."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __repr__(self):
        return f"PortRef({self.index})"

    def __eq__(self, other):
        return isinstance(other, PortRef) and other.index == self.index

    def __hash__(self):
        return hash(("PortRef", self.index))


# ---- encode / decode (references to classes and functions: refs.ref_of / refs.resolve_ref) ----


def _encode_tensor(t: torch.Tensor) -> dict:
    if t.numel() > MAX_INLINE_TENSOR:
        raise EncodeError(f"tensor of shape {tuple(t.shape)} is too large to inline "
                          f"(> {MAX_INLINE_TENSOR} elements)")
    t = t.detach().cpu()
    return {"__tensor__": {"dtype": str(t.dtype).removeprefix("torch."),
                           "shape": list(t.shape),
                           "data": [_encode_float(v) if isinstance(v, float) else v
                                    for v in t.flatten().tolist()]}}


def _encode_float(v: float) -> Any:
    if math.isfinite(v):
        return v
    return {"__float__": repr(v)}  # 'nan', 'inf', '-inf'


def encode(value: Any, module_encoder: Callable[[torch.nn.Module], dict] | None = None) -> Any:
    """Encode ``value`` to JSON-compatible data (see the module docstring for the tags).

    ``module_encoder`` encodes an ``nn.Module`` found among constructor arguments (e.g. an
    activation module); without it, modules are rejected.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if hasattr(value, "__retiarii_encode__"):  # inline choices (ValueChoice) encode themselves
        return value.__retiarii_encode__()
    if isinstance(value, float):
        return _encode_float(value)
    if isinstance(value, PortRef):
        return {"__in__": value.index}
    if isinstance(value, list):
        return [encode(v, module_encoder) for v in value]
    if isinstance(value, torch.Size):
        return {"__size__": list(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, module_encoder) for v in value]}
    if isinstance(value, dict):
        return {"__dict__": [[encode(k, module_encoder), encode(v, module_encoder)]
                             for k, v in value.items()]}
    if isinstance(value, slice):
        return {"__slice__": [encode(value.start), encode(value.stop), encode(value.step)]}
    if value is Ellipsis:
        return {"__ellipsis__": True}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    if isinstance(value, (torch.memory_format, torch.layout)):
        return {"__torchattr__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value)
    if isinstance(value, torch.nn.Module):
        if module_encoder is None:
            raise EncodeError(f"a module ({type(value).__name__}) cannot be used as a value here")
        return {"__module__": module_encoder(value)}
    if callable(value):
        return {"__ref__": ref_of(value)}
    raise EncodeError(f"value {value!r} of type {type(value).__name__} cannot be stored as JSON")


def decode(data: Any, inputs: list | None = None,
           module_decoder: Callable[[dict], torch.nn.Module] | None = None) -> Any:
    """Inverse of :func:`encode`. ``{"__in__": k}`` becomes ``inputs[k]`` (or a
    :class:`PortRef` when ``inputs`` is None)."""
    if isinstance(data, list):
        return [decode(v, inputs, module_decoder) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) != 1:
        raise ValueError(f"malformed encoded value {data!r}: a tag dict has exactly one key")
    (tag, payload), = data.items()
    if tag == "__in__":
        return PortRef(payload) if inputs is None else inputs[payload]
    if tag == "__tuple__":
        return tuple(decode(v, inputs, module_decoder) for v in payload)
    if tag == "__size__":
        return torch.Size(payload)
    if tag == "__dict__":
        return {decode(k, inputs, module_decoder): decode(v, inputs, module_decoder)
                for k, v in payload}
    if tag == "__float__":
        return float(payload)
    if tag == "__slice__":
        if not isinstance(payload, list) or len(payload) != 3:
            raise ValueError(f"malformed encoded slice {data!r}: expected [start, stop, step]")
        return slice(*(decode(v, inputs, module_decoder) for v in payload))
    if tag == "__ellipsis__":
        return Ellipsis
    if tag == "__dtype__":
        return getattr(torch, payload)
    if tag == "__device__":
        return torch.device(payload)
    if tag == "__torchattr__":
        return getattr(torch, payload)
    if tag == "__tensor__":
        data_ = [decode(v) for v in payload["data"]]
        return torch.tensor(data_, dtype=getattr(torch, payload["dtype"])).reshape(payload["shape"])
    if tag == "__ref__":
        return resolve_ref(payload)
    if tag == "__choice__":  # an unresolved ValueChoice: its default (the first value)
        return evaluate_choice(payload, None)
    if tag == "__module__":
        if module_decoder is None:
            raise ValueError("an encoded module needs a module decoder")
        return module_decoder(payload)
    raise ValueError(f"unknown tag {tag!r} in encoded value")


# Arithmetic on ValueChoices (``ratio * channels``), by the name ``ChoiceExpr`` records.
_CHOICE_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul,
               "truediv": operator.truediv, "floordiv": operator.floordiv, "mod": operator.mod,
               "pow": operator.pow}


def evaluate_choice(payload: dict, chosen: dict | None) -> Any:
    """Value of an encoded ValueChoice/expression (the payload of a ``__choice__`` tag) under
    ``chosen`` (label -> value); the defaults when ``chosen`` is None.

    It lives here, not in :mod:`retiarii.choices`, because ``decode`` needs it: the encoding is
    the bottom layer and imports nothing of retiarii.
    """
    if "op" in payload:
        args = [evaluate_choice(a["__choice__"], chosen) if isinstance(a, dict)
                and "__choice__" in a else decode(a) for a in payload["args"]]
        return _CHOICE_OPS[payload["op"]](*args)
    values = [decode(v) for v in payload["values"]]
    if chosen is None:
        return values[0]
    return chosen[payload["label"]]


# ---- walking encoded data (as torch.fx's map_arg walks call arguments) ----------------------
#
# Encoded data nests lists and dicts (tag payloads, call kwargs, module specs). The two walkers
# below share one rule: a tag dict ``{tag: payload}`` is handed over whole (its payload is not
# searched), every other list and dict is walked into.

DROP = object()  # a map_tags function's answer for "leave this list item out"


def find_tags(data: Any, tag: str) -> list:
    """The payload of every ``{tag: payload}`` in encoded ``data``, in order of appearance.

    Example::

        >>> find_tags([{"__in__": 0}, {"__tuple__": [{"__in__": 1}, 2]}], "__in__")
        [0, 1]
    """
    found: list = []
    _find(data, tag, found)
    return found


def _find(data: Any, tag: str, found: list) -> None:
    # (an accumulator, not a generator: port_indices runs for every node on every edit)
    if isinstance(data, list):
        for v in data:
            _find(v, tag, found)
    elif isinstance(data, dict):
        if len(data) == 1 and tag in data:
            found.append(data[tag])
        else:
            for v in data.values():
                _find(v, tag, found)


def map_tags(data: Any, tag: str, fn: Callable[[Any], Any]) -> Any:
    """A copy of encoded ``data`` with every ``{tag: payload}`` replaced by ``fn(payload)``.
    An item of a list for which ``fn`` returns :data:`DROP` is left out (elsewhere the tag
    is kept as it was).

    Example::

        >>> map_tags({"x": [{"__in__": 0}, {"__in__": 1}]}, "__in__",
        ...          lambda k: DROP if k == 0 else {"__in__": k - 1})
        {'x': [{'__in__': 0}]}
    """
    if isinstance(data, list):
        out = []
        for v in data:
            mapped = map_tags(v, tag, fn)
            if mapped is not DROP:
                out.append(mapped)
        return out
    if isinstance(data, dict):
        if len(data) == 1 and tag in data:
            return fn(data[tag])
        return {k: _kept(map_tags(v, tag, fn), v) for k, v in data.items()}
    return data


def _kept(mapped: Any, original: Any) -> Any:
    return original if mapped is DROP else mapped


def port_indices(data: Any) -> list[int]:
    """Every input port index referenced in an encoded template, in order of appearance."""
    return find_tags(data, "__in__")


__all__ = ["EncodeError", "PortRef", "encode", "decode", "ref_of", "resolve_ref",
           "port_indices", "evaluate_choice", "find_tags", "map_tags", "DROP"]
