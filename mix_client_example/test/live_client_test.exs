defmodule VllmBridge.LiveClientTest do
  # Against a running server (VLLM_BRIDGE_ADDRESS): servers, telemetry, published names as atoms,
  # Nx results, health. Excluded when it is not set.
  use ExUnit.Case, async: false
  @moduletag :live

  alias Vllm.AsyncLLMEngine, as: Engine
  alias Vllm.Distributed, as: D
  alias VllmBridge.{Error, Record, Ref, Tensor}

  @engine System.get_env("VLLM_BRIDGE_ENGINE", "engine")
  @events for kind <- [:call, :stream], event <- [:start, :stop, :exception], do: [:vllm_bridge, kind, event]

  defp id, do: "exunit-#{System.unique_integer([:positive])}"
  defp greedy(n), do: %{max_tokens: n, temperature: 0.0, ignore_eos: true}

  setup do
    saved = Application.get_all_env(:vllm_bridge)

    on_exit(fn ->
      for {k, _} <- Application.get_all_env(:vllm_bridge),
          not Keyword.has_key?(saved, k),
          do: Application.delete_env(:vllm_bridge, k)

      for {k, v} <- saved, do: Application.put_env(:vllm_bridge, k, v)
    end)
  end

  def handle(event, measurements, meta, test) do
    if self() == test, do: send(test, {:event, event, measurements, meta})
  end

  defp attach do
    name = "live-#{System.unique_integer([:positive])}"
    :telemetry.attach_many(name, @events, &__MODULE__.handle/4, self())
    on_exit(fn -> :telemetry.detach(name) end)
  end

  test "health: SERVING overall" do
    assert {:ok, :serving} = VllmBridge.Health.check()
    assert {:error, %Error{code: :not_found}} = VllmBridge.Health.check(nil, service: "pool/no-such-pool")
  end

  test "a server by address, and named servers from the config" do
    address = VllmBridge.address()
    assert {:ok, 2} = D.divide(6, 3, __runtime__: [server: address])
    Application.put_env(:vllm_bridge, :servers, here: [address: address, runtime: [timeout_profile: :batch_job]])
    assert {:ok, 3} = D.divide(6, 2, __runtime__: [server: :here])
    # refs remember their server: calls on them go back there
    {:ok, ref} = VllmBridge.new("vllm.config.ParallelConfig", [], __runtime__: [server: :here])
    assert %Ref{server: :here} = ref
    assert {:ok, 1} = VllmBridge.get_attr(ref, "tensor_parallel_size")
    # released where each was made
    {:ok, other} = VllmBridge.new("vllm.config.ParallelConfig")
    assert %Ref{server: :default} = other
    assert {:ok, 2} = VllmBridge.release([ref, other])
  end

  test "app-wide default runtime options apply, and the call's own win" do
    Application.put_env(:vllm_bridge, :runtime, timeout: 1, timeout_profile: :batch_job)
    # a 1 ms deadline: the call cannot make it
    assert {:error, %Error{code: :deadline_exceeded}} = D.divide(6, 3)
    assert {:ok, 2} = D.divide(6, 3, __runtime__: [timeout: 10_000])
    assert {:ok, 2} = D.divide(6, 3, __runtime__: [timeout: :infinity])
  end

  test "telemetry: a call's start and stop, with its target, server, session and outcome" do
    attach()
    assert {:ok, 2} = D.divide(6, 3, __runtime__: [pool_name: :default, affinity: :hint])

    assert_received {:event, [:vllm_bridge, :call, :start], _,
                     %{target: "vllm.distributed.divide", server: :default, pool: "default", affinity: "hint"} = m}

    assert m.session == VllmBridge.session_id()
    assert_received {:event, [:vllm_bridge, :call, :stop], %{duration: d}, %{status: :ok, error_category: nil}}
    assert d > 0

    assert {:error, %Error{}} = D.ensure_divisibility(7, 2)

    assert_received {:event, [:vllm_bridge, :call, :stop], _,
                     %{status: :error, error_category: "python_error", code: :invalid_argument}}
  end

  @tag :engine
  test "telemetry: a stream's first item latency and item count; cancelled when stopped early" do
    attach()
    {:ok, stream} = Engine.generate(@engine, "Hello", greedy(4), id())
    outputs = Enum.to_list(stream)
    assert_received {:event, [:vllm_bridge, :stream, :start], _, %{target: target, multiplex: true}}
    assert target == "#{@engine}.generate"
    assert_received {:event, [:vllm_bridge, :stream, :stop], m, %{status: :ok}}
    assert m.items == length(outputs) and m.first_item > 0 and m.first_item <= m.duration

    {:ok, stream} = Engine.generate(@engine, "Hello", greedy(200), id(), __runtime__: [multiplex: false])
    assert [_, _] = Enum.take(stream, 2)
    assert_received {:event, [:vllm_bridge, :stream, :stop], %{items: 2}, %{status: :cancelled, multiplex: false}}

    {:ok, stream} = Engine.generate(@engine, "x", %{max_tokens: 2, no_such_option: 1}, id())
    assert %Error{} = catch_error(Enum.to_list(stream))
    assert_received {:event, [:vllm_bridge, :stream, :exception], %{items: 0}, %{error_category: "validation"}}
    refute_received {:event, [:vllm_bridge, :stream, :stop], _, _}
  end

  @tag :engine
  test "a published object named by an atom, as a receiver and in classmethods" do
    engine = String.to_atom(@engine)
    assert {:ok, false} = Engine.errored(engine)
    assert {:ok, {"generate"}} = Engine.get_supported_tasks(engine)
    {:ok, stream} = Engine.generate(engine, "Hello", greedy(3), id())
    assert %Record{} = last = stream |> Enum.to_list() |> List.last()
    assert last[:finished]
    assert {:ok, false} = VllmBridge.get_attr(engine, "errored")
  end

  # The forward context holds whatever it is given as attn_metadata: an echo through Python.
  defp echo(value) do
    {:ok, config} = VllmBridge.new("vllm.config.VllmConfig")
    {:ok, cm} = Vllm.ForwardContext.Module.set_forward_context(value, config, 0)
    {:ok, {:ok, context}} = VllmBridge.with_context(cm, fn _ -> Vllm.ForwardContext.Module._forward_context() end)
    context[:attn_metadata]
  end

  test "tensors as Nx on request (when Nx is loaded)" do
    t = Tensor.from_list([[1.0, 2.0], [3.0, 4.0]], :float32)
    bool = Tensor.from_list([true], :bool)

    if Code.ensure_loaded?(Nx) do
      # `_forward_context/0` takes no options: the app-wide default asks for Nx tensors
      Application.put_env(:vllm_bridge, :runtime, tensors: :nx)
      assert [nx, %Tensor{dtype: "bool"}] = echo([t, bool])
      Application.delete_env(:vllm_bridge, :runtime)
      assert apply(Nx, :to_list, [nx]) == [[1.0, 2.0], [3.0, 4.0]]
      # and back, unchanged
      assert echo(nx) == t
    else
      assert [^t, ^bool] = echo([t, bool])
    end
  end

  @tag :slow
  test "an idle connection that pings every 10 s (the servers' minimum) stays open" do
    address = VllmBridge.address()
    Application.put_env(:vllm_bridge, :servers, pinging: [address: address, keepalive: 10_000])
    assert {:ok, :serving} = VllmBridge.Health.check(:pinging)
    [{:pinging, _, conn, _}] = :ets.lookup(:vllm_bridge_connections, :pinging)
    # four pings with no call in between: a server that punished them sends GOAWAY after two or
    # three, and the connection closes (gun gives it 15 s to close)
    Process.sleep(45_000)
    assert {:connected, _} = :sys.get_state(conn)
    assert {:ok, :serving} = VllmBridge.Health.check(:pinging)
    assert [{:pinging, _, ^conn, _}] = :ets.lookup(:vllm_bridge_connections, :pinging)
  end
end
