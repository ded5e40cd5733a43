"""Who may talk to a server, and over what: bearer tokens, TLS, and the rule that nothing listens
beyond this machine without both.

Shared by the pool server and the worker (their side: `Tokens`, `AuthInterceptor`, server
credentials, `check_exposure`) and by clients (theirs: `channel`, `token_metadata`).

A token file holds one token per line, `token` or `name:token` (blank lines and `#` comments are
skipped); the name is the client's identity, which owns the sessions and refs it creates. Tokens
are compared by their SHA-256 digest, so a lookup's time says nothing about a token's bytes. The
file, not the command line, holds the secrets (a command line is visible to every user of the
machine).
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import os
import re
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from bridge_server.wire.errors import BridgeError, abort, status_of
from bridge_server.wire.options import MD_IDENTITY

log = logging.getLogger("vllm_bridge.security")

MD_AUTHORIZATION = "authorization"
MIN_TOKEN_CHARS = 16
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
# Open to anyone unless the server is told otherwise: load balancers and `grpcurl list` need them.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


class SecurityError(ValueError):
    """A token file, certificate or listen address that cannot be served; the message says why."""


@functools.lru_cache(maxsize=1024)
def _digest(token: str) -> bytes:
    """Remembered for the tokens last seen: a call's token is identified by the receive gate, the
    authentication interceptor and the service, each once."""
    return hashlib.sha256(token.encode()).digest()


@dataclass(frozen=True)
class Tokens:
    """The tokens a server accepts, and the identity each stands for."""

    identities: Mapping[bytes, str]      # sha256(token) -> identity

    @classmethod
    def load(cls, path: str) -> Tokens:
        try:
            text = open(path, encoding="utf-8").read()
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise SecurityError(f"token file {path}: {exc.strerror}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("token file %s can be read by other users of this machine (chmod 600 it)", path)
        identities: dict[bytes, str] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, sep, token = line.partition(":")
            if not sep:
                name, token = f"token-{number}", line
            name, token = name.strip(), token.strip()
            where = f"token file {path}, line {number}"
            if not _NAME.match(name):
                raise SecurityError(f"{where}: a name is 1-64 letters, digits and . _ @ -")
            if len(token) < MIN_TOKEN_CHARS:
                raise SecurityError(f"{where}: a token needs at least {MIN_TOKEN_CHARS} characters "
                                    f"(e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
            if _digest(token) in identities:
                raise SecurityError(f"{where}: the same token is listed twice")
            if name in identities.values():
                raise SecurityError(f"{where}: the name {name!r} is listed twice")
            identities[_digest(token)] = name
        if not identities:
            raise SecurityError(f"token file {path}: no token in it")
        return cls(identities)

    def identify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The identity of a call's bearer token; None when it has none, or one not listed."""
        for key, value in metadata or ():
            if key == MD_AUTHORIZATION and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer":
                    return self.identities.get(_digest(token.strip()))
        return None


@dataclass(frozen=True)
class TLSFiles:
    """A server's certificate and key (PEM), and, for mutual TLS, the CA its clients' certificates
    must be signed by."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        key, cert = _read(self.key, "--tls-key"), _read(self.cert, "--tls-cert")
        ca = _read(self.client_ca, "--tls-client-ca") if self.client_ca else None
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _read(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SecurityError(f"{option} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class ServerSecurity:
    """What a server asks of its callers."""

    tokens: Tokens | None = None
    tls: TLSFiles | None = None
    open_services: bool = True            # health and reflection answer without a token

    @classmethod
    def load(cls, token_file: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
             tls_client_ca: str | None = None, open_services: bool = True) -> ServerSecurity:
        """From the server's options (`--token-file`, `--tls-*`, `--auth-health`)."""
        if bool(tls_cert) != bool(tls_key):
            raise SecurityError("--tls-cert and --tls-key go together")
        if tls_client_ca and not tls_cert:
            raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        tls = TLSFiles(tls_cert, tls_key, tls_client_ca or None) if tls_cert and tls_key else None
        if tls is not None:
            tls.credentials()        # unreadable files are refused now, not at the first connection
        return cls(Tokens.load(token_file) if token_file else None, tls, open_services)

    @property
    def mutual_tls(self) -> bool:
        return self.tls is not None and self.tls.client_ca is not None

    def identify_token(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The identity of a call's listed bearer token; None without one (or without tokens)."""
        return self.tokens.identify(metadata) if self.tokens is not None else None

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [AuthInterceptor(self.tokens, self.open_services)] if self.tokens is not None else []

    def add_port(self, server: grpc.aio.Server, listen: str) -> int:
        if self.tls is None:
            return int(server.add_insecure_port(listen))
        return int(server.add_secure_port(listen, self.tls.credentials()))

    def identity(self, context: grpc.aio.ServicerContext, trusted: Iterable[tuple[str, str | bytes]] = ()) -> str:
        """Who is calling: the token's identity; else the common name of a mutual-TLS client's
        certificate; else, for a peer that speaks for its clients (our pool server, over a private
        socket), the identity it names in `trusted` metadata; else nobody in particular ("")."""
        metadata = context.invocation_metadata()
        if self.tokens is not None:
            identity = self.tokens.identify(metadata)
            if identity is None:      # the interceptor lets no such call through; say so all the same
                raise BridgeError(grpc.StatusCode.UNAUTHENTICATED, "auth", "no valid bearer token",
                                  reason="unauthenticated")
            return identity
        if self.mutual_tls:
            names = context.auth_context().get("x509_common_name") or []
            if names:
                return str(names[0], "utf-8", "replace")
        return next((v for k, v in trusted if k == MD_IDENTITY and isinstance(v, str)), "")


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
    await abort(context, status_of(grpc.StatusCode.UNAUTHENTICATED,
                                   "missing or unknown bearer token: send `authorization: Bearer <token>`"))


# One refusing handler per shape of reply, made once: the server's outer interceptor (`receiving.py`)
# keeps what it wraps by handler. Each reads a stream of requests, of which it reads none (the wire is
# the same for a unary request): as a unary handler, a call without a token was given a place among
# the requests the server reads at once, and held it until its request came or receive_s passed, so
# that callers without a token stalled the calls of those with one.
_DENIALS = {(True, True): grpc.stream_stream_rpc_method_handler(_refuse),
            (True, False): grpc.stream_unary_rpc_method_handler(_refuse),
            (False, True): grpc.stream_stream_rpc_method_handler(_refuse),
            (False, False): grpc.stream_unary_rpc_method_handler(_refuse)}


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call: UNAUTHENTICATED."""
    return _DENIALS[bool(handler.request_streaming), bool(handler.response_streaming)]


@dataclass
class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Every call needs a listed bearer token, but for the open services (health, reflection) when
    `open_services` is set."""

    tokens: Tokens
    open_services: bool = True

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method   # type: ignore[attr-defined]
        if self.open_services and method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        if self.tokens.identify(handler_call_details.invocation_metadata) is not None:   # type: ignore[attr-defined]
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return _deny(handler)


def add_arguments(group: Any, unset: bool) -> None:
    """The options of `vllm-bridge serve` and `vllm-bridge worker` that say what a server asks of
    its callers. `unset`: flags default to None, for a config file's keys to fill in."""
    flag = None if unset else False
    group.add_argument("--token-file", default=None, metavar="FILE",
                       help="bearer tokens callers must send (one per line, `token` or `name:token`)")
    group.add_argument("--tls-cert", default=None, metavar="FILE", help="serve TLS with this certificate (PEM)")
    group.add_argument("--tls-key", default=None, metavar="FILE", help="... and this key (PEM)")
    group.add_argument("--tls-client-ca", default=None, metavar="FILE",
                       help="mutual TLS: callers present a certificate signed by this CA")
    group.add_argument("--insecure", action="store_true", default=flag,
                       help="listen beyond this machine without TLS and client authentication anyway")
    group.add_argument("--auth-health", action="store_true", default=flag,
                       help="health and reflection need a token too (by default they are open)")


# ------------------------------------------------------------------------------------------ exposure
def is_local(listen: str) -> bool:
    """Whether an address can be reached from this machine only: a unix socket or a loopback host."""
    if listen.startswith("unix:"):
        return True
    host = listen.rpartition(":")[0].strip("[]") if ":" in listen else listen
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(listen: str, security: ServerSecurity, insecure: bool, what: str) -> None:
    """Beyond this machine a server needs TLS and client authentication (tokens or mutual TLS):
    anyone who can reach the port could otherwise drive its engines. `--insecure` is the explicit
    opt-out."""
    if is_local(listen) or insecure:
        if not is_local(listen):
            log.warning("%s listens on %s without %s (--insecure): anyone who can reach it can use it", what, listen,
                        " and ".join(m for m, ok in (("TLS", security.tls), ("tokens", security.tokens)) if not ok)
                        or "restrictions")
        return
    missing = [m for m, ok in (("TLS (--tls-cert, --tls-key)", security.tls is not None),
                               ("client authentication (--token-file, or --tls-client-ca)",
                                security.tokens is not None or security.mutual_tls)) if not ok]
    if missing:
        raise SecurityError(f"{what}: {listen} can be reached from other machines, and this server has no "
                            f"{' and no '.join(missing)}; give them, or listen on 127.0.0.1 or a unix socket, "
                            f"or pass --insecure to serve it open anyway")


# ------------------------------------------------------------------------------------------ clients
def token_metadata(token: str | None) -> list[tuple[str, str]]:
    return [(MD_AUTHORIZATION, f"Bearer {token}")] if token else []


def read_token(token_file: str | None = None, env: Mapping[str, str] = os.environ) -> str | None:
    """A client's token: the first token of `token_file` (a `name:token` line gives its token), else
    $VLLM_BRIDGE_TOKEN, else none."""
    if token_file:
        for raw in _read(token_file, "--token-file").decode().splitlines():
            line = raw.strip()
            if line and not line.startswith("#"):
                return line.partition(":")[2].strip() if ":" in line else line
        raise SecurityError(f"--token-file {token_file}: no token in it")
    return env.get("VLLM_BRIDGE_TOKEN") or None


def channel(address: str, options: Sequence[tuple[str, Any]], tls_ca: str | None = None,
            tls_cert: str | None = None, tls_key: str | None = None) -> grpc.Channel:
    """A client channel: TLS when a CA is given (and mutual TLS with a certificate and key)."""
    if tls_ca is None and tls_cert is None:
        return grpc.insecure_channel(address, options=list(options))
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(tls_ca, "--tls-ca") if tls_ca else None,
        private_key=_read(tls_key, "--tls-key") if tls_key else None,
        certificate_chain=_read(tls_cert, "--tls-cert") if tls_cert else None)
    return grpc.secure_channel(address, credentials, options=list(options))
