"""Cross-model optimization (docs/optimization.md): the logical plan, one pass per file, and
the executable of a group of models."""
from .build import GroupError, GroupModule, build_group
from .cse import cse
from .plan import LogicalPlan, PassResult, PlanError, PlanModel, Role, build_plan

__all__ = [
           "GroupError",
           "GroupModule",
           "LogicalPlan",
           "PassResult",
           "PlanError",
           "PlanModel",
           "Role",
           "build_group",
           "build_plan",
           "cse",
]
