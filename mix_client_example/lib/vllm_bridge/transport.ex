defmodule VllmBridge.Transport do
  @moduledoc """
  The gRPC client adapter: `GRPC.Client.Adapters.Gun` (connecting, cancelling), except that it
  sends requests and reads responses itself.

  Why not the stock adapter, in grpc 0.9: it drops the trailers of a failed call, and with them the
  `grpc-status-details-bin` value that carries the server's `ErrorDetail` (Python type, message,
  traceback...); and it rounds deadlines down to whole seconds or minutes (`timeout: 1500` is sent
  as `grpc-timeout: 1S`, `90_000` as `1M`). Here a deadline is sent to the millisecond, a failure
  becomes a full `VllmBridge.Error`, and a server stream is returned as a pull handle (`next/1`,
  `cancel_handle/1`) that `VllmBridge.Client` turns into a lazy `Stream`.
  """

  @behaviour GRPC.Client.Adapter

  alias GRPC.Client.Adapters.Gun, as: Stock
  alias VllmBridge.Error

  # How much longer than the call's own deadline we wait: the server enforces deadlines and
  # answers DEADLINE_EXCEEDED itself, with a detail; this only covers a silent server.
  @grace_ms 5_000

  defstruct [:conn, :ref, :mod, buffer: <<>>, wait: :infinity, done: false]

  @type handle :: %__MODULE__{}

  @impl true
  defdelegate connect(channel, opts), to: Stock
  @impl true
  defdelegate disconnect(channel), to: Stock
  @impl true
  def send_request(%{channel: %{adapter_payload: %{conn_pid: conn}}, path: path} = stream, message, opts) do
    headers =
      [{"content-type", "application/grpc"}, {"te", "trailers"}, {"user-agent", "vllm-bridge-elixir"}] ++
        deadline(opts[:timeout]) ++ Enum.map(opts[:metadata] || %{}, fn {k, v} -> {to_string(k), to_string(v)} end)

    body = IO.iodata_to_binary(message)
    ref = :gun.post(conn, path, headers, <<0, byte_size(body)::32, body::binary>>)
    GRPC.Client.Stream.put_payload(stream, :stream_ref, ref)
  end

  @impl true
  defdelegate send_headers(stream, opts), to: Stock
  @impl true
  defdelegate send_data(stream, message, opts), to: Stock
  @impl true
  defdelegate end_stream(stream), to: Stock
  @impl true
  defdelegate cancel(stream), to: Stock

  @impl true
  def receive_data(%{channel: %{adapter_payload: %{conn_pid: conn}}, payload: %{stream_ref: ref}} = s, opts) do
    wait = wait_ms(opts[:timeout])
    h = %__MODULE__{conn: conn, ref: ref, mod: s.response_mod, wait: wait}

    case await(h) do
      {:response, :nofin, _headers} when s.server_stream ->
        {:ok, h}

      {:response, :fin, headers} when s.server_stream ->
        with :ok <- status(headers), do: {:ok, %__MODULE__{done: true}}

      {:response, :nofin, _headers} ->
        unary_body(h, [])

      {:response, :fin, headers} ->
        with :ok <- status(headers), do: {:error, Error.local(:internal, "grpc_error", "empty reply")}

      {:error, _} = err ->
        err
    end
  end

  @doc "The next message of a server stream: `{:ok, msg, handle}`, `:done`, or `{:error, %VllmBridge.Error{}}`."
  @spec next(handle()) :: {:ok, struct(), handle()} | :done | {:error, Error.t()}
  def next(%__MODULE__{buffer: buffer} = h) do
    case buffer do
      <<_flag, size::32, msg::binary-size(size), rest::binary>> ->
        {:ok, h.mod.decode(msg), %{h | buffer: rest}}

      _ when h.done ->
        :done

      _ ->
        case read(h, [buffer], byte_size(buffer), needed(buffer)) do
          {:data, buffer} -> next(%{h | buffer: buffer})
          {:trailers, trailers} -> with :ok <- status(trailers), do: :done
          {:error, _} = err -> err
        end
    end
  end

  @doc "Cancels a server stream (RST_STREAM CANCEL): the server stops the Python generator."
  @spec cancel_handle(handle()) :: :ok
  def cancel_handle(%__MODULE__{conn: conn, ref: ref}) do
    :gun.cancel(conn, ref)
    :gun.flush(ref)
    :ok
  end

  # Frames are at most 16 KiB: collect them as iodata and join once, so a large message (a tensor)
  # costs one copy, not one per frame.
  defp needed(<<_flag, size::32, _::binary>>), do: 5 + size
  defp needed(_), do: 5

  defp read(_h, acc, have, need) when have >= need, do: {:data, acc |> Enum.reverse() |> IO.iodata_to_binary()}

  defp read(h, acc, have, need) do
    case await(h) do
      {:data, data} -> read(h, [data | acc], have + byte_size(data), need)
      other -> other
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
      {:response, fin, 200, headers} -> {:response, fin, headers}
      {:response, _, code, _} -> {:error, Error.local(:internal, "grpc_error", "HTTP status #{code}")}
      {:data, _fin, data} -> {:data, data}
      {:trailers, trailers} -> {:trailers, trailers}
      {:error, :timeout} -> {:error, Error.local(:deadline_exceeded, "timeout", "no reply from the server in time")}
      {:error, reason} -> {:error, Error.local(:unavailable, "grpc_error", "connection: #{inspect(reason)}")}
      other -> {:error, Error.local(:unknown, "grpc_error", "unexpected: #{inspect(other)}")}
    end
  end

  # A trailers block (or trailers-only response): OK, or the error it describes.
  defp status(headers) do
    map = Map.new(headers)

    case map["grpc-status"] do
      nil -> {:error, Error.local(:internal, "grpc_error", "reply without grpc-status")}
      "0" -> :ok
      code -> {:error, Error.from_status(String.to_integer(code), URI.decode(map["grpc-message"] || ""), details(map))}
    end
  end

  defp details(%{"grpc-status-details-bin" => b64}) do
    case Base.decode64(b64, padding: false) do
      {:ok, bin} -> bin
      :error -> Base.decode64!(b64)
    end
  end

  defp details(_), do: nil

  # grpc-timeout allows at most 8 digits per unit.
  defp deadline(ms) when is_integer(ms) and ms < 100_000_000, do: [{"grpc-timeout", "#{max(ms, 0)}m"}]
  defp deadline(ms) when is_integer(ms), do: [{"grpc-timeout", "#{div(ms, 1000)}S"}]
  defp deadline(_), do: []

  @doc "How long to wait for the next frame, given the call's timeout or idle timeout in ms."
  @spec wait_ms(term()) :: timeout()
  def wait_ms(ms) when is_integer(ms), do: ms + @grace_ms
  def wait_ms(_), do: :infinity
end
