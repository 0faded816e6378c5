"""Triton's interpreter in a process of its own, so the Triton kernels run on a CPU there while
nothing in the test process is interpreted.

Triton chooses between compiling and interpreting when `triton.jit` runs, at import, for its own
library (tl.max, tl.cdiv, ...) as for our kernels: TRITON_INTERPRET=1 must be set before triton is
first imported, which only a fresh process guarantees. Calls are pickled by reference
(`interpreter.call(kernel.fp8_gemm, a, ..., impl="triton")`), tensors by value.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
_CALL_TIMEOUT_S = 120


def _interpret() -> None:
    """The child's initializer: runs before any work item imports triton."""
    assert "triton" not in sys.modules, "triton was imported before the interpreter was switched on"
    os.environ["TRITON_INTERPRET"] = "1"


class TritonInterpreter:
    """One spawned process with TRITON_INTERPRET=1; close() ends it."""

    def __init__(self) -> None:
        self._pool = ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_interpret
        )

    def call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return self._pool.submit(function, *args, **kwargs).result(timeout=_CALL_TIMEOUT_S)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
