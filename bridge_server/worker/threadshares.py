"""The worker's shared lane by client: how many of its threads one client's blocking calls may hold.

A blocking call holds its thread until it ends, and one given up (its deadline passed, or its caller
cancelled) while it runs inside C code still holds it: nothing can stop it. Twenty tokenizer calls of
a million characters sent at once from one connection, each given up after 0.3 s, took all sixteen
threads: every other client's blocking call waited, and the worker had to say it could not serve.

So a client (its identity, else its host: a stranger's many connections are one client) holds at
most its share of the threads, running or given up: three quarters of what the other clients leave,
rounded up, as elsewhere in the server (README, "Fair share on a shared engine"). Alone it may use
twelve of sixteen; one host can never hold them all, and four are left to the others whatever it
sends. Its further calls wait, within their deadlines, in the order they came, and take a thread as
one of its own ends or the others' use of the lane lets its share grow. Calls of the worker's own
(client "") are not counted.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import grpc

from bridge_server.wire.errors import BridgeError
from bridge_server.worker.deadlines import with_deadline


@dataclass
class ThreadShares:
    threads: int
    held: dict[str, int] = field(default_factory=dict)          # threads a client's calls hold
    total: int = 0
    given_up: dict[str, int] = field(default_factory=dict)      # of a client's calls in threads (either
    given_up_here: int = 0                                       # lane), those given up; of them, here
    # calls waiting for a thread, by client; dict order is the order clients began to wait
    _waiting: dict[str, collections.deque[asyncio.Future[None]]] = field(default_factory=dict)

    def share(self, client: str) -> int:
        """Three quarters of the threads the other clients leave, rounded up; at least one."""
        left = self.threads - (self.total - self.held.get(client, 0))
        return max(1, -(-3 * left // 4))

    def refusal(self, client: str, label: str) -> BridgeError | None:
        """RESOURCE_EXHAUSTED when `client`'s given-up calls fill its share: none of them can be
        stopped, so a new call would only wait for them."""
        given_up = self.given_up.get(client, 0) if client else 0
        if not given_up or given_up < (share := self.share(client)):
            return None
        return BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                           f"{label}: {given_up} of this client's calls were given up (at their deadline, or "
                           f"cancelled) while they ran in the worker's threads, and still run there, which no "
                           f"deadline can stop; they fill its share of the worker's {self.threads} threads "
                           f"({share}: three quarters of what other clients leave; a client is its identity, "
                           f"else its host): wait for them to end", target=label, reason="abandoned calls")

    def give_up(self, client: str, here: bool) -> None:
        """One of `client`'s calls was given up while it runs in a thread (`here`: of this lane)."""
        self.given_up[client] = self.given_up.get(client, 0) + 1
        self.given_up_here += here

    def given_up_ended(self, client: str, here: bool) -> None:
        left = self.given_up.pop(client) - 1
        if left:
            self.given_up[client] = left
        self.given_up_here -= here

    def all_given_up(self) -> bool:
        """Whether every thread runs a call given up: no blocking call can run until one ends."""
        return self.given_up_here >= self.threads

    async def take(self, client: str, deadline: float | None, label: str) -> None:
        """Waits until `client` may hold one more thread, and counts it (`give_back` ends it)."""
        if not client:
            return
        if client not in self._waiting and self.held.get(client, 0) < self.share(client):
            self._count(client, 1)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiting.setdefault(client, collections.deque())
        queue.append(waiter)
        try:
            await with_deadline(waiter, deadline, label, f"waiting for a thread: this client's calls hold "
                                                         f"{self.held.get(client, 0)}, its share of the worker's "
                                                         f"{self.threads}")
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give_back(client)          # counted for it, then given up: pass it on
            elif waiter in queue:
                queue.remove(waiter)
                if not queue and self._waiting.get(client) is queue:
                    del self._waiting[client]
            raise

    def give_back(self, client: str) -> None:
        """A thread `client` held is free: waiting calls that their shares now allow take threads."""
        if not client:
            return
        self._count(client, -1)
        for waiting in list(self._waiting):
            queue = self._waiting[waiting]
            while queue and self.held.get(waiting, 0) < self.share(waiting):
                waiter = queue.popleft()
                if not waiter.done():
                    self._count(waiting, 1)
                    waiter.set_result(None)
            if not queue:
                del self._waiting[waiting]

    def _count(self, client: str, n: int) -> None:
        held = self.held.get(client, 0) + n
        self.total += n
        if held > 0:
            self.held[client] = held
        else:
            self.held.pop(client, None)
