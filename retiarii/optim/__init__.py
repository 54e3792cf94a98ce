"""Cross-model optimization (docs/optimization.md): the logical plan, one pass per file, and
the executable of a group of models, fused training of same-shape models, packing models
onto devices."""
from .batching import batch_independent, batching
from .build import GroupError, GroupModule, build_group
from .cse import cse
from .fused_optim import FusedOptimizer, unfuse
from .fusion import FusedModel, FusionError, fusable_groups, fuse_models, fusion_key
from .packing import Device, ModelProfile, PackingConfig, PackingError, Placement, pack
from .plan import LogicalPlan, PassResult, PlanError, PlanModel, Role, build_plan

__all__ = [
           "Device",
           "FusedModel",
           "FusedOptimizer",
           "FusionError",
           "GroupError",
           "GroupModule",
           "LogicalPlan",
           "ModelProfile",
           "PackingConfig",
           "PackingError",
           "PassResult",
           "Placement",
           "PlanError",
           "PlanModel",
           "Role",
           "batch_independent",
           "batching",
           "build_group",
           "build_plan",
           "cse",
           "fusable_groups",
           "fuse_models",
           "fusion_key",
           "pack",
           "unfuse",
]
