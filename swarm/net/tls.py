"""TLS between every swarm process: gRPC (each service, server-to-server calls included) and the
MQTT bus (`mqtts://`), all trusting one swarm CA (`swarm certs`).

A process has one identity: the CA it trusts and, for a server (and for mutual TLS, every
client), a certificate with its key, from `--tls-ca`, `--tls-cert`, `--tls-key` (`SWARM_TLS_CA`,
...). `--tls-mutual` makes servers require a client certificate from the CA too. The token keeps
working beside TLS: TLS says who may connect and hides the bytes, the token says who may call.

gRPC gives a server no hook on a failed handshake, so a refusal is counted where it is seen, by
the process whose connection was refused (a certificate from another CA, an expired one, none
where one is required): `swarm_tls_refused_total`, on that process's metrics endpoint.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter

from swarm.errors import ConfigError
from swarm.flags import env_name

__all__ = [
    "REFUSED",
    "Tls",
    "add_tls_flags",
    "configure",
    "configure_from_args",
    "count_refusal",
    "current",
]

# Process-wide: every channel of the process shares its identity, and so the count.
REGISTRY = CollectorRegistry(auto_describe=True)
REFUSED = Counter(
    "swarm_tls_refused_total",
    "Connections of this process refused in the TLS handshake (a certificate from another CA, "
    "expired, or missing where one is required)",
    registry=REGISTRY,
)
_HANDSHAKE = ("handshake", "certificate", "ssl_error", "tlsv1 alert", "ssl routines")


@dataclass(frozen=True)
class Tls:
    ca: bytes  # PEM: peers are trusted when their certificate chains to it
    cert: bytes | None = None  # this process's certificate chain (PEM); a server needs one
    key: bytes | None = None
    mutual: bool = False  # servers require a client certificate from the CA
    # The files, for libraries that read paths (the MQTT broker and client)
    ca_path: Path | None = None
    cert_path: Path | None = None
    key_path: Path | None = None

    @classmethod
    def load(
        cls, ca: Path, cert: Path | None = None, key: Path | None = None, mutual: bool = False
    ) -> Tls:
        """Read and check the files: PEM, the certificate issued by the CA, in its validity
        period and matching the key. Every problem is one ConfigError naming the flag."""
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization

        if (cert is None) != (key is None):
            raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
        ca_pem = _read(ca, "--tls-ca")
        try:
            authority = x509.load_pem_x509_certificate(ca_pem)
        except ValueError as e:
            raise ConfigError(f"--tls-ca {ca} is not a PEM certificate ({e})") from None
        cert_pem = key_pem = None
        if cert is not None and key is not None:
            cert_pem, key_pem = _read(cert, "--tls-cert"), _read(key, "--tls-key")
            try:
                mine = x509.load_pem_x509_certificate(cert_pem)
                private = serialization.load_pem_private_key(key_pem, password=None)
            except (ValueError, TypeError) as e:
                raise ConfigError(f"--tls-cert/--tls-key {cert}, {key}: not PEM ({e})") from None
            try:
                mine.verify_directly_issued_by(authority)
            except (ValueError, TypeError, InvalidSignature):
                raise ConfigError(
                    f"--tls-cert {cert} was not issued by the CA of --tls-ca {ca}"
                ) from None
            now = datetime.datetime.now(datetime.UTC)
            if not mine.not_valid_before_utc <= now <= mine.not_valid_after_utc:
                raise ConfigError(
                    f"--tls-cert {cert} is valid {mine.not_valid_before_utc:%Y-%m-%d} to "
                    f"{mine.not_valid_after_utc:%Y-%m-%d}, not now: issue a new one "
                    "(swarm certs issue)"
                )
            if mine.public_key().public_numbers() != private.public_key().public_numbers():  # type: ignore[union-attr]
                raise ConfigError(f"--tls-key {key} is not the key of --tls-cert {cert}")
        if mutual and cert_pem is None:
            raise ConfigError("--tls-mutual needs this process's --tls-cert and --tls-key")
        return cls(ca_pem, cert_pem, key_pem, mutual, ca, cert, key)

    def server_credentials(self, what: str) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ConfigError(f"{what} serves TLS: give it --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=self.mutual
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)

    def client_context(self, server_name: str | None = None) -> ssl.SSLContext:
        """For a client of the MQTT broker: trusts the CA, shows the certificate if any. With
        `server_name`, the server's certificate must name it, whatever host was dialled (the
        scheduler dials its embedded broker on this machine, and checks it as peers do)."""
        if server_name is None:
            context = ssl.create_default_context(cafile=str(self.ca_path))
        else:
            context = _VerifiedAs(ssl.PROTOCOL_TLS_CLIENT)  # as create_default_context's
            context.server_name = server_name
            context.load_verify_locations(cafile=str(self.ca_path))
        if self.cert_path is not None:
            context.load_cert_chain(str(self.cert_path), str(self.key_path))
        return context

    def names(self, host: str) -> bool | None:
        """Whether this process's certificate is issued for `host` (a DNS name, a wildcard's
        child, or an IP address); None without a certificate, or one without subject
        alternative names (left to the handshake)."""
        sans = self.subject_names()
        if sans is None:
            return None
        dns, ips = sans
        host = host.strip("[]")  # an IPv6 address as a URL writes it
        try:
            return ipaddress.ip_address(host) in ips
        except ValueError:
            name = host.lower().rstrip(".")
            parent = name.split(".", 1)[1] if "." in name else None
            return name in dns or (parent is not None and f"*.{parent}" in dns)

    def named(self) -> str:
        """What this process's certificate is issued for, in words ("no host" for none)."""
        dns, ips = self.subject_names() or ([], [])
        return ", ".join([*dns, *map(str, ips)]) or "no host"

    def subject_names(self) -> tuple[list[str], Sequence[object]] | None:
        """The certificate's DNS names (lower case) and IP addresses; None without either."""
        from cryptography import x509

        if self.cert is None:
            return None
        cert = x509.load_pem_x509_certificate(self.cert)
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return None
        dns = [n.lower().rstrip(".") for n in sans.get_values_for_type(x509.DNSName)]
        return dns, sans.get_values_for_type(x509.IPAddress)

    def check_names(self, host: str, what: str) -> None:
        """A ConfigError naming the fix when this process's certificate is not issued for
        `host`, the host `what` announces: every peer dialling it there would refuse it. A
        certificate without subject alternative names is left to the handshake."""
        if self.names(host) is not False:
            return
        host = host.strip("[]")
        raise ConfigError(
            f"--tls-cert {self.cert_path} names {self.named()}, not {host}, the host {what} "
            f"announces (--announce-host): every peer dialling it there would refuse it. Give "
            f"{what} a certificate of its own for that host: `swarm certs issue NAME --host {host}`"
        )


class _VerifiedAs(ssl.SSLContext):
    """A client context that checks the server's certificate against `server_name`, not against
    the host dialled (paho names the host it dials to `wrap_socket`)."""

    server_name: str = ""

    def wrap_socket(
        self,
        sock: socket.socket,
        server_side: bool = False,
        do_handshake_on_connect: bool = True,
        suppress_ragged_eofs: bool = True,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLSocket:
        return super().wrap_socket(
            sock,
            server_side,
            do_handshake_on_connect,
            suppress_ragged_eofs,
            self.server_name,
            session,
        )


def _read(path: Path, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be read ({e.strerror})") from None


# -- the process's identity -----------------------------------------------------------------
_UNSET = object()
_configured: object = _UNSET


def configure(tls: Tls | None) -> None:
    """Set the process's identity (the CLI does, from its flags)."""
    global _configured
    _configured = tls


def current() -> Tls | None:
    """The process's identity: as configured, else from `SWARM_TLS_*` (loaded once)."""
    global _configured
    if _configured is _UNSET:
        ca, cert, key = _env("tls-ca"), _env("tls-cert"), _env("tls-key")
        _configured = (
            None
            if ca is None
            else Tls.load(
                Path(ca),
                Path(cert) if cert else None,
                Path(key) if key else None,
                _env_true("tls-mutual"),
            )
        )
    return _configured  # type: ignore[return-value]


def _env(flag: str) -> str | None:
    """`SWARM_<FLAG>`, or None when unset or blank."""
    return os.environ.get(env_name(flag), "").strip() or None


def _env_true(flag: str) -> bool:
    return (_env(flag) or "").lower() in ("1", "true", "yes")


def add_tls_flags(p: argparse.ArgumentParser) -> None:
    for flag, help in (
        (
            "tls-ca",
            "the swarm CA (PEM; `swarm certs init`): TLS on every connection, trusting only it",
        ),
        ("tls-cert", "this process's certificate (`swarm certs issue`)"),
        ("tls-key", "its private key"),
    ):
        p.add_argument(
            f"--{flag}", type=Path, default=_env(flag), help=f"{help} [env {env_name(flag)}]"
        )
    p.add_argument(
        "--tls-mutual",
        action="store_true",
        default=_env_true("tls-mutual"),
        help=f"servers require a client certificate from the CA [env {env_name('tls-mutual')}]",
    )


def configure_from_args(args: argparse.Namespace) -> None:
    """The identity the command's flags name (none without --tls-ca)."""
    if getattr(args, "tls_ca", None) is None:
        if getattr(args, "tls_cert", None) is not None:
            raise ConfigError("--tls-cert needs --tls-ca (the CA that issued it)")
        configure(None)
        return
    configure(Tls.load(args.tls_ca, args.tls_cert, args.tls_key, args.tls_mutual))


def count_refusal(details: str | None) -> bool:
    """Whether a failed call's details say its TLS handshake failed; if so, it is counted. A
    server that refuses this process's certificate (or its lack of one) under TLS 1.3 does so
    after the client's side of the handshake: the client sees its new connection closed
    before the first answer, which is counted too when this process speaks TLS."""
    text = (details or "").lower()
    closed = "failed to connect" in text and "socket closed" in text and current() is not None
    if closed or any(word in text for word in _HANDSHAKE):
        REFUSED.inc()
        return True
    return False
