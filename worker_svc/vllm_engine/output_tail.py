"""The last lines vLLM's processes print while the engine starts, so a failed start names its cause.

vLLM's engine core runs in child processes: when one fails, the worker process only gets
"Engine core initialization failed. See root cause above", and the cause (a kernel that does not
exist for this device, a missing file, an out-of-memory) is in the child's output. The children
inherit file descriptors 1 and 2, so during the start those are pipes: a thread per pipe forwards
every byte to where it went before and keeps the last lines. The threads forward for as long as any
child holds a pipe (children started then keep them for life).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator

_KEEP_LINES = 400
_READ_BYTES = 65536
_DRAIN_TIMEOUT_S = 10.0
# a traceback's last line, after any prefix vLLM's log formatter puts on each line
_EXCEPTION = re.compile(r"(?:^|[\s)\]])((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)): (.+)$")
_MEMORY_WORDS = ("memory", "cache blocks", "kv cache", "OOM")


class OutputTail:
    """The lines written to this process's stdout and stderr (by it and its children) while
    `capture` is active, and after by those children."""

    def __init__(self) -> None:
        self._lines: collections.deque[str] = collections.deque(maxlen=_KEEP_LINES)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Points fds 1 and 2 at pipes for the block, then back; the children keep the pipes."""
        restores = [self._tee(fd) for fd in (1, 2)]
        try:
            yield
        finally:
            for restore in restores:
                restore()

    def drain(self) -> None:
        """Waits until every writer of the pipes is gone (the children of a failed start have
        exited): all their output has been forwarded and kept."""
        for thread in self._threads:
            thread.join(_DRAIN_TIMEOUT_S)

    def cause(self) -> str | None:
        """The last exception line printed ("ValueError: Failed to find a kernel ..."), if any."""
        with self._lock:
            lines = list(self._lines)
        for line in reversed(lines):
            match = _EXCEPTION.search(line.strip())
            if match:
                return f"{match.group(1)}: {match.group(2)}"
        return None

    def _tee(self, fd: int) -> Callable[[], None]:
        stream = sys.stdout if fd == 1 else sys.stderr
        stream.flush()
        original = os.dup(fd)
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        thread = threading.Thread(
            target=self._forward, args=(read_end, original), name=f"output-tail-{fd}", daemon=True
        )
        thread.start()
        self._threads.append(thread)

        def restore() -> None:
            stream.flush()
            os.dup2(original, fd)  # this process's own copy of the pipe's write end closes

        return restore

    def _forward(self, read_end: int, original: int) -> None:
        pending = b""
        while chunk := os.read(read_end, _READ_BYTES):
            written = 0
            while written < len(chunk):
                written += os.write(original, chunk[written:])
            *lines, pending = (pending + chunk).split(b"\n")
            with self._lock:
                self._lines.extend(line.decode(errors="replace") for line in lines)
        os.close(read_end)
        os.close(original)


def start_failure(error: Exception, cause: str | None) -> str:
    """The worker's one-line message for a vLLM engine that did not start."""
    if cause is None:
        return f"vLLM's engine failed to start ({error}); its processes' output above has the cause"
    message = f"vLLM's engine failed to start: {cause}"
    if any(word.lower() in cause.lower() for word in _MEMORY_WORDS):
        message += (
            ". For memory: lower [attention] max_model_len, or raise [cache] "
            "gpu_memory_utilization (on a CPU: [cache] cpu_cache_bytes)"
        )
    return message
