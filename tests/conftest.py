"""Without a GPU, Triton kernels run in its CPU interpreter; it must be chosen before triton jits them."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
