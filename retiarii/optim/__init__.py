"""Cross-model optimization (docs/optimization.md): the logical plan, one pass per file, and
the executable of a group of models, fused training of same-shape models."""
from .batching import batch_independent, batching
from .build import GroupError, GroupModule, build_group
from .cost import Layout, LayoutChoice, choose_layout
from .cse import cse
from .fused_optim import FusedOptimizer, unfuse
from .fusion import FusedModel, FusionError, fusable_groups, fuse_models, fusion_key
from .plan import LogicalPlan, PassResult, PlanError, PlanModel, Role, build_plan

__all__ = [
           "FusedModel",
           "FusedOptimizer",
           "FusionError",
           "GroupError",
           "GroupModule",
           "Layout",
           "LayoutChoice",
           "LogicalPlan",
           "PassResult",
           "PlanError",
           "PlanModel",
           "Role",
           "batch_independent",
           "batching",
           "build_group",
           "build_plan",
           "choose_layout",
           "cse",
           "fusable_groups",
           "fuse_models",
           "fusion_key",
           "unfuse",
]
