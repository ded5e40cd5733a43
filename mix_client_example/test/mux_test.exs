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

  describe "batches/1 (the messages that carry the queued requests)" do
    defp encoded(requests), do: Enum.map(requests, &IO.iodata_to_binary(PB.MuxRequest.encode(&1)))

    # every request the messages carry, in order, and each message's request count (1: sent alone)
    defp unpack(messages) do
      decoded = Enum.map(messages, &PB.MuxRequest.decode/1)

      requests =
        Enum.flat_map(decoded, fn
          %PB.MuxRequest{kind: {:batch, %PB.MuxBatch{requests: rs}}} -> rs
          request -> [request]
        end)

      sizes =
        Enum.map(decoded, fn
          %PB.MuxRequest{kind: {:batch, %PB.MuxBatch{requests: rs}}} -> length(rs)
          _ -> 1
        end)

      {requests, sizes}
    end

    defp credit(i), do: %PB.MuxRequest{kind: {:credit, %PB.MuxCredit{id: i, events: 16}}}

    defp start(i, text) do
      call = %PB.CallRequest{target: %PB.Target{kind: :METHOD, name: "generate"}, args: [%PB.Value{kind: {:str, text}}]}
      %PB.MuxRequest{kind: {:start, %PB.MuxStart{id: i, call: call, stream: true, window: 32}}}
    end

    test "nothing queued: no message" do
      assert Mux.batches([]) == []
    end

    test "a lone request goes as it is, not wrapped in a batch" do
      [bin] = encoded([start(1, "Hello")])
      assert Mux.batches([bin]) == [bin]
      assert %PB.MuxRequest{kind: {:start, %PB.MuxStart{id: 1}}} = PB.MuxRequest.decode(hd(Mux.batches([bin])))
    end

    test "requests queued together leave as one MuxBatch, in order, every kind" do
      requests = [start(1, "a"), credit(7), %PB.MuxRequest{kind: {:cancel, 3}}, start(2, "b")]
      assert [message] = Mux.batches(encoded(requests))
      assert %PB.MuxRequest{kind: {:batch, %PB.MuxBatch{requests: ^requests}}} = PB.MuxRequest.decode(message)
      # the same bytes the generated modules write for that batch
      batch = %PB.MuxRequest{kind: {:batch, %PB.MuxBatch{requests: requests}}}
      assert message == IO.iodata_to_binary(PB.MuxRequest.encode(batch))
    end

    test "at most 256 requests a batch; order kept, nothing lost" do
      requests = for i <- 1..600, do: if(rem(i, 3) == 0, do: credit(i), else: start(i, "prompt #{i}"))
      messages = Mux.batches(encoded(requests))
      assert {^requests, [256, 256, 88]} = unpack(messages)

      # 257 = one full batch and one request alone
      assert {_, [256, 1]} = unpack(Mux.batches(encoded(Enum.take(requests, 257))))
    end

    test "at most 64 KiB of requests a batch; a larger request goes alone" do
      big = fn i, kib -> start(i, String.duplicate("x", kib * 1024)) end
      # 20 KiB each: three fit in 64 KiB, the fourth starts the next batch
      requests = for i <- 1..7, do: big.(i, 20)
      messages = Mux.batches(encoded(requests))
      assert {^requests, [3, 3, 1]} = unpack(messages)
      assert Enum.all?(messages, &(byte_size(&1) < 65_536 + 64))

      # a request over 64 KiB goes alone, between batches of what came before and after it
      requests = [credit(1), credit(2), big.(3, 70), credit(4), big.(5, 66), big.(6, 1)]
      messages = Mux.batches(encoded(requests))
      assert {^requests, [2, 1, 1, 1, 1]} = unpack(messages)
      assert %PB.MuxRequest{kind: {:start, %PB.MuxStart{id: 3}}} = PB.MuxRequest.decode(Enum.at(messages, 1))
    end

    test "exactly 64 KiB of requests still fits in one batch" do
      [one] = encoded([credit(1)])
      rest = 65_536 - byte_size(one)
      # a start of exactly `rest` bytes: the text's length less the start's other bytes (the length
      # prefixes are as long for both texts, at this size)
      [probe] = encoded([start(2, String.duplicate("y", rest))])
      [bin] = encoded([start(2, String.duplicate("y", 2 * rest - byte_size(probe)))])
      assert byte_size(one) + byte_size(bin) == 65_536
      assert {_, [2]} = unpack(Mux.batches([one, bin]))
      assert {_, [2, 1]} = unpack(Mux.batches([one, bin, one]))
    end
  end
end
