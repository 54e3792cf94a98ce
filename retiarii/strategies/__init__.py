"""Exploration strategies (instantiation control) and schedulers (training control).

One algorithm per file; each is importable from here.
"""
from .schedulers.base import Decision, Scheduler, Spawn
from .schedulers.median_stopping import MedianStopping
from .schedulers.asha import ASHA
from .schedulers.moasha import MOASHA
from .schedulers.scalarized import Scalarized
from .schedulers.hyperband import Hyperband
from .schedulers.hypertrick import HyperTrick
from .schedulers.pbt import PBT, Categorical, Continuous, Discrete, Integer
from .multi_trial.base import BudgetExhausted, SpaceExhausted, Strategy, UnknownSample
from .multi_trial.random_search import Random
from .multi_trial.grid import GridSearch
from .multi_trial.fixed import FixedArchitecture
from .multi_trial.evolution import RegularizedEvolution
from .multi_trial.hierarchical_evolution import HierarchicalEvolution
from .multi_trial.wann import WANN
from .multi_trial.rl import PolicyBasedRL
from .multi_trial.tpe import TPE
from .multi_trial.predictor import Predictor
from .multi_trial.chamnet import ChamNet
from .multi_trial.progressive import Progressive
from .multi_trial.compound_scaling import CompoundScaling
from .multi_trial.path_level_rl import PathLevelRL
from .multi_trial.neural_predictor import NeuralPredictor
from .one_shot.base import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from .one_shot.darts import DARTS
from .one_shot.snas import GumbelDARTS
from .one_shot.proxyless import ProxylessNAS
from .one_shot.spos import SPOS
from .one_shot.fairnas import FairNAS
from .one_shot.single_path import SinglePathNAS
from .one_shot.once_for_all import OnceForAll
from .one_shot.enas import ENAS
from .one_shot.path_dropout import PathDropout
from .one_shot.weight_sharing import WeightSharing

from ..moved import package_getattr

__getattr__ = package_getattr(__name__)  # old submodule names as attributes (retiarii/moved.py)
