"""Shared test set-up."""
import os

import torch

# Tests run two processes at a time on two cores (pytest -n 2); torch's own thread pool on top
# of that oversubscribes the CPU and makes small convolutions hundreds of times slower.
torch.set_num_threads(1)
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
