defmodule VllmBridge.Codec do
  @moduledoc """
  Elixir terms <-> `vllm_bridge.v1.Value`.

  | Elixir | wire | Python |
  | --- | --- | --- |
  | `nil`, `true`, `false` | null, bool | `None`, `True`, `False` |
  | integer (any size) | int / big_int | `int` |
  | float, `:infinity`, `:neg_infinity`, `:nan` | float | `float` (inf, -inf, nan) |
  | UTF-8 binary | str | `str` |
  | `%VllmBridge.Bytes{}`, or a binary that is not UTF-8 | bytes | `bytes` |
  | other atom | atom | `str` |
  | list, tuple | list, tuple | `list`, `tuple` |
  | `MapSet`, `%VllmBridge.FrozenSet{}` | set, frozenset | `set`, `frozenset` |
  | map (keys of any kind) | map | `dict` |
  | `%VllmBridge.Tensor{}`, `Nx.Tensor` | tensor | `torch.Tensor` |
  | `%VllmBridge.Ref{}` | ref | the object it names |
  | `%VllmBridge.Record{}`, `%VllmBridge.PyEnum{}` | record, enum | dataclass/record, enum member |

  Decoding is the inverse, so whatever Python sends comes back unchanged when sent again. The
  three float atoms mean floats: the atoms `:infinity`, `:neg_infinity` and `:nan` cannot be sent
  as atoms.
  """

  alias VllmBridge.V1, as: PB
  alias VllmBridge.{Bytes, FrozenSet, PyEnum, Record, Ref, Tensor}

  @typedoc "A `vllm_bridge.v1.Value` message (`bridge.proto`), as the generated protobuf module's struct."
  @type wire :: %{:__struct__ => PB.Value, optional(atom()) => term()}

  @min_int -0x8000000000000000
  @max_int 0x7FFFFFFFFFFFFFFF

  @doc "Encodes a term; also returns the ids of the refs inside it (for `x-bridge-refs`)."
  @spec encode(term()) :: {wire(), [String.t()]}
  def encode(term) do
    {value, refs} = enc(term, [])
    {value, Enum.reverse(refs)}
  end

  defp v(kind), do: %PB.Value{kind: kind}

  defp enc(nil, acc), do: {v({:null, %PB.Null{}}), acc}
  defp enc(b, acc) when is_boolean(b), do: {v({:bool, b}), acc}
  defp enc(i, acc) when is_integer(i) and i >= @min_int and i <= @max_int, do: {v({:int, i}), acc}
  defp enc(i, acc) when is_integer(i), do: {v({:big_int, Integer.to_string(i)}), acc}
  defp enc(f, acc) when is_float(f), do: {v({:float, f}), acc}
  defp enc(:infinity, acc), do: {v({:float, :infinity}), acc}
  defp enc(:neg_infinity, acc), do: {v({:float, :negative_infinity}), acc}
  defp enc(:nan, acc), do: {v({:float, :nan}), acc}
  defp enc(a, acc) when is_atom(a), do: {v({:atom, Atom.to_string(a)}), acc}

  defp enc(s, acc) when is_binary(s) do
    if String.valid?(s), do: {v({:str, s}), acc}, else: {v({:bytes, s}), acc}
  end

  defp enc(list, acc) when is_list(list), do: items(:list, list, acc)
  defp enc(tuple, acc) when is_tuple(tuple), do: items(:tuple, Tuple.to_list(tuple), acc)
  defp enc(%MapSet{} = set, acc), do: items(:set, MapSet.to_list(set), acc)
  defp enc(%FrozenSet{set: set}, acc), do: items(:frozenset, MapSet.to_list(set), acc)
  defp enc(%Bytes{data: data}, acc), do: {v({:bytes, data}), acc}

  defp enc(%Ref{} = r, acc) do
    ref = %PB.Ref{id: r.id, session_id: r.session_id, worker_id: r.worker_id, type_name: r.type_name, repr: r.repr}
    {v({:ref, ref}), [r.id | acc]}
  end

  defp enc(%Tensor{dtype: dtype, shape: shape, data: data}, acc),
    do: {v({:tensor, %PB.Tensor{dtype: to_string(dtype), shape: shape, data: data}}), acc}

  defp enc(%{__struct__: Nx.Tensor} = t, acc), do: enc(Tensor.from_nx(t), acc)

  defp enc(%PyEnum{type_name: type, name: name, value: value}, acc) do
    {val, acc} = enc(value, acc)
    {v({:enum, %PB.Enum{type_name: type, name: name, value: val}}), acc}
  end

  defp enc(%Record{type_name: type, fields: fields}, acc) do
    {fields, acc} =
      Enum.map_reduce(fields, acc, fn {name, value}, acc ->
        {val, acc} = enc(value, acc)
        {%PB.Field{name: to_string(name), value: val}, acc}
      end)

    {v({:record, %PB.Record{type_name: type, fields: fields}}), acc}
  end

  defp enc(%{__struct__: mod}, _acc) do
    raise ArgumentError,
          "cannot send a #{inspect(mod)} struct: use a plain map, a VllmBridge.Record or a ref"
  end

  defp enc(map, acc) when is_map(map) do
    {entries, acc} =
      Enum.map_reduce(map, acc, fn {k, val}, acc ->
        {key, acc} = enc(k, acc)
        {value, acc} = enc(val, acc)
        {%PB.Entry{key: key, value: value}, acc}
      end)

    {v({:map, %PB.Map{entries: entries}}), acc}
  end

  defp enc(other, _acc), do: raise(ArgumentError, "cannot send #{inspect(other)} to Python")

  defp items(kind, list, acc) do
    {items, acc} = Enum.map_reduce(list, acc, &enc/2)
    {v({kind, %PB.Items{items: items}}), acc}
  end

  @doc """
  Decodes a wire value into the Elixir term it stands for.

  Options: `:server`, the server the value came from (recorded in the refs it holds, so calls on
  them go back there); `:tensors`, `:struct` (default: `%VllmBridge.Tensor{}`) or `:nx`
  (`Nx.Tensor`s, for the dtypes Nx has; others stay `%VllmBridge.Tensor{}`).

  A value that stands for nothing (no kind set, or absent where one is due) or a `big_int` that is
  not an integer raises `ArgumentError`, which names it: no server sends one (`nil` is `null`), so it
  is a fault to report, not a `nil` to pass on.
  """
  @spec decode(wire() | nil, keyword()) :: term()
  def decode(value, opts \\ [])
  def decode(nil, _opts), do: empty()
  def decode(%PB.Value{kind: kind}, []), do: dec(kind, {nil, false})
  def decode(%PB.Value{kind: kind}, opts), do: dec(kind, {opts[:server], opts[:tensors] == :nx})

  @doc """
  `decode/2` as a result: `{:ok, term}`, or `{:error, %VllmBridge.Error{}}` (status `:internal`) for a
  value that cannot be decoded.
  """
  @spec decoded(wire() | nil, keyword()) :: {:ok, term()} | {:error, VllmBridge.Error.t()}
  def decoded(value, opts \\ []) do
    {:ok, decode(value, opts)}
  rescue
    e in ArgumentError ->
      {:error, VllmBridge.Error.local(:internal, "codec", "the server sent #{Exception.message(e)}")}
  end

  defp d(nil, _ctx), do: empty()
  defp d(%PB.Value{kind: kind}, ctx), do: dec(kind, ctx)

  defp empty, do: raise(ArgumentError, "an empty Value (no kind set)")

  defp dec(nil, _), do: empty()
  defp dec({:null, _}, _), do: nil
  defp dec({:bool, b}, _), do: b
  defp dec({:int, i}, _), do: i

  defp dec({:big_int, s}, _) do
    case Integer.parse(s) do
      {i, ""} -> i
      _ -> raise ArgumentError, "a big_int that is not an integer: #{inspect(String.slice(s, 0, 40))}"
    end
  end

  defp dec({:float, :negative_infinity}, _), do: :neg_infinity
  defp dec({:float, f}, _), do: f
  defp dec({:str, s}, _), do: s
  defp dec({:bytes, b}, _), do: %Bytes{data: b}
  defp dec({:list, %{items: items}}, ctx), do: Enum.map(items, &d(&1, ctx))
  defp dec({:ints, %{values: values}}, _), do: values
  defp dec({:tuple, %{items: items}}, ctx), do: items |> Enum.map(&d(&1, ctx)) |> List.to_tuple()
  defp dec({:set, %{items: items}}, ctx), do: items |> Enum.map(&d(&1, ctx)) |> MapSet.new()
  defp dec({:frozenset, %{items: items}}, ctx), do: %FrozenSet{set: items |> Enum.map(&d(&1, ctx)) |> MapSet.new()}
  defp dec({:map, %{entries: entries}}, ctx), do: Map.new(entries, &{d(&1.key, ctx), d(&1.value, ctx)})
  # Atoms are never collected: only one the application already has comes back as an atom, so a
  # server (or what it relays) cannot fill the atom table; any other name stays a string.
  defp dec({:atom, a}, _) do
    String.to_existing_atom(a)
  rescue
    ArgumentError -> a
  end

  defp dec({:tensor, t}, {_, false}), do: %Tensor{dtype: t.dtype, shape: t.shape, data: t.data}
  defp dec({:tensor, t}, {_, true}), do: Tensor.maybe_nx(%Tensor{dtype: t.dtype, shape: t.shape, data: t.data})

  defp dec({:ref, r}, {server, _}),
    do: %Ref{
      id: r.id,
      session_id: r.session_id,
      worker_id: r.worker_id,
      type_name: r.type_name,
      repr: r.repr,
      server: server
    }

  defp dec({:record, r}, ctx),
    do: %Record{type_name: r.type_name, fields: Enum.map(r.fields, &{&1.name, d(&1.value, ctx)})}

  # (an enum's value is optional: a member may travel by its name alone)
  defp dec({:enum, %{value: nil} = e}, _ctx), do: %PyEnum{type_name: e.type_name, name: e.name, value: nil}
  defp dec({:enum, e}, ctx), do: %PyEnum{type_name: e.type_name, name: e.name, value: d(e.value, ctx)}
end
