defmodule VllmBridge.Error do
  @moduledoc """
  A failed call: what the server said (its `vllm_bridge.v1.ErrorDetail`, carried in the
  `grpc-status-details-bin` trailer) plus the gRPC status.

  * `category` - `"python_error"`, `"validation"`, `"timeout"`, `"ref"`, `"engine"`, `"worker"`,
    `"pool"`, or `"grpc_error"` for failures of the connection itself (no detail from the server)
  * `python_type` - the Python exception type (`"ValueError"`, `"AssertionError"`...), or `""`
  * `message`, `traceback` - the Python message and formatted traceback (`""` when none)
  * `grpc_status` - the gRPC status code as an integer; `code` is the same as an atom
    (`:invalid_argument`, `:deadline_exceeded`, ...)
  * `target`, `parameter`, `reason`, `suggestions` - what was called, the offending parameter, a
    short machine-readable reason (`"ref released"`, `"engine dead"`...) and, for unknown names,
    the closest known names

  It is also an exception: a stream (see `Vllm.AsyncLLMEngine.generate/4`) raises it when the call
  fails while it is being consumed.
  """

  defexception category: "grpc_error",
               python_type: "",
               message: "",
               traceback: "",
               grpc_status: 2,
               code: :unknown,
               target: "",
               parameter: "",
               reason: "",
               suggestions: []

  @type t :: %__MODULE__{
          category: String.t(),
          python_type: String.t(),
          message: String.t(),
          traceback: String.t(),
          grpc_status: non_neg_integer(),
          code: atom(),
          target: String.t(),
          parameter: String.t(),
          reason: String.t(),
          suggestions: [String.t()]
        }

  @codes ~w(ok cancelled unknown invalid_argument deadline_exceeded not_found already_exists
            permission_denied resource_exhausted failed_precondition aborted out_of_range
            unimplemented internal unavailable data_loss unauthenticated)a

  @doc "The gRPC status name for a status number (`3` -> `:invalid_argument`)."
  @spec code_name(integer()) :: atom()
  def code_name(status) when status in 0..16, do: Enum.at(@codes, status)
  def code_name(_), do: :unknown

  @doc "The status number for a name (`:invalid_argument` -> `3`)."
  @spec code_number(atom()) :: non_neg_integer()
  def code_number(code), do: Enum.find_index(@codes, &(&1 == code)) || 2

  @doc """
  Builds the error from a status, its message and the raw `grpc-status-details-bin` value
  (a serialized `google.rpc.Status`), keeping whatever the detail carries.
  """
  @spec from_status(integer(), String.t(), binary() | nil) :: t()
  def from_status(status, message, details_bin) do
    with bin when is_binary(bin) <- details_bin,
         %{details: anys} <- safe_decode(VllmBridge.Proto.Google.Rpc.Status, bin),
         %{value: value} <- Enum.find(anys, &String.ends_with?(&1.type_url, "vllm_bridge.v1.ErrorDetail")),
         %VllmBridge.V1.ErrorDetail{} = d <- safe_decode(VllmBridge.V1.ErrorDetail, value) do
      from_detail(status, message, d)
    else
      _ -> from_detail(status, message, nil)
    end
  end

  @doc false
  # From a status, its message and the server's ErrorDetail (or nil), as a Multiplex event carries them.
  @spec from_detail(integer(), String.t(), VllmBridge.V1.ErrorDetail.t() | nil) :: t()
  def from_detail(status, message, detail) do
    base = %__MODULE__{
      grpc_status: status,
      code: code_name(status),
      message: message || "",
      category: default_category(status)
    }

    case detail do
      %VllmBridge.V1.ErrorDetail{} = d ->
        %{
          base
          | category: d.category,
            python_type: d.python_type,
            message: if(d.message == "", do: base.message, else: d.message),
            traceback: d.traceback,
            target: d.target,
            parameter: d.parameter,
            reason: d.reason,
            suggestions: d.suggestions
        }

      nil ->
        base
    end
  end

  @doc "An error raised on this side (connection, encoding, options), never sent to a server."
  @spec local(atom(), String.t(), String.t(), keyword()) :: t()
  def local(code, category, message, fields \\ []) do
    struct!(%__MODULE__{grpc_status: code_number(code), code: code, category: category, message: message}, fields)
  end

  defp default_category(4), do: "timeout"
  defp default_category(_), do: "grpc_error"

  defp safe_decode(mod, bin) do
    mod.decode(bin)
  rescue
    _ -> nil
  end
end
