defmodule VllmBridge.PatchLiveTest do
  # Streams as patches (`patch-v2` with rows, asked for by default as "patch-v2,patch-v1", and
  # `patch-v1`) decode to the same items as whole ones (`full`), over a gRPC call of their own and
  # over the shared Multiplex stream. Against a running server with
  # an engine (VLLM_BRIDGE_ADDRESS); excluded without one.
  use ExUnit.Case, async: false
  @moduletag :live
  @moduletag :engine
  @moduletag timeout: 300_000

  alias Vllm.AsyncLLMEngine, as: Engine
  alias VllmBridge.{Codec, Connection, Mux, PyEnum, Record, Runtime, Transport}
  alias VllmBridge.V1, as: PB

  @engine System.get_env("VLLM_BRIDGE_ENGINE", "engine")

  defp greedy(n, more \\ %{}), do: Map.merge(%{max_tokens: n, temperature: 0.0, ignore_eos: true}, more)
  defp kind(name), do: %PyEnum{type_name: "vllm.sampling_params.RequestOutputKind", name: name, value: nil}

  # Requests whose items exercise every part of a streamed RequestOutput (as the Python side's own
  # equality test does): each output kind, logprobs and prompt logprobs, n > 1, a stop string.
  defp cases do
    seeded = %{temperature: 1.0, seed: 7, n: 2, max_tokens: 12}

    [
      cumulative: {"The quick brown fox", greedy(24)},
      delta: {"The quick brown fox", greedy(24, %{output_kind: kind("DELTA")})},
      final_only: {"The quick brown fox", greedy(24, %{output_kind: kind("FINAL_ONLY")})},
      logprobs: {"A B C D", greedy(12, %{logprobs: 3, prompt_logprobs: 2})},
      logprobs_delta: {"A B C D", greedy(12, %{logprobs: 2, prompt_logprobs: 1, output_kind: kind("DELTA")})},
      n2: {"Once upon a time", seeded},
      n2_delta: {"Once upon a time", Map.put(seeded, :output_kind, kind("DELTA"))},
      stop_string: {"Once upon a time", %{temperature: 0.0, max_tokens: 16, stop: [" today"]}}
    ]
  end

  defp items(prompt, params, runtime) do
    id = "exunit-patch-#{System.unique_integer([:positive])}"
    {:ok, stream} = Engine.generate(@engine, prompt, params, id, __runtime__: [timeout: 120_000] ++ runtime)
    Enum.to_list(stream)
  end

  for multiplex <- [true, false] do
    via = if multiplex, do: "the shared Multiplex stream", else: "a gRPC call of its own"

    test "with stream_tee, every item rebuilt from its patch equals the same item sent whole (#{via})" do
      # the default (patch-v2, with rows), and patch-v1
      for encoding <- [[], [stream_encoding: :patch_v1]], {name, {prompt, params}} <- cases() do
        name = "#{name} #{inspect(encoding)}"
        items = items(prompt, params, [multiplex: unquote(multiplex), stream_tee: true] ++ encoding)
        assert rem(length(items), 2) == 0, "#{name}: #{length(items)} items"
        patched = Enum.take_every(items, 2)
        whole = items |> Enum.drop(1) |> Enum.take_every(2)
        assert length(whole) >= 1, "#{name}"

        for {{p, w}, i} <- Enum.with_index(Enum.zip(patched, whole)) do
          assert p == w, "#{name}: item #{i} rebuilt from its patch differs from the whole one"
        end

        assert %Record{} = last = List.last(whole)
        assert last[:finished] == true, "#{name}"
        if name =~ ~r/^(cumulative|logprobs) /, do: assert(length(whole) > 4, "#{name}: #{length(whole)} items")
      end
    end

    # Two runs of a request are compared on what does not depend on timing: where vLLM splits its
    # items (it merges the outputs a slow reader has not taken) and the stats it stamps on them do.
    # So each item is keyed by the tokens it holds, and items holding as many tokens must be equal.
    test "greedy generations decode to the same records as patches and as whole items (#{via})" do
      for {name, {prompt, params}} <- Keyword.take(cases(), [:cumulative, :logprobs, :stop_string]) do
        runs =
          for encoding <- [:full, :patch_v1, :patch_v2] do
            items = items(prompt, params, multiplex: unquote(multiplex), stream_encoding: encoding)
            assert [_ | _] = items, "#{name} #{encoding}"
            Enum.map(items, &timeless/1)
          end

        [full | patched_runs] = runs
        by_tokens = fn items -> Map.new(items, &{tokens(&1), &1}) end
        full_by = by_tokens.(full)

        for {patched, encoding} <- Enum.zip(patched_runs, [:patch_v1, :patch_v2]) do
          assert List.last(full) == List.last(patched), "#{name} #{encoding}: the last items differ"
          patched_by = by_tokens.(patched)
          common = full_by |> Map.keys() |> Enum.filter(&Map.has_key?(patched_by, &1))
          assert common != [], "#{name} #{encoding}: #{length(full)} and #{length(patched)} items"

          for n <- common do
            assert full_by[n] == patched_by[n], "#{name} #{encoding}: the items with #{n} tokens differ"
          end
        end
      end
    end
  end

  defp timeless(%Record{fields: fields} = r),
    do: %{r | fields: Enum.reject(fields, fn {k, _} -> k in ["request_id", "metrics", "num_cached_tokens"] end)}

  defp tokens(%Record{} = r), do: r[:outputs] |> Enum.map(&length(&1[:token_ids])) |> Enum.sum()

  # The server does send patches when asked, and whole items otherwise (so the tests above compare
  # two encodings, not one twice).
  test "patch-v2 streams arrive as a value and then patches and rows; patch-v1 without rows; full as values" do
    {rt, {:ok, server}} = Runtime.resolve!([])
    {:ok, conn} = Connection.get(server)
    %{path: path} = VllmBridge.V1.Bridge.Service.__rpc__(:Stream)

    # engine.generate("Hello", greedy(32), id), as the client sends it: long enough that, however
    # busy the machine (vLLM merges the outputs a slow reader has not taken), a patch follows the value
    request = fn id ->
      %PB.CallRequest{
        target: %PB.Target{kind: :METHOD, name: "generate", receiver: {:object, @engine}},
        args: Enum.map(["Hello", greedy(32), id], &elem(Codec.encode(&1), 0))
      }
    end

    for encoding <- ["patch-v2,patch-v1", "patch-v1", "full"] do
      md = Runtime.stream_metadata(%{rt | stream_encoding: encoding}, Runtime.metadata(rt, "exunit-patch", []))
      id = "exunit-raw-#{encoding}-#{System.unique_integer([:positive])}"

      grpc =
        conn
        |> Transport.open_stream(
          path,
          PB.CallRequest.encode(request.(id <> "-grpc")),
          PB.StreamItem,
          md,
          60_000,
          60_000
        )
        |> read_all(&Transport.next/1)
        |> Enum.map(&item_kind/1)

      {:ok, h} = Mux.open(server, request.(id <> "-mux"), md, 60_000, 60_000)
      mux = h |> read_all(&Mux.next/1) |> Enum.map(&item_kind/1)

      for {via, kinds} <- [grpc: grpc, mux: mux] do
        assert length(kinds) >= 2, "#{via}: #{inspect(kinds)}"

        case encoding do
          "full" ->
            assert kinds == List.duplicate(:value, length(kinds)), "#{via} #{encoding}"

          "patch-v1" ->
            assert kinds == [:value | List.duplicate(:patch, length(kinds) - 1)], "#{via} #{encoding}"

          "patch-v2,patch-v1" ->
            assert [:value | rest] = kinds
            assert Enum.all?(rest, &(&1 in [:patch, :row])), "#{via} #{encoding}: #{inspect(kinds)}"
            # the items that change what the item before changed (all but the first few and the
            # last) are rows (how many items there are depends on timing)
            if length(kinds) >= 6, do: assert(:row in kinds, "#{via} #{encoding}: #{inspect(kinds)}")
        end
      end
    end
  end

  defp item_kind(%PB.StreamItem{patch: patch}), do: item_kind(patch)
  defp item_kind({:patch, patch}), do: item_kind(patch)
  defp item_kind({:value, _}), do: :value
  defp item_kind(%PB.StreamPatch{row: %PB.PatchRow{}}), do: :row
  defp item_kind(%PB.StreamPatch{}), do: :patch
  defp item_kind(nil), do: :value

  defp read_all(handle, next) do
    case next.(handle) do
      {:ok, item, handle} -> [item | read_all(handle, next)]
      :done -> []
    end
  end
end
