defmodule VllmBridge.MuxTest do
  # No server needed: what the shared stream's process does with the events it reads.
  use ExUnit.Case, async: false

  import ExUnit.CaptureLog

  alias VllmBridge.Mux
  alias VllmBridge.V1, as: PB

  defp framed(events) do
    body = IO.iodata_to_binary(PB.MuxReply.encode(%PB.MuxReply{events: events}))
    <<0, byte_size(body)::32, body::binary>>
  end

  defp state(calls) do
    {:ok, state} = Mux.init(:test)
    mons = Map.new(calls, fn {id, {_pid, mon}} -> {mon, id} end)
    %{state | calls: calls, mons: mons}
  end

  setup do
    level = Logger.level()
    Logger.configure(level: :debug)
    on_exit(fn -> Logger.configure(level: level) end)
  end

  test "an error event for id 0 (a request that named no call) and events for unknown ids are dropped, at debug" do
    mon = make_ref()

    data =
      framed([
        %PB.MuxEvent{id: 0, kind: {:error, %PB.MuxError{code: 3, message: "Multiplex: unreadable request"}}},
        %PB.MuxEvent{id: 99, kind: {:value, %PB.Value{kind: {:int, 1}}}},
        %PB.MuxEvent{id: 1, kind: {:value, %PB.Value{kind: {:int, 5}}}},
        %PB.MuxEvent{id: 98, kind: {:end, %PB.Null{}}},
        # cancelled here earlier (ids 1..4 were started): dropped without a word
        %PB.MuxEvent{id: 2, kind: {:error, %PB.MuxError{code: 1, message: "cancelled"}}}
      ])

    # split across two reads, as HTTP/2 frames may split a message
    <<a::binary-size(7), b::binary>> = data

    log =
      capture_log([level: :debug], fn ->
        state = Mux.dispatch(%{state(%{1 => {self(), mon}}) | buffer: a, next_id: 5})
        assert state.buffer == a
        state = Mux.dispatch(%{state | buffer: state.buffer <> b})
        assert state.buffer == ""
        assert Map.has_key?(state.calls, 1)
      end)

    assert_received {Mux, 1, {:value, bin}}
    assert %PB.Value{kind: {:int, 5}} = PB.Value.decode(bin)
    refute_received {Mux, _, _}
    assert log =~ "no call (id 0): Multiplex: unreadable request"
    assert log =~ "call 99, which was never started (value)"
    assert log =~ "call 98, which was never started (end)"
    refute log =~ "call 2"
  end

  test "a patch is handed to its caller like a value, and the call goes on" do
    mon = Process.monitor(self())
    state = state(%{3 => {self(), mon}})
    patch = %PB.StreamPatch{ops: [%PB.PatchOp{path: [0], op: {:append_str, "b"}}]}

    events = [
      %PB.MuxEvent{id: 3, kind: {:value, %PB.Value{kind: {:str, "a"}}}},
      %PB.MuxEvent{id: 3, kind: {:patch, patch}}
    ]

    state = Mux.dispatch(%{state | buffer: framed(events), next_id: 4})
    assert Map.has_key?(state.calls, 3)
    assert_received {Mux, 3, {:value, _}}
    assert_received {Mux, 3, {:patch, bin}}
    assert PB.StreamPatch.decode(bin) == patch
  end

  test "the end or error of a call stops it being followed" do
    mon = Process.monitor(self())
    state = state(%{3 => {self(), mon}})
    state = Mux.dispatch(%{state | buffer: framed([%PB.MuxEvent{id: 3, kind: {:end, %PB.Null{}}}])})
    assert state.calls == %{} and state.mons == %{}
    assert_received {Mux, 3, {:end, _}}
  end
end
