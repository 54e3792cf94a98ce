"""The JIT engine: experiment loop, store, trials, executors, checkpoints."""
from .executors import Executor, Job, TrialTask
from .executors.simulated import SimulatedExecutor
from .trials import IllegalTransition, MemoryJournal, Trial, TrialRunner, TrialState
from .checkpoint import CheckpointError
from .executors.local import LocalExecutor
from .store import Store, StoreError
from .trainer import ClassifierConfig, ClassifierTrainer, Trainer
from .image_trainer import ImageFolderConfig, ImageFolderTrainer
from .trial_run import TrainingError, TrialRun
from .experiment import EnvironmentFailure, Experiment, ExperimentError, SearchFailed
