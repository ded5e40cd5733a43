"""What can die under a worker while the worker itself runs on: its engines, and its exclusive lane.

An engine's core is another process with threads of its own: it can exit, or stop answering (its
input thread dies on a request it cannot decode, and every later request then waits forever). The
worker cannot see that from a call's point of view, so it asks: every `interval_s` each object with a
lifecycle (`adapters/spec.py`: an engine) is probed. A dead one is killed, so that its calls, those
in flight too, fail at once with the cause ("engine dead: ..."). A published one is then created
again from its config and warmed up, while the worker reports NOT_SERVING with the reason; an
object a client created stays dead until its refs are released (the client creates another).

A call abandoned at its deadline while it runs in the exclusive lane (C code waiting for a peer that
never comes) blocks every later call that touches process-wide state, and calls abandoned in every
thread of the shared lane block every blocking call; the worker reports NOT_SERVING while they run,
so that a supervisor can replace the worker (or restart a distributed pool's group).

A probe that goes unanswered is not proof: a busy or starved engine answers late. An engine counts
as dead when vLLM says so (its core exited), or when two probes in a row go unanswered while it makes
no progress on anything (no stream of it yields an item meanwhile).

Bounds: a dead core is seen within `interval_s`; one that stops answering within `interval_s` plus
twice the probe's timeout (one stopped by a signal, which cannot answer, is said in health at once,
within `dead_check_s`, and judged by the probes like any other); a published engine then serves
again after its creation and warm-up (about 10-25 s for the tiny model on our CPUs). If it cannot be
created again within `max_tries` tries, the worker stops, and its supervisor starts a new one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bridge_server.wire.errors import clip
from bridge_server.worker.invoke import Invoker

log = logging.getLogger("vllm_bridge.worker")


@dataclass(frozen=True)
class ObjectConfig:
    """An object the worker creates at start and publishes by name (`--objects`)."""

    name: str
    target: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Liveness:
    invoker: Invoker
    published: list[ObjectConfig]
    on_health: Callable[[], Awaitable[None]]      # called when `detail` changes
    interval_s: float = 5.0
    probe_timeout_s: float = 10.0
    dead_check_s: float = 0.5     # how often a lifecycle is asked whether its object died (see run)
    warmup: bool = True
    max_tries: int = 4
    detail: str = ""              # why the worker is not serving, when it is not
    replaced: int = 0             # published objects created again since the worker started
    _adopted: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    _replacing: set[str] = field(default_factory=set)
    _strikes: dict[int, int] = field(default_factory=dict)      # unanswered probes in a row, by id()

    # --------------------------------------------------------------------------------- creation
    async def create_published(self) -> None:
        """Creates every published object (warmed up): the worker is not ready before."""
        for spec in self.published:
            await self._create(spec)

    async def _create(self, spec: ObjectConfig) -> None:
        log.info("creating published object %r with %s", spec.name, spec.target)
        obj = await self.invoker.call_python(spec.target, list(spec.args), dict(spec.kwargs))
        await self._warm(obj, spec.name)
        self.invoker.objects[spec.name] = obj

    async def _warm(self, obj: object, what: str) -> None:
        lifecycle = self.invoker.catalog.lifecycle(obj)
        if lifecycle is not None and lifecycle.started is not None:
            lifecycle.started(obj)
        if self.warmup and lifecycle is not None and lifecycle.warmup is not None:
            started = asyncio.get_running_loop().time()
            await lifecycle.warmup(obj)
            log.info("%s warmed up in %.1f s", what, asyncio.get_running_loop().time() - started)

    async def adopt(self, obj: object) -> None:
        """A client created `obj`: warm it up before the client gets its ref, then watch it."""
        if self.invoker.catalog.lifecycle(obj) is None:
            return
        await self._warm(obj, type(obj).__qualname__)
        try:
            self._adopted.add(obj)
        except TypeError:   # not weakly referenceable: not watched (it still fails when vLLM notices)
            pass

    # --------------------------------------------------------------------------------- watching
    async def run(self) -> None:
        """A full check every `interval_s`, and at once when an object's lifecycle says it died: that
        costs an attribute read, so it is asked every `dead_check_s`, and health stops saying
        SERVING within that of an engine core's exit, not a probe interval later. A full check waits
        for its probes (up to their timeout) in a task of its own, and meanwhile what health says of
        a published core stopped by a signal is kept current."""
        last = time.monotonic()
        probing: asyncio.Task[None] | None = None
        try:
            while True:
                await asyncio.sleep(min(self.dead_check_s, self.interval_s))
                try:
                    due = probing is None or probing.done()
                    if due and (time.monotonic() - last >= self.interval_s or self._any_dead()):
                        last = time.monotonic()
                        probing = asyncio.create_task(self._checked())
                    else:
                        await self._set_detail(self._health_detail())    # a published core stopped, or resumed
                except Exception:   # the watch itself must never stop
                    log.exception("liveness check failed")
        finally:
            if probing is not None:
                probing.cancel()

    async def _checked(self) -> None:
        try:
            await self.check()
        except Exception:   # noqa: BLE001 - the watch itself must never stop
            log.exception("liveness check failed")

    def _any_dead(self) -> bool:
        catalog = self.invoker.catalog
        watched = [obj for name, obj in self.invoker.objects.items() if name not in self._replacing]
        for obj in [*watched, *list(self._adopted)]:
            lifecycle = catalog.lifecycle(obj)
            try:
                if lifecycle is not None and lifecycle.dead(obj) is not None:
                    return True
            except Exception:   # noqa: BLE001 - a failing look is for the full check to report
                return True
        return False

    async def check(self) -> None:
        catalog = self.invoker.catalog
        published = [(name, obj) for name, obj in self.invoker.objects.items()
                     if name not in self._replacing and catalog.lifecycle(obj) is not None]
        adopted = [obj for obj in list(self._adopted) if obj not in dict(published).values()]
        causes = await asyncio.gather(*(self._probe(obj) for _, obj in published),
                                      *(self._probe(obj) for obj in adopted))
        for (name, obj), cause in zip(published, causes):
            if cause is not None:
                self._replacing.add(name)
                asyncio.get_running_loop().create_task(self._replace(name, obj, cause))
        for obj, cause in zip(adopted, causes[len(published):]):
            if cause is not None:
                log.error("%s created by a client is dead: %s", type(obj).__qualname__, cause)
                self._adopted.discard(obj)
                self._kill(obj, cause)
        await self._set_detail(self._health_detail())

    async def _probe(self, obj: object) -> str | None:
        lifecycle = self.invoker.catalog.lifecycle(obj)
        assert lifecycle is not None
        try:
            cause = lifecycle.dead(obj)
            if cause is not None:
                return cause
            started = time.monotonic()
            if await lifecycle.answers(obj, self.probe_timeout_s):
                self._strikes.pop(id(obj), None)
                return None
            cause = lifecycle.dead(obj)
        except Exception as exc:
            return f"its probe failed: {type(exc).__name__}: {exc}"
        if cause is not None:
            return cause
        if self.invoker.active_since(obj, started):
            log.warning("%s did not answer a probe within %g s, but makes progress: busy, not dead",
                        type(obj).__qualname__, self.probe_timeout_s)
            self._strikes.pop(id(obj), None)
            return None
        strikes = self._strikes[id(obj)] = self._strikes.get(id(obj), 0) + 1
        if strikes < 2:
            log.warning("%s did not answer a probe within %g s and makes no progress (once)",
                        type(obj).__qualname__, self.probe_timeout_s)
            return None
        self._strikes.pop(id(obj), None)
        return (f"the engine core answered no probe within {self.probe_timeout_s:g} s, twice in a row, and "
                f"made no progress meanwhile: its input or output path has died (a request it could not "
                f"decode, say)")

    def _kill(self, obj: object, cause: str) -> None:
        lifecycle = self.invoker.catalog.lifecycle(obj)
        assert lifecycle is not None
        try:
            lifecycle.kill(obj, cause)
        except Exception:
            log.exception("stopping a dead %s failed", type(obj).__qualname__)

    def _health_detail(self) -> str:
        reasons = [f"published {name!r} is dead and being created again" for name in sorted(self._replacing)]
        catalog = self.invoker.catalog
        for name, obj in sorted(self.invoker.objects.items()):
            lifecycle = catalog.lifecycle(obj)
            if name not in self._replacing and lifecycle is not None and lifecycle.stopped is not None:
                try:
                    why = lifecycle.stopped(obj)
                except Exception:    # noqa: BLE001 - a failing look is for the probes to judge
                    why = None
                if why is not None:
                    reasons.append(f"published {name!r} cannot answer: {why}")
        if blocked := self.invoker.blocked():
            reasons.append(blocked)
        return clip("; ".join(reasons), 500)

    async def _set_detail(self, detail: str) -> None:
        if detail != self.detail:
            self.detail = detail
            await self.on_health()

    async def _replace(self, name: str, obj: object, cause: str) -> None:
        spec = next(s for s in self.published if s.name == name)
        log.error("published %r is dead (%s): creating it again", name, cause)
        self._kill(obj, cause)
        await self._set_detail(self._health_detail())
        for attempt in range(1, self.max_tries + 1):
            try:
                await self._create(spec)
            except Exception as exc:
                log.error("creating %r again failed (try %d of %d): %s", name, attempt, self.max_tries, exc)
                await asyncio.sleep(min(30.0, 2.0 ** attempt))
                continue
            self.replaced += 1
            self._replacing.discard(name)
            log.warning("published %r serves again (created %d time(s) since start)", name, self.replaced)
            await self._set_detail(self._health_detail())
            return
        log.critical("published %r cannot be created again: the worker stops, for its supervisor to replace", name)
        os.kill(os.getpid(), signal.SIGTERM)
