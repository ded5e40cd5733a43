defmodule VllmBridge.StreamStateTest do
  # No server needed: the receiver of `patch-v1` and `patch-v2` streams, on hand-built patches and
  # rows, and on the Python sender's (the server's own patches are checked against whole items in
  # test/patch_live_test.exs).
  use ExUnit.Case, async: true

  alias VllmBridge.{Codec, Error, Record, StreamState}
  alias VllmBridge.V1, as: PB

  @fixture Path.expand("fixtures/patch_streams.bin", __DIR__)

  defp v(term), do: term |> Codec.encode() |> elem(0)
  defp op(path, op), do: %PB.PatchOp{path: path, op: op}
  defp patch(ops), do: %PB.StreamPatch{ops: ops}
  defp row(strs, ints, floats), do: %PB.StreamPatch{row: %PB.PatchRow{strs: strs, ints: ints, floats: floats}}
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

  # A generation's first item, whole, and its second: a token's text and id appended, then `ops`.
  defp first_two(ops) do
    [
      %PB.StreamItem{index: 0, value: output(" w0", [100], 1)},
      %PB.StreamItem{
        index: 1,
        patch:
          patch([op([2, 0, 1], {:append_str, " w1"}), op([2, 0, 2], {:append_ints, %PB.Ints{values: [101]}}) | ops])
      }
    ]
  end

  defp refused(state, p) do
    assert {:error, %Error{} = e} = StreamState.patch(state, p)
    e
  end

  test "a generation's patches rebuild exactly the whole items, and decode to the same records" do
    items =
      first_two([op([4, 0], {:set, v(2)})]) ++
        [
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
  # sent (a value or a patch) and then whole, as `stream_tee` has the server send them; every stream
  # twice, as patch-v1 and then as patch-v2 (with rows).
  test "the Python sender's patches rebuild its whole items (test/fixtures/patch_streams.bin)" do
    %PB.MuxReply{events: events} = @fixture |> File.read!() |> PB.MuxReply.decode()
    streams = Enum.group_by(events, & &1.id)
    assert map_size(streams) >= 20

    {ops, rows} =
      for {id, events} <- streams, reduce: {MapSet.new(), 0} do
        {seen, rows} ->
          {seen, rows, _, _} =
            events
            |> Enum.chunk_every(2)
            |> Enum.with_index()
            |> Enum.reduce({seen, rows, StreamState.new(), StreamState.new()}, fn
              {[sent, %PB.MuxEvent{kind: {:value, whole}}], i}, {seen, rows, state, decoding} ->
                assert {:ok, value, state} = StreamState.item(state, sent.kind)
                assert value == whole, "stream #{id}, item #{i}"
                assert Codec.decode(value) == Codec.decode(whole), "stream #{id}, item #{i}"
                # Built from the item before, decoded: the same term as the whole item decoded.
                assert {:ok, term, decoding} = StreamState.decoded_item(decoding, sent.kind, &Codec.decode/1)
                assert term == Codec.decode(whole), "stream #{id}, item #{i}, decoded"

                case sent.kind do
                  {:patch, %PB.StreamPatch{ops: [], row: %PB.PatchRow{}}} ->
                    {seen, rows + 1, state, decoding}

                  {:patch, %PB.StreamPatch{ops: ops}} ->
                    {Enum.into(ops, seen, &{elem(&1.op, 0), length(&1.path) > 1}), rows, state, decoding}

                  {:value, _} ->
                    {seen, rows, state, decoding}
                end
            end)

          {seen, rows}
      end

    for op <- [:set, :append_str, :append_ints, :append_items], deep <- [false, true] do
      assert {op, deep} in ops
    end

    # patch-v2's rows are there (7 when this was written; the Python side checks for 5 or more)
    assert rows >= 5
  end

  # The metrics, prompt, text and token ids of generation items, as `output/3` builds them.
  defp summary(value) do
    %Record{} = term = Codec.decode(value)
    [out] = term[:outputs]
    {term[:prompt], out[:text], out[:token_ids], term[:metrics]}
  end

  test "a row is the patch before's ops with new values, after a row or a whole value too" do
    items =
      first_two([op([4, 0], {:set, v(2)}), op([4, 1], {:set, v(2.5)}), op([1], {:set, v("Hi")})]) ++
        [
          # strs: the append_str's and the str set's; ints: the append's count and values, the int set's
          %PB.StreamItem{index: 2, patch: row([" w2", "Hey"], [2, 102, 103, 3], [3.5])},
          # a row after a row: the same ops again (an append of no ints too)
          %PB.StreamItem{index: 3, patch: row([" w3", "Ho"], [0, 4], [4.5])},
          # a whole value between does not count: a row still stands for the last patch's ops
          %PB.StreamItem{index: 4, value: output(" x", [7], 9)},
          {:patch, row([" y", "Yo"], [1, 8, 10], [0.5])}
        ]

    assert Enum.map(run(items), &summary/1) == [
             {"Hello", " w0", [100], {1, 1.5}},
             {"Hi", " w0 w1", [100, 101], {2, 2.5}},
             {"Hey", " w0 w1 w2", [100, 101, 102, 103], {3, 3.5}},
             {"Ho", " w0 w1 w2 w3", [100, 101, 102, 103], {4, 4.5}},
             {"Hello", " x", [7], {9, 1.5}},
             {"Yo", " x y", [7, 8], {10, 0.5}}
           ]

    # The decoded item follows a row as it does ops: only the values it carries are decoded.
    me = self()
    decode = fn value -> send(me, {:decoded, value}) && Codec.decode(value) end

    Enum.reduce(items, StreamState.new(), fn item, state ->
      {:ok, _, state} = StreamState.decoded_item(state, item, decode)
      state
    end)

    decoded = for {:decoded, %PB.Value{kind: {kind, _}}} <- Process.info(self(), :messages) |> elem(1), do: kind
    assert Enum.count(decoded, &(&1 == :record)) == 2, "only the two whole items decode whole: #{inspect(decoded)}"
  end

  test "a row is refused where it cannot stand for the patch before it, or does not fit it" do
    whole = %PB.Value{kind: {:list, %PB.Items{items: [v("a"), ints([1]), v(1), v(1.0), v(true)]}}}
    {:ok, _, fresh} = StreamState.item(StreamState.new(), whole)

    shaping =
      patch([
        op([0], {:append_str, "b"}),
        op([1], {:append_ints, %PB.Ints{values: [2]}}),
        op([2], {:set, v(2)}),
        op([3], {:set, v(2.5)})
      ])

    {:ok, _, shaped} = StreamState.patch(fresh, shaping)
    good = row(["c"], [1, 3, 4], [3.5])
    assert {:ok, value, _} = StreamState.patch(shaped, good)
    assert Codec.decode(value) == ["abc", [1, 2, 3], 4, 3.5, true]
    assert {:ok, value, _} = StreamState.patch(shaped, row(["c"], [0, 4], [3.5]))
    assert Codec.decode(value) == ["abc", [1, 2], 4, 3.5, true]

    no_shape = "stream patch: patch.row: expected a row after a patch of ops that a row can follow, got a row"
    fewer = "stream patch: patch.row: expected the values of the 4 ops before it, got fewer"
    more = "stream patch: patch.row: expected the values of the 4 ops before it, got more"

    # a stream's first item, or a row after whole values only
    assert {:error, %Error{message: ^no_shape}} = StreamState.item(StreamState.new(), {:patch, good})
    assert refused(fresh, good).message == no_shape

    # after a patch with no ops, or with any op but append_str, append_ints and sets of an int, float
    # or str (a later such patch takes the shape away)
    for p <- [
          patch([]),
          patch([op([0], {:append_str, "b"}), op([4], {:set, v(false)})]),
          patch([op([0], {:set, v(nil)})]),
          patch([op([2], {:set, v(2 ** 70)})]),
          patch([op([1], {:set, ints([5])})]),
          patch([op([0], {:set, %PB.Value{}})]),
          patch([op([], {:append_items, %PB.Items{items: [v(0)]}})])
        ] do
      {:ok, _, state} = StreamState.patch(shaped, p)
      assert refused(state, good).message == no_shape, inspect(p)
    end

    # lists that do not hold exactly the values of the ops
    for {r, message} <- [
          {row([], [], []), fewer},
          {row([], [1, 3, 4], [3.5]), fewer},
          {row(["c", "d"], [1, 3, 4], [3.5]), more},
          {row(["c"], [1, 3], [3.5]), fewer},
          {row(["c"], [1, 3, 4, 5], [3.5]), more},
          {row(["c"], [-1, 3, 4], [3.5]), fewer},
          {row(["c"], [3, 3, 4], [3.5]), fewer},
          {row(["c"], [2, 3, 4], [3.5]), fewer},
          {row(["c"], [1, 3, 4], []), fewer},
          {row(["c"], [1, 3, 4], [3.5, 1.0]), more}
        ] do
      e = refused(shaped, r)
      assert e.message == message, inspect(r)
      assert %Error{code: :internal, category: "grpc_error", reason: "stream patch does not fit"} = e
    end

    # ops and a row in one patch
    both = %PB.StreamPatch{ops: [op([0], {:append_str, "b"})], row: %PB.PatchRow{strs: ["b"]}}
    assert refused(shaped, both).message == "stream patch: patch: expected ops or a row, got both"

    # a row after a whole value that its paths do not fit: as for ops that do not fit
    {:ok, _, other} = StreamState.item(shaped, {:value, v("whole")})

    assert refused(other, good).message ==
             "stream patch: patch.ops[0] (path [0]): expected an op that fits the state, got a step into a str"

    # decoded_item refuses the same
    assert {:error, %Error{message: ^more}} =
             StreamState.decoded_item(shaped, {:patch, row(["c"], [1, 3, 4, 5], [3.5])}, &Codec.decode/1)
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

  test "an item with nothing in it fails the stream with an error, not a nil" do
    decode = &Codec.decode/1

    assert {:error, %Error{code: :internal, category: "codec", message: message}} =
             StreamState.decoded_item(StreamState.new(), %PB.StreamItem{}, decode)

    assert message =~ "stream item: the server sent an empty Value"
    {:ok, [1], state} = StreamState.decoded_item(StreamState.new(), v([1]), decode)

    assert {:error, %Error{category: "codec"}} =
             StreamState.decoded_item(state, patch([op([], {:append_items, %PB.Items{items: [%PB.Value{}]}})]), decode)
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
      },
      %PB.StreamItem{index: 2, patch: row(["ü"], [2, 7, -(2 ** 40)], [])}
    ]

    assert run(Enum.map(items, wire)) |> List.last() |> Codec.decode() |> get_in([:outputs, Access.at(0), :token_ids]) ==
             [-1, 2 ** 40, 7, -(2 ** 40)]

    assert run(Enum.map(items, wire)) |> List.last() |> Codec.decode() |> get_in([:outputs, Access.at(0), :text]) ==
             "éü"
  end
end
