"""retiarii: exploratory training of neural-network model spaces.

The public API: trace a PyTorch model into the graph IR, define a space with mutators, pick a
strategy, run an experiment. See README.md and docs/.
"""
from . import moved  # noqa: F401  (first: old import paths of moved modules keep working)
from . import engine, mutators, nn, ops, registry, strategies
from .cell import Cell
from .choices import InputChoice, LayerChoice, Repeat, ValueChoice
from .engine import Experiment, ExperimentError, SearchFailed
from .engine.trainers.function_trainer import FunctionTrainer
from .engine.trainers.image_trainer import ImageFolderTrainer
from .engine.trainers.trainer import ClassifierTrainer as Trainer
from .fixed_arch import fixed_arch
from .frozen import FrozenBatchNorm, freeze
from .graph import Graph, GraphError, Node, Operation
from .match import Chain, Pattern, TargetError
from .modspec import leaf
from .mutator import MutationError, Mutator, apply_mutator
from .optim.config import OptimizeConfig
from .optim.passes import Pass, register_pass
from .sampler import SampleError
from .shapes import ShapeMismatchError
from .space import Model, ModelSpace, SpaceError
from .trace import TraceError, trace

__version__ = "0.1.0"

__all__ = ["Experiment", "ExperimentError", "FunctionTrainer", "Trainer", "Cell", "Chain", "FrozenBatchNorm",
           "Graph", "GraphError", "ImageFolderTrainer", "InputChoice", "LayerChoice", "Model", "ModelSpace",
           "MutationError", "Mutator", "Node", "Operation", "OptimizeConfig", "Pass", "Pattern",
           "Repeat", "SampleError", "SearchFailed", "ShapeMismatchError", "SpaceError", "TargetError",
           "TraceError", "ValueChoice", "apply_mutator", "engine", "fixed_arch", "freeze", "leaf",
           "mutators", "nn", "ops", "register_pass", "registry", "strategies", "trace"]
