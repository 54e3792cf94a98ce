"""Policy-based RL: an LSTM controller emits the choices one by one and learns with REINFORCE
and a moving-average baseline (Zoph & Le, ICLR 2017; Pham et al., ENAS, ICML 2018), or with
PPO over batches of architectures (NASNet, Zoph et al., CVPR 2018: ppo.py)."""
from __future__ import annotations

import base64
import hashlib
import json
import math
from typing import Any

import numpy as np
import torch
from torch import nn

from ...sampler import ReplaySampler, index_of, sample_key
from ...scalarization import MnasNetReward, WeightedSum
from ...threads import one_thread
from .base import Draw, Strategy, draw
from .ppo import ppo_update

ALGORITHMS = ("reinforce", "ppo")


def _uniform_(tensor: torch.Tensor, seed: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        return tensor.uniform_(-scale, scale, generator=generator)


def _head_seed(base_seed: int, head: str) -> int:
    # Derived from the head's name, not drawn in sequence: a head's initial weights do not
    # depend on the order in which choices were first met.
    digest = hashlib.sha256(f"{base_seed}:{head}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class Controller(nn.Module):
    """An LSTM cell stepping through the choices; one decoder and one embedding per choice.

    A choice is identified by its label *and* its candidates (a label whose candidates depend
    on earlier choices gets one head per candidate list). Heads are created the first time a
    choice is met, so the controller handles any space, conditional choices included.
    """

    def __init__(self, hidden_size: int, seed: int, init_scale: float):
        super().__init__()
        self.hidden_size = hidden_size
        self.seed = seed
        self.init_scale = init_scale
        self.cell = nn.LSTMCell(hidden_size, hidden_size)
        self.start = nn.Parameter(torch.zeros(1, hidden_size))  # the first input
        for i, p in enumerate(self.parameters()):
            _uniform_(p, _head_seed(seed, f"core{i}"), init_scale)
        self.heads: dict[str, int] = {}  # head name -> index into decoders / embeddings
        self.decoders = nn.ModuleList()
        self.embeddings = nn.ModuleList()

    @staticmethod
    def head_name(label: str, candidates: list) -> str:
        return json.dumps([label, candidates])

    def head(self, label: str, candidates: list) -> tuple[int, bool]:
        """The index of the head of this choice, and whether it was just created."""
        name = self.head_name(label, candidates)
        if name in self.heads:
            return self.heads[name], False
        n = len(candidates)
        decoder = nn.Linear(self.hidden_size, n)  # (1, H) -> (1, n) logits
        embedding = nn.Embedding(n, self.hidden_size)  # candidate -> next input (1, H)
        for j, p in enumerate([*decoder.parameters(), *embedding.parameters()]):
            _uniform_(p, _head_seed(self.seed, f"{name}:{j}"), self.init_scale)
        self.heads[name] = len(self.decoders)
        self.decoders.append(decoder)
        self.embeddings.append(embedding)
        return self.heads[name], True

    def initial(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        zeros = torch.zeros(1, self.hidden_size)
        return self.start, (zeros, zeros)  # input (1, H), state ((1, H), (1, H))

    def step(self, x: torch.Tensor, state, head: int, tanh_constant: float | None):
        """One choice: new LSTM state and the log-probabilities of its candidates (n,)."""
        h, c = self.cell(x, state)  # (1, H) each
        logits = self.decoders[head](h)[0]  # (n,)
        if tanh_constant is not None:  # bounds the logits so no candidate's odds vanish
            logits = tanh_constant * torch.tanh(logits)
        return (h, c), torch.log_softmax(logits, dim=-1)

    def feed(self, head: int, index: int) -> torch.Tensor:
        return self.embeddings[head].weight[index].unsqueeze(0)  # (1, H)


class _ControllerSampler:
    """Samples each choice from the controller as the space reaches it (no gradients)."""

    def __init__(self, rl: "PolicyBasedRL"):
        self.rl = rl
        self.x, self.state = rl._controller.initial()
        self.log_prob = 0.0  # of the choices made so far, under the policy that draws them

    def choose(self, label: str, candidates: list, context: dict) -> int:
        rl = self.rl
        head = rl._add_head(label, candidates)
        with torch.no_grad():
            self.state, logp = rl._controller.step(self.x, self.state, head, rl.tanh_constant)
            probs = logp.exp().tolist()
            index = rl._rng.choices(range(len(candidates)), weights=probs)[0]
            self.log_prob += float(logp[index])
            self.x = rl._controller.feed(head, index)
        return index


def tensors_to_json(obj: Any) -> Any:
    """Tensors as ``{"data": base64 of the little-endian bytes, "shape", "dtype"}``: exact, and
    the state of the controller and its optimizer, saved after every model, stays small."""
    if isinstance(obj, torch.Tensor):
        array = obj.detach().cpu().contiguous().numpy()
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        return {"data": base64.b64encode(data).decode("ascii"), "shape": list(obj.shape),
                "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {str(k): tensors_to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [tensors_to_json(v) for v in obj]
    return obj


def tensor_from_json(obj: dict) -> torch.Tensor:
    dtype = getattr(torch, obj["dtype"].replace("torch.", ""))
    little = torch.empty((), dtype=dtype).numpy().dtype.newbyteorder("<")
    array = np.frombuffer(base64.b64decode(obj["data"]), dtype=little)
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="))).reshape(obj["shape"])


class PolicyBasedRL(Strategy):
    """An LSTM controller proposes samples; REINFORCE with a moving-average baseline trains it.

    For each choice the space reaches, the controller's LSTM cell takes the embedding of the
    previous decision, a per-choice decoder turns its output into logits over the candidates
    (bounded by ``tanh_constant * tanh``, as in ENAS) and a candidate is sampled. On ``tell``
    the sample is fed again through the controller (teacher forcing) to get its
    log-probability, the baseline moves towards the reward
    (``b <- decay * b + (1 - decay) * r``), and one Adam step lowers
    ``-(r - b) / sigma * log p(sample) - entropy_weight * entropy``, where ``sigma`` is a moving
    estimate of the spread of ``r - b`` so that the scale of the metric does not matter.

    Conditional choices: the controller has one decoder and one embedding per choice (a label
    with its candidate list), created when the choice is first met, so only the choices that
    exist in a sample are emitted and trained. Asynchronous use: each pending sample keeps its
    recorded choices, so a ``tell`` after other asks still trains on the right sequence (a
    slightly off-policy update: the policy may have moved since that sample was drawn). A proposal that
    repeats a known sample is redrawn (``dedup=True``) without a gradient step.

    Several objectives (MnasNet, Tan et al., CVPR 2019): give ``reward=`` a scalarization
    of them, ``MnasNetReward("val_acc", "latency_ms", target=5.0)`` for MnasNet's
    ``ACC x (LAT / target) ** w``, and the controller learns from that one number
    (``Experiment(metric=["val_acc", "latency_ms"], mode=["max", "min"])`` names the metrics
    it reads). A model that misses a constraint is rewarded as given; the search's result is
    still the front of the told models (:meth:`pareto`).

    Example:
        >>> from retiarii.strategies import PolicyBasedRL
        >>> class Space:
        ...     ops = ["conv", "pool", "skip"]
        ...     def sample(self, sampler):
        ...         s = {}
        ...         for i in range(2):
        ...             s[f"op{i}"] = self.ops[sampler.choose(f"op{i}", self.ops, dict(s))]
        ...         return type("Model", (), {"sample": s})()
        >>> s = PolicyBasedRL(seed=0)
        >>> best = {"op0": "conv", "op1": "conv"}
        >>> before = s.probability(Space(), best)
        >>> for _ in range(9):
        ...     sample = s.ask(Space())
        ...     s.tell(sample, sum(op == "conv" for op in sample.values()))
        >>> s.probability(Space(), best) > before
        True

    PPO (``algorithm="ppo"``, NASNet's controller update): each proposal keeps its
    log-probability under the policy that drew it; told models gather with their advantages
    (``(r - b) / sigma`` as above) until ``ppo_batch`` of them are told, then ``ppo_epochs``
    Adam steps over the batch lower the clipped surrogate of :mod:`.ppo`
    (``clip``: PPO's epsilon), and the batch is dropped.

    Args:
        seed: seeds the weights and the sampling (equal seeds, equal searches in any process).
        algorithm: ``"reinforce"`` (default: one step per told model) or ``"ppo"``.
        ppo_batch: PPO: told models per update (NASNet's controller: a batch of sampled
            architectures; 4 fits the launcher's budgets of tens of models).
        ppo_epochs: PPO: steps over each batch (the PPO paper: a few epochs over its data).
        clip: PPO's epsilon (the PPO paper's 0.2).
        hidden_size: LSTM width; 32 is plenty for spaces of tens of choices and CPU-fast
            (ENAS uses 100 for 100+ decisions).
        learning_rate: Adam's step; higher than ENAS's 3.5e-4 because a search here trains the
            controller on hundreds of models, not tens of thousands (0.005-0.02 did equally
            well on ``benchmarks/strategies.py``; 0.05 collapsed too early).
        baseline_decay: the moving-average factor of the baseline (ENAS: 0.99 over a long run;
            0.9 follows a short run's rising rewards).
        entropy_weight: bonus on the policy's entropy; keeps exploring (ENAS: 1e-4).
        tanh_constant: bound on the logits (ENAS: 2.5); ``None`` leaves them free.
        init_scale: weights start uniform in ``[-init_scale, init_scale]`` (ENAS: 0.1), so the
            first policy is close to uniform.
        reward: with several objectives, the scalarization the controller maximizes
            (:class:`~retiarii.scalarization.MnasNetReward` or
            :class:`~retiarii.scalarization.WeightedSum`); None: one metric.
        mode, dedup, max_models, max_time, clock: see :class:`~retiarii.strategies.Strategy`.
    """

    def __init__(self, *, seed: int | None = None, algorithm: str = "reinforce",
                 ppo_batch: int = 4, ppo_epochs: int = 4, clip: float = 0.2,
                 hidden_size: int = 32,
                 learning_rate: float = 0.01, baseline_decay: float = 0.9,
                 entropy_weight: float = 1e-3, tanh_constant: float | None = 2.5,
                 init_scale: float = 0.1, reward: MnasNetReward | WeightedSum | None = None,
                 **common: Any):
        super().__init__(seed=seed, **common)
        if reward is not None and not isinstance(reward, (MnasNetReward, WeightedSum)):
            raise ValueError(f"PolicyBasedRL: reward must be a MnasNetReward or a WeightedSum "
                             f"(retiarii.scalarization), got {reward!r}")
        self.reward = reward
        if algorithm not in ALGORITHMS:
            raise ValueError(f"PolicyBasedRL: algorithm must be one of {ALGORITHMS}, "
                             f"got {algorithm!r}")
        for name, value in [("ppo_batch", ppo_batch), ("ppo_epochs", ppo_epochs)]:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PolicyBasedRL: {name} must be a positive int, got {value!r}")
        if not 0 < clip < 1:
            raise ValueError(f"PolicyBasedRL: clip must be in (0, 1), got {clip!r}")
        self.algorithm, self.ppo_batch, self.ppo_epochs, self.clip = \
            algorithm, ppo_batch, ppo_epochs, clip
        # PPO: sample key -> its log-probability when drawn (the old policy), while pending;
        # and the told batch so far as [key, advantage]
        self._old_log_prob: dict[str, float] = {}
        self._batch: list[list] = []
        # several objectives only with a reward that makes them one number
        self.multi_objective = reward is not None
        for name, value in [("hidden_size", hidden_size), ("learning_rate", learning_rate),
                            ("init_scale", init_scale)]:
            if not value > 0:
                raise ValueError(f"PolicyBasedRL: {name} must be positive, got {value!r}")
        if not 0 <= baseline_decay < 1:
            raise ValueError(f"PolicyBasedRL: baseline_decay must be in [0, 1), "
                             f"got {baseline_decay!r}")
        if tanh_constant is not None and not tanh_constant > 0:
            raise ValueError(f"PolicyBasedRL: tanh_constant must be positive or None, "
                             f"got {tanh_constant!r}")
        self.hidden_size = hidden_size
        self.learning_rate = learning_rate
        self.baseline_decay = baseline_decay
        self.entropy_weight = entropy_weight
        self.tanh_constant = tanh_constant
        self.init_scale = init_scale
        self._controller = Controller(hidden_size, self._rng.getrandbits(62), init_scale)
        self._optimizer = torch.optim.Adam(self._controller.parameters(), lr=learning_rate)
        self._baseline: float | None = None
        self._spread: float | None = None  # moving mean of (r - b)^2

    # -- the controller -----------------------------------------------------------------------

    def _add_head(self, label: str, candidates: list) -> int:
        head, created = self._controller.head(label, candidates)
        if created:
            params = [*self._controller.decoders[head].parameters(),
                      *self._controller.embeddings[head].parameters()]
            self._optimizer.add_param_group({"params": params})
        return head

    def _log_prob(self, trace: list[tuple[str, list]], sample: dict):
        """Log-probability and entropy of ``sample`` under the controller (with gradients)."""
        x, state = self._controller.initial()
        log_prob = torch.zeros(())
        entropy = torch.zeros(())
        for label, candidates in trace:
            head = self._add_head(label, candidates)
            state, logp = self._controller.step(x, state, head, self.tanh_constant)
            index = index_of(candidates, sample[label])
            log_prob = log_prob + logp[index]
            entropy = entropy - (logp.exp() * logp).sum()
            x = self._controller.feed(head, index)
        return log_prob, entropy

    def probability(self, space: Any, sample: dict) -> float:
        """The probability that the controller emits ``sample`` of ``space`` now.

        Example: see the class docstring.
        """
        trace = draw(space, ReplaySampler(sample)).trace
        with torch.no_grad(), one_thread():
            log_prob, _ = self._log_prob(trace, sample)
        return math.exp(log_prob.item())

    # -- the strategy hooks -------------------------------------------------------------------

    def _propose(self, space: Any) -> Draw:
        sampler = _ControllerSampler(self)
        with one_thread():
            proposal = draw(space, sampler)
        if self.algorithm == "ppo":
            self._old_log_prob[sample_key(proposal.sample)] = sampler.log_prob
        return proposal

    def use_objectives(self, modes, names=None) -> None:
        if self.reward is None:
            raise ValueError("PolicyBasedRL optimizes one metric; for several objectives give "
                             "it reward=MnasNetReward(accuracy, latency, target=...) "
                             "(MnasNet's accuracy x (latency/target)^w) or a WeightedSum")
        super().use_objectives(modes, names)
        names = self.objective_names or self.reward.metrics  # direct use: in reward order
        missing = [m for m in self.reward.metrics if m not in names]
        if missing or len(names) != len(self.objectives):
            raise ValueError(f"PolicyBasedRL: the reward reads {list(self.reward.metrics)} but "
                             f"the objectives are {list(names)}; make every metric of the "
                             f"reward an objective")
        self.objective_names = tuple(names)

    def scalar_reward(self, values: list[float]) -> float:
        """The reward of a model's objective values (several objectives: the scalarization)."""
        return self.reward(dict(zip(self.objective_names, values)))

    def _on_tell(self, key: str, score: Any) -> None:
        if score is None:  # a failed model teaches nothing about the metric
            return
        if self.objectives is not None:
            score = self.scalar_reward(self._records[key].values[-1])
            if not math.isfinite(score):
                return
        decay = self.baseline_decay
        if self._baseline is None:
            self._baseline = score
        else:
            self._baseline = decay * self._baseline + (1 - decay) * score
        advantage = score - self._baseline
        if not self._spread:  # the first spread is the first deviation itself
            self._spread = advantage ** 2
        else:
            self._spread = decay * self._spread + (1 - decay) * advantage ** 2
        if self._spread > 0:
            advantage /= math.sqrt(self._spread)
        if self.algorithm == "ppo":
            self._batch.append([key, advantage])
            if len(self._batch) >= self.ppo_batch:
                self._ppo_step()
            return
        with one_thread():
            log_prob, entropy = self._log_prob(self._trace(key), self._records[key].sample)
            loss = -advantage * log_prob - self.entropy_weight * entropy
            self._optimizer.zero_grad()
            loss.backward()
            self._optimizer.step()

    def _ppo_step(self) -> None:
        """PPO's epochs over the told batch (ppo.py), then the batch is dropped."""
        keys = [key for key, _ in self._batch]
        old = []
        with torch.no_grad(), one_thread():
            for key in keys:  # a sample never drawn here (foreign): the current policy's
                if key not in self._old_log_prob:
                    self._old_log_prob[key] = float(
                        self._log_prob(self._trace(key), self._records[key].sample)[0])
                old.append(self._old_log_prob[key])
        with one_thread():
            ppo_update(lambda i: self._log_prob(self._trace(keys[i]),
                                                self._records[keys[i]].sample),
                       old, [a for _, a in self._batch], self._optimizer,
                       epochs=self.ppo_epochs, clip=self.clip,
                       entropy_weight=self.entropy_weight)
        for key in keys:
            self._old_log_prob.pop(key, None)
        self._batch = []

    def random_startup(self) -> tuple[int, str] | None:
        # its policy moves from the first result; what runs before it (the experiment's first
        # batch) is drawn from the initial, near-uniform policy; PPO's from its first batch
        if self.algorithm == "ppo":
            return self.ppo_batch, f"ppo_batch={self.ppo_batch}"
        return 0, "its first result"

    def config(self) -> dict:
        return {**super().config(), "hidden_size": self.hidden_size,
                "learning_rate": self.learning_rate, "baseline_decay": self.baseline_decay,
                "entropy_weight": self.entropy_weight, "tanh_constant": self.tanh_constant,
                "init_scale": self.init_scale,
                # (PPO's settings only with PPO: states saved before it existed still load)
                **({"algorithm": "ppo", "ppo_batch": self.ppo_batch,
                    "ppo_epochs": self.ppo_epochs, "clip": self.clip}
                   if self.algorithm == "ppo" else {}),
                # (left out without a reward: states saved before it existed still load)
                **({"reward": self.reward.to_json()} if self.reward is not None else {})}

    def _state(self) -> dict:
        return {
            "controller_seed": self._controller.seed,
            "heads": list(self._controller.heads),  # in creation order
            "weights": tensors_to_json(self._controller.state_dict()),
            "optimizer": tensors_to_json(self._optimizer.state_dict()),
            "baseline": self._baseline,
            "spread": self._spread,
            **({"old_log_prob": self._old_log_prob, "batch": self._batch}
               if self.algorithm == "ppo" else {}),
        }

    def _load_state(self, state: dict) -> None:
        self._controller = Controller(self.hidden_size, state["controller_seed"],
                                       self.init_scale)
        self._optimizer = torch.optim.Adam(self._controller.parameters(),
                                           lr=self.learning_rate)
        for name in state["heads"]:
            label, candidates = json.loads(name)
            self._add_head(label, candidates)
        self._controller.load_state_dict(
            {k: tensor_from_json(v) for k, v in state["weights"].items()})
        saved = state["optimizer"]
        self._optimizer.load_state_dict({
            "state": {int(i): {k: tensor_from_json(v) for k, v in s.items()}
                      for i, s in saved["state"].items()},
            "param_groups": saved["param_groups"],
        })
        self._baseline = state["baseline"]
        self._spread = state["spread"]
        self._old_log_prob = dict(state.get("old_log_prob", {}))
        self._batch = [list(member) for member in state.get("batch", [])]

