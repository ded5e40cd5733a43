"""vllm-bridge: a gRPC worker-pool server that lets Elixir applications (or any gRPC client) drive vLLM.

The folders say where code runs:

- `wire/`: what crosses the wire and every side shares (the protocol's keys and options, the value
  codec, errors, the lane's framing, the event loop);
- `worker/`: a worker process, which holds vLLM objects and runs calls on them;
- `pool/`: the pool server process, which supervises workers and routes calls to them;
- `client/`: the Python client and the command line's client commands;
- `tools/`: what runs at build or set-up time (the binding documents' parser, the Elixir generator,
  the tiny model).

The worker and the pool server talk only through the protocol; neither imports the other.
`cli.py` is the `vllm-bridge` command, the one entry point of every role.
"""
