# Unit tests need nothing. Tagged tests need more, and are excluded without it:
#   :live    a running server: VLLM_BRIDGE_ADDRESS (e.g. 127.0.0.1:50051 for `make serve`)
#   :engine  (with :live) the server publishes an engine (name: $VLLM_BRIDGE_ENGINE, default "engine")
#   :server  starts servers itself (VllmBridge.Server): VLLM_BRIDGE_VENV, the project's .venv
#   :slow    minutes-long checks (keepalive over idle connections): VLLM_BRIDGE_SLOW=1
#   :tls, :token  a server with TLS / tokens (`vllm-bridge serve --tls-cert ...`, `--token-file`),
#                 started by VllmBridge.Server: VLLM_BRIDGE_VENV and VLLM_BRIDGE_TRUST=1
env = fn name -> if System.get_env(name, "") != "", do: System.get_env(name) end

exclude =
  [
    live: env.("VLLM_BRIDGE_ADDRESS") == nil,
    engine: env.("VLLM_BRIDGE_ADDRESS") == nil,
    server: env.("VLLM_BRIDGE_VENV") == nil,
    slow: env.("VLLM_BRIDGE_SLOW") == nil,
    tls: env.("VLLM_BRIDGE_TRUST") == nil or env.("VLLM_BRIDGE_VENV") == nil,
    token: env.("VLLM_BRIDGE_TRUST") == nil or env.("VLLM_BRIDGE_VENV") == nil
  ]
  |> Enum.filter(&elem(&1, 1))
  |> Enum.map(&elem(&1, 0))

ExUnit.start(exclude: exclude)
