"""Tests share two CPU cores with other jobs: run torch on a single thread."""

import torch

torch.set_num_threads(1)
