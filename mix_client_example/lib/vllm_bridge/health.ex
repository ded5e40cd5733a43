defmodule VllmBridge.Health do
  @moduledoc """
  The standard `grpc.health.v1.Health/Check` of a server.

  A vllm-bridge server reports SERVING for the overall service `""` once every pool is up, and
  per pool as service `"pool/<name>"`; NOT_SERVING while it starts, regroups or shuts down.
  """

  alias VllmBridge.{Config, Connection, Error, Transport}
  alias VllmBridge.Proto.Grpc.Health.V1, as: H

  @type status :: :serving | :not_serving | :unknown | :service_unknown

  @doc """
  Checks a server (a name or an address, see `VllmBridge.Config`; default: the one calls go to).

  Options: `:service` (default `""`: the whole server; `"pool/NAME"` for one pool) and
  `:timeout` (ms, default 5,000).

      {:ok, :serving} = VllmBridge.Health.check()
      {:ok, :not_serving} = VllmBridge.Health.check(:gpu, service: "pool/llm")
  """
  @spec check(Config.server() | nil, keyword()) :: {:ok, status()} | {:error, Error.t()}
  def check(server \\ nil, opts \\ []) do
    with {:ok, s} <- Config.server(server), {:ok, conn} <- Connection.get(s) do
      request(conn, opts)
    end
  end

  @doc false
  # Over a connection of the caller's own, opened and closed here (VllmBridge.Server polls a
  # server that calls cannot reach yet).
  @spec probe(Config.Server.t(), keyword()) :: {:ok, status()} | {:error, Error.t()}
  def probe(%Config.Server{} = s, opts \\ []) do
    case Transport.open(s) do
      {:ok, pid, headers} ->
        try do
          request({pid, headers}, opts)
        after
          :gun.close(pid)
        end

      {:error, _} = err ->
        err
    end
  end

  defp request(conn, opts) do
    %{path: path, reply: reply} = H.Health.Service.__rpc__(:Check)
    body = H.HealthCheckRequest.encode(%H.HealthCheckRequest{service: Keyword.get(opts, :service, "")})

    with {:ok, %H.HealthCheckResponse{status: status}} <-
           Transport.unary(conn, path, body, reply, %{}, Keyword.get(opts, :timeout, 5_000)) do
      {:ok, status_name(status)}
    end
  end

  defp status_name(:SERVING), do: :serving
  defp status_name(:NOT_SERVING), do: :not_serving
  defp status_name(:SERVICE_UNKNOWN), do: :service_unknown
  defp status_name(1), do: :serving
  defp status_name(2), do: :not_serving
  defp status_name(3), do: :service_unknown
  defp status_name(_), do: :unknown
end
