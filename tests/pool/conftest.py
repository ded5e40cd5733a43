"""The pool server that clients not ours meet: test_fuzz.py sends it random and mutated requests first,
then test_resilience.py checks each defect class and breaks its engine on purpose (so it runs last)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bridge_server.tools.tiny_model import ensure_tiny_model
from tests.pool.harness import PoolServer, start_pool_server, toml_inline
from tests.worker.test_engine import engine_args

UNREAD_BYTES = 48 * 2**20      # what the router holds for callers that do not read, in all (max_unread_bytes)


@pytest.fixture(scope="session")
def stranger_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    """Pool `e`: one worker publishing an engine, probed every second, whose streams end when their
    caller reads nothing for 6 s, or for 1 s while calls wait for a slot. Pool `p`: one worker, no
    engine. Clients may ping every 2 s (compressed time for the keepalive test). The router holds at
    most UNREAD_BYTES of replies that callers have not read."""
    tmp = tmp_path_factory.mktemp("strangers")
    kwargs = toml_inline({"engine_args": engine_args(ensure_tiny_model())})
    config = f"""
min_ping_interval_s = 2
max_unread_bytes = {UNREAD_BYTES}
[[pools]]
name = "e"
workers = 1
log_dir = "{tmp / 'logs'}"
probe_interval_s = 1
probe_timeout_s = 4
reader_stall_s = 6
contended_stall_s = 1
[[pools.objects]]
name = "engine"
target = "vllm.AsyncLLMEngine.from_engine_args"
kwargs = {kwargs}

[[pools]]
name = "p"
workers = 1
"""
    server = start_pool_server(tmp, config, metrics=True)
    yield server
    server.stop()
