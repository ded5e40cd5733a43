defmodule VllmBridge.Telemetry do
  @moduledoc """
  `:telemetry` events of the client.

  ## Calls: `[:vllm_bridge, :call, :start | :stop | :exception]`

  Every unary RPC: the generated `Vllm.*` functions that do not stream, `VllmBridge.call/3`,
  `new/3`, `call_method/4`, `get_attr/3`, `set_attr/4`, `collective/3`, `release/2`,
  `release_session/2` and `describe/2`.

    * `:start` - measurements `%{monotonic_time: t, system_time: t}`.
    * `:stop` - measurements `%{duration: d, monotonic_time: t}`; the call returned, with
      `{:ok, _}` (metadata `status: :ok`) or `{:error, %VllmBridge.Error{}}` (`status: :error`,
      plus `:error`, `:error_category` and `:code`).
    * `:exception` - measurements `%{duration: d, monotonic_time: t}`; something raised or
      exited inside the call (metadata `:kind`, `:reason`, `:stacktrace`).

  ## Streams: `[:vllm_bridge, :stream, :start | :stop | :exception]`

  Every streaming call (`Vllm.AsyncLLMEngine.generate/4`, `encode`, `VllmBridge.iterate/2`), from
  the moment its stream is first enumerated (when the call starts) until it ends:

    * `:start` - measurements `%{monotonic_time: t, system_time: t}`.
    * `:stop` - measurements `%{duration: d, monotonic_time: t, first_item: l, items: n}`:
      `first_item` is the time from the start to the first item (`nil` when none came), `items`
      the number of items consumed. Metadata `status: :ok` when the stream ran to its end,
      `:cancelled` when the consumer stopped early (the call was cancelled on the server).
    * `:exception` - the same measurements; the stream raised (`VllmBridge.Error` when the call
      failed while streaming): metadata `:kind`, `:reason`, `:stacktrace`, `status: :error`, and
      for a `VllmBridge.Error` its `:error`, `:error_category` and `:code`.

  Durations and times are in `:native` units (`System.convert_time_unit/3`), as `:telemetry.span/3`
  gives them.

  ## Metadata (every event)

    * `:target` - what is called: a catalog name (`"vllm.distributed.divide"`), or the receiver
      and member (`"engine.generate"` for a published object, `"vllm.forward_context.DPMetadata.cu_tokens_across_sp"`
      for a ref, by its Python type), or the RPC (`"Release"`, `"Describe"`)
    * `:operation` - `:function`, `:module_attr`, `:constructor`, `:method`, `:get_attr`,
      `:set_attr`, `:iterate`, `:collective`, `:release` or `:describe`
    * `:server` - the server's name or address (`VllmBridge.Config`), `:address` - where it is
    * `:pool`, `:session`, `:affinity` - the call's runtime options (`nil` when not given; the
      session is always sent)
    * `:multiplex` - streams: whether the stream went over the shared `Multiplex` stream
    * `:telemetry_span_context` - the same reference in the start and the stop or exception
      event of one call

  A handler, for example:

      :telemetry.attach_many("log-vllm", [[:vllm_bridge, :call, :stop], [:vllm_bridge, :stream, :stop]],
        fn event, m, meta, _ ->
          ms = System.convert_time_unit(m.duration, :native, :millisecond)
          Logger.info("\#{inspect(event)} \#{meta.target} \#{meta.status} in \#{ms} ms")
        end, nil)
  """

  alias VllmBridge.Error

  @typedoc "Event metadata (see the module doc)."
  @type metadata :: %{optional(atom()) => term()}

  @doc false
  # Runs a unary call inside call events.
  @spec span(metadata(), (-> result)) :: result when result: term()
  def span(meta, fun) do
    {start, meta} = start(:call, meta)

    try do
      result = fun.()
      finish(:call, :stop, start, %{}, Map.merge(meta, outcome(result)))
      result
    catch
      kind, reason ->
        finish(
          :call,
          :exception,
          start,
          %{},
          Map.merge(meta, %{kind: kind, reason: reason, stacktrace: __STACKTRACE__})
        )

        :erlang.raise(kind, reason, __STACKTRACE__)
    end
  end

  @doc false
  @spec start(:call | :stream, metadata()) :: {integer(), metadata()}
  def start(kind, meta) do
    meta = Map.put(meta, :telemetry_span_context, make_ref())
    now = System.monotonic_time()
    :telemetry.execute([:vllm_bridge, kind, :start], %{monotonic_time: now, system_time: System.system_time()}, meta)
    {now, meta}
  end

  @doc false
  @spec finish(:call | :stream, :stop | :exception, integer(), map(), metadata()) :: :ok
  def finish(kind, event, start, measurements, meta) do
    now = System.monotonic_time()

    :telemetry.execute(
      [:vllm_bridge, kind, event],
      Map.merge(measurements, %{duration: now - start, monotonic_time: now}),
      meta
    )
  end

  @doc false
  @spec outcome(term()) :: map()
  def outcome({:error, %Error{} = e}), do: %{status: :error, error: e, error_category: e.category, code: e.code}
  def outcome(_), do: %{status: :ok, error: nil, error_category: nil, code: :ok}
end
