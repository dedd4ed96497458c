"""Shared test settings: keep torch to one thread (2-core machine, tests run beside others)."""

import torch

torch.set_num_threads(1)
