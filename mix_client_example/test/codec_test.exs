defmodule VllmBridge.CodecTest do
  # No server needed: values through the real protobuf encoding and back.
  use ExUnit.Case, async: true

  alias VllmBridge.{Binding, Bytes, Codec, Error, FrozenSet, PyEnum, Record, Ref, Tensor}
  alias VllmBridge.V1, as: PB

  defp wire(term) do
    {value, refs} = Codec.encode(term)
    back = value |> PB.Value.encode() |> IO.iodata_to_binary() |> PB.Value.decode() |> Codec.decode()
    {back, refs}
  end

  test "every value kind survives the wire" do
    ref = %Ref{id: "w1.abc", session_id: "s", worker_id: "w1", type_name: "x.Y", repr: "Y()"}

    for v <- [
          0,
          -1,
          2 ** 63 - 1,
          -(2 ** 63),
          2 ** 64,
          -(10 ** 40),
          1.5,
          -0.25,
          :infinity,
          :neg_infinity,
          nil,
          true,
          false,
          "",
          "héllo ✓",
          %Bytes{data: "abc"},
          [1, [2, "x"]],
          {},
          {1, {2, nil}},
          MapSet.new([1, "a"]),
          %FrozenSet{set: MapSet.new([1])},
          %{"a" => 1, 2 => [3], {1, 2} => nil, nil => 1.0},
          %{},
          ref,
          %Tensor{dtype: "bfloat16", shape: [2], data: <<0x80, 0x3F, 0, 0x40>>},
          %Record{type_name: "vllm.X", fields: [{"a", 1}, {"b", [ref]}]},
          %PyEnum{type_name: "vllm.config.compilation.CUDAGraphMode", name: "NONE", value: 0}
        ] do
      assert {^v, _} = wire(v)
    end
  end

  test "packed int lists (how the server sends token ids) decode to lists" do
    # Bytes as the Python server writes [1, -2, 300, 2**40]: Value.ints, packed zigzag varints.
    bytes = Base.decode16!("92010c0a0a0203d804808080808040", case: :lower)
    assert bytes |> PB.Value.decode() |> Codec.decode() == [1, -2, 300, 1_099_511_627_776]
    assert Codec.decode(%PB.Value{kind: {:ints, %PB.Ints{values: []}}}) == []
  end

  test "special cases: nan, atoms, non-UTF-8 binaries" do
    assert {:nan, []} = wire(:nan)
    assert {:hello, []} = wire(:hello)
    # a name the application has no atom for stays a string: the atom table is never grown from outside
    fresh = "never_an_atom_#{System.unique_integer([:positive])}"
    assert Codec.decode(%PB.Value{kind: {:atom, fresh}}) == fresh
    assert {%Bytes{data: <<255, 0>>}, []} = wire(<<255, 0>>)
    assert %PB.Value{kind: {:str, "x"}} = elem(Codec.encode("x"), 0)
    assert %PB.Value{kind: {:bytes, "x"}} = elem(Codec.encode(VllmBridge.bytes("x")), 0)
    assert %PB.Value{kind: {:big_int, "18446744073709551616"}} = elem(Codec.encode(2 ** 64), 0)
  end

  test "the refs inside a value are collected for x-bridge-refs" do
    a = %Ref{id: "w1.a"}
    b = %Ref{id: "w1.b"}
    assert {_, ["w1.a", "w1.b"]} = Codec.encode(%{x: [a, {b}]})
  end

  test "unsendable terms are refused" do
    assert_raise ArgumentError, ~r/cannot send/, fn -> Codec.encode(self()) end
    assert_raise ArgumentError, ~r/URI struct/, fn -> Codec.encode(URI.parse("http://x")) end
  end

  test "tensors from and to lists" do
    t = Tensor.from_list([[1, 2], [3, 4]], :int64)
    assert t.shape == [2, 2] and byte_size(t.data) == 32
    assert Tensor.to_list(t) == [[1, 2], [3, 4]]
    assert Tensor.to_list(Tensor.from_list([1.5, -2.0], :float32)) == [1.5, -2.0]
    assert Tensor.to_list(Tensor.from_list([true, false], :bool)) == [true, false]
    assert Tensor.to_list(Tensor.from_list(7, :int64)) == 7
    assert Tensor.from_list(7, :int64).shape == []
  end

  test "records read like maps" do
    r = %Record{
      type_name: "vllm.outputs.RequestOutput",
      fields: [{"outputs", [%Record{type_name: "C", fields: [{"text", "hi"}]}]}]
    }

    assert get_in(r, [:outputs, Access.at(0), :text]) == "hi"
    assert r["outputs"] |> hd() |> Record.to_map() == %{"text" => "hi"}
  end

  test "argument layouts of the generated functions" do
    assert Binding.tail([1, 2, 3]) == {[1, 2, 3], []}
    assert Binding.tail([1, [a: 1]]) == {[1], [a: 1]}
    assert Binding.tail([1, []]) == {[1], []}
    assert Binding.rest([1], [2, 3]) == {[1, 2, 3], []}
    assert Binding.rest([1], level: 2) == {[1], [level: 2]}
    assert Binding.rest([], []) == {[], []}

    assert Binding.classmethod(Vllm.AsyncLLMEngine, "from_engine_args", "vllm.AsyncLLMEngine.from_engine_args") ==
             {:function, "vllm.AsyncLLMEngine.from_engine_args"}

    assert Binding.classmethod("engine", "m", "q") == {:method, "engine", "m"}
  end

  test "an error detail in grpc-status-details-bin becomes the error's fields" do
    detail = %PB.ErrorDetail{
      category: "python_error",
      python_type: "ValueError",
      message: "bad",
      traceback: "tb",
      reason: "r"
    }

    any = %VllmBridge.Proto.Google.Protobuf.Any{
      type_url: "type.googleapis.com/vllm_bridge.v1.ErrorDetail",
      value: PB.ErrorDetail.encode(detail)
    }

    status =
      VllmBridge.Proto.Google.Rpc.Status.encode(%VllmBridge.Proto.Google.Rpc.Status{
        code: 3,
        message: "bad",
        details: [any]
      })

    e = Error.from_status(3, "bad", IO.iodata_to_binary(status))

    assert %Error{
             category: "python_error",
             python_type: "ValueError",
             traceback: "tb",
             code: :invalid_argument,
             grpc_status: 3
           } = e

    assert %Error{category: "timeout", code: :deadline_exceeded} = Error.from_status(4, "Deadline Exceeded", nil)
  end

  test "a value with nothing in it, or a big_int that is no integer, is refused by name, not taken for nil" do
    for {bad, said} <- [
          {%PB.Value{}, "an empty Value (no kind set)"},
          {nil, "an empty Value (no kind set)"},
          {%PB.Value{kind: {:list, %PB.Items{items: [%PB.Value{kind: {:int, 1}}, %PB.Value{}]}}}, "an empty Value"},
          {%PB.Value{kind: {:record, %PB.Record{type_name: "T", fields: [%PB.Field{name: "a", value: nil}]}}},
           "an empty Value"},
          {%PB.Value{kind: {:big_int, "12x"}}, "a big_int that is not an integer: \"12x\""}
        ] do
      assert_raise ArgumentError, ~r/#{Regex.escape(said)}/, fn -> Codec.decode(bad) end
      assert {:error, %Error{code: :internal, category: "codec", message: "the server sent " <> _}} = Codec.decoded(bad)
    end

    assert Codec.decoded(%PB.Value{kind: {:null, %PB.Null{}}}) == {:ok, nil}
    assert %PyEnum{value: nil} = Codec.decode(%PB.Value{kind: {:enum, %PB.Enum{type_name: "E", name: "A"}}})
  end

  test "decoding: refs remember their server; tensors as Nx on request" do
    ref = %PB.Value{kind: {:ref, %PB.Ref{id: "w1.x", type_name: "T"}}}
    assert %Ref{id: "w1.x", server: :gpu} = Codec.decode(ref, server: :gpu)
    assert %Ref{server: nil} = Codec.decode(ref)
    # the server is not sent back to Python
    assert {%PB.Value{kind: {:ref, %PB.Ref{id: "w1.x"}}}, ["w1.x"]} = Codec.encode(%Ref{id: "w1.x", server: :gpu})

    t = %PB.Value{kind: {:tensor, %PB.Tensor{dtype: "float32", shape: [2], data: <<0, 0, 128, 63, 0, 0, 0, 64>>}}}
    b = %PB.Value{kind: {:tensor, %PB.Tensor{dtype: "bool", shape: [1], data: <<1>>}}}
    assert %Tensor{dtype: "float32"} = Codec.decode(t)

    if Code.ensure_loaded?(Nx) do
      nx = Codec.decode(t, tensors: :nx)
      assert apply(Nx, :to_flat_list, [nx]) == [1.0, 2.0]
      assert apply(Nx, :type, [nx]) == {:f, 32}
      # bool has no Nx type: it stays a struct, so it goes back to Python as bool
      assert [%Tensor{dtype: "bool"}] = Codec.decode(%PB.Value{kind: {:list, %PB.Items{items: [b]}}}, tensors: :nx)
      assert {%PB.Value{kind: {:tensor, %PB.Tensor{dtype: "float32", shape: [2]}}}, []} = Codec.encode(nx)
    end
  end

  test "classmethods on the class, a ref or a published name; published names as atoms" do
    assert Binding.classmethod(Vllm.ForwardContext.DPMetadata, "make", "q.make") == {:function, "q.make"}
    assert Binding.classmethod(nil, "make", "q.make") == {:function, "q.make"}
    assert Binding.classmethod(:engine, "from_engine_args", "q") == {:method, :engine, "from_engine_args"}
    ref = %Ref{id: "w1.a"}
    assert Binding.classmethod(ref, "make", "q") == {:method, ref, "make"}
    # a function documented to return its class's instance keeps a ref, and passes errors through
    assert Binding.instance({:ok, ref}, "x.Y", []) == {:ok, ref}
    assert {:error, %Error{}} = Binding.instance({:error, %Error{}}, "x.Y", [])
  end

  test "a receiver that is neither a ref nor a published name is refused" do
    for bad <- [nil, 42, Vllm.AsyncLLMEngine, ""] do
      assert {:error, %Error{category: "validation", message: msg}} = VllmBridge.get_attr(bad, "x")
      assert msg =~ "the receiver must be a VllmBridge.Ref or the name of a published object"
    end
  end
end
