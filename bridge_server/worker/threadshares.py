"""The worker's shared lane by client: how many of its threads one client's blocking calls may hold.

A blocking call holds its thread until it ends, and one given up (its deadline passed, or its caller
cancelled) while it runs inside C code still holds it: nothing can stop it. Twenty tokenizer calls of
a million characters sent at once from one connection, each given up after 0.3 s, took all sixteen
threads: every other client's blocking call waited, and the worker had to say it could not serve. So
each client (its identity, else its host: a stranger's many connections are one client) holds at most
`per_client` threads, running or given up; its further calls wait for one of its own, within their
deadlines, in the order they came. Calls of the worker's own (client "") are not counted.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

from bridge_server.worker.deadlines import with_deadline


@dataclass
class ThreadShares:
    per_client: int
    held: dict[str, int] = field(default_factory=dict)          # threads a client's calls hold
    _waiting: dict[str, collections.deque[asyncio.Future[None]]] = field(default_factory=dict)

    async def take(self, client: str, deadline: float | None, label: str) -> None:
        """Waits until `client` may use one more thread, and counts it as held (`give_back` ends it)."""
        if not client:
            return
        held = self.held.get(client, 0)
        if held < self.per_client and client not in self._waiting:
            self.held[client] = held + 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(client, collections.deque())
        queue.append(waiter)
        try:
            await with_deadline(waiter, deadline, label,
                                f"waiting for a thread: this client's calls hold {self.per_client}, its share")
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give_back(client)          # handed over, then given up: pass it on
            elif waiter in queue:
                queue.remove(waiter)
                if not queue and self._waiting.get(client) is queue:
                    del self._waiting[client]
            raise

    def give_back(self, client: str) -> None:
        """A thread `client` held is free: the next of its waiting calls takes it over."""
        if not client:
            return
        queue = self._waiting.get(client)
        while queue:
            waiter = queue.popleft()
            if not queue:
                del self._waiting[client]
            if not waiter.done():
                waiter.set_result(None)
                return
        left = self.held.get(client, 0) - 1
        if left > 0:
            self.held[client] = left
        else:
            self.held.pop(client, None)
