# Tests tagged :live need a server: set VLLM_BRIDGE_ADDRESS (e.g. 127.0.0.1:50051 for `make serve`).
# Tests tagged :engine also need the server to publish an engine (name: $VLLM_BRIDGE_ENGINE, default "engine").
exclude = if System.get_env("VLLM_BRIDGE_ADDRESS"), do: [], else: [:live]
ExUnit.start(exclude: exclude)
