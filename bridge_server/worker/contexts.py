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
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bridge_server.wire.errors import BridgeError, clip
from bridge_server.wire.protocol import host_of

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


# How long a client holds a shared state it does not use: past it, the next client that enters a
# manager of that state (or reads it) ends the hold. A client that entered vLLM's forward context and
# went away without exiting or releasing it kept every other client out of it until its refs expired.
HOLD_LAPSE_S = 60.0
# How long a client holds a shared state another client asks for, however it uses it: one that entered
# and exited a manager nested under its own every 30 s renewed its hold for good (a stranger kept every
# other client out of the forward context of a pool's only worker, for four cheap calls a minute).
HOLD_MAX_S = 600.0
# A client that enters a state again within TURN_S of ending its hold (by exit or release; or another
# connection of its host) holds on: its hold counts from its first enter. One that exited just before
# HOLD_MAX_S and entered again at once kept the state for good, while a client that asked every 5 s
# was refused 130 times in 700 s.
TURN_S = 10.0


@dataclass
class EnteredContexts:
    """The managers entered and not exited, innermost last, by the state they change, and who entered
    each (the caller's identity, else its connection).

    A state is one client's at a time: its managers change what every client then reads (vLLM's
    forward context is one module global), so another client's enter is refused while one is in force,
    and so are its reads of that state (`holder`). A hold lapses: a holder that has not used its state
    for HOLD_LAPSE_S, or has held it for HOLD_MAX_S however it used it, loses it to the next client
    that asks, its managers exited from the innermost out
    (its later exit is then refused as "exited already"); a holder (or its host) that ends its hold and
    enters again within TURN_S holds on, its hold counted from its first enter. Only the client that
    entered a manager exits it or releases it. A manager whose refs are all released (`held`
    says no) is exited as soon as it is innermost, as its `with` block would have ended: one released
    while in force stayed in force for good, its attn_metadata read by every client. An enter is
    counted from its check, not its end: two clients entering at the same moment both got in."""

    held: Callable[[object], bool]
    lapse_s: float = HOLD_LAPSE_S
    max_s: float = HOLD_MAX_S
    turn_s: float = TURN_S
    _stacks: dict[tuple[str, object], list[object]] = field(default_factory=dict)
    _state: dict[int, tuple[str, object]] = field(default_factory=dict)
    _owner: dict[int, str] = field(default_factory=dict)
    _used: dict[tuple[str, object], float] = field(default_factory=dict)    # the holder's last use
    _since: dict[tuple[str, object], float] = field(default_factory=dict)   # ... and its first enter
    _freed: dict[tuple[str, object], tuple[str, float, float]] = field(default_factory=dict)   # host, since, when

    def check(self, label: str, method: str, obj: object, who: str = "") -> None:
        """Refuses an enter or exit the manager's state, its place among its state's, or another
        client's hold on its state forbids."""
        _check_state(label, method, obj)
        if method not in _EXITS:
            key = _state_of(obj)
            stack = self._held_by(key, who)
            now = time.monotonic()
            if any(self._owner.get(id(x), "") != who for x in stack):
                raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                                  f"{label}: another client's context manager of the same state is in force "
                                  f"(it changes what every client reads): one client's at a time; try again once "
                                  f"it is exited (a hold unused for {self.lapse_s:g} s, or kept for "
                                  f"{self.max_s:g} s, lapses when another client asks)", target=label,
                                  reason="context in force")
            self._state[id(obj)] = key
            self._owner[id(obj)] = who
            if not stack:
                last = self._freed.pop(key, None)
                # the same host back within turn_s holds on: its hold counts from its first enter
                self._since[key] = last[1] if last is not None and last[0] == host_of(who) \
                    and now - last[2] <= self.turn_s else now
            stack.append(obj)           # counted now: another client's enter meanwhile is refused
            self._used[key] = now
            return
        self._own(obj, who, label, "exits", "validation")
        key = self._state.get(id(obj), ("", None))
        stack = self._pruned(key)
        later = next((len(stack) - 1 - i for i, x in enumerate(stack) if x is obj), 0)
        if later:
            raise BridgeError(grpc.StatusCode.FAILED_PRECONDITION, "validation",
                              f"{label}: {later} context manager(s) of the same state were entered after this one "
                              f"and are still entered: exit those first, the innermost first, as nested with "
                              f"statements do", target=label, reason="context manager order")
        self._used[key] = time.monotonic()

    def check_release(self, obj: object, who: str) -> None:
        """Refuses `who` releasing a manager another client entered and has not exited: releasing it
        ends that client's hold, as its exit would."""
        self._own(obj, who, "Release", "releases", "ref")

    def _own(self, obj: object, who: str, label: str, doing: str, category: str) -> None:
        """Refuses `who` ending a manager another client entered (by exit or release)."""
        owner = self._owner.get(id(obj))
        if owner is not None and owner != who:
            raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, category,
                              f"{label}: this context manager was entered by another client: only the client "
                              f"that entered a manager {doing} it (its hold lapses when it stops using it)",
                              target=label, reason="not yours")

    def holder(self, module_file: str, who: str = "") -> str:
        """Who holds the state of the module at `module_file` (the caller that entered its managers
        in force; "" when none is), as `who` asks it."""
        stack = self._held_by(("module", module_file), who)
        return self._owner.get(id(stack[-1]), "") if stack else ""

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
        who = self._owner.get(id(obj), "")
        self._forget(obj)
        stack[:] = [x for x in stack if x is not obj]
        if not stack:
            del self._stacks[key]
            self._ended(key, who)

    def settle(self) -> None:
        """Exits every released manager that is innermost of its state, now. Left to the next client
        that asks of its state, a manager of a state no one reaches again (an object's, released with
        the object) was never exited: each such `DPMetadata.sp_local_sizes` entered and released kept
        its tensors, 10-15 MB a cycle, counted against nobody."""
        for key in list(self._stacks):
            if not self._pruned(key):
                del self._stacks[key]
        now = time.monotonic()
        for key, (_, _, at) in list(self._freed.items()):
            if now - at > self.turn_s:
                del self._freed[key]

    def _ended(self, key: tuple[str, object], who: str) -> None:
        """A hold its holder ended (by exit or release), remembered for TURN_S."""
        self._used.pop(key, None)
        since = self._since.pop(key, None)
        if since is not None:
            self._freed[key] = (host_of(who), since, time.monotonic())

    def _held_by(self, key: tuple[str, object], who: str) -> list[object]:
        """The state's stack as `who` finds it: another client's hold that has lapsed (unused for
        lapse_s, or kept for max_s) is ended first; the holder's own asking is a use."""
        stack = self._pruned(key)
        if not stack:
            return stack
        now = time.monotonic()
        if self._owner.get(id(stack[-1]), "") == who:
            self._used[key] = now
        elif now - self._used.get(key, 0.0) > self.lapse_s or now - self._since.get(key, now) > self.max_s:
            while stack:
                self._end(stack.pop())
            self._since.pop(key, None)
        return stack

    def _end(self, obj: object) -> None:
        """Exits a manager whose block is over (released, or its hold lapsed), if it is entered."""
        self._forget(obj)
        if _entered(obj) and _frame(obj) is not None:
            try:
                obj.__exit__(None, None, None)      # type: ignore[attr-defined]
            except Exception:   # noqa: BLE001 - its block has ended; what its exit raises has no caller
                pass

    def _forget(self, obj: object) -> None:
        self._state.pop(id(obj), None)
        self._owner.pop(id(obj), None)

    def _pruned(self, key: tuple[str, object]) -> list[object]:
        """The state's stack, its released managers exited from the innermost out while they are
        innermost (one released under another still held waits for that one)."""
        stack = self._stacks.setdefault(key, [])
        if stack and not self.held(stack[-1]):
            who = self._owner.get(id(stack[-1]), "")
            while stack and not self.held(stack[-1]):
                self._end(stack.pop())
            if not stack:
                self._ended(key, who)
        return stack
