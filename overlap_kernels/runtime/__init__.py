"""The shared runtime: platform, symmetric workspace and backends, signals, errors."""

from . import platform  # noqa: F401  (first: turns the interpreter on before any kernel)
from .collectives import raise_if_failed
from .errors import OverlapError, OverlapInputError, OverlapMismatchError, OverlapTimeoutError
from .workspace import Workspace, get_workspace, reset_workspaces, use_backend

__all__ = [
    "OverlapError",
    "OverlapInputError",
    "OverlapMismatchError",
    "OverlapTimeoutError",
    "Workspace",
    "get_workspace",
    "raise_if_failed",
    "reset_workspaces",
    "use_backend",
]
