"""Mutual TLS on every gRPC hop: the ``[tls]`` section every service shares, the server's
credentials and the one channel helper every client dials with.

TLS is required by default: a ``[tls]`` without its three files and without an explicit
``plaintext = true`` is a ConfigError. Servers ask for a client certificate from the CA
(``require_client_auth``), so a plaintext caller or one with another CA's certificate never
gets a connection. Both sides follow the files: the server re-reads them at the next
handshake after their modification time changed; a client channel (``open_channel``) checks
them at most once a second when a call starts and, once they changed, sends the call and
those after it on a new channel with the new certificate (calls already open stay on the old
one). Rotating is therefore writing new files (same CA); nothing restarts."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple, Self, cast

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization

import telemetry
from infermesh.config import ConfigError, section

logger = logging.getLogger(__name__)

# How often a client channel looks at its files' modification times (a stat each).
_CHECK_INTERVAL_S = 1.0
_FILE_KEYS = ("cert_file", "key_file", "ca_file")


@section
class TlsSection:
    """``[tls]`` of the gateway, the router and the worker: this service's certificate and key
    (PEM) and the CA that signed every service's certificate. ``plaintext = true`` turns TLS
    off, and with it every caller check: every caller is trusted."""

    # This service's certificate (PEM), naming its role and hosts; re-read when it changes.
    cert_file: str = ""
    # The certificate's private key (PEM).
    key_file: str = ""
    # The CA (PEM) that signed every service's certificate; a peer's must chain to it.
    ca_file: str = ""
    # true: gRPC without TLS and without caller checks (development and in-process tests only).
    plaintext: bool = False


class Pems(NamedTuple):
    cert: bytes
    key: bytes
    ca: bytes


def check_loaded(tls: TlsSection, path: object, env_prefix: str) -> None:
    """The start-time check of a loaded config's ``[tls]``: raises ConfigError naming the
    file, the key and its environment variable."""
    origin = f"{path}: [tls]" if path is not None else "[tls]"
    try:
        TlsFiles(tls, origin).check()
    except ConfigError as e:
        raise ConfigError(f"{e} (or {env_prefix.upper()}_TLS_<KEY>)") from None


def warn_plaintext(service: str) -> None:
    """The start-up warning of a service running without TLS."""
    logger.warning("%s: [tls] plaintext = true: gRPC without TLS, every caller is trusted", service)


class TlsFiles:
    """The three PEM files of a ``[tls]`` section, read again once one of them changed."""

    def __init__(self, tls: TlsSection, origin: str = "[tls]") -> None:
        self.tls = tls
        self._origin = origin
        self._lock = threading.Lock()  # the server's fetcher runs on gRPC's own threads
        self._stamp: tuple[tuple[int, int], ...] | None = None
        self._pems: Pems | None = None

    def check(self) -> None:
        """Raises ConfigError unless plaintext or the files are there and hold a matching
        certificate and key and a CA certificate."""
        if self.tls.plaintext:
            given = [key for key in _FILE_KEYS if getattr(self.tls, key)]
            if given:
                raise ConfigError(f"{self._origin} plaintext: true with {given[0]} set; choose one")
            return
        self.pems()

    def pems(self) -> Pems:
        """The files' contents as last read (reading them the first time)."""
        with self._lock:
            if self._pems is None:
                self._stamp = self._stamps()
                self._pems = self._read()
            return self._pems

    def changed(self) -> Pems | None:
        """The files' new contents if they changed since last read, else None. A set caught
        half-written (a certificate without its key yet) counts as unchanged until whole."""
        with self._lock:
            try:
                stamp = self._stamps()
            except ConfigError:
                return None
            if stamp == self._stamp:
                return None
            try:
                pems = self._read()
            except ConfigError as e:
                logger.warning("TLS files changed but are not usable yet: %s", e)
                return None
            self._stamp, self._pems = stamp, pems
            logger.info("TLS files changed; using the new certificate %s", self.tls.cert_file)
            return pems

    def _stamps(self) -> tuple[tuple[int, int], ...]:
        stamps = []
        for key in _FILE_KEYS:
            path = self._path(key)
            try:
                stat = os.stat(path)
            except OSError as e:  # gone between the check and the stat (a rotation)
                raise ConfigError(f"{self._origin} {key}: {path}: {e.strerror}") from None
            stamps.append((stat.st_mtime_ns, stat.st_size))
        return tuple(stamps)

    def _path(self, key: str) -> Path:
        value: str = getattr(self.tls, key)
        if not value:
            raise ConfigError(
                f"{self._origin} {key}: TLS is required but no {key} is set: give cert_file, "
                "key_file and ca_file (`python -m infermesh certs DIR` writes a development "
                "set), or plaintext = true to trust every caller"
            )
        path = Path(value)
        if not path.is_file():
            raise ConfigError(f"{self._origin} {key}: {value}: no such file")
        return path

    def _read_file(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{self._origin} {key}: {path}: {e.strerror}") from None

    def _read(self) -> Pems:
        cert, key, ca = (self._read_file(k) for k in _FILE_KEYS)
        try:
            leaf = x509.load_pem_x509_certificate(cert)
        except ValueError:
            raise ConfigError(f"{self._origin} cert_file: not a PEM certificate") from None
        try:
            private = serialization.load_pem_private_key(key, None)
        except (ValueError, TypeError):
            raise ConfigError(f"{self._origin} key_file: not an unencrypted PEM key") from None
        try:
            x509.load_pem_x509_certificates(ca)
        except ValueError:
            raise ConfigError(f"{self._origin} ca_file: not a PEM certificate") from None
        if private.public_key() != leaf.public_key():
            raise ConfigError(f"{self._origin} key_file: not the key of cert_file")
        return Pems(cert, key, ca)


def channel_credentials(pems: Pems) -> grpc.ChannelCredentials:
    """A client's credentials: the CA to check the server with, this service's certificate."""
    return grpc.ssl_channel_credentials(pems.ca, pems.key, pems.cert)


def server_credentials(tls: TlsSection) -> grpc.ServerCredentials:
    """Credentials that require a client certificate from the CA, following the files."""
    files = TlsFiles(tls)
    pems = files.pems()

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        new = files.changed()
        return None if new is None else _server_configuration(new)

    # gRPC takes None from the fetcher as "no change"; the type stub leaves None out
    fetcher = cast(Callable[[], grpc.ServerCertificateConfiguration], fetch)
    return grpc.dynamic_ssl_server_credentials(
        _server_configuration(pems), fetcher, require_client_authentication=True
    )


def _server_configuration(pems: Pems) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration([(pems.key, pems.cert)], pems.ca)


def open_channel(
    address: str, tls: TlsSection, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    """A client channel to ``address`` with this service's certificate (plaintext: without
    TLS), traced; the one way every service dials another. ``address`` is a gRPC target: also
    several servers of one role, ``ipv4:host:port,host:port`` (or ``ipv6:``) or a DNS name
    of several addresses (``options`` choose how the channel spreads calls over them:
    ``infermesh.channels.router_channel_options``)."""
    interceptors = telemetry.grpc_client_interceptors()
    options = [*options, *_list_authority(address)]
    if tls.plaintext:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return RotatingChannel(address, TlsFiles(tls), options, interceptors)


def open_blocking_channel(address: str, tls: TlsSection) -> grpc.Channel:
    """A blocking client channel (probes, developer tools) with ``tls``'s certificate."""
    options = _list_authority(address)
    if tls.plaintext:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(TlsFiles(tls).pems()), options)


def _list_authority(address: str) -> list[tuple[str, Any]]:
    """A list target's authority: its first address. gRPC's would be the whole list, which no
    certificate names, so that TLS would refuse every server of it."""
    scheme, _, addresses = address.partition(":")
    if scheme in ("ipv4", "ipv6") and "," in addresses:
        return [("grpc.default_authority", addresses.split(",")[0])]
    return []


class RotatingChannel(grpc.aio.Channel):
    """A TLS channel whose calls go to a new channel once its certificate files changed."""

    def __init__(
        self,
        address: str,
        files: TlsFiles,
        options: Sequence[tuple[str, Any]],
        interceptors: Sequence[grpc.aio.ClientInterceptor],
    ) -> None:
        self._address = address
        self._files = files
        self._options = list(options)
        self._interceptors = list(interceptors)
        self._channel = self._open(files.pems())
        self._retired: list[grpc.aio.Channel] = []  # their open calls end on them
        self.generation = 0
        self._next_check = time.monotonic() + _CHECK_INTERVAL_S

    def _open(self, pems: Pems) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(
            self._address,
            channel_credentials(pems),
            options=self._options,
            interceptors=self._interceptors,
        )

    def current(self) -> grpc.aio.Channel:
        """The channel for a call starting now: a new one once the files changed."""
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + _CHECK_INTERVAL_S
            pems = self._files.changed()
            if pems is not None:
                self._retired.append(self._channel)
                self._channel = self._open(pems)
                self.generation += 1
        return self._channel

    async def close(self, grace: float | None = None) -> None:
        for channel in [*self._retired, self._channel]:
            await channel.close(grace)

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._channel.wait_for_state_change(last_observed_state)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> None:
        await self.close()

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Rotating(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Rotating(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Rotating(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Rotating(self, "stream_stream", method, args, kwargs)


class _Rotating:
    """A method of a RotatingChannel: each call goes to the channel current when it starts."""

    def __init__(
        self,
        owner: RotatingChannel,
        kind: str,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._owner = owner
        self._kind = kind
        self._method = method
        self._args = args
        self._kwargs = kwargs
        self._generation = -1
        self._callable: Any = None

    def _current(self) -> Any:
        channel = self._owner.current()
        if self._generation != self._owner.generation:
            self._callable = getattr(channel, self._kind)(self._method, *self._args, **self._kwargs)
            self._generation = self._owner.generation
        return self._callable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._current()(*args, **kwargs)
