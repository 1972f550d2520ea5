"""Triton's CPU interpreter runs its kernels in numpy, and old interpreters predate numpy 2:
Triton 3.0's computes wrong grouped GEMMs with numpy 2.0-2.3, and Triton 3.0-3.6's refuse numpy
2.4 ("only 0-dimensional arrays can be converted to Python scalars", in every loop whose bound is
held in a tensor). fmoe refuses those pairs in one line rather than run them."""
from typing import Optional

import numpy
import triton


def _release(version: str) -> tuple:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def interpreter_problem(triton_version: str = triton.__version__,
                        numpy_version: str = numpy.__version__) -> Optional[str]:
    """Why this Triton's interpreter cannot run with this numpy, or None."""
    t, n = _release(triton_version), _release(numpy_version)
    if (t < (3, 1) and n >= (2, 0)) or (t < (3, 7) and n >= (2, 4)):
        newest = "2" if t < (3, 1) else "2.4"
        return (f"Triton {triton_version}'s CPU interpreter (TRITON_INTERPRET=1) needs numpy<{newest}, "
                f"this is numpy {numpy_version}: install 'numpy<{newest}' or triton>=3.7")
    return None


def check_interpreter():
    problem = interpreter_problem()
    if problem is not None:
        raise RuntimeError(problem)
