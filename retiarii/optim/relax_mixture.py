"""How one step of a relaxation mixes candidates: weights by mode, each node's terms, autograd.

:class:`~retiarii.optim.relax.Relaxation` computes a node as the expectation of its variants
(relax.py's docstring). Each forward step it asks this module, with plain data only (the
alphas, the space's reading, the mode's settings), for: :func:`label_weights`, every label's
weights this step (softmax, Gumbel, a binary draw, or the fixed sample); :func:`node_terms`,
every node's operations with their weights and ports' mixtures (``NOTE: [Port weights]``);
and :func:`needed`, which nodes the step computes and which of them with autograd. The
relaxation then runs the operations with its weights (``Relaxation._compute``) and adds the
terms with :func:`add_mixed`, which names the node and labels when candidates cannot mix.

Example::

    lw, sampled, mixing = label_weights("softmax", labels, alphas, fixed={}, temperature=1.0,
                                        hard=False, paths=2, generator=torch.Generator())
    terms = {plan.name: node_terms(plan, lw, "softmax") for plan in reading.nodes}
    need = needed(reading, terms)   # node -> "grad" / "nograd"
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .relax_space import NodePlan, RelaxError, SpaceReading

__all__ = ["add_mixed", "label_weights", "needed", "node_terms"]


def label_weights(mode: str, labels: list[str], alphas: Any, *, fixed: dict[str, int],
                  temperature: float, hard: bool, paths: int,
                  generator: torch.Generator) -> tuple[dict, dict, dict]:
    """One step's weights of every label, by ``mode`` (the module docstring of relax.py).

    Args:
        mode, temperature, hard, paths: the relaxation's mode and its settings.
        labels, alphas: the labels and their architecture parameters, in one order.
        fixed: label -> the candidate of the fixed sample (mode ``"fixed"``).
        generator: draws the Gumbel noise and the binary candidates.

    Returns:
        ``(weights, sampled, mixing)``: label -> (weights, candidates computed, candidates
        computed with autograd); binary: label -> the candidates drawn this step; gumbel:
        label -> this step's Gumbel weights (FBNet's cost term reads them).
    """
    out = {}
    sampled, mixing = {}, {}
    for label, alpha in zip(labels, alphas):
        n = len(alpha)
        every = set(range(n))
        if mode == "fixed":
            i = fixed[label]
            out[label] = ([1.0 if j == i else 0.0 for j in range(n)], {i}, {i})
        elif mode == "softmax":
            out[label] = (F.softmax(alpha, -1), every, every)
        elif mode == "gumbel":
            u = torch.rand(n, generator=generator).to(alpha.device)
            g = -torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-10)))
            soft = F.softmax((alpha + g) / temperature, -1)
            if hard:
                hot = F.one_hot(soft.detach().argmax(), n).to(soft.dtype)
                soft = hot - soft.detach() + soft
            out[label] = (mixing.setdefault(label, soft), every, every)
        else:  # binary
            p = F.softmax(alpha, -1)
            k = min(paths, n)
            drawn = torch.multinomial(p.detach().cpu(), k, generator=generator)
            mask = torch.zeros(n, dtype=p.dtype, device=p.device)
            mask[drawn.to(p.device)] = 1.0
            q = p * mask / (p * mask).sum()  # the drawn candidates' renormalized probs
            active = int(drawn[torch.multinomial(q.detach().cpu()[drawn], 1,
                                                 generator=generator)])
            gate = F.one_hot(torch.tensor(active), n).to(p) - q.detach() + q
            sampled[label] = drawn.tolist()
            out[label] = (gate, set(drawn.tolist()), {active})
    return out, sampled, mixing


def node_terms(plan: NodePlan, lw: dict, mode: str) -> list:
    """[(op key, weight or None, with grad, [[(source, weight or None, with grad)] per
    port])] for this step; an empty list when the node does not exist in it.

    NOTE: [Port weights] Within one operation, a port's sources are weighted by the
    product of the weights of the labels that move the node's sources, summed over the
    combinations giving that operation and normalized: the probability of each source
    given the operation, without the factors of labels that only choose the operation.
    Those factors are common to the operation's variants; leaving them out keeps the
    division away from tiny numbers (a Gumbel sample of 1e-30 for one op would make the
    gradient overflow) and keeps the ports of an operation whose one-hot gate is off
    defined (binary, hard gumbel): its gate gradient then sees the active input. An
    operation whose sources all weigh exactly 0 is not computed.
    """
    src_pos = [j for j, label in enumerate(plan.labels)
               if label in plan.labels_changing("sources")]
    variants: dict[int, list] = {}  # variant -> [weight, with grad, port weight]
    for combo, vid in plan.table.items():
        if vid is None:
            continue
        w, grad, ok = None, True, True
        for label, i in zip(plan.labels, combo):
            weights, computed, with_grad = lw[label]
            if i not in computed:
                ok = False
                break
            grad = grad and i in with_grad
            w = weights[i] if w is None else w * weights[i]
        if not ok:
            continue
        wp = 1.0
        for j in src_pos:
            wp = wp * lw[plan.labels[j]][0][combo[j]]
        if vid in variants:
            acc = variants[vid]
            acc[0], acc[1], acc[2] = acc[0] + w, acc[1] or grad, acc[2] + wp
        else:
            variants[vid] = [w, grad, wp]
    if mode == "fixed":  # exactly the sample's operation: no weights at all
        variants = {v: [None, True, None] for v, (w, _, _) in variants.items() if w != 0.0}
    if not variants:
        return []
    exists = None
    if plan.may_be_absent and mode != "fixed":
        exists = _nonzero(sum(acc[0] for acc in variants.values()))
    by_op: dict[str, list[int]] = {}
    for vid in variants:
        by_op.setdefault(plan.variants[vid][0], []).append(vid)
    single = len(by_op) == 1
    out = []
    for key, vids in by_op.items():
        w_op = None
        if plan.labels and mode != "fixed":
            w_op = sum(variants[v][0] for v in vids)
        grad = any(variants[v][1] for v in vids)
        ports = []
        for k in range(len(plan.variants[vids[0]][1])):
            srcs: dict[str, list] = {}
            for v in vids:
                s = plan.variants[v][1][k]
                _, g, w = variants[v]
                if s in srcs:
                    srcs[s][0], srcs[s][1] = srcs[s][0] + w, srcs[s][1] or g
                else:
                    srcs[s] = [w, g]
            if len(srcs) == 1:
                ports.append([(s, None, g) for s, (w, g) in srcs.items()])
                continue
            total = sum(w for w, _ in srcs.values())
            if float(total.detach() if isinstance(total, torch.Tensor) else total) == 0.0:
                ports = None  # an operation that cannot run on the active inputs
                break
            ports.append([(s, w / _nonzero(total), g) for s, (w, g) in srcs.items()])
        if ports is None:
            continue
        weight = None
        if not single or exists is not None:
            weight = w_op if exists is None else w_op / exists
        out.append((key, weight, grad, ports))
    return out


def needed(reading: SpaceReading, terms: dict[str, list]) -> dict[str, str]:
    """node -> "grad" or "nograd": what this step computes, walking back from the output."""
    need = {reading.output: "grad"}
    for plan in reversed(reading.nodes):
        mode = need.get(plan.name)
        if mode is None:
            continue
        for _, _, grad, ports in terms[plan.name]:
            t = mode if grad else "nograd"
            for port in ports:
                for src, _, g in port:
                    m = t if g else "nograd"
                    if need.get(src) != "grad":
                        need[src] = m
    return need


def _nonzero(w: Any) -> Any:
    """``w`` to divide by, at least 1e-6: a one-hot gate that is off (0) or a weight that
    underflowed divides terms that weigh (almost) nothing anyway, without a NaN or an
    overflowing gradient."""
    if isinstance(w, torch.Tensor):
        return w.clamp_min(1e-6)
    return w if w != 0 else 1.0



def add_mixed(a: Any, b: Any, plan: NodePlan) -> Any:
    """a + b for the mixture of a node; a shape mismatch names the node and its choices."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise RelaxError(f"node {plan.name!r}: its candidates for labels {list(plan.labels)} "
                         f"return {type(a).__name__} and {type(b).__name__}, not tensors; only "
                         f"tensors can be mixed")
    if a.shape != b.shape:
        raise RelaxError(f"labels {list(plan.labels)} change the shape of what node "
                         f"{plan.name!r} computes ({list(a.shape)} vs {list(b.shape)}): "
                         f"candidates of different widths are not shared by slicing here, "
                         f"so they cannot be mixed; use spos/enas or a multi-trial strategy, "
                         f"or make the candidates keep the shape")
    return a + b

