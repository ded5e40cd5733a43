defmodule VllmBridge.StreamState do
  @moduledoc """
  The receiver's side of a stream that travels as patches (`patch-v1`, the `StreamEncoding` of
  `bridge.proto`): the latest item's `vllm_bridge.v1.Value`, which each item replaces (a whole
  `value`) or changes (a `StreamPatch`).

  Every item then decodes, as any Value does (`VllmBridge.Codec.decode/2`), to exactly what the
  `full` encoding would have given for it. This follows the Python receiver
  (`bridge_server/wire/streamstate.py`) op for op:

    * a `value` replaces the state; a stream's first item always is one;
    * a `patch` applies its ops in order. Each op's `path` walks from the root, one step per number:
      into a `record`, the field at that position of its fields (in the order they arrived, never by
      name); into a `list` or `tuple`, the item at that position. Then `set` replaces the target,
      `append_str` appends to a `str`, `append_ints` to an `ints`, `append_items` to a `list` or
      `tuple`;
    * a patch before any value, a path that does not fit the state, or an op that does not fit its
      target (or that this client does not know) is an error: the stream fails, it never guesses.

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

  defstruct value: nil, decoded: nil

  @type t :: %__MODULE__{value: PB.Value.t() | nil, decoded: {:ok, term()} | nil}

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
  def item(state, %PB.StreamItem{patch: %PB.StreamPatch{} = patch}), do: patch(state, patch)
  def item(state, %PB.StreamItem{value: value}), do: full(state, value)
  def item(state, %PB.StreamPatch{} = patch), do: patch(state, patch)
  def item(state, %PB.Value{} = value), do: full(state, value)
  def item(state, {:patch, %PB.StreamPatch{} = patch}), do: patch(state, patch)
  def item(state, {:value, value}), do: full(state, value)

  # A StreamItem with neither field is an empty Value on the wire (it decodes to nil).
  defp full(state, nil), do: full(state, %PB.Value{})
  defp full(state, %PB.Value{} = value), do: {:ok, value, %{state | value: value, decoded: nil}}

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

    with {:ok, value, state} <- item(state, msg) do
      term =
        with {:patch, %PB.StreamPatch{ops: ops}} <- kind(msg),
             {:ok, before} <- last,
             {:ok, term} <- follow(before, ops, decode) do
          term
        else
          _ -> decode.(value)
        end

      {:ok, term, %{state | decoded: {:ok, term}}}
    end
  end

  defp kind(%PB.StreamItem{patch: %PB.StreamPatch{} = patch}), do: {:patch, patch}
  defp kind(%PB.StreamPatch{} = patch), do: {:patch, patch}
  defp kind({:patch, %PB.StreamPatch{} = patch}), do: {:patch, patch}
  defp kind(_), do: :value

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

  @doc "Applies a patch: `{:ok, value, state}` or `{:error, %VllmBridge.Error{}}`."
  @spec patch(t(), PB.StreamPatch.t()) :: {:ok, PB.Value.t(), t()} | {:error, Error.t()}
  def patch(%__MODULE__{value: nil}, %PB.StreamPatch{}),
    do: {:error, misfit("stream", "a whole value before the first patch", "a patch")}

  def patch(%__MODULE__{value: root} = state, %PB.StreamPatch{ops: ops}) do
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
    |> case do
      {:ok, value} -> {:ok, value, %{state | value: value, decoded: nil}}
      {:error, _} = err -> err
    end
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
