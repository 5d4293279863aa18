"""The CPU is shared with other jobs: one thread keeps the training runs fast and predictable."""

import torch

torch.set_num_threads(1)
