"""Paged MLA decode attention behind a backend switch (torch, triton, flashinfer)."""

from mlaserve.attention.registry import (
    available_backends,
    create_backend,
    mla_decode,
    resolve_backend_name,
)

__all__ = ["available_backends", "create_backend", "mla_decode", "resolve_backend_name"]
