"""The pool server process: one address in front of pools of worker processes.

Its configuration (`config.py`); starting, watching, restarting, recycling and stopping workers
(`supervisor.py`, `workerproc.py`); routing (`router.py`, with each pool's live state in
`poolstate.py`); moving calls to workers (`forward.py`, `multiplex.py`, over `lane.py`), collectives
over ranks (`collective.py`); and the server itself with health, status and metrics (`server.py`,
`metrics.py`). It reaches workers only through the protocol.
"""
