"""The JIT engine: experiment loop, store, trials, executors, checkpoints."""
from .executors import Executor, Job, TrialTask
