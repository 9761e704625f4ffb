"""Make a Ray actor handle look like the in-process object it wraps.

``await proxy.generate(requests)`` becomes ``await handle.generate.remote(requests)``, so the
controller and the rollout manager drive Ray workers and in-process fakes through the same
async calls. ``proxy.handle`` stays available for transports that pass object references
between workers directly (weight sync).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any


class ActorProxy:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self.handle, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await method.remote(*args, **kwargs)

        call.__name__ = name
        return call

    def __reduce__(self) -> tuple[type[ActorProxy], tuple[Any]]:
        return (ActorProxy, (self.handle,))
