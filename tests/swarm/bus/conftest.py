"""Either broker behind one interface (`tests.support.brokers.broker`), for the bus's tests."""

from tests.support.brokers import broker  # noqa: F401
