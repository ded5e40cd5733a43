defmodule VllmBridge.StreamState do
  @moduledoc """
  The receiver's side of a stream that travels as patches (`patch-v1` and `patch-v2`, the
  `StreamEncoding` of `bridge.proto`): the latest item's `vllm_bridge.v1.Value`, which each item
  replaces (a whole `value`) or changes (a `StreamPatch`).

  Every item then decodes, as any Value does (`VllmBridge.Codec.decode/2`), to exactly what the
  `full` encoding would have given for it. This follows the Python receiver
  (`bridge_server/wire/streamstate.py`) op for op:

    * a `value` replaces the state; a stream's first item always is one;
    * a `patch` applies its ops in order. Each op's `path` walks from the root, one step per number:
      into a `record`, the field at that position of its fields (in the order they arrived, never by
      name); into a `list` or `tuple`, the item at that position. Then `set` replaces the target,
      `append_str` appends to a `str`, `append_ints` to an `ints`, `append_items` to a `list` or
      `tuple`;
    * with `patch-v2`, a patch may instead be a `row` (`PatchRow`, and then no ops): the ops of the
      stream's previous patch (the last item that arrived as a patch, as ops or as a row; whole
      values in between do not count), the same paths and kinds in the same order, each with its
      value taken from the row: `strs` holds, in op order, the text of each `append_str` and each
      `set` of a `str`; `ints` each `set` of an `int`, and for each `append_ints` its count, then
      that many values; `floats` each `set` of a `float`. The state keeps those paths and kinds
      (`shape`) after a patch whose ops are all of these kinds (`append_str`, `append_ints`, `set`
      of an `int`, `float` or `str`), and none after any other patch (or one with no ops);
    * a patch before any value, a path that does not fit the state, an op that does not fit its
      target (or that this client does not know), a patch with both ops and a row, a row with no
      shape before it, or a row whose lists do not hold exactly the values its ops take (fewer,
      more, a count below zero or past the end) is an error: the stream fails, it never guesses.

  The state is plain data, so values already handed out never change.

  `decoded_item/3` also keeps the last item decoded, and builds each patched item from it: only what
  an op carries is decoded, and the rest of the term is the item before's (shared, as immutable data
  is). A CUMULATIVE generation's items grow with it (token ids, text, a logprob map per token), so
  decoding each whole would cost a long stream time quadratic in its length.

  The streams of `VllmBridge` keep one of these per stream; it is public for those who read a
  `Stream` or `Multiplex` RPC themselves.
  """

  alias VllmBridge.{Error, Record}
  alias VllmBridge.V1, as: PB

  defstruct value: nil, decoded: nil, shape: nil

  @typedoc "What a row's op is: its path and kind (a row's `set`s by the kind of Value they set)."
  @type row_op :: {[non_neg_integer()], :append_str | :append_ints | :set_int | :set_float | :set_str}

  @typedoc """
  `value`: the latest item's Value (nil before the first); `decoded`: the latest item decoded, when
  `decoded_item/3` took it; `shape`: the ops a row stands for (nil: a row now is an error).
  """
  @type t :: %__MODULE__{value: PB.Value.t() | nil, decoded: {:ok, term()} | nil, shape: [row_op()] | nil}

  @doc "A state for a new stream (no item yet)."
  @spec new() :: t()
  def new, do: %__MODULE__{}

  @doc """
  Takes a stream's next item, as its `StreamItem` (or its `value` or `patch` alone, or a Multiplex
  event's kind: `{:value, value}`, `{:patch, patch}`): `{:ok, value, state}`, where `value` is the
  item's whole `Value`, or `{:error, %VllmBridge.Error{}}` when a patch does not fit.
  """
  @spec item(t(), PB.StreamItem.t() | PB.Value.t() | PB.StreamPatch.t() | {:value | :patch, struct()}) ::
          {:ok, PB.Value.t(), t()} | {:error, Error.t()}
  def item(state, msg) do
    with {:ok, value, _ops, state} <- next(state, msg), do: {:ok, value, state}
  end

  # The item's Value, and the ops it was (a row's spelled out), or :value for a whole one.
  defp next(state, %PB.StreamItem{patch: %PB.StreamPatch{} = patch}), do: next_patch(state, patch)
  defp next(state, %PB.StreamItem{value: value}), do: full(state, value)
  defp next(state, %PB.StreamPatch{} = patch), do: next_patch(state, patch)
  defp next(state, %PB.Value{} = value), do: full(state, value)
  defp next(state, {:patch, %PB.StreamPatch{} = patch}), do: next_patch(state, patch)
  defp next(state, {:value, value}), do: full(state, value)

  # A StreamItem with neither field is an empty Value on the wire (decoding refuses it). A whole value
  # leaves the shape as it was: a row stands for the ops of the last patch, whatever came between.
  defp full(state, nil), do: full(state, %PB.Value{})
  defp full(state, %PB.Value{} = value), do: {:ok, value, :value, %{state | value: value, decoded: nil}}

  @doc """
  Takes a stream's next item, as `item/2` does, and decodes it with `decode` (a function of a
  `Value`, such as `&VllmBridge.Codec.decode(&1, opts)`): `{:ok, term, state}` or
  `{:error, %VllmBridge.Error{}}`. A patched item is the item before with the patch's ops applied
  to it, each op's part decoded alone; where a term cannot follow an op, the whole state is decoded.
  Either way the term is what decoding the item's whole Value gives.
  """
  @spec decoded_item(
          t(),
          PB.StreamItem.t() | PB.Value.t() | PB.StreamPatch.t() | {:value | :patch, struct()},
          (PB.Value.t() -> term())
        ) :: {:ok, term(), t()} | {:error, Error.t()}
  def decoded_item(state, msg, decode) when is_function(decode, 1) do
    last = state.decoded

    with {:ok, value, ops, state} <- next(state, msg) do
      term =
        with ops when is_list(ops) <- ops,
             {:ok, before} <- last,
             {:ok, term} <- follow(before, ops, decode) do
          term
        else
          _ -> decode.(value)
        end

      {:ok, term, %{state | decoded: {:ok, term}}}
    end
  rescue
    # what the decoder refuses (an empty Value, a big_int that is not one): this item, not the caller
    e in ArgumentError ->
      {:error, Error.local(:internal, "codec", "stream item: the server sent #{Exception.message(e)}")}
  end

  # The ops on the decoded term, in order; :whole where the term cannot follow one. (The state has
  # taken every op already, so paths and ops fit the Value the term was decoded from.)
  defp follow(term, [], _decode), do: {:ok, term}

  defp follow(term, [%PB.PatchOp{path: path, op: op} | ops], decode) do
    with {:ok, term} <- follow_op(term, path, op, decode), do: follow(term, ops, decode)
  end

  defp follow_op(term, [], op, decode), do: change_term(term, op, decode)

  defp follow_op(%Record{fields: fields} = record, [step | rest], op, decode) when step < length(fields) do
    {name, value} = Enum.at(fields, step)

    with {:ok, value} <- follow_op(value, rest, op, decode),
         do: {:ok, %{record | fields: List.replace_at(fields, step, {name, value})}}
  end

  defp follow_op(list, [step | rest], op, decode) when is_list(list) and step < length(list) do
    with {:ok, item} <- follow_op(Enum.at(list, step), rest, op, decode),
         do: {:ok, List.replace_at(list, step, item)}
  end

  defp follow_op(tuple, [step | rest], op, decode) when is_tuple(tuple) and step < tuple_size(tuple) do
    with {:ok, item} <- follow_op(elem(tuple, step), rest, op, decode), do: {:ok, put_elem(tuple, step, item)}
  end

  defp follow_op(_term, _path, _op, _decode), do: :whole

  defp change_term(_old, {:set, value}, decode), do: {:ok, decode.(value || %PB.Value{})}
  defp change_term(old, {:append_str, more}, _decode) when is_binary(old), do: {:ok, old <> more}
  defp change_term(old, {:append_ints, more}, _decode) when is_list(old), do: {:ok, old ++ values_of(more)}

  defp change_term(old, {:append_items, more}, decode) when is_list(old),
    do: {:ok, old ++ Enum.map(items_of(more), decode)}

  defp change_term(old, {:append_items, more}, decode) when is_tuple(old),
    do: {:ok, List.to_tuple(Tuple.to_list(old) ++ Enum.map(items_of(more), decode))}

  defp change_term(_old, _op, _decode), do: :whole

  @doc "Applies a patch (its ops, or a row): `{:ok, value, state}` or `{:error, %VllmBridge.Error{}}`."
  @spec patch(t(), PB.StreamPatch.t()) :: {:ok, PB.Value.t(), t()} | {:error, Error.t()}
  def patch(state, %PB.StreamPatch{} = patch) do
    with {:ok, value, _ops, state} <- next_patch(state, patch), do: {:ok, value, state}
  end

  defp next_patch(%__MODULE__{} = state, patch) do
    with {:ok, ops, shape} <- ops(state, patch),
         {:ok, value} <- apply_ops(state.value, ops) do
      {:ok, value, ops, %{state | value: value, decoded: nil, shape: shape}}
    end
  end

  # The patch's ops (a row's spelled out as the PatchOps it stands for), and the shape a row after
  # it will take.
  defp ops(_state, %PB.StreamPatch{ops: [_ | _], row: %PB.PatchRow{}}),
    do: {:error, misfit("patch", "ops or a row", "both")}

  defp ops(%__MODULE__{shape: shape}, %PB.StreamPatch{row: %PB.PatchRow{} = row}) do
    with {:ok, ops} <- row(shape, row), do: {:ok, ops, shape}
  end

  defp ops(_state, %PB.StreamPatch{ops: ops}), do: {:ok, ops, shape(ops, [])}

  # A row can follow a patch of append_str, append_ints, and sets of an int, float or str; nothing
  # else (nor a patch with no ops).
  defp shape([], []), do: nil
  defp shape([], shape), do: Enum.reverse(shape)

  defp shape([%PB.PatchOp{path: path, op: op} | ops], shape) do
    case row_kind(op) do
      nil -> nil
      kind -> shape(ops, [{path, kind} | shape])
    end
  end

  defp row_kind({:append_str, _}), do: :append_str
  defp row_kind({:append_ints, _}), do: :append_ints
  defp row_kind({:set, %PB.Value{kind: {:int, _}}}), do: :set_int
  defp row_kind({:set, %PB.Value{kind: {:float, _}}}), do: :set_float
  defp row_kind({:set, %PB.Value{kind: {:str, _}}}), do: :set_str
  defp row_kind(_op), do: nil

  defp row(nil, %PB.PatchRow{}),
    do: {:error, misfit("patch.row", "a row after a patch of ops that a row can follow", "a row")}

  defp row(shape, %PB.PatchRow{strs: strs, ints: ints, floats: floats}) do
    shape
    |> Enum.reduce_while({[], strs, ints, floats}, fn {path, kind}, {ops, strs, ints, floats} ->
      case row_op(kind, strs, ints, floats) do
        {:ok, op, strs, ints, floats} -> {:cont, {[%PB.PatchOp{path: path, op: op} | ops], strs, ints, floats}}
        :fewer -> {:halt, :fewer}
      end
    end)
    |> case do
      {ops, [], [], []} -> {:ok, Enum.reverse(ops)}
      :fewer -> {:error, misfit("patch.row", "the values of the #{length(shape)} ops before it", "fewer")}
      _more -> {:error, misfit("patch.row", "the values of the #{length(shape)} ops before it", "more")}
    end
  end

  # One op of a row: the op, and what is left of the row's lists.
  defp row_op(:append_str, [s | strs], ints, floats), do: {:ok, {:append_str, s}, strs, ints, floats}
  defp row_op(:set_str, [s | strs], ints, floats), do: {:ok, {:set, %PB.Value{kind: {:str, s}}}, strs, ints, floats}
  defp row_op(:set_int, strs, [i | ints], floats), do: {:ok, {:set, %PB.Value{kind: {:int, i}}}, strs, ints, floats}
  defp row_op(:set_float, strs, ints, [f | floats]), do: {:ok, {:set, %PB.Value{kind: {:float, f}}}, strs, ints, floats}

  defp row_op(:append_ints, strs, [count | ints], floats) when is_integer(count) and count >= 0 do
    case Enum.split(ints, count) do
      {values, ints} when length(values) == count -> {:ok, {:append_ints, %PB.Ints{values: values}}, strs, ints, floats}
      _ -> :fewer
    end
  end

  defp row_op(_kind, _strs, _ints, _floats), do: :fewer

  defp apply_ops(nil, _ops), do: {:error, misfit("stream", "a whole value before the first patch", "a patch")}

  defp apply_ops(root, ops) do
    ops
    |> Enum.with_index()
    |> Enum.reduce_while({:ok, root}, fn {%PB.PatchOp{path: path} = op, n}, {:ok, value} ->
      case apply_op(value, path, op.op) do
        {:ok, value} ->
          {:cont, {:ok, value}}

        {:misfit, why} ->
          {:halt, {:error, misfit("patch.ops[#{n}] (path #{inspect(path)})", "an op that fits the state", why)}}
      end
    end)
  end

  # The target: what the op does to it. Above it: one step down, then the node rebuilt around the
  # changed child.
  defp apply_op(node, [], op), do: change(node, op)

  defp apply_op(%PB.Value{kind: {:record, %PB.Record{fields: fields} = record}} = node, [step | rest], op) do
    case fields do
      fields when step < length(fields) ->
        field = Enum.at(fields, step)

        with {:ok, value} <- apply_op(field.value, rest, op) do
          fields = List.replace_at(fields, step, %{field | value: value})
          {:ok, %{node | kind: {:record, %{record | fields: fields}}}}
        end

      _ ->
        {:misfit, "position #{step} of a record"}
    end
  end

  defp apply_op(%PB.Value{kind: {kind, %PB.Items{items: items} = list}} = node, [step | rest], op)
       when kind in [:list, :tuple] do
    if step < length(items) do
      with {:ok, item} <- apply_op(Enum.at(items, step), rest, op) do
        {:ok, %{node | kind: {kind, %{list | items: List.replace_at(items, step, item)}}}}
      end
    else
      {:misfit, "position #{step} of a #{kind}"}
    end
  end

  defp apply_op(node, [_step | _], _op), do: {:misfit, "a step into a #{kind_name(node)}"}

  defp change(_node, {:set, value}), do: {:ok, value || %PB.Value{}}

  defp change(%PB.Value{kind: {:str, s}} = node, {:append_str, more}), do: {:ok, %{node | kind: {:str, s <> more}}}

  defp change(%PB.Value{kind: {:ints, %PB.Ints{values: values} = ints}} = node, {:append_ints, more}),
    do: {:ok, %{node | kind: {:ints, %{ints | values: values ++ values_of(more)}}}}

  defp change(%PB.Value{kind: {kind, %PB.Items{items: items} = list}} = node, {:append_items, more})
       when kind in [:list, :tuple],
       do: {:ok, %{node | kind: {kind, %{list | items: items ++ items_of(more)}}}}

  defp change(node, nil), do: {:misfit, "an op this client does not know (on a #{kind_name(node)})"}
  defp change(node, {op, _}), do: {:misfit, "#{op} on a #{kind_name(node)}"}

  defp values_of(nil), do: []
  defp values_of(%PB.Ints{values: values}), do: values
  defp items_of(nil), do: []
  defp items_of(%PB.Items{items: items}), do: items

  # As the Python receiver names kinds; a field or item with no kind set is "None".
  defp kind_name(%PB.Value{kind: {kind, _}}), do: Atom.to_string(kind)
  defp kind_name(_), do: "None"

  defp misfit(where, expected, got) do
    Error.local(:internal, "grpc_error", "stream patch: #{where}: expected #{expected}, got #{got}",
      reason: "stream patch does not fit"
    )
  end
end
