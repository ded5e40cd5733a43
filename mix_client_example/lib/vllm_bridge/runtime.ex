defmodule VllmBridge.Runtime do
  @moduledoc false
  # `__runtime__` options: validated (ArgumentError naming the option), merged over the defaults
  # (the server's `runtime:`, then the app's), and turned into gRPC metadata
  # (bridge_server/wire/options.py).

  alias VllmBridge.Config

  # option -> metadata key (bridge_server/wire/options.py); `timeout` is the call's deadline.
  @metadata [
    session_id: "x-bridge-session",
    timeout_profile: "x-bridge-timeout-profile",
    stream_timeout: "x-bridge-stream-timeout-ms",
    stream_interval: "x-bridge-stream-interval-ms",
    pool_name: "x-bridge-pool",
    affinity: "x-bridge-affinity",
    rank: "x-bridge-rank"
  ]
  # streams only: how their items travel (bridge.proto, StreamEncoding)
  @stream_metadata [
    stream_encoding: "x-bridge-stream-encoding",
    stream_tee: "x-bridge-stream-tee"
  ]
  # the protocol's STREAM_ENCODINGS: the ones this client can read. By default a stream asks for
  # patch-v2, then patch-v1 (the server takes the first it knows, else full: a server older than
  # patch-v2 sends patch-v1)
  @stream_encoding_default "patch-v2,patch-v1"
  @stream_encodings ~w(full patch-v1 patch-v2) ++ [@stream_encoding_default]
  # the protocol's PROFILES and AFFINITY_MODES
  @profiles ~w(default ml_inference batch_job streaming)
  @affinities ~w(hint strict_queue strict_fail_fast)
  # not sent as metadata: the deadline, which server, the transport of a stream, how tensors come back
  @local [:timeout, :server, :multiplex, :tensors]
  @keys @local ++ Keyword.keys(@metadata) ++ Keyword.keys(@stream_metadata)

  defstruct timeout: nil,
            timeout_profile: nil,
            stream_timeout: nil,
            stream_interval: nil,
            session_id: nil,
            pool_name: nil,
            affinity: nil,
            rank: nil,
            server: nil,
            multiplex: true,
            tensors: :struct,
            stream_encoding: @stream_encoding_default,
            stream_tee: false

  @type t :: %__MODULE__{
          timeout: pos_integer() | nil,
          timeout_profile: String.t() | nil,
          stream_timeout: pos_integer() | :infinity | nil,
          stream_interval: non_neg_integer() | nil,
          session_id: String.t() | nil,
          pool_name: String.t() | nil,
          affinity: String.t() | nil,
          rank: non_neg_integer() | nil,
          server: Config.server() | nil,
          multiplex: boolean(),
          tensors: :struct | :nx,
          stream_encoding: String.t(),
          stream_tee: boolean()
        }

  @doc "The option names `__runtime__` accepts."
  @spec keys() :: [atom()]
  def keys, do: @keys

  @doc """
  The options of a call: its own `__runtime__` over the server's and the app's defaults, and the
  server it goes to (`fallback` when no source names one: the server of the call's receiver ref).
  """
  @spec resolve!(keyword(), Config.server() | nil) ::
          {t(), {:ok, Config.Server.t()} | {:error, VllmBridge.Error.t()}}
  def resolve!(call, fallback \\ nil) do
    call = validate!(call, "__runtime__")
    app = validate!(Config.runtime_defaults(), "config :vllm_bridge, runtime:")
    server = Keyword.get(call, :server) || fallback || Keyword.get(app, :server)

    case Config.server(server) do
      {:ok, %Config.Server{} = s} ->
        own = validate!(s.runtime, "the runtime: of server #{inspect(s.key)}")
        {struct(__MODULE__, app |> Keyword.merge(own) |> Keyword.merge(call) |> Keyword.put(:server, s.key)), {:ok, s}}

      {:error, _} = err ->
        {struct(__MODULE__, Keyword.merge(app, call)), err}
    end
  end

  @doc "Validates a list of runtime options; returns them normalized (strings where the wire has strings)."
  @spec validate!(term(), String.t()) :: keyword()
  def validate!([], _where), do: []

  def validate!(opts, where) when is_list(opts) do
    unless Keyword.keyword?(opts), do: raise(ArgumentError, "#{where} must be a keyword list, got #{inspect(opts)}")
    Enum.map(opts, fn {k, v} -> {k, check!(k, v, where)} end)
  end

  def validate!(other, where), do: raise(ArgumentError, "#{where} must be a keyword list, got #{inspect(other)}")

  defp check!(:timeout, v, _) when (is_integer(v) and v > 0) or v == :infinity, do: if(v == :infinity, do: nil, else: v)
  defp check!(:timeout, v, w), do: bad!(w, :timeout, "a positive integer (ms) or :infinity", v)
  defp check!(:stream_timeout, v, _) when (is_integer(v) and v > 0) or v == :infinity, do: v
  defp check!(:stream_timeout, v, w), do: bad!(w, :stream_timeout, "a positive integer (ms) or :infinity", v)
  defp check!(:stream_interval, v, _) when is_integer(v) and v >= 0, do: v
  defp check!(:stream_interval, v, w), do: bad!(w, :stream_interval, "a non-negative integer (ms)", v)
  defp check!(:rank, v, _) when is_integer(v) and v >= 0, do: v
  defp check!(:rank, v, w), do: bad!(w, :rank, "a non-negative integer", v)
  defp check!(:multiplex, v, _) when is_boolean(v), do: v
  defp check!(:multiplex, v, w), do: bad!(w, :multiplex, "true or false", v)
  defp check!(:stream_encoding, :patch_v2, _), do: "patch-v2"
  defp check!(:stream_encoding, :patch_v1, _), do: "patch-v1"
  defp check!(:stream_encoding, v, _) when v in @stream_encodings, do: v
  defp check!(:stream_encoding, :full, _), do: "full"
  defp check!(:stream_encoding, v, w), do: bad!(w, :stream_encoding, ":patch_v2, :patch_v1 or :full", v)
  defp check!(:stream_tee, v, _) when is_boolean(v), do: v
  defp check!(:stream_tee, v, w), do: bad!(w, :stream_tee, "true or false", v)
  defp check!(:tensors, :struct, _), do: :struct

  defp check!(:tensors, :nx, w) do
    if Code.ensure_loaded?(Nx),
      do: :nx,
      else: raise(ArgumentError, "#{w}: option :tensors is :nx, but Nx is not loaded: add {:nx, ...} to your deps")
  end

  defp check!(:tensors, v, w), do: bad!(w, :tensors, ":struct or :nx", v)
  defp check!(:timeout_profile, v, w), do: one_of!(:timeout_profile, v, @profiles, w)
  defp check!(:affinity, v, w), do: one_of!(:affinity, v, @affinities, w)
  defp check!(:session_id, v, w), do: name!(:session_id, v, w)
  defp check!(:pool_name, v, w), do: name!(:pool_name, v, w)

  defp check!(:server, v, w) do
    if (is_atom(v) and v not in [nil, true, false]) or (is_binary(v) and v != ""),
      do: v,
      else: bad!(w, :server, "a server name (atom) or an address (string)", v)
  end

  defp check!(k, _v, w), do: raise(ArgumentError, "#{w}: unknown option #{inspect(k)}; known: #{inspect(@keys)}")

  defp one_of!(k, v, allowed, w) do
    s = if is_atom(v) and v not in [nil, true, false], do: Atom.to_string(v), else: v
    if s in allowed, do: s, else: bad!(w, k, "one of #{Enum.map_join(allowed, ", ", &":#{&1}")}", v)
  end

  defp name!(k, v, w) do
    cond do
      is_binary(v) and v != "" -> v
      is_atom(v) and v not in [nil, true, false] -> Atom.to_string(v)
      true -> bad!(w, k, "a non-empty string or an atom", v)
    end
  end

  defp bad!(where, key, expected, got),
    do: raise(ArgumentError, "#{where}: option #{inspect(key)}: expected #{expected}, got #{inspect(got)}")

  @doc "The call's gRPC metadata: its options (the session always) and the ids of the refs it uses."
  @spec metadata(t(), String.t(), [String.t()]) :: %{String.t() => String.t()}
  def metadata(%__MODULE__{} = rt, session, refs) do
    md =
      Enum.reduce(@metadata, %{}, fn
        {:session_id, key}, md ->
          Map.put(md, key, rt.session_id || session)

        {opt, key}, md ->
          case Map.fetch!(rt, opt) do
            nil -> md
            :infinity -> Map.put(md, key, "inf")
            v when is_integer(v) -> Map.put(md, key, Integer.to_string(v))
            v -> Map.put(md, key, v)
          end
      end)

    if refs == [], do: md, else: Map.put(md, "x-bridge-refs", Enum.join(refs, ","))
  end

  @doc """
  A stream's metadata: the call's, and how its items travel (`patch-v2,patch-v1`, the first the
  server knows, unless the options say `patch_v2`, `patch_v1` or `full`; with `stream_tee`, every
  item also whole right after it, to check the receiver).
  """
  @spec stream_metadata(t(), map()) :: %{String.t() => String.t()}
  def stream_metadata(%__MODULE__{} = rt, md) do
    md = Map.put(md, @stream_metadata[:stream_encoding], rt.stream_encoding)
    if rt.stream_tee, do: Map.put(md, @stream_metadata[:stream_tee], "1"), else: md
  end
end
