"""Kernels for the self-check's child-process tests, importable by name in the child (test_selfcheck_child.py).

The crashing ones crash only in a child: called in the process that set PARENT_ENV (the test's), they raise
instead, so a check that wrongly ran in-process fails the test rather than killing pytest.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import trillm.kernels  # noqa: F401  (BLAS before mlx)
import mlx.core as mx

from trillm.kernels.kv_gather import kv_gather_ref
from trillm.kernels.paged_attention import paged_attention_ref

PARENT_ENV = "SELFCHECK_PLANTS_PARENT"  # the test process's pid
LOG_ENV = "SELFCHECK_PLANTS_LOG"  # a file each call appends "<name> <pid>" to


def _called(name: str) -> bool:
    """Log the call; True in a child process (where crashing is the point)."""
    if log := os.environ.get(LOG_ENV):
        with open(log, "a") as f:
            f.write(f"{name} {os.getpid()}\n")
    return os.environ.get(PARENT_ENV) not in (None, str(os.getpid()))


def _refuse(name: str) -> mx.array:
    raise RuntimeError(f"{name} was called in the test's own process: the check did not run in a child first")


def segfaults(*args: Any, **kwargs: Any) -> mx.array:
    if _called("segfaults"):
        ctypes.string_at(0)  # reads address 0: SIGSEGV
    return _refuse("segfaults")


def aborts(*args: Any, **kwargs: Any) -> mx.array:
    if _called("aborts"):
        os.abort()  # what MLX does when a Metal command buffer fails inside its completion handler
    return _refuse("aborts")


def exits(*args: Any, **kwargs: Any) -> mx.array:
    if _called("exits"):
        os._exit(3)
    return _refuse("exits")


def hangs(*args: Any, **kwargs: Any) -> mx.array:
    if _called("hangs"):
        time.sleep(3600)
    return _refuse("hangs")


def passes(*args: Any, **kwargs: Any) -> mx.array:
    _called("passes")
    return paged_attention_ref(*args, **kwargs)


def wrong(*args: Any, **kwargs: Any) -> mx.array:
    _called("wrong")
    return paged_attention_ref(*args, **kwargs) + 0.01


def gather_passes(pool: mx.array, block_tables: mx.array, max_len: int) -> mx.array:
    _called("gather_passes")
    return kv_gather_ref(pool, block_tables, max_len)
