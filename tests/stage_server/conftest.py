"""A live middle stage server (`tests.support.middle_stage`: the `job`, `server` and `client`
fixtures), for the stage server's tests."""

from tests.support.middle_stage import client, job, server  # noqa: F401
