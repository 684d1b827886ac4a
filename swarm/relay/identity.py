"""Who attaches to a relay: the key that signs the relay's challenge, bound to the attachment.

The swarm token (`swarm.relay.auth`) says only that an attacher belongs to the swarm: every peer
holds it, so it cannot say which peer. A peer therefore also signs each attach with a key of its
own, and the relay binds the attachment to that key: another key attaching under the same peer id
cannot unseat a live attachment (`swarm.relay.server`).

- With TLS, the key is the peer's certificate's (`AttachKey.of`): a relay that holds the swarm's
  CA takes an attach as PEER only from a certificate the CA issued that certifies PEER
  (`swarm.net.peer_names.certifies`: it names `PEER.peer.swarm`, or `*.NAME.peer.swarm` for
  PEER `LABEL.NAME`, a second machine on an invite for NAME), the name its callers verify it by
  end to end (`swarm certs issue NAME --peer PEER`, `swarm invite NAME`).
- Without TLS, a key the peer made at its start (Ed25519, `AttachKey.fresh`): the first live
  attachment under an id holds it; a restarted peer (a new key) takes it over once the old
  attachment no longer answers.

What is signed names the peer, the relay's address as the peer dialled it and the relay's fresh
nonce: a signature is good once, at that relay, so a hostile relay cannot hand a peer another
relay's challenge and attach there in its name.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import hashlib

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from swarm.net.paths import peer_name
from swarm.net.peer_names import certified_ids, certifies
from swarm.net.tls import Tls

__all__ = ["CERT_HEADER", "KEY_HEADER", "AttachKey", "Unproven", "challenge", "verify"]

CERT_HEADER, KEY_HEADER = "x-swarm-cert", "x-swarm-key"
"""The attach headers carrying the attacher's certificate (DER, base64) or bare public key."""

_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw
_SPKI = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo


class Unproven(Exception):
    """An attach whose identity does not hold: why, said to the attacher."""


def challenge(peer: str, relay: str, nonce: str) -> bytes:
    """What an attach signs: the peer id, the relay's address as dialled, the relay's nonce."""
    return f"swarm-relay-attach\n{peer}\n{relay}\n{nonce}".encode()


class AttachKey:
    """The key a peer attaches with: its certificate's (`of` a TLS identity with one) or its own,
    made now (`fresh`)."""

    def __init__(
        self,
        private: ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey,
        cert_der: bytes | None = None,
    ) -> None:
        self._private, self._cert = private, cert_der

    @classmethod
    def fresh(cls) -> AttachKey:
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def of(cls, identity: Tls | None) -> AttachKey:
        """The certificate's key of `identity` when it has one, else a fresh key."""
        if identity is None or identity.cert is None or identity.key is None:
            return cls.fresh()
        private = serialization.load_pem_private_key(identity.key, password=None)
        if not isinstance(private, ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey):
            raise ValueError(f"a {type(private).__name__} cannot sign a relay attach")
        cert = x509.load_pem_x509_certificate(identity.cert)
        return cls(private, cert.public_bytes(serialization.Encoding.DER))

    def header(self) -> str:
        """The attach's header line (without its CRLF) that shows this key."""
        if self._cert is not None:
            return f"X-Swarm-Cert: {base64.b64encode(self._cert).decode()}"
        public = self._private.public_key().public_bytes(*_RAW)
        return f"X-Swarm-Key: {base64.b64encode(public).decode()}"

    def sign(self, message: bytes) -> str:
        if isinstance(self._private, ec.EllipticCurvePrivateKey):
            signature = self._private.sign(message, ec.ECDSA(hashes.SHA256()))
        else:
            signature = self._private.sign(message)
        return base64.b64encode(signature).decode()


def verify(
    headers: dict[str, str], peer: str, message: bytes, signature: str, ca: bytes | None
) -> str:
    """The identity (a fingerprint of its public key) that signed `message` for `peer`, from an
    attach's `headers`; `Unproven` otherwise. With `ca`, only a certificate it issued, valid
    now, that names `peer_name(peer)` is taken; without, a bare key or a certificate's key."""
    try:
        sig = base64.b64decode(signature, validate=True)
        if CERT_HEADER in headers:
            cert = x509.load_der_x509_certificate(
                base64.b64decode(headers[CERT_HEADER], validate=True)
            )
            public = cert.public_key()
            if ca is not None:
                _certified(cert, peer, ca)
        elif ca is not None:
            raise Unproven(f"this relay takes {peer} from its certificate only (--peer {peer})")
        elif KEY_HEADER in headers:
            raw = base64.b64decode(headers[KEY_HEADER], validate=True)
            public = ed25519.Ed25519PublicKey.from_public_bytes(raw)
        else:
            raise Unproven("no key: an attach shows X-Swarm-Key or X-Swarm-Cert")
        if isinstance(public, ec.EllipticCurvePublicKey):
            public.verify(sig, message, ec.ECDSA(hashes.SHA256()))
        elif isinstance(public, ed25519.Ed25519PublicKey):
            public.verify(sig, message)
        else:
            raise Unproven(f"a {type(public).__name__} cannot sign a relay attach")
    except (ValueError, binascii.Error, TypeError):
        raise Unproven("its key or signature is malformed") from None
    except InvalidSignature:
        raise Unproven("its signature does not hold (signed for another relay or nonce?)") from None
    return hashlib.sha256(public.public_bytes(*_SPKI)).hexdigest()


def _certified(cert: x509.Certificate, peer: str, ca: bytes) -> None:
    """`Unproven` unless `ca` issued `cert`, it is valid now and names `peer`."""
    authority = x509.load_pem_x509_certificate(ca)
    try:
        cert.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature):
        raise Unproven("its certificate is not the swarm CA's") from None
    now = datetime.datetime.now(datetime.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise Unproven("its certificate is not valid now")
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        sans = None
    names = [] if sans is None else sans.get_values_for_type(x509.DNSName)
    if certifies(names, peer):
        return
    ids = certified_ids(names)
    if ids:  # an invite's, most likely: the fix is the friend's own flag, not a CA they lack
        raise Unproven(
            f"its certificate certifies {', '.join(ids)}, not {peer} ({peer_name(peer)}): "
            f"start it with --peer {ids[0]}" + (f" or --peer {ids[1]}" if len(ids) > 1 else "")
        )
    raise Unproven(
        f"its certificate does not name {peer_name(peer)}: ask the swarm's admin for an invite "
        f"(`swarm invite NAME`) or a certificate (`swarm certs issue NAME --peer {peer}`)"
    )
