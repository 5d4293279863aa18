"""One torch thread: the CPU is shared, and the short training run stays fast and reproducible."""

import torch

torch.set_num_threads(1)
