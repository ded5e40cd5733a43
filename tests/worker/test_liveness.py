"""What the worker does with an object that has a lifecycle once it exists (bridge_server/worker/liveness.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from adapters.async_llm import ASYNC_LLM
from adapters.spec import Lifecycle
from bridge_server.worker.catalog import Catalog
from bridge_server.worker.invoke import Invoker
from bridge_server.worker.liveness import Liveness
from bridge_server.worker.refs import RefRegistry


class Engine:
    """A class with a lifecycle, as an adapter declares one for vLLM's engines."""


def _liveness(lifecycle: Lifecycle, warmup: bool) -> Liveness:
    catalog = Catalog(lifecycles={Engine: lifecycle})

    async def on_health() -> None:
        return None

    return Liveness(Invoker(catalog, RefRegistry("w-test")), [], on_health, warmup=warmup)


def test_a_new_instance_is_started_before_its_warmup_and_also_when_warmups_are_off() -> None:
    seen: list[tuple[str, Any]] = []

    async def warm(obj: Any) -> None:
        seen.append(("warmup", obj))

    lifecycle = Lifecycle(dead=lambda obj: None, answers=lambda obj, s: asyncio.sleep(0, True), kill=lambda obj, why: None,
                          warmup=warm, started=lambda obj: seen.append(("started", obj)))
    first, second = Engine(), Engine()
    asyncio.run(_liveness(lifecycle, warmup=True).adopt(first))
    asyncio.run(_liveness(lifecycle, warmup=False).adopt(second))
    assert seen == [("started", first), ("warmup", first), ("started", second)]


def test_vllm_caches_its_environment_once_an_engine_has_started() -> None:
    """As vLLM's own engine processes do once started: its front-end in the worker otherwise reads an
    environment variable per request per engine step."""
    from vllm import envs

    assert ASYNC_LLM.lifecycle is not None and ASYNC_LLM.lifecycle.started is not None
    was = envs._is_envs_cache_enabled()
    try:
        if was:
            envs.disable_envs_cache()
        ASYNC_LLM.lifecycle.started(object())
        assert envs._is_envs_cache_enabled()
    finally:
        if not was:
            envs.disable_envs_cache()


def test_an_engine_records_no_prometheus_metrics_that_nothing_reads_and_keeps_its_other_stats() -> None:
    """vLLM's Prometheus logger records every engine step (a histogram observation per token) into
    the worker's default registry, which the worker never serves; its other loggers (`do_log_stats`)
    stay. (vLLM's own classes; the loggers are made without a config, as only their type matters.)"""
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger, StatLoggerManager

    manager = object.__new__(StatLoggerManager)
    kept, dropped = object.__new__(LoggingStatLogger), object.__new__(PrometheusStatLogger)
    manager.stat_loggers = [kept, dropped]
    engine = type("Engine", (), {"logger_manager": manager})()
    assert ASYNC_LLM.lifecycle is not None and ASYNC_LLM.lifecycle.started is not None
    ASYNC_LLM.lifecycle.started(engine)
    assert manager.stat_loggers == [kept]
    ASYNC_LLM.lifecycle.started(type("Quiet", (), {"logger_manager": None})())    # stats off: nothing to drop


def test_an_object_that_died_is_seen_at_the_next_quick_look_not_a_probe_interval_later() -> None:
    """A lifecycle's `dead` is cheap to ask, so it is asked every `dead_check_s`: an engine core that
    exits is killed (its calls fail at once) and health changes within that, with full probes still
    only every `interval_s`."""
    died: dict[str, str] = {}
    killed: list[tuple[Any, str]] = []
    probes: list[Any] = []

    async def answers(obj: Any, timeout_s: float) -> bool:
        probes.append(obj)
        return True

    lifecycle = Lifecycle(dead=lambda obj: died.get("cause"), answers=answers,
                          kill=lambda obj, why: killed.append((obj, why)))

    async def main() -> float:
        liveness = _liveness(lifecycle, warmup=False)
        liveness.interval_s, liveness.dead_check_s = 3600.0, 0.01
        engine = Engine()
        await liveness.adopt(engine)
        watch = asyncio.create_task(liveness.run())
        await asyncio.sleep(0.1)
        assert not killed and not probes        # nothing died, and no full probe is due for an hour
        died["cause"] = "the engine core exited"
        started = time.monotonic()
        while not killed and time.monotonic() - started < 10:
            await asyncio.sleep(0.005)
        watch.cancel()
        assert killed == [(engine, "the engine core exited")]
        return time.monotonic() - started

    assert asyncio.run(main()) < 5
