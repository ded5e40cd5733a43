defmodule VllmBridge do
  @moduledoc """
  Elixir client for vllm-bridge, a gRPC server that drives vLLM.

  The documented bindings are generated modules: `Vllm.ForwardContext.Module`,
  `Vllm.Distributed`, `Vllm.ForwardContext.DPMetadata` and `Vllm.AsyncLLMEngine`. Every function
  returns `{:ok, value}` or `{:error, %VllmBridge.Error{}}` and takes a trailing keyword list:
  `__runtime__: [...]` holds runtime options, every other keyword is a Python keyword argument.

  ## Runtime options

  | `__runtime__` option | meaning | sent as |
  | --- | --- | --- |
  | `timeout` | ms for the call (a positive integer), or `:infinity`: no deadline, the profile applies | the gRPC deadline |
  | `timeout_profile` | `:default` 120 s, `:ml_inference` 600 s, `:batch_job` unlimited, `:streaming` 120 s | `x-bridge-timeout-profile` |
  | `stream_timeout` | ms allowed between two stream items (or `:infinity`) | `x-bridge-stream-timeout-ms` |
  | `stream_interval` | ms: coalesce a stream to at most one item per interval (vLLM merges the outputs in between) | `x-bridge-stream-interval-ms` |
  | `session_id` | the session that owns the refs the call makes | `x-bridge-session` |
  | `pool_name` | which pool serves the call | `x-bridge-pool` |
  | `affinity` | `:hint`, `:strict_queue`, `:strict_fail_fast` | `x-bridge-affinity` |
  | `rank` | the worker slot of a pool that runs a ref-free call | `x-bridge-rank` |
  | `server` | which server: a name or an address (`VllmBridge.Config`) | - |
  | `multiplex` | streams only: `true` (default) shares the server's `Multiplex` stream, `false` makes a gRPC call | - |
  | `tensors` | `:struct` (default): tensors arrive as `%VllmBridge.Tensor{}`; `:nx`: as `Nx.Tensor` (needs Nx) | - |
  | `stream_encoding` | streams only: by default (`"patch-v2,patch-v1"`) items travel as patches against the item before (`VllmBridge.StreamState`), as `patch-v2` (with rows) or, from a server older than it, `patch-v1`; `:patch_v2` or `:patch_v1` asks for that one alone, `:full` each item whole; the same values either way | `x-bridge-stream-encoding` |
  | `stream_tee` | streams only, for checking the receiver: `true` has the server send every item twice, rebuilt from its patch and then whole, so the stream yields each item twice | `x-bridge-stream-tee` |

  Names (`session_id`, `pool_name`) may be strings or atoms. A malformed or unknown option raises
  `ArgumentError` naming it, before anything is sent. Defaults for every call come from
  `config :vllm_bridge, runtime: [...]` and a server's own `runtime:` (`VllmBridge.Config`); the
  call's options win.

  Without `timeout` no deadline is sent and the server applies the profile (its own deadlines
  cancel the Python work). Without `session_id` the call runs under the calling process's own
  session (`session_id/0`), released when the process exits (see `VllmBridge.Sessions`).

  ## Servers

  Calls go to the `:default` server (`config :vllm_bridge, address:`, else `$VLLM_BRIDGE_ADDRESS`,
  else `127.0.0.1:50051`), to the one a `VllmBridge.Server` child in the application's supervision
  tree runs, or to any other configured one; see `VllmBridge.Config` (tokens, TLS, keepalive) and
  `VllmBridge.Server`.

  ## Generic operations

  This module has what the documents do not name: members of any ref (`call_method/4`,
  `get_attr/3`, `set_attr/4`), context managers (`with_context/3`), constructors and functions by
  catalog name, releasing refs and sessions, and the catalog. A receiver is a `VllmBridge.Ref` or
  the name of an object the server published (`"engine"` or `:engine`).
  """

  alias VllmBridge.{Client, Error, Ref}

  @typedoc "What a method is called on: a ref, or the name of a published object (`\"engine\"`, `:engine`)."
  @type receiver :: Ref.t() | String.t() | atom()
  @typedoc "The result of every call."
  @type result(t) :: {:ok, t} | {:error, Error.t()}

  @doc "Calls a catalog function or classmethod by name: `call(\"vllm.distributed.divide\", [6, 3])`."
  @spec call(String.t(), list(), keyword()) :: result(term())
  def call(name, args \\ [], opts \\ []), do: Client.call({:function, name}, args, opts)

  @doc "Builds an instance of a catalog class and returns its ref: `new(\"vllm.SamplingParams\", [], max_tokens: 8)`."
  @spec new(String.t(), list(), keyword()) :: result(Ref.t())
  def new(class, args \\ [], opts \\ []), do: Client.call({:constructor, class}, args, opts)

  @doc "Calls a method of a ref, or of an object the server published by name (`\"engine\"` or `:engine`)."
  @spec call_method(receiver(), String.t(), list(), keyword()) :: result(term())
  def call_method(receiver, name, args \\ [], opts \\ []), do: Client.call({:method, receiver, name}, args, opts)

  @doc "Reads an attribute of a ref or published object."
  @spec get_attr(receiver(), String.t(), keyword()) :: result(term())
  def get_attr(receiver, name, opts \\ []), do: Client.call({:get_attr, receiver, name}, [], opts)

  @doc "Sets an attribute of a ref or published object."
  @spec set_attr(receiver(), String.t(), term(), keyword()) :: result(nil)
  def set_attr(receiver, name, value, opts \\ []), do: Client.call({:set_attr, receiver, name}, [value], opts)

  @doc "Streams the items of an iterator or generator ref (a lazy `Stream`, like `generate`)."
  @spec iterate(receiver(), keyword()) :: result(Enumerable.t())
  def iterate(receiver, opts \\ []), do: Client.stream({:iterate, receiver}, [], opts)

  @doc """
  Runs `fun` inside a Python context manager: calls `__enter__` on `cm` (a ref, e.g. the result
  of `Vllm.ForwardContext.Module.set_forward_context/3`), passes what it returned to `fun`, and
  always calls `__exit__` afterwards, even if `fun` raises. Returns `{:ok, fun_result}`.
  """
  @spec with_context(Ref.t(), (term() -> result), keyword()) :: {:ok, result} | {:error, Error.t()} when result: term()
  def with_context(cm, fun, opts \\ []) do
    with {:ok, entered} <- call_method(cm, "__enter__", [], opts) do
      try do
        {:ok, fun.(entered)}
      after
        call_method(cm, "__exit__", [], opts)
      end
    end
  end

  @doc """
  Runs a catalog function on every rank of a distributed pool at once (a lone worker is a group of
  one rank) and returns the results in rank order: `collective("vllm.distributed.get_tensor_model_parallel_rank")`.
  """
  @spec collective(String.t(), list(), keyword()) :: result([term()])
  def collective(name, args \\ [], opts \\ []), do: Client.collective({:function, name}, args, opts)

  @doc """
  Releases refs (their objects are freed on the server). Returns how many were live. Options:
  `__runtime__: [server: ..., timeout: ...]` (default: each ref's own server, 30 s; ids given as
  strings go to the default server).
  """
  @spec release(Ref.t() | [Ref.t() | String.t()], keyword()) :: result(non_neg_integer())
  def release(refs, opts \\ []) do
    refs
    |> List.wrap()
    |> Enum.group_by(fn
      %Ref{server: server} -> server
      _id -> nil
    end)
    |> Enum.reduce_while({:ok, 0}, fn {_server, group}, {:ok, n} ->
      case Client.release(group, "", opts) do
        {:ok, released} -> {:cont, {:ok, n + released}}
        {:error, _} = err -> {:halt, err}
      end
    end)
  end

  @doc "Releases every ref of a session. Options as for `release/2`."
  @spec release_session(String.t(), keyword()) :: result(non_neg_integer())
  def release_session(session, opts \\ []) when is_binary(session), do: Client.release([], session, opts)

  @typedoc """
  The server's catalog, the `vllm_bridge.v1.Catalog` message of `bridge.proto` as its generated
  struct: `entries` (each with `name`, `kind`, `parameters`, `return_type`, `streams`, `summary`,
  `documented_in`...), `vllm_version`, `bridge_version`.
  """
  @type catalog :: %{:__struct__ => VllmBridge.V1.Catalog, :entries => [struct()], optional(atom()) => term()}

  @doc """
  The server's catalog: what can be called, with parameters (`t:catalog/0`), optionally only the
  names starting with `prefix`. Options as for `release/2`.
  """
  @spec describe(String.t(), keyword()) :: result(catalog())
  def describe(prefix \\ "", opts \\ []), do: Client.describe(prefix, opts)

  @doc "The session the calling process uses by default."
  @spec session_id() :: String.t()
  defdelegate session_id(), to: Client

  @doc "The address of a server (`VllmBridge.Config`): by default, the one calls go to when they name none."
  @spec address(VllmBridge.Config.server() | nil) :: String.t()
  def address(server \\ nil) do
    case VllmBridge.Config.server(server) do
      {:ok, s} -> s.address
      {:error, e} -> raise e
    end
  end

  @doc "Marks a binary as Python `bytes` (plain binaries are `str`)."
  @spec bytes(binary()) :: VllmBridge.Bytes.t()
  def bytes(data) when is_binary(data), do: %VllmBridge.Bytes{data: data}
end

defmodule VllmBridge.Binding do
  @moduledoc false
  # What the generated `Vllm.*` functions call. They differ only in how their arguments are laid
  # out (the binding documents' conventions, kept so documented calls work as written), so the layouts are
  # resolved here once.

  alias VllmBridge.Client

  @doc false
  def invoke(mode, target, {args, opts}), do: invoke(mode, target, args, opts)

  @doc false
  def invoke(:call, target, args, opts), do: Client.call(target, args, opts)
  def invoke(:stream, target, args, opts), do: Client.stream(target, args, opts)

  @doc false
  # Module functions: an argument in an optional slot may instead be the trailing keyword list.
  def tail(args) do
    {init, [last]} = Enum.split(args, -1)
    if keyword?(last), do: {init, last}, else: {args, []}
  end

  @doc false
  # Class methods: `rest` is the list of optional positional arguments; a keyword list given there
  # (and no opts) is taken as the options, so `sleep(engine, level: 2)` works as expected.
  def rest(required, rest) when is_list(rest) do
    if rest != [] and keyword?(rest), do: {required, rest}, else: {required ++ rest, []}
  end

  @doc false
  # Classmethods are documented with a receiver: a ref (or published name) calls the method on that
  # object; a module (the class's own, as the documents write it) or nil calls it on the class.
  def classmethod(receiver, attr, _qualified) when is_binary(receiver) or is_struct(receiver, VllmBridge.Ref),
    do: {:method, receiver, attr}

  def classmethod(nil, _attr, qualified), do: {:function, qualified}

  def classmethod(receiver, attr, qualified) when is_atom(receiver) do
    case Atom.to_string(receiver) do
      "Elixir." <> _ -> {:function, qualified}
      _published -> {:method, receiver, attr}
    end
  end

  @doc false
  # A function documented to return an instance of its own class (`DPMetadata.make` returns
  # `Vllm.ForwardContext.DPMetadata.t()`, what `new` returns, usable with the other methods): the
  # server sends such a record (a dataclass) by value, so it is built into an instance from its
  # fields, under the same runtime options. A ref stays as it is.
  def instance({:ok, %VllmBridge.Record{type_name: class, fields: fields}}, class, opts) do
    runtime = if keyword?(opts), do: Keyword.get(opts, :__runtime__, []), else: []
    kwargs = Enum.map(fields, fn {name, value} -> {String.to_atom(name), value} end)
    Client.call({:constructor, class}, [], kwargs ++ [__runtime__: runtime])
  end

  def instance(result, _class, _opts), do: result

  defp keyword?(list), do: is_list(list) and Keyword.keyword?(list)
end
