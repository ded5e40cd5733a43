# Generation throughput from Elixir: streams over the shared Multiplex stream against one gRPC call per
# stream, with their items as patches (patch_v2 with rows, the default; patch_v1) and whole (full), in
# the same run (rounds interleaved, so drift hits all of them). Needs a server with an engine published
# as "engine" (`make -C .. serve`). ENCODINGS: a comma-separated list of patch_v2, patch_v1 and full
# (default all three).
#
#   mix run examples/stream_throughput.exs [ROUNDS] [ENCODINGS]
alias Vllm.AsyncLLMEngine, as: Engine

engine = System.get_env("VLLM_BRIDGE_ENGINE", "engine")
rounds = System.argv() |> Enum.at(0, "6") |> String.to_integer()

encodings =
  System.argv()
  |> Enum.at(1, "patch_v2,patch_v1,full")
  |> String.split(",")
  |> Enum.map(&Map.fetch!(%{"patch_v2" => :patch_v2, "patch_v1" => :patch_v1, "full" => :full}, &1))

params = %{max_tokens: 64, temperature: 0.0, ignore_eos: true}

# One round: c concurrent 64-token generations; output tokens per second of wall time.
round = fn c, {multiplex, encoding}, r ->
  started = System.monotonic_time(:microsecond)

  tokens =
    1..c
    |> Task.async_stream(
      fn i ->
        {:ok, stream} =
          Engine.generate(
            engine,
            "#{c} #{r} #{i} a prompt for request #{i}",
            params,
            "tp-#{c}-#{multiplex}-#{encoding}-#{r}-#{i}",
            __runtime__: [multiplex: multiplex, stream_encoding: encoding]
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
ways = for encoding <- encodings, multiplex <- [true, false], do: {multiplex, encoding}

for c <- [8, 32] do
  for way <- ways, do: round.(c, way, 0)
  results = for r <- 1..rounds, way <- ways, do: {way, round.(c, way, r)}

  for encoding <- encodings do
    shared = median.(for {{true, ^encoding}, x} <- results, do: x)
    own = median.(for {{false, ^encoding}, x} <- results, do: x)

    IO.puts(
      "@#{c} #{encoding}: shared Multiplex stream #{round(shared)} tok/s, one call per stream #{round(own)} tok/s, " <>
        "ratio #{Float.round(shared / own, 2)}"
    )
  end
end
