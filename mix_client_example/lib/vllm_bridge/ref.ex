defmodule VllmBridge.Ref do
  @moduledoc """
  A handle to a Python object that stays in the worker that made it.

  A ref is plain data: send it to another process, store it, pass it back as an argument or as the
  receiver of a method. Any session that presents a ref may use it; it lives until it is released
  (`VllmBridge.release/2`), its session is released, or the server evicts it. A ref whose object is
  gone fails with category `"ref"` and a message that says why.

  `server` is the server that made it (see `VllmBridge.Config`): a call on the ref goes there
  unless its `__runtime__` names another server. It is not sent to Python.
  """

  @enforce_keys [:id]
  defstruct [:id, session_id: "", worker_id: "", type_name: "", repr: "", server: nil]

  @type t :: %__MODULE__{
          id: String.t(),
          session_id: String.t(),
          worker_id: String.t(),
          type_name: String.t(),
          repr: String.t(),
          server: atom() | String.t() | nil
        }

  defimpl Inspect do
    def inspect(ref, _opts), do: "#VllmBridge.Ref<#{ref.type_name} #{ref.id}>"
  end
end

defmodule VllmBridge.Bytes do
  @moduledoc """
  Python `bytes`. Elixir strings (UTF-8 binaries) go to Python as `str`; wrap a binary in this
  struct (`VllmBridge.bytes/1`) to send `bytes`. A binary that is not valid UTF-8 is sent as
  `bytes` anyway, and Python `bytes` always come back as this struct, so a round trip never turns
  one into the other.
  """
  @enforce_keys [:data]
  defstruct [:data]
  @type t :: %__MODULE__{data: binary()}
end

defmodule VllmBridge.FrozenSet do
  @moduledoc "A Python `frozenset` (a `MapSet` is a Python `set`)."
  defstruct set: MapSet.new()
  @type t :: %__MODULE__{set: MapSet.t()}
end

defmodule VllmBridge.PyEnum do
  @moduledoc """
  A member of a Python enum, e.g. `%VllmBridge.PyEnum{type_name: "vllm.config.compilation.CUDAGraphMode",
  name: "NONE", value: 0}`. Sent back as it came, the server rebuilds the member by name.
  """
  @enforce_keys [:type_name, :name]
  defstruct [:type_name, :name, value: nil]
  @type t :: %__MODULE__{type_name: String.t(), name: String.t(), value: term()}
end

defmodule VllmBridge.Record do
  @moduledoc """
  A Python record sent by value (a dataclass, named tuple, msgspec struct, pydantic model, vLLM's
  `RequestOutput`...): its qualified type name and its fields in declaration order.

  Fields can be read with `Access`, by string or atom name: `output[:outputs]`,
  `get_in(output, [:outputs, Access.at(0), :text])`.
  """
  @enforce_keys [:type_name]
  defstruct [:type_name, fields: []]
  @type t :: %__MODULE__{type_name: String.t(), fields: [{String.t(), term()}]}

  @behaviour Access

  @impl Access
  def fetch(%__MODULE__{fields: fields}, key) do
    name = to_string(key)

    case List.keyfind(fields, name, 0) do
      {^name, value} -> {:ok, value}
      nil -> :error
    end
  end

  @impl Access
  def get_and_update(%__MODULE__{fields: fields} = rec, key, fun) do
    name = to_string(key)

    current =
      case List.keyfind(fields, name, 0),
        do: (
          {_, v} -> v
          nil -> nil
        )

    case fun.(current) do
      {get, new} -> {get, %{rec | fields: List.keystore(fields, name, 0, {name, new})}}
      :pop -> {current, %{rec | fields: List.keydelete(fields, name, 0)}}
    end
  end

  @impl Access
  def pop(%__MODULE__{fields: fields} = rec, key) do
    name = to_string(key)
    {Access.get(rec, key), %{rec | fields: List.keydelete(fields, name, 0)}}
  end

  @doc "The fields as a map with string keys."
  @spec to_map(t()) :: %{String.t() => term()}
  def to_map(%__MODULE__{fields: fields}), do: Map.new(fields)
end
