defmodule VllmBridge.Tensor do
  @moduledoc """
  A dense tensor by value: `dtype` as torch names it without the prefix (`"float32"`, `"int64"`,
  `"bool"`, `"bfloat16"`, ...), `shape`, and `data`, the C-contiguous little-endian bytes.
  Arrives in Python as a `torch.Tensor` and comes back as this struct.

  `Nx.Tensor`s may be passed wherever a value is expected when Nx is loaded (it is an optional
  dependency: add `{:nx, ...}` to your own project); `to_nx/1` converts a result back, and
  `__runtime__: [tensors: :nx]` (or `config :vllm_bridge, runtime: [tensors: :nx]`) makes results
  arrive as `Nx.Tensor`s. Dtypes Nx does not have (`bool`, the float8 types) stay
  `%VllmBridge.Tensor{}` there, so that they go back to Python unchanged.
  """

  @enforce_keys [:dtype, :shape, :data]
  defstruct [:dtype, :shape, :data]
  @type t :: %__MODULE__{dtype: String.t(), shape: [non_neg_integer()], data: binary()}

  # dtype -> {kind, bits}: s signed, u unsigned, f float, bf bfloat, c complex, b bool
  @types %{
    "bool" => {:b, 8},
    "int8" => {:s, 8},
    "int16" => {:s, 16},
    "int32" => {:s, 32},
    "int64" => {:s, 64},
    "uint8" => {:u, 8},
    "uint16" => {:u, 16},
    "uint32" => {:u, 32},
    "uint64" => {:u, 64},
    "float16" => {:f, 16},
    "bfloat16" => {:bf, 16},
    "float32" => {:f, 32},
    "float64" => {:f, 64},
    "complex64" => {:c, 64},
    "complex128" => {:c, 128}
  }

  @doc """
  Builds a tensor from a (nested) list of numbers: `from_list([[1, 2], [3, 4]], :int64)`.
  Supports the integer, `float32`/`float64` and `bool` dtypes.
  """
  @spec from_list(list() | number() | boolean(), atom() | String.t()) :: t()
  def from_list(values, dtype) do
    dtype = to_string(dtype)
    shape = shape_of(values)
    data = values |> List.wrap() |> List.flatten() |> Enum.map(&pack(&1, dtype)) |> IO.iodata_to_binary()
    %__MODULE__{dtype: dtype, shape: shape, data: data}
  end

  @doc "The elements as a nested list (the inverse of `from_list/2`)."
  @spec to_list(t()) :: list() | number() | boolean()
  def to_list(%__MODULE__{dtype: dtype, shape: shape, data: data}) do
    {_, bits} = Map.fetch!(@types, dtype)
    flat = for <<chunk::binary-size(div(bits, 8)) <- data>>, do: unpack(chunk, dtype)
    nest(flat, shape)
  end

  @doc "Converts an `Nx.Tensor` (`bool` is not an Nx type: use `:u8` data and dtype \"bool\" yourself)."
  @spec from_nx(struct()) :: t()
  def from_nx(%{__struct__: Nx.Tensor} = t) do
    {kind, bits} = apply(Nx, :type, [t])
    dtype = Enum.find_value(@types, fn {name, type} -> if type == {kind, bits}, do: name end)
    dtype || raise ArgumentError, "Nx type #{inspect({kind, bits})} has no torch dtype"
    data = apply(Nx, :to_binary, [t])
    %__MODULE__{dtype: dtype, shape: Tuple.to_list(apply(Nx, :shape, [t])), data: little(data, bits, kind)}
  end

  @doc "Converts to an `Nx.Tensor` (needs Nx; `bool` becomes `{:u, 8}`)."
  @spec to_nx(t()) :: struct()
  def to_nx(%__MODULE__{dtype: dtype, shape: shape, data: data}) do
    unless Code.ensure_loaded?(Nx), do: raise(ArgumentError, "Nx is not loaded: add {:nx, ...} to your deps")

    type =
      case Map.fetch!(@types, dtype),
        do: (
          {:b, 8} -> {:u, 8}
          other -> other
        )

    {kind, bits} = type
    bin = little(data, bits, kind)
    apply(Nx, :reshape, [apply(Nx, :from_binary, [bin, type]), List.to_tuple(shape)])
  end

  @doc false
  # A result under `tensors: :nx`: an Nx.Tensor when Nx has the dtype, else unchanged.
  @spec maybe_nx(t()) :: t() | struct()
  def maybe_nx(%__MODULE__{dtype: dtype} = t) when dtype != "bool" and is_map_key(@types, dtype), do: to_nx(t)
  def maybe_nx(%__MODULE__{} = t), do: t

  # Nx stores native-endian bytes; torch and the wire are little-endian.
  @native_little <<1::16-native>> == <<1::16-little>>
  defp little(data, bits, kind) do
    size = if kind == :c, do: div(bits, 2), else: bits

    if @native_little or size == 8,
      do: data,
      else: for(<<x::size(size)-native <- data>>, into: <<>>, do: <<x::size(size)-little>>)
  end

  defp shape_of([first | _] = list), do: [length(list) | shape_of(first)]
  defp shape_of([]), do: [0]
  defp shape_of(_scalar), do: []

  defp pack(true, "bool"), do: <<1>>
  defp pack(false, "bool"), do: <<0>>
  defp pack(x, "float32"), do: <<x * 1.0::float-32-little>>
  defp pack(x, "float64"), do: <<x * 1.0::float-64-little>>

  defp pack(x, dtype) when is_integer(x) do
    case Map.fetch!(@types, dtype) do
      {:s, bits} -> <<x::signed-size(bits)-little>>
      {:u, bits} -> <<x::unsigned-size(bits)-little>>
      other -> raise ArgumentError, "from_list does not build #{dtype} (#{inspect(other)})"
    end
  end

  defp unpack(<<b>>, "bool"), do: b != 0
  defp unpack(<<x::float-32-little>>, "float32"), do: x
  defp unpack(<<x::float-64-little>>, "float64"), do: x

  defp unpack(chunk, dtype) do
    case Map.fetch!(@types, dtype) do
      {:s, bits} ->
        <<x::signed-size(bits)-little>> = chunk
        x

      {:u, bits} ->
        <<x::unsigned-size(bits)-little>> = chunk
        x

      _ ->
        chunk
    end
  end

  defp nest(flat, []), do: hd(flat)
  defp nest(flat, [_n]), do: flat

  defp nest(flat, [n | rest]) do
    size = Enum.reduce(rest, 1, &(&1 * &2))

    if size == 0,
      do: List.duplicate(nest([], rest), n),
      else: flat |> Enum.chunk_every(size) |> Enum.map(&nest(&1, rest))
  end
end
