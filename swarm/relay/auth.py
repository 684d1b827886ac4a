"""What a relay (`swarm.relay.server`) asks of whoever connects to it, all derived from the swarm
token, so that the relay, the peers it carries and their callers need no secret beyond it.

- A caller opening a tunnel to peer P shows `relay_credential(token, P)` (its HTTP CONNECT's
  `Proxy-Authorization`, user P): a credential leaked from one caller opens tunnels to P only,
  and P still checks the caller's own token and TLS end to end. The dialer makes it, so it lives
  beside the relayed address it dials (`swarm.net.paths`).
- A peer attaching as P answers the relay's fresh nonce with `attach_proof(token, P, nonce)`:
  nothing overheard can be replayed to attach as P later.
- A peer's data connection for call C shows `data_proof(token, C)`; C is a random id the relay
  sent over that peer's control connection and takes once.

The token says only that the attacher is one of the swarm's peers, not which: every holder can
derive every proof above. Which peer is the key that signs the attach (`swarm.relay.identity`),
to which the relay binds the attachment. Without a token (a trusted network,
`--insecure-no-token`) the relay checks no proof, and still binds each attachment to its key.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

__all__ = [
    "attach_proof",
    "data_proof",
    "metrics_credential",
    "proxy_user",
    "same",
]


def _mac(token: str, message: str) -> str:
    return hmac.new(token.encode(), message.encode(), hashlib.sha256).hexdigest()


def metrics_credential(token: str | None) -> str:
    """The password of a tunnel to any attached peer's metrics address, and to nothing else
    ("" without a token): what Prometheus holds to scrape every peer a relay carries."""
    return _mac(token, "relay-metrics") if token else ""


def attach_proof(token: str | None, peer: str, nonce: str) -> str:
    """A peer's answer to the relay's `nonce` when it attaches as `peer` ("-" without a token)."""
    return _mac(token, f"attach:{peer}:{nonce}") if token else "-"


def data_proof(token: str | None, call: str) -> str:
    """What a peer's data connection for relay call `call` shows ("-" without a token)."""
    return _mac(token, f"data:{call}") if token else "-"


def same(given: str, expected: str) -> bool:
    """Constant-time comparison (hashed first: no length leak either)."""
    digest = hashlib.sha256
    return hmac.compare_digest(digest(given.encode()).digest(), digest(expected.encode()).digest())


def proxy_user(header: str) -> tuple[str, str] | None:
    """(user, password) of a `Proxy-Authorization: Basic ...` value, or None when it is none."""
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, colon, password = (
            base64.b64decode(encoded.strip(), validate=True).decode().partition(":")
        )
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if colon else None
