"""Who the embedded broker lets in, and what they may publish: the check of a CONNECT, made before
the broker touches any session, and the ACL (`Topics.may_publish`) on messages and last-wills.

Why before any session: amqtt 0.12.1 deletes (clean session) or takes over (persistent session)
the session of a CONNECT's client id before it asks whether the password is right, so a refused
login could strip the scheduler of its subscriptions or send a forged last-will. The broker
(`swarm.bus.broker`) calls `Gate.admit` on the CONNECT it has just read, and again where amqtt
authenticates, so a later amqtt that moved either hook still refuses the same clients.
"""

from __future__ import annotations

import hmac
import logging
import ssl
from typing import NamedTuple

from amqtt.mqtt.connack import BAD_USERNAME_PASSWORD, IDENTIFIER_REJECTED, NOT_AUTHORIZED
from amqtt.session import Session

from swarm.bus.topics import SCHEDULER_USER, TopicError, TopicKind, Topics
from swarm.net.peer_ids import MAX_PEER_ID_CHARS
from swarm.net.peer_names import own_id

__all__ = ["PEER_ID_PREFIX", "Gate", "Refusal", "certificate_name", "reserved_for"]

log = logging.getLogger(__name__)

PEER_ID_PREFIX = "peer-"
"""A stage server's client id is this and its peer id (its MQTT user): `peer-X` is user X's."""


def reserved_for(client_id: str) -> str | None:
    """The user whose client id `client_id` is, whether connected or not: `scheduler` is the
    scheduler's, `peer-X` peer X's; None for any other id (a trainer's, a tool's), which is only
    the user's who holds it while connected."""
    if client_id == SCHEDULER_USER:
        return SCHEDULER_USER
    if client_id.startswith(PEER_ID_PREFIX) and len(client_id) > len(PEER_ID_PREFIX):
        return client_id[len(PEER_ID_PREFIX) :]
    return None


class Refusal(NamedTuple):
    """Why a CONNECT is refused: the CONNACK return code, and a line for the log."""

    code: int
    reason: str


def _text(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value or ""


def _equal(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def certificate_name(ssl_object: ssl.SSLObject | None) -> str | None:
    """The common name (CN) of the verified client certificate on `ssl_object`, if any: the name
    `swarm certs issue NAME` gave it."""
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    subject: tuple[tuple[tuple[str, str], ...], ...] = (cert or {}).get("subject", ())  # type: ignore[assignment]
    names = [value for rdn in subject for key, value in rdn if key == "commonName" and value]
    return names[-1] if names else None


class Gate:
    """The embedded broker's logins and ACL. Without `token` anyone may connect; with it, a
    client must send the token as its password, except the scheduler (`SCHEDULER_USER`), whose
    password is `scheduler_token` alone: the swarm token, which every peer holds, does not make
    a scheduler. With `use_identity_as_username` (mutual TLS) a client's user is the name (CN)
    of its certificate, whatever username it sends, as Mosquitto's option of that name does; a
    certificate named "scheduler" is then the scheduler's credential.

    A client id belongs to the user connected under it (`claim`): another user's CONNECT with
    that id is refused (a peer cannot unseat the scheduler), the same user's replaces the old
    connection. With a token, `scheduler` and `peer-X` are their users' even while they are away
    (`reserved_for`). What binds a user is its credential: with the shared token a username is
    a claim (any holder may say it is peer X, never the scheduler); under
    `use_identity_as_username` it is the certificate's name. Persistent sessions
    (clean_session=0) are refused: the swarm's clients never ask for one, and they are how a
    CONNECT reached a live session."""

    def __init__(
        self,
        topics: Topics,
        token: str | None,
        scheduler_token: str | None = None,
        *,
        use_identity_as_username: bool = False,
    ) -> None:
        self.topics, self._token, self._scheduler_token = topics, token or "", scheduler_token or ""
        self._from_certificate = use_identity_as_username
        self._owners: dict[str, tuple[str | None, object]] = {}  # client id -> (user, holder)
        self._held: dict[object, str] = {}  # holder (a connection's task) -> its client id

    @property
    def closed(self) -> bool:
        """Whether logins are checked (else an open broker: a client without a user is trusted)."""
        return bool(self._token or self._scheduler_token)

    def admit(self, session: Session) -> Refusal | None:
        """None when `session` (a CONNECT just read) may connect, else why not. With
        `use_identity_as_username` this sets its username to its certificate's name first."""
        if not session.clean_session:
            return Refusal(
                NOT_AUTHORIZED, "a persistent session (clean_session=0): swarm clients start clean"
            )
        certified = False
        if self._from_certificate:
            name = certificate_name(session.ssl_object)
            if name is None:
                return Refusal(NOT_AUTHORIZED, "its client certificate names nobody (no CN)")
            session.username, certified = name, True
        if (
            len(session.username or "") > MAX_PEER_ID_CHARS
            or not (session.username or "").isprintable()
        ):
            # A peer's user is its peer id, its topics' level: what it retains is kept under a
            # topic that long, and every reader keeps the id.
            return Refusal(
                NOT_AUTHORIZED,
                f"a user of {len(session.username or '')} characters: a peer's user is its peer "
                f"id, at most {MAX_PEER_ID_CHARS}, none a control character",
            )
        if not self._password_fits(session.username, _text(session.password), certified):
            return Refusal(BAD_USERNAME_PASSWORD, "wrong or missing password for its user")
        if session.will_flag and not self.may_publish(session.username, _text(session.will_topic)):
            return Refusal(
                NOT_AUTHORIZED, f"its last-will is on {session.will_topic!r}, not its own topic"
            )
        reserved = reserved_for(session.client_id or "")
        theirs = certified and own_id(reserved or "", session.username or "")  # gpu1.alice's
        if self.closed and reserved is not None and reserved != session.username and not theirs:
            # reserved even while its user is away: another holding it would lock that user out
            # (refused on every retry). Not authorised, not "identifier rejected": the client
            # should stop, not retry.
            return Refusal(
                NOT_AUTHORIZED, f"the client id {session.client_id!r} is user {reserved!r}'s"
            )
        owner = self._owners.get(session.client_id or "")
        if owner is not None and owner[0] != session.username:
            return Refusal(
                IDENTIFIER_REJECTED,
                f"client id {session.client_id!r} is connected as user {owner[0]!r}",
            )
        return None

    def _password_fits(self, user: str | None, password: str, certified: bool) -> bool:
        """The scheduler's password is its own token, everyone else's the swarm token. A
        scheduler named by its certificate has its own credential there, and may send either."""
        if user != SCHEDULER_USER:
            return not self._token or _equal(password, self._token)
        if certified:
            own = [t for t in (self._token, self._scheduler_token) if t]
            return not self._token or any(_equal(password, t) for t in own)
        if not self.closed:
            return True
        return bool(self._scheduler_token) and _equal(password, self._scheduler_token)

    def claim(self, session: Session, holder: object) -> None:
        """`session`'s client id is `holder`'s (its connection's) until `release(holder)`: claimed
        at once when admitted, so that two CONNECTs racing for one id cannot both get in."""
        client_id = session.client_id or ""
        previous = self._owners.get(client_id)
        if previous is not None:
            self._held.pop(previous[1], None)
        self._owners[client_id] = (session.username, holder)
        self._held[holder] = client_id

    def release(self, holder: object) -> None:
        client_id = self._held.pop(holder, None)
        if client_id is not None and self._owners.get(client_id, (None, None))[1] is holder:
            del self._owners[client_id]

    def _as(self, user: str | None, topic: str) -> str | None:
        """Who `user` acts as on `topic`: under `use_identity_as_username`, the peer the topic
        is for when `user`'s certificate certifies it (an invite for alice certifies gpu1.alice,
        `swarm.net.peer_names`: its second process publishes as gpu1.alice, as it attaches to a
        relay as gpu1.alice); else `user`."""
        if not self._from_certificate or not user or user == SCHEDULER_USER:
            return user
        try:
            peer = self.topics.parse(topic).peer
        except TopicError:
            return user
        return peer if peer and own_id(peer, user) else user

    def may_retain(self, user: str | None, topic: str) -> bool:
        """Whether `user` may leave a retained message on `topic` (which it may publish): the
        scheduler anywhere; a peer only its announcement (`peers/{peer}`, its last-will's topic),
        not its load reports (`peers/{peer}/load`), which are sent again every few seconds and
        which no one needs kept; an open broker's client without a username, as for publishing,
        anywhere."""
        if user == SCHEDULER_USER or (not user and not self.closed):
            return True
        try:
            info = self.topics.parse(topic)
        except TopicError:
            return False
        return info.kind == TopicKind.PEER and info.peer == self._as(user, topic)

    def may_read(self, user: str | None, topic: str) -> bool:
        """The read ACL (`Topics.may_read`): a peer reads every topic but other peers'
        reachability reports; on an open broker a client without a username reads everything."""
        if not user and not self.closed:
            return True
        return self.topics.may_read(self._as(user, topic), topic)

    def may_publish(self, user: str | None, topic: str) -> bool:
        """The ACL (`Topics.may_publish`); a client without a username on a broker without a token
        is trusted with everything (an open broker: there is no identity to check)."""
        if not user and not self.closed:
            return True
        return self.topics.may_publish(self._as(user, topic), topic)
