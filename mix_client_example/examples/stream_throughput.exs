# Generation throughput from Elixir: streams over the shared Multiplex stream against one gRPC call per
# stream, in the same run (rounds interleaved, so drift hits both). Needs a server with an engine
# published as "engine" (`make -C .. serve`).
#
#   mix run examples/stream_throughput.exs [ROUNDS]
alias Vllm.AsyncLLMEngine, as: Engine

engine = System.get_env("VLLM_BRIDGE_ENGINE", "engine")
rounds = System.argv() |> List.first("6") |> String.to_integer()
params = %{max_tokens: 64, temperature: 0.0, ignore_eos: true}

# One round: c concurrent 64-token generations; output tokens per second of wall time.
round = fn c, multiplex, r ->
  started = System.monotonic_time(:microsecond)

  tokens =
    1..c
    |> Task.async_stream(
      fn i ->
        {:ok, stream} =
          Engine.generate(engine, "#{c} #{r} #{i} a prompt for request #{i}", params, "tp-#{c}-#{multiplex}-#{r}-#{i}",
            __runtime__: [multiplex: multiplex]
          )

        stream |> Enum.to_list() |> List.last() |> get_in([:outputs, Access.at(0), :token_ids]) |> length()
      end,
      max_concurrency: c,
      timeout: 300_000
    )
    |> Enum.reduce(0, fn {:ok, n}, acc -> acc + n end)

  tokens / ((System.monotonic_time(:microsecond) - started) / 1.0e6)
end

median = fn xs -> xs |> Enum.sort() |> Enum.at(div(length(xs), 2)) end

for c <- [8, 32] do
  round.(c, true, 0)
  round.(c, false, 0)
  results = for r <- 1..rounds, multiplex <- [true, false], do: {multiplex, round.(c, multiplex, r)}
  shared = median.(for {true, x} <- results, do: x)
  own = median.(for {false, x} <- results, do: x)

  IO.puts(
    "@#{c}: shared Multiplex stream #{round(shared)} tok/s, one call per stream #{round(own)} tok/s, " <>
      "ratio #{Float.round(shared / own, 2)}"
  )
end
