"""Path-level NAS's meta-controller (Cai et al., ICML 2018): a bidirectional tree-LSTM encodes
the cell, decides node by node which path-level transformation to apply, and learns by
REINFORCE; every transformed network starts from the start network's weights."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from model_spaces.path_tree import PRIMITIVES, apply, kinds, node

from ...sampler import ReplaySampler, sample_key
from ...threads import one_thread
from .base import Draw, SpaceExhausted, draw
from .rl import PolicyBasedRL, tensor_from_json, tensors_to_json
from .tree_lstm import Heads, TreeLSTM

ACTIONS = ("none", "replicate", "split", "deepen", "change_op")
OPS = tuple(p for p in PRIMITIVES if p != "identity")  # a new edge's operation
TOKENS = [f"op:{p}" for p in PRIMITIVES] + ["add", "concat", "seq"]
BASE_CELL = ["op", "conv_3x3"]  # model_spaces/path_level.py's start cell
START = {"path/grow0": False}  # the start network: the base cell, untransformed

# decide(tree, path, allowed actions) -> (action, op or None)
Decide = Callable[[list, str, list], tuple]


def traverse(tree: list, channels: int, max_depth: int, decide: Decide) -> list[list]:
    """The meta-controller's walk: pre-order from the root, one decision per node (``none``
    or a transformation that applies there), then on to the node's children *after* its
    transformation (a replicated node's two copies are decided separately), down to depth
    ``max_depth``. Returns the steps ``[path, kind, op]`` in order (a transformation only
    changes paths below its node, all visited after it, so each step's path is valid).

    Example:
        >>> first = lambda tree, path, allowed: (("replicate", None) if path == "r"
        ...                                      else ("none", None))
        >>> traverse(["op", "conv_3x3"], 8, 1, first)
        [['r', 'replicate', None]]
    """
    steps: list[list] = []

    def visit(path: str, depth: int) -> None:
        nonlocal tree
        action, op = decide(tree, path, ["none", *kinds(tree, path, channels)])
        if action != "none":
            tree = apply(tree, path, action, channels, op)
            steps.append([path, action, op])
        sub = node(tree, path)
        if sub[0] != "op" and depth < max_depth:
            for i in range(len(sub[1])):
                visit(f"{path}.{i}", depth + 1)

    visit("r", 0)
    return steps


def to_sample(steps: list[list]) -> dict:
    """The space's sample (model_spaces/path_level.py's labels) of these steps."""
    sample: dict = {}
    for i, (path, kind, op) in enumerate(steps):
        sample.update({f"path/grow{i}": True, f"path/node{i}": path, f"path/kind{i}": kind})
        if op is not None:
            sample[f"path/op{i}"] = op
    sample[f"path/grow{len(steps)}"] = False
    return sample


def steps_of(sample: dict) -> list[list]:
    steps, i = [], 0
    while sample.get(f"path/grow{i}"):
        steps.append([sample[f"path/node{i}"], sample[f"path/kind{i}"],
                      sample.get(f"path/op{i}")])
        i += 1
    return steps


class PathLevelRL(PolicyBasedRL):
    """The paper's meta-controller over model_spaces/path_level.py's space.

    The first proposal is the start network (the base cell); every later one waits for it
    (``ask`` raises :class:`SpaceExhausted` meanwhile: the engine asks again when a trial
    ends). Then each proposal encodes the start cell's tree with the bidirectional tree-LSTM
    (:mod:`.tree_lstm`) and walks it (:func:`traverse`): at each node, the action head over
    the node's encoding picks ``none`` or one of the transformations that apply there
    (replication-add, split-concat, a new node with an identity edge, or for an identity
    edge a new operation, then picked by the op head); the tree is re-encoded after each
    transformation, so later decisions see the grown cell. The proposal names the start
    network as its parent and asks for weight inheritance (``inherit_weights``): its trial
    starts from the start network's checkpoint through the function-preserving transfers
    (model_spaces/path_level.py: ``Cell.inherit_state``). REINFORCE as
    :class:`PolicyBasedRL`'s: moving-average baseline, normalized advantage, one Adam step
    per told network on the log-probability of its decisions (``none`` ones included).

    Args:
        max_depth: the deepest node the walk decides on (root: 0). 2 here (the paper's
            cells: up to 3 levels of branching).
        seed, hidden_size, learning_rate, baseline_decay, entropy_weight, tanh_constant,
            init_scale, mode, dedup, max_models, max_time, clock: see
            :class:`PolicyBasedRL` (REINFORCE only, the paper's).
    """

    inherit_weights = True

    def __init__(self, *, max_depth: int = 2, seed: int | None = None, **options: Any):
        if options.get("algorithm", "reinforce") != "reinforce" or "reward" in options:
            raise ValueError("PathLevelRL learns by REINFORCE on one metric (the paper's); "
                             "leave algorithm and reward out")
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
            raise ValueError(f"PathLevelRL: max_depth must be an int >= 0, got {max_depth!r}")
        super().__init__(seed=seed, **options)  # seed named: the registry passes what it sees
        self.max_depth = max_depth
        self._channels: int | None = None  # the cell's output channels (split needs 2+)
        self._build(self._rng.getrandbits(62))

    def _build(self, seed: int) -> None:
        self._seed = seed
        self._encoder = TreeLSTM(TOKENS, self.hidden_size, seed, self.init_scale)
        self._heads = Heads(self.hidden_size, len(ACTIONS), len(OPS), seed + 1,
                            self.init_scale)
        self._optimizer = torch.optim.Adam(
            [*self._encoder.parameters(), *self._heads.parameters()], lr=self.learning_rate)

    def check(self, space: Any) -> None:
        super().check(space)
        try:  # the start network: its cells say the channels a split divides
            graph = space.instantiate(dict(START)).graph
        except Exception as err:  # noqa: BLE001 (any space that has no start network)
            graph, why = None, err
        cells = [] if graph is None else [
            n.op.spec["args"] for n in graph.nodes if n.kind == "module" and n.op.spec
            and str(n.op.spec.get("cls", "")).endswith(":Cell")]
        if not cells or not all(c[0] == BASE_CELL for c in cells):
            raise ValueError("PathLevelRL searches model_spaces/path_level.py's space (cells "
                             "starting as ['op', 'conv_3x3']); this space has none"
                             + (f" ({why})" if graph is None else ""))
        self._channels = cells[0][2]

    # -- the controller -----------------------------------------------------------------------

    def _decide(self, choose: Callable[[str, str, torch.Tensor], int], totals: list) -> Decide:
        """A decide() for :func:`traverse` that encodes the tree, asks ``choose(path, what,
        log-probabilities)`` (``what``: "action" or "op") for an index, and adds up
        log-probability and entropy in ``totals``."""
        def decide(tree: list, path: str, allowed: list) -> tuple:
            h = self._encoder(tree)[path]  # (2H,)
            action_lp = Heads.masked_log_softmax(self._heads.action(h),
                                                 [a in allowed for a in ACTIONS],
                                                 self.tanh_constant)
            action = ACTIONS[choose(path, "action", action_lp)]
            picked = [(action_lp, ACTIONS.index(action))]
            op = None
            if action == "change_op":
                op_lp = Heads.masked_log_softmax(self._heads.op(h), [True] * len(OPS),
                                                 self.tanh_constant)
                op = OPS[choose(path, "op", op_lp)]
                picked.append((op_lp, OPS.index(op)))
            for lp, index in picked:
                totals[0] = totals[0] + lp[index]
                p = lp.exp()
                totals[1] = totals[1] - (p * lp.masked_fill(p == 0, 0.0)).sum()
            return action, op
        return decide

    def _log_prob(self, trace: Any, sample: dict):
        """Log-probability and entropy of the decisions that give ``sample`` (with
        gradients). Raises ValueError for a sample the walk does not produce."""
        steps, totals = steps_of(sample), [torch.zeros(()), torch.zeros(())]
        queue = list(steps)

        def replay(path: str, what: str, lp: torch.Tensor) -> int:
            if what == "op":  # the op of the step just taken
                return OPS.index(taken[-1][2])
            if not queue or queue[0][0] != path:
                return ACTIONS.index("none")
            taken.append(queue.pop(0))
            if taken[-1][1] not in ACTIONS:
                raise ValueError(f"unknown transformation {taken[-1][1]!r}")
            return ACTIONS.index(taken[-1][1])

        taken: list[list] = []
        replayed = traverse(list(BASE_CELL), self._need_channels(), self.max_depth,
                            self._decide(replay, totals))
        if replayed != steps:
            raise ValueError(f"the sample {sample} is not a walk of PathLevelRL's controller")
        return totals[0], totals[1]

    def _need_channels(self) -> int:
        if self._channels is None:
            raise ValueError("PathLevelRL has not seen its space yet (ask first)")
        return self._channels

    def probability(self, space: Any, sample: dict) -> float:
        """The probability that the controller emits ``sample`` of ``space`` now."""
        if self._checked != id(space):
            self.check(space)
        with torch.no_grad(), one_thread():
            log_prob, _ = self._log_prob(None, sample)
        return math.exp(log_prob.item())

    # -- the strategy hooks -------------------------------------------------------------------

    def _propose(self, space: Any) -> Draw:
        start = self._records.get(sample_key(START))
        if start is None:
            return draw(space, ReplaySampler(dict(START)))
        if not start.values:
            raise SpaceExhausted("PathLevelRL: waiting for the start network, whose weights "
                                 "every transformed network inherits")
        if start.values[-1] is None:
            raise SpaceExhausted("PathLevelRL: the start network failed: nothing to "
                                 "transform (see its error in `retiarii status`)")

        def sample_index(path: str, what: str, lp: torch.Tensor) -> int:
            probs = lp.exp().tolist()
            return self._rng.choices(range(len(probs)), weights=probs)[0]

        with torch.no_grad(), one_thread():
            steps = traverse(list(BASE_CELL), self._need_channels(), self.max_depth,
                             self._decide(sample_index, [torch.zeros(()), torch.zeros(())]))
        proposal = draw(space, ReplaySampler(to_sample(steps)))
        proposal.parent = dict(START)  # its trial inherits the start network's weights
        return proposal

    def _on_tell(self, key: str, score: Any) -> None:
        if key == sample_key(START):
            return  # the start network: not a decision of the controller
        try:
            with torch.no_grad():
                self._log_prob(None, self._records[key].sample)
        except ValueError:
            return  # a sample the walk cannot give (a random fallback): nothing to learn
        super()._on_tell(key, score)

    def config(self) -> dict:
        return {**super().config(), "max_depth": self.max_depth}

    def _state(self) -> dict:
        return {"seed": self._seed, "channels": self._channels,
                "encoder": tensors_to_json(self._encoder.state_dict()),
                "heads": tensors_to_json(self._heads.state_dict()),
                "optimizer": tensors_to_json(self._optimizer.state_dict()),
                "baseline": self._baseline, "spread": self._spread}

    def _load_state(self, state: dict) -> None:
        self._build(state["seed"])
        self._channels = state["channels"]
        for module, name in ((self._encoder, "encoder"), (self._heads, "heads")):
            module.load_state_dict({k: tensor_from_json(v) for k, v in state[name].items()})
        saved = state["optimizer"]
        self._optimizer.load_state_dict({
            "state": {int(i): {k: tensor_from_json(v) for k, v in s.items()}
                      for i, s in saved["state"].items()},
            "param_groups": saved["param_groups"]})
        self._baseline, self._spread = state["baseline"], state["spread"]
