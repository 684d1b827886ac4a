"""Either broker behind one interface (`tests.support.brokers.broker`), for the bus's tests; a
broker certificate for Mosquitto on the files `swarm broker-config` writes
(`tests.support.mosquitto.broker_certs`); this process's TLS identity
(`tests.support.tls.tls_identity`)."""

from tests.support.brokers import broker  # noqa: F401
from tests.support.mosquitto import broker_certs  # noqa: F401
from tests.support.tls import tls_identity  # noqa: F401
