"""Cross-model optimization (docs/optimization.md): the logical plan, one pass per file, and
the executable of a group of models, fused training of same-shape models, and the continuous
relaxation of a space that differentiable one-shot strategies search (relax.py)."""
from .batching import batch_independent, batching
from .build import GroupError, GroupModule, build_group
from .cse import cse
from .fused_optim import FusedOptimizer, unfuse
from .fusion import FusedModel, FusionError, fusable_groups, fuse_models, fusion_key
from .plan import LogicalPlan, PassResult, PlanError, PlanModel, Role, build_plan
from .relax import Relaxation
from .relax_space import RelaxError, read_space

__all__ = [
           "FusedModel",
           "FusedOptimizer",
           "FusionError",
           "GroupError",
           "GroupModule",
           "LogicalPlan",
           "PassResult",
           "PlanError",
           "PlanModel",
           "RelaxError",
           "Relaxation",
           "Role",
           "batch_independent",
           "batching",
           "build_group",
           "build_plan",
           "cse",
           "fusable_groups",
           "fuse_models",
           "fusion_key",
           "read_space",
           "unfuse",
]
