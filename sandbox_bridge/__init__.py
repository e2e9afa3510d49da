"""Run model-written code in isolation, with Code Judge's semantics (see types.py).

`from sandbox_bridge import LocalSandbox` imports the executor lazily, so importing the package
(or sandbox_bridge.types) stays cheap for processes that never run code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbox_bridge.local import LocalSandbox

__all__ = ["LocalSandbox"]


def __getattr__(name: str) -> Any:
    if name == "LocalSandbox":
        from sandbox_bridge.local import LocalSandbox

        return LocalSandbox
    raise AttributeError(f"module 'sandbox_bridge' has no attribute {name!r}")
