"""What crosses the wire, shared by every side: the worker, the pool server and the clients.

A call's metadata keys, runtime options and timeout profiles (`options.py`), what every server and
channel is set up with and how requests are read and bounded before parsing (`protocol.py`), values to and from protobuf
(`codec.py`, `decoder.py`) and their JSON spellings (`jsonvalue.py`, for the command line and
config files), errors as statuses (`errors.py`), the lane's framing between the pool
server and its workers (`framing.py`), and the event loop both servers run on (`eventloop.py`).
Nothing here knows about pools, workers' internals or vLLM's surfaces.
"""
