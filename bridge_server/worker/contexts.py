"""Context managers made by generators (`contextlib.contextmanager`: `set_forward_context`,
`graph_capture`, `DPMetadata.sp_local_sizes`), as clients enter and exit them through refs.

Such a manager is entered once, then exited once. Used otherwise it failed with what its machinery
tripped on (a second `__enter__`: AttributeError 'args'; an `__exit__` before any enter: RuntimeError
"generator didn't stop"), status UNKNOWN. And managers of one state are exited innermost first, as
nested `with` statements exit them: vLLM's `set_forward_context` restores, on exit, the context it
found on entering, so a, b, exit a, exit b left every client with a's stale context. A manager's
state is read from the manager itself: its `func` goes when it is entered, and its generator's frame
when it is done.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bridge_server.wire.errors import BridgeError, clip

__all__ = ["EnteredContexts", "generator_manager"]

_EXITS = ("__exit__", "__aexit__")


def generator_manager(obj: object) -> bool:
    return isinstance(obj, (contextlib._GeneratorContextManager, contextlib._AsyncGeneratorContextManager))


def _frame(obj: Any) -> types.FrameType | None:
    """The manager's generator's frame: None once it is done."""
    gen = obj.gen
    return gen.gi_frame if isinstance(gen, types.GeneratorType) else getattr(gen, "ag_frame", None)


def _entered(obj: Any) -> bool:
    return not hasattr(obj, "func")


def _state_of(obj: Any) -> tuple[str, object]:
    """What a manager changes: the attributes of the object whose method made it
    (`DPMetadata.sp_local_sizes`), or its module's globals (`set_forward_context`)."""
    frame = _frame(obj)
    owner = frame.f_locals.get("self") if frame is not None else None
    if owner is not None:
        return "object", id(owner)
    code = getattr(obj.gen, "gi_code", None) or getattr(obj.gen, "ag_code", None)
    return "module", getattr(code, "co_filename", "")


def _check_state(label: str, method: str, obj: Any) -> None:
    """Entered once, then exited once."""
    done, entered = _frame(obj) is None, _entered(obj)
    entering = method not in _EXITS
    if entering and entered or not entering and (not entered or done):
        state = "exited already" if done and entered else "entered already" if entered else "not entered yet"
        made = str(getattr(obj.gen, "__qualname__", "") or "a generator")
        raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                          f"{label}: this context manager (made by {clip(made, 80)}) is {state}: one is entered "
                          f"once, then exited once; make another to use it again", target=label,
                          reason="context manager state")


@dataclass
class EnteredContexts:
    """The managers entered and not exited, innermost last, by the state they change. One whose
    refs are all released (`held` says no) no longer counts: its state goes back when one entered
    before it exits, and it is dropped, so that it keeps nothing alive."""

    held: Callable[[object], bool]
    _stacks: dict[tuple[str, object], list[object]] = field(default_factory=dict)
    _state: dict[int, tuple[str, object]] = field(default_factory=dict)

    def check(self, label: str, method: str, obj: object) -> None:
        """Refuses an enter or exit the manager's state or its place among its state's forbids."""
        _check_state(label, method, obj)
        if method not in _EXITS:
            self._state[id(obj)] = _state_of(obj)
            return
        stack = self._pruned(self._state.get(id(obj), ("", None)))
        later = next((len(stack) - 1 - i for i, x in enumerate(stack) if x is obj), 0)
        if later:
            raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                              f"{label}: {later} context manager(s) of the same state were entered after this one "
                              f"and are still entered: exit those first, the innermost first, as nested with "
                              f"statements do", target=label, reason="context manager order")

    def moved(self, obj: object) -> None:
        """After an enter or exit ran (or failed): entered and not done, it is innermost of its state;
        otherwise it is on no stack."""
        key = self._state.get(id(obj))
        if key is None:
            return
        stack = self._pruned(key)
        if _entered(obj) and _frame(obj) is not None:
            if not any(x is obj for x in stack):
                stack.append(obj)
            return
        del self._state[id(obj)]
        stack[:] = [x for x in stack if x is not obj]
        if not stack:
            del self._stacks[key]

    def _pruned(self, key: tuple[str, object]) -> list[object]:
        stack = self._stacks.setdefault(key, [])
        kept = []
        for x in stack:
            if self.held(x):
                kept.append(x)
            else:
                self._state.pop(id(x), None)
        stack[:] = kept
        return stack
