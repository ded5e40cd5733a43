"""The worker process: a complete `Bridge` server over vLLM's documented surfaces.

It holds the catalog (`catalog.py`, built from the adapters), resolves a call's target to a plan
(`planner.py`: the closed surface), runs calls (`invoke.py`: bind (`binding.py`), run under deadlines
(`deadlines.py`); the result goes out through `results.py`, a stream's items through `streams.py`),
keeps refs (`refs.py`), and serves them over gRPC (`server.py`), Multiplex (`mux.py`) and the pool
server's lane (`lane.py`). Started by `vllm-bridge worker` (`main.py`), by our pool server or any
other supervisor.
"""
