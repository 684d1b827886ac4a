"""TLS on one side only, told apart from a server that is down: what a failed connection meant,
in words that name the flag to pass.

A client in clear text to a TLS port sees its connection closed; a TLS client to a clear-text
port sees a failed handshake; a server under `--tls-mutual` closes the connection of a client
without a certificate from its CA, right after the handshake. None of these says so in the
library's error, so when a failure looks like one of them, `probe` asks the server itself: one
TLS handshake that verifies nothing, then one capped at TLS 1.2, where a server that requires a
client certificate must refuse inside the handshake (TLS 1.3 refuses only after it).
"""

from __future__ import annotations

import enum
import socket
import ssl
from pathlib import Path

from swarm.net import tls

__all__ = [
    "PROBE_TIMEOUT_S",
    "Speaks",
    "explain_grpc",
    "explain_verify",
    "grpc_host_port",
    "probe",
    "refuses",
]

PROBE_TIMEOUT_S = 2.0
"""Bound on each of the probe's two connections (seconds): the server answered the failed call
a moment ago, so it answers this at once or not at all."""

# What a failed call's details say when TLS can explain it: a connection closed before the
# first answer, or a handshake that failed. "Connection refused" (nothing listens) and deadlines
# are other causes, not worth a probe.
_SUSPECT = (
    "socket closed",
    "handshake",
    "ssl",
    "tls",
    "connection reset",
    "end of tcp stream",
    "verification",
)


class Speaks(enum.Enum):
    """What a server answered a TLS handshake with."""

    TLS = "tls"  # a TLS server, with no client certificate required
    TLS_CLIENT_CERT = "tls, client certificate required"
    PLAIN = "clear text"  # closed, reset or answered something else than TLS
    NO_ANSWER = "no answer"  # nothing listens, or it did not answer in time


def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> Speaks:
    """Whether `host:port` speaks TLS, and requires a client certificate. Blocking; it trusts
    any certificate, since it sends nothing but the handshake."""
    first, _ = _handshake(host, port, timeout, ssl.TLSVersion.MAXIMUM_SUPPORTED)
    if first is not Speaks.TLS:
        return first
    # Capped at TLS 1.2 the server asks for the certificate inside the handshake, and a
    # server that requires one fails the handshake when none comes.
    second, completed = _handshake(host, port, timeout, ssl.TLSVersion.TLSv1_2)
    refused = not completed and second is not Speaks.NO_ANSWER
    return Speaks.TLS_CLIENT_CERT if refused else Speaks.TLS


def refuses(host: str, port: int, identity: tls.Tls, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the server at `host:port` refuses `identity`'s certificate: a handshake showing
    it, capped at TLS 1.2 (where the refusal comes inside the handshake), fails. False when
    the certificate's files are not known, or the server did not answer."""
    if identity.cert_path is None or identity.key_path is None:
        return False
    chain = (identity.cert_path, identity.key_path)
    speaks, completed = _handshake(host, port, timeout, ssl.TLSVersion.TLSv1_2, chain)
    return not completed and speaks is not Speaks.NO_ANSWER


def _handshake(
    host: str,
    port: int,
    timeout: float,
    highest: ssl.TLSVersion,
    chain: tuple[Path, Path] | None = None,
) -> tuple[Speaks, bool]:
    """What the server answered one handshake (showing `chain`'s certificate, if any) with, and
    whether the handshake completed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.maximum_version = highest
    if chain is not None:
        context.load_cert_chain(*chain)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError:
        return Speaks.NO_ANSWER, False
    with sock:
        try:
            context.wrap_socket(sock, server_hostname=host).close()
        except ssl.SSLError as e:
            # An alert is the server's TLS stack refusing us; anything else (the bytes of
            # another protocol, an end of stream) is not a TLS server's answer, unless it
            # came after the server's first flight (`probe` knows from the first handshake).
            alert = "ALERT" in (e.reason or "").upper()
            return (Speaks.TLS if alert else Speaks.PLAIN), False
        except TimeoutError:
            return Speaks.NO_ANSWER, False
        except OSError:  # reset, or closed without a word: it would not hear a ClientHello
            return Speaks.PLAIN, False
    return Speaks.TLS, True


def grpc_host_port(target: str) -> tuple[str, int] | None:
    """(host, port) of a gRPC target such as `host:7700`, `[::1]:7700` or `dns:///host:7700`;
    None for a form that names no single TCP port (unix sockets, a target without a port)."""
    for prefix in ("dns:///", "ipv4:", "ipv6:"):
        target = target.removeprefix(prefix)
    host, sep, port = target.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not host or "/" in host:
        return None
    return host.strip("[]"), int(port)


def explain_grpc(target: str, details: str, what: str) -> str | None:
    """Why a call to `what` (e.g. "the scheduler") at `target` failed with `details`, when TLS
    on one side only, or a client certificate missing or refused, is the cause: the sentence
    names the flags that fix it. None when TLS does not explain it. Blocking: it may probe."""
    text = details.lower()
    where = grpc_host_port(target)
    if where is None or not any(word in text for word in _SUSPECT):
        return None
    identity = tls.current()
    at = f"{what} at {target}"
    if identity is not None and (unverified := explain_verify(details, at, identity)):
        return unverified
    speaks = probe(*where)
    if identity is None:
        if speaks is Speaks.TLS:
            return (
                f"{at} serves TLS and this process does not: give --tls-ca with the swarm's "
                "CA (SWARM_TLS_CA)"
            )
        if speaks is Speaks.TLS_CLIENT_CERT:
            return (
                f"{at} serves TLS with client certificates (--tls-mutual) and this process "
                "speaks clear text: give --tls-ca with the swarm's CA, and --tls-cert and "
                "--tls-key with a certificate it issued (`swarm certs issue NAME`; "
                "SWARM_TLS_CA, SWARM_TLS_CERT, SWARM_TLS_KEY)"
            )
        return None
    if speaks is Speaks.PLAIN:
        return (
            f"{at} does not serve TLS and this process does (--tls-ca): leave out --tls-ca, "
            f"--tls-cert and --tls-key (and SWARM_TLS_*), or give {what} its own"
        )
    if speaks is Speaks.TLS_CLIENT_CERT and "socket closed" in text:
        if identity.cert is None:
            return (
                f"TLS refused: {at} requires a client certificate (--tls-mutual): give "
                "--tls-cert and --tls-key with one the swarm's CA issued (`swarm certs issue "
                "NAME`; SWARM_TLS_CERT, SWARM_TLS_KEY)"
            )
        if not refuses(*where, identity):
            return None  # the connection closed for another reason (a restart, say)
        return (
            f"TLS refused: {at} refused this process's certificate (--tls-cert "
            f"{identity.cert_path}): expired, or not from the CA it trusts; give a current one "
            "from the swarm's CA (`swarm certs issue NAME`)"
        )
    return None


def explain_verify(details: str, at: str, identity: tls.Tls | None) -> str | None:
    """Why the certificate of the server `at` ("the scheduler at HOST:PORT") did not verify,
    from an error's `details` (gRPC's or Python's ssl's), for a process trusting `identity`'s
    CA (None: the system's): the host dialled is not in it, it expired, or another CA issued
    it. None when the details say none of these."""
    text = details.lower()
    if "hostname verification" in text or "mismatch" in text or "not valid for" in text:
        return (
            f"TLS refused: the certificate of {at} does not name the host dialled: dial a name "
            "or address it was issued for, or issue it one that names this one (`swarm certs "
            "issue NAME --host HOST`)"
        )
    if "certificate verify failed" not in text and "certificate_verify_failed" not in text:
        return None
    if "expired" in text:
        return f"TLS refused: the certificate of {at} has expired: issue it a new one"
    if identity is None:
        return (
            f"TLS refused: the certificate of {at} was not issued by a CA this system trusts: "
            "give --tls-ca with the swarm's CA, the one that issued it"
        )
    return (
        f"TLS refused: the certificate of {at} was not issued by the CA of --tls-ca "
        f"{identity.ca_path}: give this process the swarm's CA, the one that issued it"
    )
