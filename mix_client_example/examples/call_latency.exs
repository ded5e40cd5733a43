# The latency of a trivial call from Elixir (`Vllm.Distributed.divide(6, 3)`, one at a time): p50 and
# p99 per address. Given two addresses (a pool server and one worker on its own, say), rounds
# alternate between them, so drift hits both, and the ratio of the first to the second is printed.
#
#   mix run examples/call_latency.exs ADDRESS [OTHER_ADDRESS] [ROUNDS] [CALLS_PER_ROUND]
#
# A worker serves on its own with `vllm-bridge worker --listen 127.0.0.1:50052`.
{addresses, rest} = Enum.split_with(System.argv(), &String.contains?(&1, ":"))
addresses = if addresses == [], do: [VllmBridge.address()], else: addresses

[rounds, per_round] =
  case rest do
    [r, n | _] -> [String.to_integer(r), String.to_integer(n)]
    [r] -> [String.to_integer(r), 300]
    [] -> [10, 300]
  end

# Each address is a server of its own (its own connection): `__runtime__: [server: address]`.
timed = fn address, n ->
  for _ <- 1..n do
    started = System.monotonic_time(:nanosecond)
    {:ok, 2} = Vllm.Distributed.divide(6, 3, __runtime__: [server: address])
    (System.monotonic_time(:nanosecond) - started) / 1000
  end
end

percentile = fn xs, p ->
  sorted = Enum.sort(xs)
  Enum.at(sorted, min(length(sorted) - 1, trunc(p * length(sorted))))
end

for address <- addresses, do: timed.(address, per_round)

samples =
  Enum.reduce(1..rounds, Map.new(addresses, &{&1, []}), fn _, acc ->
    Enum.reduce(addresses, acc, fn address, acc -> Map.update!(acc, address, &(timed.(address, per_round) ++ &1)) end)
  end)

for address <- addresses do
  xs = samples[address]

  IO.puts(
    "#{address}: p50 #{Float.round(percentile.(xs, 0.5), 1)} us, p99 #{Float.round(percentile.(xs, 0.99), 1)} us " <>
      "(#{length(xs)} calls)"
  )
end

case addresses do
  [a, b] ->
    IO.puts("#{a} / #{b}: p50 #{Float.round(percentile.(samples[a], 0.5) / percentile.(samples[b], 0.5), 2)}x")

  _ ->
    :ok
end
