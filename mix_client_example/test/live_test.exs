defmodule VllmBridge.LiveTest do
  # Against a running server (VLLM_BRIDGE_ADDRESS); excluded when it is not set.
  use ExUnit.Case, async: false
  @moduletag :live

  alias Vllm.AsyncLLMEngine, as: Engine
  alias Vllm.Distributed, as: D
  alias Vllm.ForwardContext.DPMetadata
  alias Vllm.ForwardContext.Module, as: FC
  alias VllmBridge.{Bytes, Error, FrozenSet, PyEnum, Record, Ref, Tensor}
  alias VllmBridge.V1, as: PB

  @engine System.get_env("VLLM_BRIDGE_ENGINE", "engine")

  defp dp(opts \\ []), do: DPMetadata.new(Tensor.from_list(7, :int64), Tensor.from_list([5, 7, 3], :int64), [], opts)
  defp id, do: "exunit-#{System.unique_integer([:positive])}"
  defp greedy(n), do: %{max_tokens: n, temperature: 0.0, ignore_eos: true}

  describe "Vllm.Distributed" do
    test "module functions, errors with the Python type" do
      assert {:ok, 2} = D.divide(6, 3)
      assert {:ok, {0, 16}} = D.get_pp_indices(32, 0, 2)
      assert {:ok, true} = D.use_sched_yield() |> then(fn {:ok, b} -> {:ok, is_boolean(b)} end)

      assert {:error, %Error{category: "python_error", python_type: "AssertionError", code: :invalid_argument} = e} =
               D.ensure_divisibility(7, 2)

      assert e.message =~ "not divisible" and e.traceback =~ "Traceback"

      assert {:error, %Error{code: :invalid_argument, category: "validation", parameter: p}} =
               VllmBridge.call("vllm.distributed.divide", [6])

      assert p == "denominator"
    end
  end

  describe "Vllm.ForwardContext.Module" do
    test "the forward context through a context-manager ref" do
      {:ok, config} = VllmBridge.new("vllm.config.VllmConfig")
      assert {:ok, false} = FC.is_forward_context_available()
      {:ok, %Ref{} = cm} = FC.set_forward_context(nil, config, 0)

      assert {:ok, {true, %Record{type_name: "vllm.forward_context.ForwardContext"}}} =
               VllmBridge.with_context(cm, fn _ ->
                 {:ok, available} = FC.is_forward_context_available()
                 {:ok, context} = FC._forward_context()
                 {available, context}
               end)

      assert {:ok, false} = FC.is_forward_context_available()
      assert {:ok, nil} = FC._forward_context()
      assert {:ok, -1.0} = FC.batchsize_logging_interval()
    end
  end

  describe "Vllm.ForwardContext.DPMetadata" do
    test "constructor, methods, attribute, classmethod" do
      {:ok, dp} = dp()
      assert {:ok, %Tensor{dtype: "int64"} = t} = DPMetadata.cu_tokens_across_sp(dp, 1)
      assert Tensor.to_list(t) == [5, 12, 15]
      assert {:ok, nil} = DPMetadata.local_sizes(dp)
      {:ok, cm} = DPMetadata.sp_local_sizes(dp, 2)
      assert {:ok, {:ok, [3, 3, 4, 4, 2, 2]}} = VllmBridge.with_context(cm, fn _ -> DPMetadata.local_sizes(dp) end)
      {:ok, parallel} = VllmBridge.new("vllm.config.ParallelConfig", [], data_parallel_size: 2, data_parallel_rank: 1)
      # make returns what the documents say, a DPMetadata.t(): an instance, like new's, usable with the methods
      assert {:ok, %Ref{type_name: "vllm.forward_context.DPMetadata"} = made} =
               DPMetadata.make(DPMetadata, parallel, 7, Tensor.from_list([5, 7], :int64))

      assert {:ok, %Tensor{} = cu} = DPMetadata.cu_tokens_across_sp(made, 1)
      assert Tensor.to_list(cu) == [5, 12]
      # on a ref, make runs on the object's class, and returns an instance too
      assert {:ok, %Ref{}} =
               DPMetadata.make(dp, parallel, 7, Tensor.from_list([5, 7], :int64), __runtime__: [timeout: 10_000])
    end
  end

  describe "Vllm.AsyncLLMEngine" do
    @describetag :engine
    test "generate streams RequestOutput records" do
      {:ok, stream} = Engine.generate(@engine, "Hello", greedy(5), id(), __runtime__: [timeout_profile: :ml_inference])
      # vLLM merges outputs the consumer has not taken yet, so there are 1 to 5 of them.
      outputs = Enum.to_list(stream)
      assert length(outputs) in 1..5
      assert %Record{type_name: "vllm.outputs.RequestOutput"} = last = List.last(outputs)
      assert last[:finished] == true
      assert length(get_in(last, [:outputs, Access.at(0), :token_ids])) == 5
    end

    # That vLLM aborts the request is checked in engine_live_test.exs (the engine's own log, which
    # only a server the tests start shows); the documented surface has no view of the engine's queue.
    test "stopping a stream early ends the call at once" do
      {:ok, stream} = Engine.generate(@engine, "Hello", greedy(200), id())
      {took_us, items} = :timer.tc(fn -> Enum.take(stream, 3) end)
      assert [_, _, _] = items

      {whole_us, _} =
        :timer.tc(fn -> Engine.generate(@engine, "Hello", greedy(200), id()) |> elem(1) |> Stream.run() end)

      assert took_us < whole_us
    end

    test "concurrent streams share one Multiplex stream and equal one call per stream" do
      prompts = for i <- 1..8, do: "prompt number #{i} for the shared stream"

      tokens = fn runtime ->
        prompts
        |> Task.async_stream(
          fn p ->
            {:ok, stream} = Engine.generate(@engine, p, greedy(12), id(), __runtime__: runtime)
            outputs = Enum.to_list(stream)
            assert List.last(outputs)[:finished] == true
            get_in(List.last(outputs), [:outputs, Access.at(0), :token_ids])
          end,
          timeout: 60_000
        )
        |> Enum.map(fn {:ok, ids} -> ids end)
      end

      shared = tokens.([])
      assert [{mux, _}] = Registry.lookup(VllmBridge.MuxRegistry, :default)
      assert Process.alive?(mux)
      assert Enum.all?(shared, &(length(&1) == 12))
      assert shared == tokens.(multiplex: false)
    end

    # Starts that reach the shared process together leave as one MuxBatch; each call then gets its
    # own tokens. The process is held while the 16 callers start, so all 16 starts are in its mailbox
    # at once (otherwise how many coincide depends on the machine); the write is seen with a trace.
    test "16 streams started at once leave as one batch over the shared stream and all complete" do
      prompts = for i <- 1..4, do: "batched prompt #{i}"
      # one at a time first: what each prompt gives (and the shared stream is open)
      alone = Map.new(prompts, fn p -> {p, generated_tokens(p)} end)
      assert [{mux, _}] = Registry.lookup(VllmBridge.MuxRegistry, :default)

      traced_writes(mux, fn ->
        :ok = :sys.suspend(mux)
        tasks = for i <- 1..16, p = Enum.at(prompts, rem(i, 4)), do: {p, Task.async(fn -> generated_tokens(p) end)}
        wait_for_mailbox(mux, 16, 10_000)
        :ok = :sys.resume(mux)

        for {p, task} <- tasks,
            do: assert(Task.await(task, 60_000) == alone[p], "the stream of #{inspect(p)} got another's tokens")

        # the first write after the hold carries the 16 starts, in one MuxBatch
        assert_receive {:trace, ^mux, :call, {:gun, :data, [_conn, _ref, :nofin, data]}}, 5_000
        assert [ids] = written_batches(data)
        assert length(ids) == 16 and ids == Enum.sort(ids)
      end)
    end

    # gun refuses a stream opened as the connection closes (GOAWAY) and says so with
    # {:gun_error, conn, ref, :closing}; the calls start again on a new connection. Here that report
    # reaches the shared process before its queued starts were written: they leave once, on the new
    # stream, as one batch.
    test "starts refused as the connection closes start again on a new connection, in one batch" do
      prompts = for i <- 1..3, do: "refused prompt #{i}"
      alone = Map.new(prompts, fn p -> {p, generated_tokens(p)} end)
      assert [{mux, _}] = Registry.lookup(VllmBridge.MuxRegistry, :default)
      %{conn: old, ref: old_ref} = :sys.get_state(mux)

      try do
        traced_writes(mux, fn ->
          :ok = :sys.suspend(mux)
          tasks = for p <- prompts, do: {p, Task.async(fn -> generated_tokens(p) end)}
          wait_for_mailbox(mux, 3, 10_000)
          send(mux, {:gun_error, old, old_ref, :closing})
          :ok = :sys.resume(mux)

          for {p, task} <- tasks, do: assert(Task.await(task, 60_000) == alone[p])

          assert_receive {:trace, ^mux, :call, {:gun, :data, [conn, _ref, :nofin, data]}}, 5_000
          assert conn != old
          assert [[_, _, _] = ids] = written_batches(data)
          assert ids == Enum.sort(ids)
          refute_received {:trace, ^mux, :call, {:gun, :data, [^old | _]}}
        end)
      after
        # the forgotten connection still holds the stream the report was about
        :gun.close(old)
      end
    end

    test "a slow consumer of a multiplexed stream gets every token" do
      {:ok, stream} = Engine.generate(@engine, "slowly", greedy(100), id())

      outputs =
        stream
        |> Stream.each(fn _ -> Process.sleep(5) end)
        |> Enum.to_list()

      assert length(get_in(List.last(outputs), [:outputs, Access.at(0), :token_ids])) == 100
    end

    test "a failure while streaming raises VllmBridge.Error" do
      {:ok, stream} = Engine.generate(@engine, "x", %{max_tokens: 2, no_such_option: 1}, id())
      assert %Error{category: "validation", code: :invalid_argument} = catch_error(Enum.to_list(stream))
    end

    test "methods and properties" do
      assert {:ok, {"generate"}} = Engine.get_supported_tasks(@engine)
      assert {:ok, false} = Engine.is_paused(@engine)

      case Engine.list_loras(@engine) do
        {:ok, loras} -> assert %MapSet{} = loras
        {:error, e} -> assert %Error{code: :failed_precondition, reason: "lora disabled"} = e
      end

      assert {:ok, false} = Engine.errored(@engine)
      # the published engine is shared: only an operator (pool key operators) may change it
      assert {:error, %Error{code: :permission_denied, reason: "published"}} =
               Engine.reset_prefix_cache(@engine, [false])

      assert {:ok, nil} = Engine.check_health(@engine, __runtime__: [timeout: 10_000])
    end
  end

  describe "runtime options" do
    @describetag :engine
    test "timeout is the gRPC deadline; the server stops the stream" do
      # 20 ms: less than 200 tokens take, even on a fast machine
      {:ok, stream} = Engine.generate(@engine, "slow", greedy(200), id(), __runtime__: [timeout: 20])
      assert %Error{code: :deadline_exceeded, category: "timeout"} = catch_error(Enum.to_list(stream))
    end

    test "stream_timeout bounds the gap between items" do
      {:ok, stream} = Engine.generate(@engine, "idle", greedy(50), id(), __runtime__: [stream_timeout: 1])
      assert %Error{code: :deadline_exceeded} = catch_error(Enum.to_list(stream))
      {:ok, stream} = Engine.generate(@engine, "idle", greedy(3), id(), __runtime__: [stream_timeout: 60_000])
      assert %Record{} = last = stream |> Enum.to_list() |> List.last()
      assert last[:finished] and length(get_in(last, [:outputs, Access.at(0), :token_ids])) == 3
    end
  end

  describe "runtime options (no engine)" do
    test "timeout_profile, pool_name and affinity reach the server" do
      for p <- [:default, :ml_inference, :batch_job, :streaming],
          do: assert({:ok, 2} = D.divide(4, 2, __runtime__: [timeout_profile: p]))

      for a <- [:hint, :strict_queue, :strict_fail_fast],
          do: assert({:ok, 2} = D.divide(4, 2, __runtime__: [affinity: a]))

      assert {:ok, 2} = D.divide(4, 2, __runtime__: [timeout: 5_000, timeout_profile: :batch_job])
      assert {:ok, 2} = D.divide(4, 2, __runtime__: [timeout: :infinity, rank: 0, stream_interval: 10])

      # A pool server routes by pool and refuses unknown ones; a single worker serves any pool name.
      case D.divide(4, 2, __runtime__: [pool_name: :no_such_pool]) do
        {:ok, 2} -> :single_worker
        {:error, e} -> assert e.code == :not_found and e.message =~ "no_such_pool"
      end
    end

    test "session_id owns the refs; releasing the session frees them; refs work in other processes" do
      session = "exunit-#{System.unique_integer([:positive])}"
      {:ok, dp} = dp(__runtime__: [session_id: session])
      assert dp.session_id == session
      assert {:ok, _} = Task.async(fn -> DPMetadata.cu_tokens_across_sp(dp, 1) end) |> Task.await()
      assert {:ok, 1} = VllmBridge.release_session(session)
      assert {:error, %Error{category: "ref", code: :not_found}} = DPMetadata.local_sizes(dp)
    end

    test "each process has its own session, released when it exits" do
      parent = self()

      pid =
        spawn(fn ->
          {:ok, ref} = dp()
          send(parent, {:made, ref, VllmBridge.session_id()})
          receive do: (:exit -> :ok)
        end)

      assert_receive {:made, ref, session}, 10_000
      assert ref.session_id == session and session != VllmBridge.session_id()
      assert {:ok, nil} = DPMetadata.local_sizes(ref)
      send(pid, :exit)

      assert Enum.any?(1..250, fn _ ->
               Process.sleep(20)
               match?({:error, %Error{category: "ref"}}, DPMetadata.local_sizes(ref))
             end)
    end
  end

  test "collective runs one call on every rank, results in rank order" do
    assert {:ok, [_ | _] = results} = VllmBridge.collective("vllm.distributed.divide", [6, 3])
    assert Enum.all?(results, &(&1 == 2))
  end

  # The forward context holds whatever it is given as attn_metadata (documented as term()): an echo
  # through Python that stays within the documented surface.
  defp generated_tokens(prompt) do
    {:ok, stream} = Engine.generate(@engine, prompt, greedy(10), id())
    last = stream |> Enum.to_list() |> List.last()
    assert last[:finished] == true
    get_in(last, [:outputs, Access.at(0), :token_ids])
  end

  # Runs `fun` with the shared process's writes (:gun.data/4) traced to the test process.
  defp traced_writes(mux, fun) do
    :erlang.trace_pattern({:gun, :data, 4}, true, [:global])
    :erlang.trace(mux, true, [:call])
    fun.()
  after
    # (resuming a process that runs does nothing)
    :sys.resume(mux)
    :erlang.trace(mux, false, [:call])
    :erlang.trace_pattern({:gun, :data, 4}, false, [:global])
  end

  # The start ids of each MuxBatch of starts in written `data`; a message that is not one fails.
  defp written_batches(data), do: data |> IO.iodata_to_binary() |> batches_in()

  defp batches_in(<<>>), do: []

  defp batches_in(<<0, size::32, body::binary-size(size), rest::binary>>) do
    assert %PB.MuxRequest{kind: {:batch, %PB.MuxBatch{requests: requests}}} = PB.MuxRequest.decode(body)
    [Enum.map(requests, fn %PB.MuxRequest{kind: {:start, %PB.MuxStart{id: id}}} -> id end) | batches_in(rest)]
  end

  defp wait_for_mailbox(pid, n, timeout) do
    {:message_queue_len, len} = Process.info(pid, :message_queue_len)

    cond do
      len >= n ->
        :ok

      timeout <= 0 ->
        flunk("#{n} messages expected in the multiplexer's mailbox, #{len} there")

      true ->
        Process.sleep(5)
        wait_for_mailbox(pid, n, timeout - 5)
    end
  end

  defp echo(value) do
    {:ok, config} = VllmBridge.new("vllm.config.VllmConfig")
    {:ok, cm} = FC.set_forward_context(value, config, 0)
    {:ok, {:ok, context}} = VllmBridge.with_context(cm, fn _ -> FC._forward_context() end)
    context[:attn_metadata]
  end

  test "every value kind round-trips through Python" do
    values = [
      42,
      -(2 ** 70),
      2 ** 64,
      1.5,
      :infinity,
      :neg_infinity,
      :nan,
      nil,
      true,
      false,
      "héllo",
      %Bytes{data: "raw"},
      [1, "a", nil],
      {1, {2, 3}},
      MapSet.new([1, 2]),
      %FrozenSet{set: MapSet.new(["x"])},
      %{"a" => 1, 2 => "b", {1, 2} => [3], nil => true},
      Tensor.from_list([[1.0, 2.0]], :float32),
      %Tensor{dtype: "bfloat16", shape: [2], data: <<0x80, 0x3F, 0, 0x40>>},
      %PyEnum{type_name: "vllm.config.compilation.CUDAGraphMode", name: "NONE", value: 0},
      %Record{
        type_name: "vllm.forward_context.BatchDescriptor",
        fields: [{"num_tokens", 4}, {"num_reqs", nil}, {"uniform", false}, {"has_lora", false}]
      }
    ]

    for v <- values, do: assert(echo(v) == v, "#{inspect(v)} came back as #{inspect(echo(v))}")
    assert echo(:an_atom) == "an_atom"
    {:ok, other} = dp()
    assert [%Record{type_name: "vllm.forward_context.DPMetadata"}] = echo([other])
  end
end
