"""Cross-model optimization (docs/optimization.md): the logical plan, one pass per file, and
the executable of a group of models, fused training of same-shape models, packing models
onto devices, the weight-sharing super-graph, the continuous relaxation of a space that
differentiable one-shot strategies search (relax.py), and mixed parallelism of
weight-sharing training (docs/weight_sharing.md)."""
from .batching import batch_independent, batching
from .build import GroupError, GroupModule, build_group
from .cost import Layout, LayoutChoice, Verdict, choose_layout, judge_segment
from .cse import cse
from .fused_optim import FusedOptimizer, unfuse
from .fusion import (FusedModel, FusionError, fusable_groups, fuse_models, fusion_family,
                     fusion_key, segments_fit)
from .mixed_parallel import average_used_gradients, gather_segment, segment_rank
from .packing import Device, ModelProfile, PackingConfig, PackingError, Placement, pack
from .split import SuperGraphSplit, Window, parse_bytes, split_paths
from .plan import LogicalPlan, PassResult, PlanError, PlanModel, Role, build_plan
from .supergraph import SuperGraph, SuperGraphError
from .weight_keys import OpKey, weight_keys
from .relax import Relaxation
from .relax_space import RelaxError, read_space

from ..moved import package_getattr

# spawn, run_segment_on_ranks and RankError moved to the executors (engine/executors/
# local_ranks.py); they keep answering here, imported on first use (retiarii/moved.py)
__getattr__ = package_getattr(__name__)

__all__ = [
           "Device",
           "FusedModel",
           "FusedOptimizer",
           "FusionError",
           "GroupError",
           "GroupModule",
           "Layout",
           "LayoutChoice",
           "LogicalPlan",
           "OpKey",
           "ModelProfile",
           "PackingConfig",
           "PackingError",
           "PassResult",
           "Placement",
           "PlanError",
           "PlanModel",
           "RankError",
           "SuperGraphSplit",
           "Window",
           "parse_bytes",
           "split_paths",
           "RelaxError",
           "Relaxation",
           "Role",
           "SuperGraph",
           "SuperGraphError",
           "Verdict",
           "average_used_gradients",
           "batch_independent",
           "batching",
           "build_group",
           "build_plan",
           "choose_layout",
           "cse",
           "fusable_groups",
           "fuse_models",
           "fusion_family", "fusion_key", "segments_fit",
           "gather_segment",
           "judge_segment",
           "run_segment_on_ranks",
           "segment_rank",
           "spawn",
           "read_space",
           "pack",
           "unfuse",
           "weight_keys",
]
