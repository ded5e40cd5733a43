# The server as a child of a supervision tree, calls of every module, a stream, telemetry.
#
#     VLLM_BRIDGE_VENV=../.venv mix run examples/supervised.exs [CONFIG.toml]
#
# Starts `vllm-bridge serve` (the built-in default pool: an engine on the tiny model, published as
# "engine"; or the pool config given) on a free port, waits until it serves, uses it, and stops it
# with the tree: the server and every process it started are gone when this script ends.
require Logger

alias Vllm.AsyncLLMEngine, as: Engine
alias Vllm.ForwardContext.DPMetadata
alias Vllm.ForwardContext.Module, as: FC
alias VllmBridge.Tensor

venv = System.get_env("VLLM_BRIDGE_VENV") || raise "set VLLM_BRIDGE_VENV to the vllm-bridge project's .venv"
config = List.first(System.argv())

# Telemetry: one line per call and per stream (a module's function, as :telemetry prefers).
defmodule Supervised.Telemetry do
  def handle([_, kind, _], m, meta, _config) do
    ms = &System.convert_time_unit(&1, :native, :microsecond)
    first = if kind == :stream and m.first_item, do: ", first item #{ms.(m.first_item)} us, #{m.items} items", else: ""
    IO.puts("  [telemetry] #{kind} #{meta.target} on #{meta.address}: #{meta.status} in #{ms.(m.duration)} us#{first}")
  end
end

:telemetry.attach_many(
  "supervised-example",
  [[:vllm_bridge, :call, :stop], [:vllm_bridge, :stream, :stop], [:vllm_bridge, :stream, :exception]],
  &Supervised.Telemetry.handle/4,
  nil
)

children = [
  # `start_link` returns once the server says SERVING; its log lines go to Logger (here: warnings only)
  {VllmBridge.Server, [venv: venv, log: :debug] ++ if(config, do: [config: config], else: [])}
]

Logger.configure(level: :warning)
started = System.monotonic_time(:millisecond)
{:ok, sup} = Supervisor.start_link(children, strategy: :one_for_one)
IO.puts("serving on #{VllmBridge.Server.address()} after #{System.monotonic_time(:millisecond) - started} ms")

# Calls that name no server go to the :default one, which this child is.
{:ok, 2} = Vllm.Distributed.divide(6, 3)
{:ok, false} = FC.is_forward_context_available()
{:ok, dp} = DPMetadata.new(Tensor.from_list(7, :int64), Tensor.from_list([5, 7, 3], :int64))
{:ok, cu} = DPMetadata.cu_tokens_across_sp(dp, 1)
IO.puts("cu_tokens_across_sp -> #{inspect(Tensor.to_list(cu))}")

if config == nil do
  {:ok, stream} = Engine.generate(:engine, "Hello, world", %{max_tokens: 12, temperature: 0.0}, "supervised-1")
  text = stream |> Enum.to_list() |> List.last() |> get_in([:outputs, Access.at(0), :text])
  IO.puts("generated: #{inspect(text)}")
  {:ok, stream} = Engine.generate(:engine, "Once upon a time", %{max_tokens: 200, temperature: 0.0}, "supervised-2")
  IO.puts("stopped early after #{length(Enum.take(stream, 3))} items")
end

:ok = Supervisor.stop(sup)
IO.puts("stopped; a call now: #{inspect(elem(Vllm.Distributed.divide(6, 3), 1).message)}")
