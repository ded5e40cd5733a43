defmodule VllmBridge.TelemetryTest do
  # No server needed: events of calls that fail to connect (the live tests cover successful ones).
  use ExUnit.Case, async: false

  alias VllmBridge.Error

  @events for kind <- [:call, :stream], event <- [:start, :stop, :exception], do: [:vllm_bridge, kind, event]

  setup do
    test = self()
    id = "telemetry-test-#{System.unique_integer([:positive])}"
    :telemetry.attach_many(id, @events, &__MODULE__.handle/4, test)
    on_exit(fn -> :telemetry.detach(id) end)
  end

  # Only the test's own events (a test process that exits has its session released elsewhere).
  def handle(event, measurements, meta, test) do
    if self() == test, do: send(test, {:event, event, measurements, meta})
  end

  test "a unary call: start, then stop with the error's status and category" do
    assert {:error, %Error{code: :unavailable}} =
             Vllm.Distributed.divide(6, 3, __runtime__: [server: "127.0.0.1:1", pool_name: :p, session_id: "s"])

    assert_received {:event, [:vllm_bridge, :call, :start], %{monotonic_time: _, system_time: _}, start}

    assert %{
             target: "vllm.distributed.divide",
             operation: :function,
             server: "127.0.0.1:1",
             address: "127.0.0.1:1",
             pool: "p",
             session: "s",
             affinity: nil
           } = start

    assert_received {:event, [:vllm_bridge, :call, :stop], %{duration: d, monotonic_time: _}, stop}
    assert is_integer(d) and d >= 0
    assert %{status: :error, error_category: "grpc_error", code: :unavailable, error: %Error{}} = stop
    assert stop.telemetry_span_context == start.telemetry_span_context
  end

  test "a stream: start when enumerated, exception when it fails, with the item count" do
    {:ok, stream} = Vllm.AsyncLLMEngine.generate(:engine, "x", %{}, "r", __runtime__: [server: "127.0.0.1:1"])
    refute_received {:event, _, _, _}
    assert %Error{} = catch_error(Enum.to_list(stream))

    assert_received {:event, [:vllm_bridge, :stream, :start], _,
                     %{target: "engine.generate", operation: :method, multiplex: true}}

    assert_received {:event, [:vllm_bridge, :stream, :exception], m, meta}
    assert %{items: 0, first_item: nil, duration: _} = m
    assert %{kind: :error, reason: %Error{}, status: :error, error_category: "grpc_error"} = meta
    refute_received {:event, [:vllm_bridge, :stream, :stop], _, _}
  end

  test "invalid options raise before any event" do
    assert_raise ArgumentError, fn -> Vllm.Distributed.divide(6, 3, __runtime__: [timeout: -5]) end
    refute_received {:event, _, _, _}
  end
end
