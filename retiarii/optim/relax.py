"""A continuous relaxation of a space: one supernet whose architecture is a set of weights.

:func:`retiarii.optim.relax_space.read_space` reads, for every node the space can produce,
which choices decide its operation and inputs. :class:`Relaxation` holds every operation of
that union once (the weights of every candidate) and one vector of architecture parameters
``alpha[label]`` per choice, and computes a node as the expectation of its variants under the
choices' distributions (each choice independent)::

    operator choice   node = sum_c w_c * op_c(x)                       (DARTS' mixed op)
    input choice      port = sum_c w_c * x_{src_c}, node = op(ports)   (mixed input)

where a node's variants that share an operation are mixed at its input ports (so a
nonlinearity after a choice sees the mixture, as in DARTS) and variants with different
operations are mixed at its output. The weights ``w`` depend on the mode:

* ``"softmax"`` (DARTS): ``w = softmax(alpha)``, every candidate computed;
* ``"gumbel"`` (SNAS / GumbelDARTS): ``w = softmax((alpha + g) / tau)`` with Gumbel noise
  ``g``; ``hard=True`` makes the forward one-hot with the soft gradient (straight-through);
* ``"binary"`` (ProxylessNAS): per choice, ``paths`` candidates are drawn from
  ``softmax(alpha)`` and one of them is active (a one-hot gate); only it is computed with
  autograd, the others of the draw run without it so the gate gradient
  ``dL/dg_c = <dL/dy, y_c>`` reaches their alphas (ProxylessNAS' estimator, through the gates'
  straight-through to the probabilities); ``paths=1`` trains the sampled path only;
* ``"fixed"``: one sample's architecture only (:meth:`Relaxation.fix`).

Value choices that change a tensor's shape (widths) are not shared by slicing: mixing them
raises a :class:`RelaxError` naming the labels; value choices that keep shapes (a kernel size
with its padding, an activation) are operator choices like any other.

Example::

    relax = Relaxation(space, mode="softmax")
    loss = F.cross_entropy(relax(x), y)          # grads reach weights and alphas
    sample = relax.derive()                       # argmax per label, a sample of the space
    net = relax.export(sample)                    # space.build(sample), weights inherited
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..codec import decode, resolve_ref
from ..codegen import to_module
from ..interpreter import init_tensor
from ..modspec import build_module
from .arch_params import ArchParameters
from ..sampler import index_of
from .relax_mixture import add_mixed, label_weights, needed, node_terms
from .relax_space import NodePlan, RelaxError, SpaceReading, op_key, read_space

__all__ = ["MODES", "Relaxation", "RelaxError"]

MODES = ("softmax", "gumbel", "binary", "fixed")

# A space is read once per process (strategies rebuilt on resume, several strategies compared
# on one space): reading replays it hundreds of times. Keyed by the space object.
_READINGS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Tensor(nn.Module):
    """Holds the tensor of a ``param`` or ``constant`` node (a parameter or a buffer)."""

    def __init__(self, value: torch.Tensor, parameter: bool, requires_grad: bool = True):
        super().__init__()
        if parameter:
            self.value = nn.Parameter(value, requires_grad=requires_grad)
        else:
            self.register_buffer("value", value)


def _weight_key(op) -> tuple:
    """Operations with one key share one set of weights (tied modules keep one)."""
    if op.kind in ("module", "param"):
        return (op.kind, op.attr, op_key(_spec_only(op)))
    return ("op", op_key(op))


def _spec_only(op):
    out = op.copy()
    out.args, out.kwargs = [], {}
    return out


class Relaxation(ArchParameters):
    """The supernet of ``space``; see the module docstring.

    Args:
        space: a :class:`~retiarii.ModelSpace` whose choices are operator and input choices.
        mode: one of :data:`MODES`.
        temperature: Gumbel-softmax temperature (``"gumbel"``).
        hard: straight-through one-hot samples (``"gumbel"``).
        paths: candidates drawn per choice and step (``"binary"``; 2 as in ProxylessNAS).
        seed: the generator of the Gumbel noise and binary draws (saved in the state dict).
        reading: a :class:`SpaceReading` already made for ``space`` (else read here).

    Raises:
        RelaxError: the space has a choice that cannot be relaxed (named in the message).
    """

    def __init__(self, space, mode: str = "softmax", temperature: float = 1.0,
                 hard: bool = False, paths: int = 2, seed: int = 0,
                 reading: SpaceReading | None = None):
        super().__init__()
        self.space = space
        if reading is None:
            reading = _READINGS.get(space)
            if reading is None:
                reading = _READINGS[space] = read_space(space)
        self.reading = reading
        self.labels = list(self.reading.labels)
        self.keys = dict(self.reading.labels)
        self.alphas = nn.ParameterList(
            [nn.Parameter(torch.zeros(len(self.keys[label]))) for label in self.labels])
        self.weights = nn.ModuleList()
        self._slot: dict[tuple, int] = {}  # weight key -> index in self.weights
        self._alias: dict[str, tuple[int, str]] = {}  # param op key -> (slot, tensor name)
        ops = list(self.reading.ops.values())
        for op in ops:
            if op.kind != "param":
                self._add_weights(op)
        for op in ops:  # after the modules: a tensor read from a module is the module's
            if op.kind == "param":
                self._add_param(op)
        self._load_frozen()
        self.mode, self.temperature, self.hard, self.paths = mode, temperature, hard, paths
        self.set_mode(mode)
        self.generator = torch.Generator().manual_seed(seed)
        self._fixed: dict[str, int] = {}
        self.sampled: dict[str, list[int]] = {}  # binary: the candidates drawn this step
        if space.example_input is not None:
            self._probe(space.example_input)

    def _probe(self, example_input: Any) -> None:
        """One softmax forward on the example input: choices that change a shape (widths)
        fail here, naming their labels, instead of in the first training step."""
        mode, training = self.mode, self.training
        inputs = example_input if isinstance(example_input, tuple) else (example_input,)
        try:
            self.mode = "softmax"
            self.eval()
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                self(*inputs)
        finally:
            self.mode = mode
            self.train(training)

    # ---- building -------------------------------------------------------------------------
    def _add_weights(self, op) -> None:
        key = _weight_key(op)
        if op.kind not in ("module", "param", "constant", "subgraph") or key in self._slot:
            return
        if op.kind == "module":
            module = build_module(op.spec)
        elif op.kind == "subgraph":
            module = to_module(op.graph, "Cell")
        elif op.kind == "param":
            spec = op.spec
            module = _Tensor(init_tensor(spec), not spec["buffer"],
                             spec.get("requires_grad", True))
        else:
            module = _Tensor(decode(op.spec["value"]), parameter=False)
        self._slot[key] = len(self.weights)
        self.weights.append(module)

    def _add_param(self, op) -> None:
        """A param node's tensor: its own, or (tied weights: ``F.linear(x, self.fc.weight)``)
        the tensor of the module it lives in, which must then be one module."""
        owners = {o.attr: o for o in self.reading.ops.values() if o.kind in ("module", "subgraph")}
        parts = op.attr.split(".")
        owner = next((".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)
                      if ".".join(parts[:i]) in owners), None)
        if owner is None:
            self._add_weights(op)
            return
        slots = {self._slot[_weight_key(o)] for o in self.reading.ops.values()
                 if o.kind in ("module", "subgraph") and o.attr == owner}
        if len(slots) != 1:
            raise RelaxError(f"the tensor {op.attr!r} is read directly from the module "
                             f"{owner!r}, whose operation is a choice ({len(slots)} candidates): "
                             f"a relaxation cannot tie it to one of them; read it through the "
                             f"module, or use a multi-trial strategy")
        self._alias[op_key(op)] = (slots.pop(), op.attr[len(owner) + 1:])

    def weights_of(self, op) -> nn.Module:
        return self.weights[self._slot[_weight_key(op)]]

    def _load_frozen(self) -> None:
        """Frozen layers of the base model keep its values here too, as in ``space.build``."""
        model = self.reading.reference
        for uid, attr in self.space.frozen_nodes(model).items():
            node = model.graph.node_by_uid(uid)
            if node.kind == "param" and op_key(node.op) in self._alias:
                continue  # the module it lives in holds it
            target = self.weights_of(node.op)
            with torch.no_grad():
                for key, value in self.space._frozen[model.base].get(attr, {}).items():
                    name = key[len(attr) + 1:] if node.kind == "module" else "value"
                    owner, _, leaf = name.rpartition(".")
                    tensor = getattr(target.get_submodule(owner), leaf)  # a frozen BatchNorm's
                    tensor.copy_(value)  # running statistics are buffers
                    if isinstance(tensor, nn.Parameter):
                        tensor.requires_grad_(False)

    # ---- modes ------------------------------------------------------------------------------
    def set_mode(self, mode: str, **settings: Any) -> None:
        """Switch the mode (and ``temperature``, ``hard``, ``paths``) for the next forwards."""
        if mode not in MODES:
            raise ValueError(f"unknown relaxation mode {mode!r}; choose one of {MODES}")
        if mode == "fixed" and not getattr(self, "_fixed", None):
            raise ValueError("mode 'fixed' runs one sample: call fix(sample) instead")
        unknown = set(settings) - {"temperature", "hard", "paths"}
        if unknown:
            raise TypeError(f"unknown relaxation settings {sorted(unknown)}")
        for k, v in settings.items():
            setattr(self, k, v)
        if self.paths < 1:
            raise ValueError(f"paths must be at least 1, got {self.paths}")
        self.mode = mode

    def fix(self, sample: dict) -> "Relaxation":
        """Run only ``sample``'s architecture from now on (mode ``"fixed"``); returns self."""
        self._fixed = self.indices(sample)
        self.mode = "fixed"
        return self

    def indices(self, sample: dict) -> dict[str, int]:
        """label -> candidate index of a sample of the space (labels it lacks: the first)."""
        out = {}
        for label, key in sample.items():
            if label not in self.keys:
                raise RelaxError(f"the sample has label {label!r}, which this space never "
                                 f"asks for; known labels: {self.labels}")
            i = index_of(self.keys[label], key)
            if i is None:
                raise RelaxError(f"label {label!r}: {key!r} is not among its candidates "
                                 f"{self.keys[label]}")
            out[label] = i
        return {label: out.get(label, 0) for label in self.labels}

    # ---- the architecture found (weights, alphas, probabilities: ArchParameters) ---------------
    def derive(self) -> dict:
        """The sample of the argmax of every alpha, or of the space's ``derivation`` (DARTS')."""
        best = {label: int(a.detach().argmax()) for label, a in zip(self.labels, self.alphas)}
        rule = self.space.derivation
        return self.sample_of({**best, **(rule(self.probabilities(), self.keys) if rule else {})})

    def sample_of(self, assignment: dict[str, int]) -> dict:
        """The space's sample of label -> candidate index (the labels it asks for only)."""
        return dict(self.space.sample(
            lambda label, candidates, ctx: assignment.get(label, 0)).sample)

    def export(self, sample: dict) -> nn.Module:
        """``space.build(sample)`` with the weights of the chosen candidates copied in."""
        module = self.space.build(sample)
        model = self.space.replay(sample)
        if self.space.example_input is not None:
            self.space.check_shapes(model)
        with torch.no_grad():
            for node in model.graph.nodes:
                if node.kind in ("module", "subgraph"):
                    key = _weight_key(node.op)
                    if key not in self._slot:
                        raise RelaxError(f"node {node.name!r} of the sample has an operation "
                                         f"the relaxation never saw ({node.op.describe()})")
                    module.get_submodule(node.attr).load_state_dict(
                        self.weights_of(node.op).state_dict())
                elif node.kind == "param" and op_key(node.op) not in self._alias:
                    parts = node.attr.split(".")
                    owner = module.get_submodule(".".join(parts[:-1]))
                    getattr(owner, parts[-1]).copy_(self.weights_of(node.op).value)
        return module

    # ---- the forward -------------------------------------------------------------------------
    def _label_weights(self) -> dict[str, tuple[Any, set, set]]:
        """label -> (weights, candidates computed, candidates computed with autograd)."""
        lw, self.sampled, self.mixing = label_weights(  # mixing: the Gumbel weights (FBNet)
            self.mode, self.labels, self.alphas, fixed=self._fixed, temperature=self.temperature,
            hard=self.hard, paths=self.paths, generator=self.generator)
        return lw

    def forward(self, *args: Any) -> Any:
        reading = self.reading
        if len(args) != len(reading.inputs):
            raise TypeError(f"the supernet takes {len(reading.inputs)} inputs "
                            f"({reading.inputs}), got {len(args)}")
        lw = self._label_weights()
        terms = {plan.name: node_terms(plan, lw, self.mode) for plan in reading.nodes}
        need = needed(reading, terms)
        env: dict[str, Any] = dict(zip(reading.inputs, args))
        grad_on = torch.is_grad_enabled()
        for plan in reading.nodes:
            mode = need.get(plan.name)
            if mode is None or plan.name in env:
                continue
            with torch.set_grad_enabled(grad_on and mode == "grad"):
                env[plan.name] = self._compute(plan, terms[plan.name], env, grad_on)
        return env[reading.output]

    def _compute(self, plan: NodePlan, terms: list, env: dict, grad_on: bool) -> Any:
        if not terms:
            raise RelaxError(f"node {plan.name!r} is used in this step but does not exist in "
                             f"it (the choices {list(plan.labels)} remove it)")
        out = None
        for key, weight, grad, ports in terms:
            values = []
            for port in ports:
                if len(port) == 1 and port[0][1] is None:
                    values.append(env[port[0][0]])
                    continue
                mixed = None
                for src, w, g in port:
                    x = env[src] if g or not grad_on else env[src].detach()
                    mixed = w * x if mixed is None else add_mixed(mixed, w * x, plan)
                values.append(mixed)
            if grad or not grad_on:
                y = self._run_op(self.reading.ops[key], values)
            else:
                with torch.no_grad():
                    y = self._run_op(self.reading.ops[key], values)
            if weight is not None:
                y = weight * y
            out = y if out is None else add_mixed(out, y, plan)
        return out

    def _run_op(self, op, inputs: list) -> Any:
        kind = op.kind
        if kind == "output":
            return decode(op.args[0], inputs, build_module)
        args = decode(op.args, inputs, build_module)
        kwargs = {k: decode(v, inputs, build_module) for k, v in op.kwargs.items()}
        if kind in ("module", "subgraph"):
            return self.weights_of(op)(*args, **kwargs)
        if kind == "function":
            return resolve_ref(op.target)(*args, **kwargs)
        if kind == "method":
            return getattr(args[0], op.target)(*args[1:], **kwargs)
        if kind == "param" and self._alias:
            alias = self._alias.get(op_key(op))
            if alias is not None:
                holder, name = self.weights[alias[0]], alias[1]
                return holder.get_parameter(name) if name in dict(holder.named_parameters()) \
                    else holder.get_buffer(name)
        if kind in ("param", "constant"):
            return self.weights_of(op).value
        raise RelaxError(f"cannot run a {kind!r} operation inside the supernet")

    def extra_repr(self) -> str:
        return (f"mode={self.mode!r}, labels={len(self.labels)}, "
                f"candidates={sum(len(k) for k in self.keys.values())}, "
                f"weight_modules={len(self.weights)}")


def rescale_drawn(relax: Relaxation, before: dict[str, torch.Tensor]) -> None:
    """ProxylessNAS' correction after an architecture step on drawn candidates: shift the
    drawn alphas so their total probability mass equals what it was before the step (the
    candidates that were not drawn keep their probabilities)."""
    with torch.no_grad():
        for label, drawn in relax.sampled.items():
            alpha = relax.alpha(label)
            if len(drawn) == len(alpha):
                continue
            idx = torch.tensor(drawn, device=alpha.device)
            old = torch.logsumexp(before[label][idx], 0)
            new = torch.logsumexp(alpha[idx], 0)
            alpha[idx] += old - new
