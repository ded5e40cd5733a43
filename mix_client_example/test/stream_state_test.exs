defmodule VllmBridge.StreamStateTest do
  # No server needed: the receiver of `patch-v1` streams, on hand-built patches (the server's own
  # patches are checked against whole items in test/patch_live_test.exs).
  use ExUnit.Case, async: true

  alias VllmBridge.{Codec, Error, Record, StreamState}
  alias VllmBridge.V1, as: PB

  @fixture Path.expand("fixtures/patch_streams.bin", __DIR__)

  defp v(term), do: term |> Codec.encode() |> elem(0)
  defp op(path, op), do: %PB.PatchOp{path: path, op: op}
  defp patch(ops), do: %PB.StreamPatch{ops: ops}
  defp ints(values), do: %PB.Value{kind: {:ints, %PB.Ints{values: values}}}

  # A generation's item as the server encodes it (a record; token ids packed).
  defp output(text, ids, n) do
    %PB.Value{
      kind:
        {:record,
         %PB.Record{
           type_name: "vllm.outputs.RequestOutput",
           fields: [
             %PB.Field{name: "request_id", value: v("r")},
             %PB.Field{name: "prompt", value: v("Hello")},
             %PB.Field{
               name: "outputs",
               value: %PB.Value{
                 kind:
                   {:list,
                    %PB.Items{
                      items: [
                        %PB.Value{
                          kind:
                            {:record,
                             %PB.Record{
                               type_name: "vllm.outputs.CompletionOutput",
                               fields: [
                                 %PB.Field{name: "index", value: v(0)},
                                 %PB.Field{name: "text", value: v(text)},
                                 %PB.Field{name: "token_ids", value: ints(ids)}
                               ]
                             }}
                        }
                      ]
                    }}
               }
             },
             %PB.Field{name: "finished", value: v(false)},
             %PB.Field{name: "metrics", value: v({n, 1.5})}
           ]
         }}
    }
  end

  # Each item's whole Value; on the way, each item built from the one before and decoded
  # (`decoded_item/3`) must be that Value decoded.
  defp run(items) do
    {values, _} =
      Enum.map_reduce(items, {StreamState.new(), StreamState.new()}, fn item, {state, decoding} ->
        {:ok, value, state} = StreamState.item(state, item)
        {:ok, term, decoding} = StreamState.decoded_item(decoding, item, &Codec.decode/1)
        assert term == Codec.decode(value)
        {value, {state, decoding}}
      end)

    values
  end

  defp refused(state, p) do
    assert {:error, %Error{} = e} = StreamState.patch(state, p)
    e
  end

  test "a generation's patches rebuild exactly the whole items, and decode to the same records" do
    items = [
      %PB.StreamItem{index: 0, value: output(" w0", [100], 1)},
      %PB.StreamItem{
        index: 1,
        patch:
          patch([
            op([2, 0, 1], {:append_str, " w1"}),
            op([2, 0, 2], {:append_ints, %PB.Ints{values: [101]}}),
            op([4, 0], {:set, v(2)})
          ])
      },
      # a patch with no ops repeats the item before
      %PB.StreamItem{index: 2, patch: patch([])},
      %PB.StreamItem{
        index: 3,
        patch:
          patch([
            op([2, 0, 1], {:append_str, " w2"}),
            op([2, 0, 2], {:append_ints, %PB.Ints{values: [102, 103]}}),
            op([3], {:set, v(true)}),
            op([4, 1], {:set, v(2.5)})
          ])
      }
    ]

    expected = [output(" w0", [100], 1), output(" w0 w1", [100, 101], 2), output(" w0 w1", [100, 101], 2)]
    expected = expected ++ [put_in_finished(output(" w0 w1 w2", [100, 101, 102, 103], 2), 2.5)]
    assert run(items) == expected
    assert Enum.map(run(items), &Codec.decode/1) == Enum.map(expected, &Codec.decode/1)

    assert %Record{} = last = items |> run() |> List.last() |> Codec.decode()
    assert last[:finished] == true and last[:metrics] == {2, 2.5}
    assert [%Record{} = out] = last[:outputs]
    assert out[:text] == " w0 w1 w2" and out[:token_ids] == [100, 101, 102, 103]
  end

  defp put_in_finished(%PB.Value{kind: {:record, r}}, ts) do
    fields =
      r.fields
      |> List.replace_at(3, %PB.Field{name: "finished", value: v(true)})
      |> List.replace_at(4, %PB.Field{name: "metrics", value: v({2, ts})})

    %PB.Value{kind: {:record, %{r | fields: fields}}}
  end

  # Written by the Python sender (tests/tools/test_elixir_patch_fixture.py): vLLM's RequestOutputs as
  # its output processor changes them, and values of every kind changed in place, each item as it is
  # sent (a value or a patch) and then whole, as `stream_tee` has the server send them.
  test "the Python sender's patches rebuild its whole items (test/fixtures/patch_streams.bin)" do
    %PB.MuxReply{events: events} = @fixture |> File.read!() |> PB.MuxReply.decode()
    streams = Enum.group_by(events, & &1.id)
    assert map_size(streams) >= 10

    ops =
      for {id, events} <- streams, reduce: MapSet.new() do
        seen ->
          {seen, _, _} =
            events
            |> Enum.chunk_every(2)
            |> Enum.with_index()
            |> Enum.reduce({seen, StreamState.new(), StreamState.new()}, fn
              {[sent, %PB.MuxEvent{kind: {:value, whole}}], i}, {seen, state, decoding} ->
                assert {:ok, value, state} = StreamState.item(state, sent.kind)
                assert value == whole, "stream #{id}, item #{i}"
                assert Codec.decode(value) == Codec.decode(whole), "stream #{id}, item #{i}"
                # Built from the item before, decoded: the same term as the whole item decoded.
                assert {:ok, term, decoding} = StreamState.decoded_item(decoding, sent.kind, &Codec.decode/1)
                assert term == Codec.decode(whole), "stream #{id}, item #{i}, decoded"

                case sent.kind do
                  {:patch, %PB.StreamPatch{ops: ops}} ->
                    {Enum.into(ops, seen, &{elem(&1.op, 0), length(&1.path) > 1}), state, decoding}

                  {:value, _} ->
                    {seen, state, decoding}
                end
            end)

          seen
      end

    for op <- [:set, :append_str, :append_ints, :append_items], deep <- [false, true] do
      assert {op, deep} in ops
    end
  end

  test "appends to lists and tuples, sets at the root and inside items; a whole value replaces the state" do
    values =
      run([
        {:value, v([["a"], {1}])},
        {:patch, patch([op([0], {:append_items, %PB.Items{items: [v("b"), v(nil)]}})])},
        {:patch, patch([op([1], {:append_items, %PB.Items{items: [v(2)]}}), op([0, 0], {:append_str, "z"})])},
        {:patch, patch([op([0, 1], {:set, v(%{"k" => [1]})})])},
        {:value, v("whole")},
        {:patch, patch([op([], {:append_str, "!"})])},
        {:patch, patch([op([], {:set, v({:x, 1})})])}
      ])

    assert Enum.map(values, &Codec.decode/1) == [
             [["a"], {1}],
             [["a", "b", nil], {1}],
             [["az", "b", nil], {1, 2}],
             [["az", %{"k" => [1]}, nil], {1, 2}],
             "whole",
             "whole!",
             {:x, 1}
           ]
  end

  test "each item is its own value: a later patch does not change one handed out" do
    [first, second] =
      run([%PB.StreamItem{value: v(["a"])}, %PB.StreamItem{patch: patch([op([0], {:append_str, "b"})])}])

    assert Codec.decode(first) == ["a"] and Codec.decode(second) == ["ab"]
  end

  test "a patch that does not fit the state is refused with a VllmBridge.Error saying where" do
    rec = %PB.Record{
      type_name: "t.Rec",
      fields: [%PB.Field{name: "a", value: v("s")}, %PB.Field{name: "b", value: ints([1, 2])}]
    }

    {:ok, _, state} = StreamState.item(StreamState.new(), %PB.Value{kind: {:record, rec}})

    for {ops, message} <- [
          {[op([5], {:set, v(1)})],
           "patch.ops[0] (path [5]): expected an op that fits the state, got position 5 of a record"},
          {[op([0, 0], {:set, v(1)})], "got a step into a str"},
          {[op([0], {:append_ints, %PB.Ints{values: [1]}})], "got append_ints on a str"},
          {[op([1], {:append_str, "x"})], "got append_str on a ints"},
          {[op([1], {:append_items, %PB.Items{items: [v(3)]}})], "got append_items on a ints"},
          {[op([0], nil)], "got an op this client does not know (on a str)"},
          {[op([0], {:append_str, "ok"}), op([1, 0], {:set, v(1)})], "patch.ops[1] (path [1, 0]): expected"}
        ] do
      e = refused(state, patch(ops))
      assert e.message =~ "stream patch: " and e.message =~ message
      assert %Error{code: :internal, category: "grpc_error", reason: "stream patch does not fit"} = e
    end

    {:ok, _, list} = StreamState.item(StreamState.new(), v([1, [2]]))
    assert refused(list, patch([op([2], {:set, v(1)})])).message =~ "got position 2 of a list"
    assert refused(list, patch([op([0], {:append_items, %PB.Items{}})])).message =~ "got append_items on a int"
    assert refused(list, patch([op([1, 1, 0], {:set, v(1)})])).message =~ "got position 1 of a list"
  end

  test "a patch before any whole value is refused" do
    assert {:error, %Error{message: "stream patch: stream: expected a whole value before the first patch, got a patch"}} =
             StreamState.item(StreamState.new(), %PB.StreamItem{patch: patch([])})
  end

  test "a record field or item with no value set: a set fills it, anything else is refused" do
    empty = %PB.Value{kind: {:list, %PB.Items{items: [%PB.Value{}]}}}
    {:ok, _, state} = StreamState.item(StreamState.new(), empty)
    assert refused(state, patch([op([0], {:append_str, "x"})])).message =~ "got append_str on a None"
    assert refused(state, patch([op([0, 0], {:set, v(1)})])).message =~ "got a step into a None"
    assert {:ok, value, _} = StreamState.patch(state, patch([op([0], {:set, v("x")})]))
    assert Codec.decode(value) == ["x"]
  end

  test "patches survive the wire: encoded and decoded as the generated modules do" do
    wire = fn msg -> msg |> PB.StreamItem.encode() |> IO.iodata_to_binary() |> PB.StreamItem.decode() end

    items = [
      %PB.StreamItem{value: output("", [], 0)},
      %PB.StreamItem{
        index: 1,
        patch:
          patch([op([2, 0, 1], {:append_str, "é"}), op([2, 0, 2], {:append_ints, %PB.Ints{values: [-1, 2 ** 40]}})])
      }
    ]

    assert run(Enum.map(items, wire)) |> List.last() |> Codec.decode() |> get_in([:outputs, Access.at(0), :token_ids]) ==
             [-1, 2 ** 40]

    assert run(Enum.map(items, wire)) |> List.last() |> Codec.decode() |> get_in([:outputs, Access.at(0), :text]) == "é"
  end
end
