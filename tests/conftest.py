"""Shared test settings.

- One torch thread: a 2-core machine, and tests run beside each other.
- TRITON_INTERPRET=1 before anything imports triton (torch.distributed.tensor and
  torch._inductor do): on a machine without a GPU, Triton kernels run only in its
  interpreter, and triton reads the variable once, at import.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
