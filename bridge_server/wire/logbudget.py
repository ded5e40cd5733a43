"""How often one line of code may warn in a server's log: a few times a minute, then a count.

Why: a client decides how often much of the code it reaches runs, and some of that code warns at
every call (vLLM's platform object warns of each attribute it lacks; a teardown warned each time): a
stranger calling one such function from 8 connections wrote 1.8 MB of log in 10 s, ~15 GB a day, on
the disk every process of the machine shares, and buried the lines an operator looks for. So each
place that warns (its file and line) has a budget: LOG_BURST records of WARNING or above per
LOG_WINDOW_S, then none until the window ends; the first record after that says how many were left
out. INFO lines are the server's account of what it did for each request (vLLM's "Aborted request",
which operators and our tests read), one per request at most: they are not budgeted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

__all__ = ["LOG_BURST", "LOG_WINDOW_S", "LogBudget", "budget_logs"]

LOG_BURST = 5
LOG_WINDOW_S = 60.0


class LogBudget(logging.Filter):
    """A handler's filter: at most `burst` warnings (or worse) from one place in the code per `window_s`."""

    def __init__(self, burst: int = LOG_BURST, window_s: float = LOG_WINDOW_S) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._lock = threading.Lock()
        self._spent: dict[tuple[str, int], list[float]] = {}     # place -> [window start, records, left out]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        place = (record.pathname, record.lineno)
        with self._lock:
            spent = self._spent.get(place)
            if spent is None or record.created - spent[0] >= self.window_s:
                left_out = int(spent[2]) if spent is not None else 0
                self._spent[place] = [record.created, 1, 0]
            else:
                spent[1] += 1
                if spent[1] > self.burst:
                    spent[2] += 1
                    return False
                return True
        if left_out:
            record.msg = (f"{record.getMessage()} ({left_out:,} more like this were left out: a place in the code "
                          f"logs at most {self.burst} times in {self.window_s:g} s)")
            record.args = ()
        return True


def budget_logs(loggers: Iterable[logging.Logger]) -> None:
    """One budget on each handler of these loggers (handlers shared by several get one)."""
    for logger in loggers:
        for handler in logger.handlers:
            if not any(isinstance(f, LogBudget) for f in handler.filters):
                handler.addFilter(LogBudget())
