defmodule VllmBridge.Transport do
  @moduledoc false
  # gRPC over HTTP/2 with gun, which the client owns: it opens its connections, sends requests and
  # reads replies itself, relying on no elixir-grpc internals (so any elixir-grpc version, or none,
  # can sit beside it in an application).
  #
  # A failure keeps everything the server said: the `grpc-status-details-bin` trailer becomes a
  # full `VllmBridge.Error` (Python type, message, traceback...); deadlines are sent to the
  # millisecond. Requests are made by the calling process, so replies go straight to it (gun sends
  # a stream's messages to the process that made the request); the connection is shared.

  alias VllmBridge.{Config, Error}

  # How much longer than the call's own deadline we wait: the server enforces deadlines and
  # answers DEADLINE_EXCEEDED itself, with a detail; this only covers a silent server.
  @grace_ms 5_000
  @user_agent "vllm-bridge-elixir/#{Mix.Project.config()[:version]}"

  defstruct [:conn, :ref, :mod, buffer: <<>>, wait: :infinity, state: :headers]

  @typedoc "A server stream being read: `next/1`, `cancel/1`."
  @type handle :: %__MODULE__{}

  # ------------------------------------------------------------------------------------ connections

  @doc """
  Opens an HTTP/2 connection to `server`, owned by the calling process (the connection closes when
  it exits). Returns the gun pid and the headers every request on it carries.
  """
  @spec open(Config.Server.t()) :: {:ok, pid(), [{String.t(), String.t()}]} | {:error, Error.t()}
  def open(%Config.Server{} = s) do
    with {:ok, headers} <- base_headers(s),
         {:ok, opts} <- gun_opts(s),
         {:ok, pid} <- start(s.endpoint, opts) do
      case :gun.await_up(pid, s.connect_timeout) do
        {:ok, :http2} ->
          {:ok, pid, headers}

        {:ok, other} ->
          :gun.close(pid)
          {:error, unavailable(s, "the server speaks #{other}, not HTTP/2")}

        {:error, reason} ->
          :gun.close(pid)
          {:error, unavailable(s, describe_down(reason))}
      end
    end
  end

  defp start({:tcp, host, port}, opts), do: wrap_start(:gun.open(host, port, opts))
  defp start({:unix, path}, opts), do: wrap_start(:gun.open_unix(String.to_charlist(path), opts))

  defp wrap_start({:ok, pid}), do: {:ok, pid}

  defp wrap_start({:error, reason}),
    do: {:error, Error.local(:unavailable, "grpc_error", "cannot connect: #{inspect(reason)}")}

  defp gun_opts(%Config.Server{} = s) do
    base = %{
      protocols: [:http2],
      retry: 0,
      connect_timeout: s.connect_timeout,
      # a gRPC call is HEADERS then DATA: without TCP_NODELAY, Nagle holds the second back ~40 ms
      tcp_opts: if(match?({:tcp, _, _}, s.endpoint), do: [nodelay: true], else: []),
      http2_opts: %{keepalive: s.keepalive, settings_timeout: :infinity}
    }

    case tls_opts(s) do
      nil -> {:ok, base}
      {:ok, tls} -> {:ok, Map.merge(base, %{transport: :tls, tls_opts: tls, tls_handshake_timeout: s.connect_timeout})}
      {:error, _} = err -> err
    end
  end

  defp tls_opts(%Config.Server{tls: false}), do: nil

  defp tls_opts(%Config.Server{tls: tls} = s) do
    opts = if tls == true, do: [], else: tls
    own = Keyword.drop(opts, [:cacertfile, :certfile, :keyfile, :server_name_indication])

    # gun adds ALPN (h2) and, for a host name, SNI; the certificate is checked against that name.
    # An IP address is no name: no SNI, and the certificate must carry the address (an IP SAN).
    sni =
      case {Keyword.get(opts, :server_name_indication), s.endpoint} do
        {nil, {:tcp, host, _}} ->
          case :inet.parse_address(host) do
            {:ok, ip} -> [server_name_indication: :disable, verify_fun: {&verify_ip/3, ip}]
            {:error, _} -> []
          end

        {nil, _} ->
          []

        {name, _} ->
          [server_name_indication: to_charlist(name)]
      end

    cas =
      case Keyword.get(opts, :cacertfile) do
        nil -> [cacerts: system_cacerts()]
        file -> [cacertfile: to_charlist(file)]
      end

    client =
      case {Keyword.get(opts, :certfile), Keyword.get(opts, :keyfile)} do
        {nil, nil} -> []
        {cert, key} -> [certfile: to_charlist(cert), keyfile: to_charlist(key)]
      end

    case for({k, f} <- cas ++ client, k != :cacerts, not File.regular?(f), do: "#{k} #{f}") do
      [] -> {:ok, Keyword.merge([verify: :verify_peer] ++ sni ++ cas ++ client, own)}
      missing -> {:error, unavailable(s, "tls: not a readable file: #{Enum.join(missing, ", ")}")}
    end
  end

  # The chain is checked as usual (a bad certificate fails); the peer's certificate must also name
  # the address connected to.
  @doc false
  def verify_ip(_cert, {:bad_cert, _} = reason, _ip), do: {:fail, reason}
  def verify_ip(_cert, {:extension, _}, ip), do: {:unknown, ip}
  def verify_ip(_cert, :valid, ip), do: {:valid, ip}

  def verify_ip(cert, :valid_peer, ip) do
    if :public_key.pkix_verify_hostname(cert, ip: ip),
      do: {:valid, ip},
      else: {:fail, {:bad_cert, :hostname_check_failed}}
  end

  # OTP 25+ reads the system's CA store; no bundled certificates.
  defp system_cacerts do
    if function_exported?(:public_key, :cacerts_get, 0), do: apply(:public_key, :cacerts_get, []), else: []
  end

  defp base_headers(%Config.Server{} = s) do
    common = [{"content-type", "application/grpc"}, {"te", "trailers"}, {"user-agent", @user_agent}]

    case s.token do
      nil ->
        {:ok, common}

      {:token, token} ->
        {:ok, [{"authorization", "Bearer " <> token} | common]}

      {:file, path} ->
        case File.read(path) do
          {:ok, text} ->
            {:ok, [{"authorization", "Bearer " <> String.trim(text)} | common]}

          {:error, reason} ->
            {:error, unavailable(s, "cannot read the token file #{path}: #{:file.format_error(reason)}")}
        end
    end
  end

  defp unavailable(s, why), do: Error.local(:unavailable, "grpc_error", "cannot connect to #{s.address}: #{why}")

  defp describe_down({:down, {:shutdown, reason}}), do: describe_reason(reason)
  defp describe_down({:down, reason}), do: describe_reason(reason)
  defp describe_down({:shutdown, reason}), do: describe_reason(reason)
  defp describe_down(:timeout), do: "timed out"
  defp describe_down(reason), do: describe_reason(reason)

  defp describe_reason(reason) when is_atom(reason), do: "#{:inet.format_error(reason)} (#{reason})"
  defp describe_reason(reason), do: inspect(reason)

  # ------------------------------------------------------------------------------------ requests

  @doc """
  A unary call: `{:ok, reply}` or `{:error, %VllmBridge.Error{}}`. `timeout` (ms, or nil for
  none) is sent as the call's deadline.
  """
  @spec unary({pid(), list()}, String.t(), iodata(), module(), map(), pos_integer() | nil) ::
          {:ok, struct()} | {:error, Error.t()}
  def unary({pid, base}, path, body, reply_mod, metadata, timeout) do
    ref = :gun.post(pid, path, headers(base, metadata, timeout), frame(body))
    h = %__MODULE__{conn: pid, ref: ref, mod: reply_mod, wait: wait_ms(timeout)}

    case await(h) do
      {:response, :nofin, _headers} ->
        unary_body(h, [])

      {:response, :fin, headers} ->
        with :ok <- status(headers), do: {:error, Error.local(:internal, "grpc_error", "empty reply")}

      {:error, _} = err ->
        err
    end
  end

  @doc """
  Starts a server-streaming call and returns its handle at once; `next/1` reads the items.
  `idle` is how long `next/1` waits for each message (ms or `:infinity`).
  """
  @spec open_stream({pid(), list()}, String.t(), iodata(), module(), map(), pos_integer() | nil, timeout()) :: handle()
  def open_stream({pid, base}, path, body, reply_mod, metadata, timeout, idle) do
    ref = :gun.post(pid, path, headers(base, metadata, timeout), frame(body))
    %__MODULE__{conn: pid, ref: ref, mod: reply_mod, wait: idle}
  end

  @doc "The next message of a server stream: `{:ok, msg, handle}`, `:done`, or `{:error, %VllmBridge.Error{}}`."
  @spec next(handle()) :: {:ok, struct(), handle()} | :done | {:error, Error.t()}
  def next(%__MODULE__{state: :done}), do: :done

  def next(%__MODULE__{state: :headers} = h) do
    case await(h) do
      {:response, :nofin, _headers} -> next(%{h | state: :data})
      {:response, :fin, headers} -> with :ok <- status(headers), do: :done
      {:error, _} = err -> err
    end
  end

  def next(%__MODULE__{buffer: buffer} = h) do
    case buffer do
      <<_flag, size::32, msg::binary-size(size), rest::binary>> ->
        case decode(h.mod, msg) do
          {:ok, msg} ->
            {:ok, msg, %{h | buffer: rest}}

          {:error, _} = err ->
            drop(h)
            err
        end

      _ ->
        case read(h, [buffer], byte_size(buffer), needed(buffer)) do
          {:data, buffer} -> next(%{h | buffer: buffer})
          {:trailers, trailers} -> with :ok <- status(trailers), do: :done
          {:error, _} = err -> err
        end
    end
  end

  defp decode(mod, msg) do
    {:ok, mod.decode(msg)}
  rescue
    e -> {:error, Error.local(:internal, "grpc_error", "an unreadable #{inspect(mod)}: #{Exception.message(e)}")}
  end

  @doc "Cancels a call (RST_STREAM CANCEL; the server stops the Python work) and drops what it sent."
  @spec cancel(handle()) :: :ok
  def cancel(%__MODULE__{} = h), do: drop(h)

  defp drop(%__MODULE__{conn: pid, ref: ref}) do
    :gun.cancel(pid, ref)
    :gun.flush(ref)
    :ok
  end

  @doc false
  def frame(body) do
    size = IO.iodata_length(body)
    [<<0, size::32>>, body]
  end

  defp headers(base, metadata, timeout) do
    base ++ deadline(timeout) ++ Enum.map(metadata, fn {k, v} -> {k, v} end)
  end

  # Frames are at most 16 KiB: collect them as iodata and join once, so a large message (a tensor)
  # costs one copy, not one per frame.
  defp needed(<<_flag, size::32, _::binary>>), do: 5 + size
  defp needed(_), do: 5

  defp read(_h, acc, have, need) when have >= need, do: {:data, acc |> Enum.reverse() |> IO.iodata_to_binary()}

  defp read(h, acc, have, need) do
    case await(h) do
      {:data, data} ->
        read(h, [data | acc], have + byte_size(data), need)

      {:trailers, _} = t ->
        if have == 0, do: t, else: {:error, Error.local(:internal, "grpc_error", "truncated message")}

      other ->
        other
    end
  end

  defp unary_body(h, acc) do
    case await(h) do
      {:data, data} ->
        unary_body(h, [data | acc])

      {:trailers, trailers} ->
        with :ok <- status(trailers) do
          case acc |> Enum.reverse() |> IO.iodata_to_binary() do
            <<_flag, size::32, msg::binary-size(size), _::binary>> -> {:ok, h.mod.decode(msg)}
            _ -> {:error, Error.local(:internal, "grpc_error", "malformed reply")}
          end
        end

      {:error, _} = err ->
        err
    end
  end

  defp await(%__MODULE__{conn: conn, ref: ref, wait: wait}) do
    case :gun.await(conn, ref, wait) do
      {:response, fin, 200, headers} ->
        {:response, fin, headers}

      {:response, _, code, headers} ->
        {:error, http_error(code, headers)}

      {:data, _fin, data} ->
        {:data, data}

      {:trailers, trailers} ->
        {:trailers, trailers}

      {:error, :timeout} ->
        # Nothing came within the deadline and its grace: stop the call, drop what may still come.
        drop(%__MODULE__{conn: conn, ref: ref})
        {:error, Error.local(:deadline_exceeded, "timeout", "no reply from the server in time")}

      {:error, {:stream_error, :closing}} ->
        {:error, closing()}

      {:error, reason} ->
        {:error, Error.local(:unavailable, "grpc_error", "connection: #{describe_down(reason)}")}

      other ->
        {:error, Error.local(:unknown, "grpc_error", "unexpected: #{inspect(other)}")}
    end
  end

  @doc false
  # A request made on a connection that is closing (the server sent GOAWAY: it is shutting down,
  # or it found the client's pings too frequent): gun refuses it without sending anything, so it
  # can be made again on a new connection.
  @spec closing() :: Error.t()
  def closing,
    do: Error.local(:unavailable, "grpc_error", "the connection is closing (GOAWAY)", reason: "connection closing")

  defp http_error(code, headers) do
    case status(headers) do
      {:error, %Error{} = e} -> e
      _ -> Error.local(:internal, "grpc_error", "HTTP status #{code}")
    end
  end

  @doc false
  # A trailers block (or trailers-only response): OK, or the error it describes.
  @spec status([{String.t(), String.t()}]) :: :ok | {:error, Error.t()}
  def status(headers) do
    map = Map.new(headers)

    case map["grpc-status"] do
      nil ->
        {:error, Error.local(:internal, "grpc_error", "reply without grpc-status")}

      "0" ->
        :ok

      code ->
        message = grpc_message(map["grpc-message"] || "")

        case Integer.parse(code) do
          {number, ""} when number in 1..16 ->
            {:error, Error.from_status(number, message, details(map))}

          _ ->
            {:error,
             Error.local(:unknown, "grpc_error", "grpc-status #{inspect(String.slice(code, 0, 20))}: #{message}")}
        end
    end
  end

  # grpc-message is percent-encoded; one that is not is shown as it came.
  defp grpc_message(text) do
    URI.decode(text)
  rescue
    ArgumentError -> text
  end

  defp details(%{"grpc-status-details-bin" => b64}) do
    case Base.decode64(b64, padding: false) do
      {:ok, bin} -> bin
      :error -> Base.decode64!(b64)
    end
  end

  defp details(_), do: nil

  # grpc-timeout allows at most 8 digits per unit.
  defp deadline(ms) when is_integer(ms) and ms < 100_000_000, do: [{"grpc-timeout", "#{ms}m"}]
  defp deadline(ms) when is_integer(ms), do: [{"grpc-timeout", "#{div(ms, 1000)}S"}]
  defp deadline(_), do: []

  @doc "How long to wait for the next frame, given the call's timeout or idle timeout in ms."
  @spec wait_ms(term()) :: timeout()
  def wait_ms(ms) when is_integer(ms), do: ms + @grace_ms
  def wait_ms(_), do: :infinity
end
