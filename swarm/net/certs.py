"""`swarm certs`: a swarm's own certificate authority and the host certificates it issues, with
the `cryptography` library (no hand-written ASN.1, no openssl command lines).

`init` makes `ca.pem` (give it to every process: `--tls-ca`) and `ca.key` (keep it where you
issue certificates only). `issue NAME --host H ...` makes `NAME.pem` and `NAME.key`, valid for
each host (DNS name or IP address, as peers dial it: the announced address) and for both
server and client use, so one certificate serves a stage server's port and its calls to
others. A peer behind NAT is dialled through a relay and verified by its peer id, not by an
address: `--peer ID` names it (`ID.peer.swarm`, `swarm.net.paths.peer_name`). Keys are ECDSA
P-256, written readable by their owner only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from swarm.errors import ConfigError
from swarm.net.paths import peer_name

__all__ = ["CA_CERT", "Issued", "init_ca", "issue", "issue_pem", "private_file"]

CA_CERT, CA_KEY = "ca.pem", "ca.key"


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path
    not_after: datetime.datetime


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def init_ca(directory: Path, days: int = 3650, name: str | None = None) -> Issued:
    """A new CA in `directory`; an existing one is never overwritten (every certificate it
    issued would stop being trusted)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # its owner's only, as the keys
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if cert_path.exists() or key_path.exists():
        raise ConfigError(
            f"{directory} already holds a CA ({CA_CERT}, {CA_KEY}); a new one would void every "
            "certificate it issued: use another --dir, or remove them first"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    # A name of its own: two swarms' CAs never look alike to a verifier.
    name = name or f"swarm CA {secrets.token_hex(4)}"
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    start = _now() - datetime.timedelta(minutes=5)  # clocks differ a little between machines
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    private_file(key_path, _key_pem(key))
    private_file(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return Issued(cert_path, key_path, cert.not_valid_after_utc)


def issue(
    directory: Path,
    name: str,
    hosts: list[str],
    days: int = 365,
    *,
    peers: list[str] | None = None,
    valid_from: datetime.datetime | None = None,
) -> Issued:
    """`NAME.pem` and `NAME.key` in `directory`, signed by its CA, for `hosts` and for the peer
    ids `peers` (what a relayed peer is verified by). `valid_from` is for tests (an expired
    certificate)."""
    peers = peers or []
    if not hosts and not peers:
        raise ConfigError(
            "give at least one --host (the name or address others dial it by) or, for a peer "
            "behind NAT, --peer ID (its peer id, what callers through a relay verify it by)"
        )
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"certificate name {name!r}: use a plain file name, e.g. the host's")
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}.key"
    for path in (cert_path, key_path):
        # Never over an issued certificate or the CA itself (`issue ca` would void every
        # certificate it signed and lose its key): remove the old files first to re-issue.
        if path.exists():
            raise ConfigError(f"{path} already exists: choose another name, or remove it first")
    cert_pem, key_pem, not_after = issue_pem(
        directory, name, hosts, days, peers=peers, valid_from=valid_from
    )
    private_file(key_path, key_pem)
    private_file(cert_path, cert_pem)
    return Issued(cert_path, key_path, not_after)


def issue_pem(
    directory: Path,
    name: str,
    hosts: list[str],
    days: int = 365,
    *,
    peers: list[str] | None = None,
    valid_from: datetime.datetime | None = None,
) -> tuple[bytes, bytes, datetime.datetime]:
    """A certificate (PEM) for `hosts` and the peer ids `peers` named `name`, its key (PEM) and
    its end, signed by the CA in `directory`, written nowhere (`swarm invite` puts them in the
    invite file)."""
    peers = peers or []
    if not hosts and not peers:
        raise ConfigError(
            "give at least one --host (the name or address others dial it by) or, for a peer "
            "behind NAT, --peer ID (its peer id, what callers through a relay verify it by)"
        )
    try:
        ca_cert = x509.load_pem_x509_certificate((directory / CA_CERT).read_bytes())
        ca_key = serialization.load_pem_private_key((directory / CA_KEY).read_bytes(), None)
    except OSError as e:
        raise ConfigError(
            f"no CA in {directory} ({e.strerror}): run `swarm certs init --dir {directory}` first"
        ) from None
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
        except ValueError:
            sans.append(x509.DNSName(host))
    for peer in peers:
        try:
            sans.append(x509.DNSName(peer_name(peer)))
        except ValueError as e:
            raise ConfigError(f"--peer {peer!r}: {e}") from None
    key = ec.generate_private_key(ec.SECP256R1())
    start = (valid_from or _now()) - datetime.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key), cert.not_valid_after_utc


def private_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` complete or not at all, readable by its owner only from the first
    byte (`mkstemp` creates the file 0600)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
