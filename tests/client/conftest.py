"""The swarm's CA and certificates (tests/swarm/net/test_tls.py), for the clients' TLS tests."""

from tests.swarm.net.test_tls import pki  # noqa: F401
