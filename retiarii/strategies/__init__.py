"""Exploration strategies (instantiation control) and schedulers (training control).

One algorithm per file; each is importable from here.
"""
from .scheduler import Decision, Scheduler, Spawn
from .median_stopping import MedianStopping
from .asha import ASHA
from .moasha import MOASHA
from .scalarized import Scalarized
from .hyperband import Hyperband
from .hypertrick import HyperTrick
from .pbt import PBT, Categorical, Continuous, Discrete, Integer
from .base import BudgetExhausted, SpaceExhausted, Strategy, UnknownSample
from .random_search import Random
from .grid import GridSearch
from .fixed import FixedArchitecture
from .evolution import RegularizedEvolution
from .wann import WANN
from .rl import PolicyBasedRL
from .tpe import TPE
from .predictor import Predictor
from .progressive import Progressive
from .one_shot import EvaluatedModel, OneShot, SegmentContext, SegmentResult
from .darts import DARTS
from .snas import GumbelDARTS
from .proxyless import ProxylessNAS
from .spos import SPOS
from .fairnas import FairNAS
from .single_path import SinglePathNAS
from .once_for_all import OnceForAll
from .enas import ENAS
from .weight_sharing import WeightSharing
