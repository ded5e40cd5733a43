defmodule VllmBridge.TrustLiveTest do
  # Tokens and TLS against servers VllmBridge.Server starts (`--token-file`, `--tls-cert`,
  # `--tls-key`, `--tls-client-ca`): VLLM_BRIDGE_VENV and VLLM_BRIDGE_TRUST=1, and openssl on PATH
  # for the certificates. Excluded otherwise.
  use ExUnit.Case, async: false
  @moduletag timeout: 300_000

  import ExUnit.CaptureLog

  alias VllmBridge.{Error, Server}

  @venv if System.get_env("VLLM_BRIDGE_VENV", "") != "", do: System.get_env("VLLM_BRIDGE_VENV")

  setup_all do
    dir = Path.join(System.tmp_dir!(), "vb-trust-#{System.unique_integer([:positive])}")
    File.mkdir_p!(dir)
    on_exit(fn -> File.rm_rf!(dir) end)
    config = Path.join(dir, "plain.toml")
    File.write!(config, "[[pools]]\nname = \"plain\"\nworkers = 1\n")
    openssl = fn args -> {_, 0} = System.cmd("openssl", args, cd: dir, stderr_to_stdout: true) end
    openssl.(~w(req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=test-ca))

    for {name, san} <- [
          {"server", "subjectAltName=DNS:localhost,IP:127.0.0.1"},
          {"client", "subjectAltName=DNS:client"}
        ] do
      File.write!(Path.join(dir, "#{name}.ext"), san <> "\n")
      openssl.(~w(req -newkey rsa:2048 -nodes -keyout #{name}.key -out #{name}.csr -subj /CN=#{name}))

      openssl.(
        ~w(x509 -req -in #{name}.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out #{name}.pem -days 2 -extfile #{name}.ext)
      )
    end

    %{dir: dir, config: config, path: &Path.join(dir, &1)}
  end

  defp start(ctx, name, extra) do
    opts = [name: name, venv: @venv, config: ctx.config, shutdown_timeout: 20_000] ++ extra
    capture_log(fn -> {:ok, _} = start_supervised({Server, opts}) end)
    Server.address(name)
  end

  defp divide(server), do: Vllm.Distributed.divide(6, 3, __runtime__: [server: server])

  @tag :token
  test "a token: the client sends it; calls without it or with another are refused", ctx do
    address = start(ctx, :tok, token: "s3cret-token-#{System.unique_integer([:positive])}-#{System.system_time()}")
    assert {:ok, 2} = divide(:tok)
    assert {:ok, :serving} = VllmBridge.Health.check(:tok)
    assert {:error, %Error{code: :unauthenticated}} = divide(address)
    Application.put_env(:vllm_bridge, :servers, other: [address: address, token: "wrong"])
    on_exit(fn -> Application.delete_env(:vllm_bridge, :servers) end)
    assert {:error, %Error{code: :unauthenticated}} = divide(:other)
    # streams too
    {:ok, stream} = VllmBridge.iterate("engine", __runtime__: [server: :other])
    assert %Error{code: :unauthenticated} = catch_error(Enum.to_list(stream))
  end

  @tag :tls
  test "TLS: the client checks the server's certificate; plaintext is refused", ctx do
    # the client checks the server's certificate against this CA (by default, against the server's
    # certificate file itself, which fits a self-signed one)
    address =
      start(ctx, :tls,
        tls: [certfile: ctx.path.("server.pem"), keyfile: ctx.path.("server.key")],
        connect: [tls: [cacertfile: ctx.path.("ca.pem")]]
      )

    Application.put_env(:vllm_bridge, :servers,
      ca: [address: address, tls: [cacertfile: ctx.path.("ca.pem")]],
      by_name: [address: String.replace(address, "127.0.0.1", "localhost"), tls: [cacertfile: ctx.path.("ca.pem")]],
      wrong_ca: [address: address, tls: [cacertfile: ctx.path.("client.pem")]],
      plain: [address: address]
    )

    on_exit(fn -> Application.delete_env(:vllm_bridge, :servers) end)
    assert {:ok, 2} = divide(:ca)
    assert {:ok, 2} = divide(:by_name)
    assert {:error, %Error{code: :unavailable}} = divide(:wrong_ca)
    assert {:error, %Error{code: :unavailable}} = divide(:plain)
  end

  @tag :tls
  test "mutual TLS: a client certificate signed by the server's client CA is needed", ctx do
    tls = [certfile: ctx.path.("server.pem"), keyfile: ctx.path.("server.key"), client_cafile: ctx.path.("ca.pem")]

    client = [
      tls: [cacertfile: ctx.path.("ca.pem"), certfile: ctx.path.("client.pem"), keyfile: ctx.path.("client.key")]
    ]

    address = start(ctx, :mtls, tls: tls, connect: client)
    assert {:ok, 2} = divide(:mtls)
    Application.put_env(:vllm_bridge, :servers, nocert: [address: address, tls: [cacertfile: ctx.path.("ca.pem")]])
    on_exit(fn -> Application.delete_env(:vllm_bridge, :servers) end)
    assert {:error, %Error{code: :unavailable}} = divide(:nocert)
  end
end
