"""amqtt's own warnings, rated: amqtt writes a warning for every connection it drops (`Failed to
initialize client session: ...`), for each strange packet and for each take-over, so a stranger
repeating a refused CONNECT wrote one line per try on the `amqtt.broker` logger, however rated
the swarm's own lines were. `rate_amqtt_warnings` puts a filter on amqtt's loggers: the line for a
dropped connection goes (`swarm.bus.acl_broker.AclBroker` has logged why, rated), every other
warning is rated by where amqtt logs it (one line per kind every few seconds,
`swarm.ops.rated.RatedLog`), on this module's logger, with amqtt's text.

One kind is said in the swarm's words instead (issue 68 item 6): a client that does not
acknowledge a message within 5 s (a PUBACK), as every client behind a home router does while its
router is down. amqtt warns of it, then logs the broadcast task's failure at ERROR with its
internals (`Task failed and will be skipped: ... TimeoutError('Timeout waiting for PUBACK ...')`);
both become one WARNING a minute (`PUBACK_EVERY_S`) that says what happened."""

from __future__ import annotations

import logging

from swarm.ops.rated import RatedLog

__all__ = ["AMQTT_LOGGERS", "rate_amqtt_warnings"]

log = logging.getLogger(__name__)

AMQTT_LOGGERS = ("amqtt.broker", "amqtt.mqtt.protocol.handler")
"""The loggers of amqtt's broker and of its protocol handlers (the broker's sessions)."""

_DROPPED = "Failed to initialize client session"  # the CONNECT path: AclBroker said why
_PUBACK = "Timeout waiting for PUBACK"  # amqtt's words for a client that did not acknowledge
PUBACK_EVERY_S = 60.0
"""One line a minute for unacknowledged messages: an outage makes one per message per client."""


class _RatedAmqtt(logging.Filter):
    """Holds every amqtt warning back from its own logger; re-logs it rated here. A logger's
    filter sees only what is logged on that logger (not its children's), hence one per name."""

    def __init__(self) -> None:
        super().__init__()
        self._rated = RatedLog(log)
        self._unacknowledged = RatedLog(log, every_s=PUBACK_EVERY_S)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if message.startswith(_DROPPED):
            return False
        if _PUBACK in message or _PUBACK in _exception(record):
            self._unacknowledged.warning(
                _PUBACK,
                "broker: a client did not acknowledge a message within 5 s (its link is down or "
                "stalled, as behind a home router that is off): the message to it is dropped; "
                "it reads the retained state again when it reconnects",
            )
            return False
        # Where amqtt logs it is the kind: the text holds client ids and addresses a stranger
        # chooses.
        kind = (record.name, record.lineno)
        self._rated.log(record.levelno, kind, "broker (amqtt): %s", message)
        return False


def _exception(record: logging.LogRecord) -> str:
    """The text of the exception `record` was logged with ("" for none)."""
    error = record.exc_info[1] if record.exc_info else None
    return str(error) if error is not None else ""


_FILTER = _RatedAmqtt()


def rate_amqtt_warnings() -> None:
    """Install the filter on amqtt's loggers (once: idempotent)."""
    for name in AMQTT_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
