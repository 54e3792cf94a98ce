"""The JIT engine: experiment loop, store, trials, executors, checkpoints."""
from .executors import Executor, Job, TrialTask
from .executors.simulated import SimulatedExecutor
from .runner.trial_runner import IllegalTransition, MemoryJournal, Trial, TrialRunner, TrialState
from .storage.checkpoint import CheckpointError
from .executors.local import LocalExecutor
from .storage.store import Store, StoreError
from .trainers.trainer import ClassifierConfig, ClassifierTrainer, Trainer
from .trainers.image_trainer import ImageFolderConfig, ImageFolderTrainer
from .trainers.trial_training import TrainingError, TrialRun
from .driver.experiment import EnvironmentFailure, Experiment, ExperimentError, SearchFailed

from ..moved import package_getattr

__getattr__ = package_getattr(__name__)  # old submodule names as attributes (retiarii/moved.py)
