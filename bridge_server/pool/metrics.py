"""Prometheus metrics of the pool server, on their own registry and HTTP port.

Counters and histograms are updated as calls finish; gauges (queue depth, in-flight calls, workers
by state, pinned sessions) are read from the live router state at scrape time instead of being
updated on every call, so the hot path pays for one histogram observation and one counter only.
The payload is never decoded, so calls are labelled by pool, method and status, not by target.

The endpoint is prometheus_client's WSGI app, served a thread per connection as its own server does,
but with at most MAX_METRICS_CONNECTIONS at once, METRICS_PER_HOST of them from one host (more are
closed as they come), each closed METRICS_CONNECTION_S after it came, whatever it sends: its own
gave every idle connection a thread and a file for good (2,500 connections, 2,510 threads), and
thousands closed at once held the pool server's loop for a minute. (A bound on silence alone let 16
connections sending a byte every 2 s keep every scrape out.)
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                   60.0, 120.0, 600.0)

MAX_METRICS_CONNECTIONS = 16      # connections the endpoint serves at once
METRICS_PER_HOST = 4              # ... from one host
METRICS_CONNECTION_S = 5.0        # how long one lasts at most, request and reply

# (pool, queue length, in flight, sessions, {worker state: count}, stalled streams), one per pool, read
# at scrape time.
PoolSnapshot = tuple[str, int, int, int, dict[str, int], int]


class _LiveState(Collector):
    def __init__(self, snapshot: Callable[[], list[PoolSnapshot]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        queue = GaugeMetricFamily("vllm_bridge_queue_depth", "Calls waiting for a worker slot", labels=["pool"])
        flight = GaugeMetricFamily("vllm_bridge_in_flight", "Calls running on workers", labels=["pool"])
        sessions = GaugeMetricFamily("vllm_bridge_sessions", "Sessions pinned to a worker", labels=["pool"])
        workers = GaugeMetricFamily("vllm_bridge_workers", "Worker processes by state", labels=["pool", "state"])
        stalled = GaugeMetricFamily("vllm_bridge_stalled_streams",
                                    "Streams that have waited on their caller for a second or more", labels=["pool"])
        for pool, q, f, s, states, st in self._snapshot():
            queue.add_metric([pool], q)
            flight.add_metric([pool], f)
            sessions.add_metric([pool], s)
            for state, n in states.items():
                workers.add_metric([pool, state], n)
            stalled.add_metric([pool], st)
        yield from (queue, flight, sessions, workers, stalled)


class _Unread(Collector):
    """The backlog of replies callers have not read (`backlog.py`): (bytes held, streams ended,
    calls refused), read at scrape time."""

    def __init__(self, read: Callable[[], tuple[int, int, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        held, ended, refused = self._read()
        yield GaugeMetricFamily("vllm_bridge_unread_reply_bytes",
                                "Bytes of replies held for callers that have not read them", value=held)
        yield CounterMetricFamily("vllm_bridge_unread_streams_ended",
                                  "Streams ended past max_unread_bytes, their caller holding the most", value=ended)
        yield CounterMetricFamily("vllm_bridge_unread_calls_refused",
                                  "Calls refused past max_unread_bytes, their caller holding over its share",
                                  value=refused)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter("vllm_bridge_calls", "Calls finished, by pool, method and status",
                             ["pool", "method", "code"], registry=self.registry)
        self.latency = Histogram("vllm_bridge_call_seconds", "Call latency through the router, queue wait included",
                                 ["pool", "method"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram("vllm_bridge_queue_wait_seconds", "Time calls waited for a worker slot",
                                    ["pool"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.restarts = Counter("vllm_bridge_worker_restarts", "Worker processes restarted after a crash",
                                ["pool"], registry=self.registry)
        self.recycles = Counter("vllm_bridge_worker_recycles", "Worker processes recycled (lifetime or calls)",
                                ["pool"], registry=self.registry)
        self._children: dict[tuple[str, str, str], Any] = {}
        self._server: Any = None

    def observe_call(self, pool: str, method: str, code: str, seconds: float) -> None:
        key = (pool, method, code)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = (self.calls.labels(pool, method, code), self.latency.labels(pool, method))
        child[0].inc()
        child[1].observe(seconds)

    def watch(self, snapshot: Callable[[], list[PoolSnapshot]]) -> None:
        self.registry.register(_LiveState(snapshot))

    def watch_unread(self, read: Callable[[], tuple[int, int, int]]) -> None:
        self.registry.register(_Unread(read))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the HTTP endpoint (a daemon thread); returns the bound port."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        server: WSGIServer = make_server(host, port, make_wsgi_app(self.registry),
                             type("MetricsServer", (_BoundedServer,), {"address_family": family}), _QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        self._server = server
        return int(server.server_port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_CONNECTION_S      # (the socket's, for each read and write: the whole is bounded too)

    def log_message(self, format: str, *args: Any) -> None:   # noqa: A002 - the library's name
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, MAX_METRICS_CONNECTIONS at most, METRICS_PER_HOST from one host,
    each shut METRICS_CONNECTION_S after it came."""

    daemon_threads = True

    def server_activate(self) -> None:
        self._lock = threading.Lock()
        self._by_host: dict[str, int] = {}
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        host = _host(client_address)
        with self._lock:
            if sum(self._by_host.values()) >= MAX_METRICS_CONNECTIONS or \
                    self._by_host.get(host, 0) >= METRICS_PER_HOST:
                self.shutdown_request(request)
                return
            self._by_host[host] = self._by_host.get(host, 0) + 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._done(host)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        cut = threading.Timer(METRICS_CONNECTION_S, _shut, (request,))
        cut.daemon = True
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self._done(_host(client_address))

    def _done(self, host: str) -> None:
        with self._lock:
            left = self._by_host.get(host, 0) - 1
            if left > 0:
                self._by_host[host] = left
            else:
                self._by_host.pop(host, None)


def _host(address: Any) -> str:
    return str(address[0]) if isinstance(address, tuple) else ""


def _shut(sock: socket.socket) -> None:
    """Ends a connection past its time: its thread's read or write fails, and the thread ends."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
