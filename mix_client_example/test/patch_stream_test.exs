defmodule VllmBridge.PatchStreamTest do
  # No server needed: a stream over a stand-in for the shared Multiplex stream's process, which
  # answers the start and then sends what a test tells it to. What the caller sees of a patch that
  # does not fit, or that cannot be read: a VllmBridge.Error, and the call cancelled on the server.
  use ExUnit.Case, async: false

  alias VllmBridge.{Codec, Error, Mux}
  alias VllmBridge.V1, as: PB

  @address "127.0.0.1:9"

  setup do
    saved = Application.get_env(:vllm_bridge, :release_sessions_on_exit)
    Application.put_env(:vllm_bridge, :release_sessions_on_exit, false)

    on_exit(fn ->
      if saved == nil,
        do: Application.delete_env(:vllm_bridge, :release_sessions_on_exit),
        else: Application.put_env(:vllm_bridge, :release_sessions_on_exit, saved)
    end)
  end

  # A process registered as the multiplexer of @address: it accepts one call (id 1), reports its
  # start and cancel to the test, and sends the caller `events` (as the real one does, as bytes).
  defp stand_in(events) do
    test = self()

    pid =
      spawn_link(fn ->
        {:ok, _} = Registry.register(VllmBridge.MuxRegistry, @address, nil)
        send(test, :registered)
        stand_in_loop(test, events)
      end)

    assert_receive :registered
    pid
  end

  defp stand_in_loop(test, events) do
    receive do
      {:"$gen_call", from, {:start, _server, _req, metadata, _timeout, caller}} ->
        GenServer.reply(from, {:ok, 1})
        send(test, {:started, metadata})
        for event <- events, do: send(caller, {Mux, 1, event})
        stand_in_loop(test, events)

      {:"$gen_cast", {:cancel, id}} ->
        send(test, {:cancelled, id})
        stand_in_loop(test, events)

      {:"$gen_cast", _credit} ->
        stand_in_loop(test, events)
    end
  end

  defp value(term), do: {:value, term |> Codec.encode() |> elem(0) |> PB.Value.encode() |> IO.iodata_to_binary()}
  defp patch(ops), do: {:patch, %PB.StreamPatch{ops: ops} |> PB.StreamPatch.encode() |> IO.iodata_to_binary()}

  defp row(strs, ints, floats) do
    row = %PB.PatchRow{strs: strs, ints: ints, floats: floats}
    {:patch, %PB.StreamPatch{row: row} |> PB.StreamPatch.encode() |> IO.iodata_to_binary()}
  end

  defp stream(runtime \\ []), do: VllmBridge.iterate("it", __runtime__: [server: @address] ++ runtime)

  @ops [%PB.PatchOp{path: [0], op: {:append_str, "b"}}, %PB.PatchOp{path: [1], op: {:set, %PB.Value{kind: {:int, 2}}}}]

  test "items arrive as a value, patches and rows, and decode as whole ones would; patch-v2, then v1, is asked for" do
    stand_in([value(["a", 1]), patch(@ops), row(["c"], [3], []), value(5), row(["d"], [4], []), {:end, ""}])
    {:ok, s} = stream()
    # a row after a whole value: the ops of the last patch, on the value (here they do not fit it)
    assert %Error{message: message} = catch_error(Enum.to_list(s))
    assert message =~ "stream patch: patch.ops[0] (path [0]): expected an op that fits the state, got a step into a"
    assert_received {:started, %{"x-bridge-stream-encoding" => "patch-v2,patch-v1"} = md}
    refute Map.has_key?(md, "x-bridge-stream-tee")
    assert_receive {:cancelled, 1}
  end

  test "rows follow the patch before them, after a whole value too" do
    stand_in([value(["a", 1]), patch(@ops), row(["c"], [3], []), value(["x", 0]), row(["y"], [-4], []), {:end, ""}])
    {:ok, s} = stream()
    assert Enum.to_list(s) == [["a", 1], ["ab", 2], ["abc", 3], ["x", 0], ["xy", -4]]
    refute_receive {:cancelled, _}, 100
  end

  test "a row after a patch that a row cannot follow raises VllmBridge.Error, and the call is cancelled" do
    stand_in([value(["a", 1]), patch(@ops), row(["c"], [3], []), patch([]), row(["d"], [4], []), {:end, ""}])
    {:ok, s} = stream()

    assert %Error{message: "stream patch: patch.row: expected a row after a patch of ops that a row can follow" <> _} =
             catch_error(Enum.to_list(s))

    assert_receive {:cancelled, 1}
  end

  test "stream_encoding: :patch_v1 asks for patch-v1 alone, whose patches decode as before" do
    stand_in([value(["a", 1]), patch([%PB.PatchOp{path: [0], op: {:append_str, "b"}}]), patch([]), {:end, ""}])
    {:ok, s} = stream(stream_encoding: :patch_v1)
    assert Enum.to_list(s) == [["a", 1], ["ab", 1], ["ab", 1]]
    assert_received {:started, %{"x-bridge-stream-encoding" => "patch-v1"} = md}
    refute Map.has_key?(md, "x-bridge-stream-tee")
    refute_receive {:cancelled, _}, 100
  end

  test "stream_encoding: :full asks for whole items; stream_tee for each item twice" do
    stand_in([value(1), {:end, ""}])
    {:ok, s} = stream(stream_encoding: :full)
    assert Enum.to_list(s) == [1]
    assert_received {:started, %{"x-bridge-stream-encoding" => "full"}}
    {:ok, s} = stream(stream_tee: true)
    assert Enum.to_list(s) == [1]
    assert_received {:started, %{"x-bridge-stream-encoding" => "patch-v2,patch-v1", "x-bridge-stream-tee" => "1"}}
  end

  test "a patch that does not fit raises VllmBridge.Error in the consumer, and the call is cancelled" do
    stand_in([value(["a"]), patch([%PB.PatchOp{path: [3], op: {:append_str, "b"}}]), {:end, ""}])
    {:ok, s} = stream()

    assert %Error{code: :internal, category: "grpc_error", reason: "stream patch does not fit", message: message} =
             catch_error(Enum.to_list(s))

    assert message ==
             "stream patch: patch.ops[0] (path [3]): expected an op that fits the state, got position 3 of a list"

    assert_receive {:cancelled, 1}
  end

  test "a row that does not hold its ops' values raises VllmBridge.Error, and the call is cancelled" do
    stand_in([
      value(["a"]),
      patch([%PB.PatchOp{path: [0], op: {:append_str, "b"}}]),
      row(["c", "d"], [], []),
      {:end, ""}
    ])

    {:ok, s} = stream()

    assert %Error{code: :internal, reason: "stream patch does not fit", message: message} = catch_error(Enum.to_list(s))
    assert message == "stream patch: patch.row: expected the values of the 1 ops before it, got more"
    assert_receive {:cancelled, 1}
  end

  test "a patch before any value raises VllmBridge.Error too, and the call is cancelled" do
    stand_in([patch([]), {:end, ""}])
    {:ok, s} = stream()

    assert %Error{message: "stream patch: stream: expected a whole value before the first patch" <> _} =
             catch_error(Enum.to_list(s))

    assert_receive {:cancelled, 1}
  end

  test "bytes that are no patch raise VllmBridge.Error, and the call is cancelled" do
    stand_in([value(1), {:patch, <<255, 255, 255>>}, {:end, ""}])
    {:ok, s} = stream()

    assert %Error{code: :internal, message: "an unreadable VllmBridge.V1.StreamPatch" <> _} =
             catch_error(Enum.to_list(s))

    assert_receive {:cancelled, 1}
  end
end
