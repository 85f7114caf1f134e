"""What a sandbox worker process (the grammar sandbox's, the request-template renderer's) does
to itself when it starts, and how a process gives freed memory back.

The workers run code whose cost a client chooses, in pebble's process pools: `enter_sandbox`
makes a worker end at once when the pool kills it (pebble's own SIGTERM handler is Python code,
which waits until the C call in progress returns) and caps what it may allocate beyond its
start-up size (RLIMIT_DATA; an allocation past it fails inside the call, as MemoryError or
C++'s std::bad_alloc). The cap needs Linux's /proc; elsewhere it is not set.
"""

import ctypes
import ctypes.util
import logging
import re
import signal

logger = logging.getLogger(__name__)

_libc: ctypes.CDLL | None = None


def enter_sandbox(memory_bytes: int) -> None:
    """Die at the pool's SIGTERM; allocate at most `memory_bytes` beyond what is in use now."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        import resource

        with open("/proc/self/status") as status:
            in_use = int(re.search(r"VmData:\s+(\d+) kB", status.read()).group(1)) * 1024
    except (ImportError, OSError, AttributeError):
        logger.warning("no memory cap for this sandbox worker (it needs Linux's /proc)")
        return
    limit = in_use + memory_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def trim_heap() -> None:
    """Give the heap's free memory back to the system (glibc keeps what a large compile freed,
    and the resident size would stay at its peak). A no-op without glibc."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
