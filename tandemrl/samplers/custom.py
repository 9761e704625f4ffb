"""custom: a user's ``PromptGroupSampler`` imported from ``async_rl.sampler.target``.

``target: "module:ClassName"`` names the class; every other key of the sampler block is passed
to its constructor as a keyword argument, together with ``buffer`` and ``groups_per_step``.
The class must subclass ``PromptGroupSampler`` (and implement its abstract methods), or at
least provide ``admit``, ``select`` and ``evict`` as coroutine functions plus
``should_abort_inflight`` and ``required_buffer_capacity``; a structural class is wrapped in
``StructuralSamplerAdapter`` so the pumps can call every hook of the base class on it.
A custom sampler is replay-recoverable only if it declares ``supports_buffer_checkpoint = True``.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from typing import Any, cast

from tandemrl.buffer import ReplayBuffer, Slot
from tandemrl.samplers.base import (
    PromptGroupSampler,
    SamplerClosed,
    SamplerConfigError,
    Selection,
    TrainerVersionFn,
)

TARGET_PATH = "async_rl.sampler.target"
REQUIRED_COROUTINES = ("admit", "select", "evict")
REQUIRED_METHODS = ("should_abort_inflight", "required_buffer_capacity")


def load_sampler_class(target: str) -> type:
    """Import and type-check the class ``target`` ("module:ClassName") names."""
    module_name, sep, class_path = target.partition(":")
    if not sep or not module_name or not class_path:
        raise SamplerConfigError(f"{TARGET_PATH}: {target!r} is not of the form 'module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is a config problem
        raise SamplerConfigError(
            f"{TARGET_PATH}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})"
        ) from exc
    found: Any = module
    for part in class_path.split("."):
        if not hasattr(found, part):
            raise SamplerConfigError(
                f"{TARGET_PATH}: module {module_name!r} has no attribute {class_path!r}"
            )
        found = getattr(found, part)
    if not isinstance(found, type):
        raise SamplerConfigError(
            f"{TARGET_PATH}: {target!r} is a {type(found).__name__}, not a class"
        )
    check_sampler_class(found, target)
    return found


def check_sampler_class(cls: type, target: str) -> None:
    """Refuse a class that is neither a complete PromptGroupSampler nor structurally one."""
    if issubclass(cls, PromptGroupSampler):
        if inspect.isabstract(cls):
            missing = sorted(getattr(cls, "__abstractmethods__", ()))
            raise SamplerConfigError(
                f"{TARGET_PATH}: {target!r} does not implement {', '.join(missing)} of "
                "PromptGroupSampler"
            )
        return
    problems = [
        f"{name} (must be an async def)"
        for name in REQUIRED_COROUTINES
        if not inspect.iscoroutinefunction(getattr(cls, name, None))
    ]
    problems += [name for name in REQUIRED_METHODS if not callable(getattr(cls, name, None))]
    if problems:
        raise SamplerConfigError(
            f"{TARGET_PATH}: {target!r} is not a PromptGroupSampler: subclass "
            "tandemrl.samplers.PromptGroupSampler, or provide " + ", ".join(problems)
        )


def create_custom_sampler(
    target: str, buffer: ReplayBuffer, *, groups_per_step: int, kwargs: dict[str, Any]
) -> PromptGroupSampler:
    cls = load_sampler_class(target)
    reserved = sorted({"buffer", "groups_per_step"} & set(kwargs))
    if reserved:
        raise SamplerConfigError(
            f"async_rl.sampler: {', '.join(reserved)} cannot be set in the config; the "
            "controller passes them to the custom sampler"
        )
    try:
        instance = cls(buffer=buffer, groups_per_step=groups_per_step, **kwargs)
    except TypeError as exc:
        raise SamplerConfigError(
            f"async_rl.sampler: constructing {target!r} with buffer, groups_per_step and "
            f"{sorted(kwargs)} failed: {exc}"
        ) from exc
    if isinstance(instance, PromptGroupSampler):
        return instance
    return StructuralSamplerAdapter(instance, buffer, groups_per_step=groups_per_step)


class StructuralSamplerAdapter(PromptGroupSampler):
    """Gives a structurally typed custom sampler the base class's hooks.

    The five required calls go to the wrapped object. Optional hooks (notify, close,
    on_group_removed, lookahead_at, dispatch_state, load_dispatch_state) go to it when it has
    them, and fall back to the base behaviour otherwise. Capability flags are the wrapped
    class's (False when it does not declare them).
    """

    def __init__(self, inner: Any, buffer: ReplayBuffer, *, groups_per_step: int) -> None:
        super().__init__(buffer, groups_per_step=groups_per_step)
        self.inner = inner
        self.name = f"custom:{type(inner).__qualname__}"  # type: ignore[misc]
        self.supports_buffer_checkpoint = bool(  # type: ignore[misc]
            getattr(inner, "supports_buffer_checkpoint", False)
        )
        self.supports_training_claims = bool(  # type: ignore[misc]
            getattr(inner, "supports_training_claims", False)
        )

    async def admit(self, *, trainer_version_fn: TrainerVersionFn) -> int | None:
        # The wrapped admit knows nothing of close(); race it against our wake-ups so that a
        # close still ends a waiting admit.
        inner_admit = asyncio.ensure_future(self.inner.admit(trainer_version_fn=trainer_version_fn))
        try:
            while not inner_admit.done():
                if self.closed:
                    raise SamplerClosed(f"{self.name} sampler is closed")
                wakeup = asyncio.ensure_future(self._wakeup_event().wait())
                try:
                    await asyncio.wait({inner_admit, wakeup}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wakeup.cancel()
            return cast(int | None, inner_admit.result())
        finally:
            if not inner_admit.done():
                inner_admit.cancel()

    async def select(
        self, *, current_train_weight: int, min_prompt_groups: int, max_prompt_groups: int
    ) -> Selection:
        selection = await self.inner.select(
            current_train_weight=current_train_weight,
            min_prompt_groups=min_prompt_groups,
            max_prompt_groups=max_prompt_groups,
        )
        return cast(Selection, selection)

    async def evict(self, *, current_train_weight: int) -> list[Slot]:
        return cast(list[Slot], await self.inner.evict(current_train_weight=current_train_weight))

    def should_abort_inflight(self, *, start_weight: int, current_train_weight: int) -> bool:
        return bool(
            self.inner.should_abort_inflight(
                start_weight=start_weight, current_train_weight=current_train_weight
            )
        )

    def required_buffer_capacity(self, groups_per_step: int) -> int:
        return int(self.inner.required_buffer_capacity(groups_per_step))

    def notify(self) -> None:
        super().notify()
        if callable(getattr(self.inner, "notify", None)):
            self.inner.notify()

    def close(self) -> None:
        if callable(getattr(self.inner, "close", None)):
            self.inner.close()
        super().close()

    def on_group_removed(self, slot: Slot) -> None:
        if callable(getattr(self.inner, "on_group_removed", None)):
            self.inner.on_group_removed(slot)
        super().on_group_removed(slot)

    def lookahead_at(self, trainer_version: int) -> int | None:
        if not callable(getattr(self.inner, "lookahead_at", None)):
            return super().lookahead_at(trainer_version)
        lookahead = self.inner.lookahead_at(trainer_version)
        return None if lookahead is None else int(lookahead)

    def dispatch_state(self) -> dict[str, Any]:
        state = super().dispatch_state()
        if callable(getattr(self.inner, "dispatch_state", None)):
            state["inner"] = self.inner.dispatch_state()
        return state

    def load_dispatch_state(self, state: dict[str, Any]) -> None:
        super().load_dispatch_state(state)
        if "inner" in state and callable(getattr(self.inner, "load_dispatch_state", None)):
            self.inner.load_dispatch_state(state["inner"])
