"""Shared by every plugin's tests in this repository: torch on one thread (tests share two cores)."""

import torch

torch.set_num_threads(1)
