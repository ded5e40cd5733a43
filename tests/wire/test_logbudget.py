"""A place in the code warns in a server's log at most a few times a minute: a stranger calling a
function that warns at every call (from 8 connections: 1.8 MB of log in 10 s) must not fill the disk
or bury what an operator looks for."""

from __future__ import annotations

import io
import logging

from bridge_server.wire.logbudget import LOG_BURST, LOG_WINDOW_S, LogBudget, budget_logs


def _record(logger: logging.Logger, line: int, at: float, msg: str = "platform has no %s") -> logging.LogRecord:
    record = logger.makeRecord(logger.name, logging.WARNING, "vllm/platforms/interface.py", line, msg,
                               ("empty_cache",), None)
    record.created = at
    return record


def test_one_place_logs_a_burst_per_window_then_says_how_many_it_left_out() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger = logging.getLogger("test.logbudget")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        budget_logs([logger])
        budget_logs([logger])           # once per handler, however often it is asked
        assert sum(isinstance(f, LogBudget) for f in handler.filters) == 1
        for i in range(1000):           # one place, 1,000 times within a window
            handler.handle(_record(logger, 10, 100.0 + i * 0.01))
        handler.handle(_record(logger, 20, 105.0))       # another place has its own budget
        lines = out.getvalue().splitlines()
        assert lines.count("platform has no empty_cache") == LOG_BURST + 1, lines
        handler.handle(_record(logger, 10, 100.0 + LOG_WINDOW_S + 1))    # the next window
        last = out.getvalue().splitlines()[-1]
        assert last.startswith("platform has no empty_cache (995 more like this were left out"), last
        assert len(out.getvalue()) < 1000
        for i in range(20):             # an account of each request, at INFO, is not budgeted
            info = _record(logger, 30, 200.0 + i * 0.01, "Aborted request %s.")
            info.levelno, info.levelname = logging.INFO, "INFO"
            handler.handle(info)
        assert out.getvalue().count("Aborted request empty_cache.") == 20
    finally:
        logger.removeHandler(handler)
