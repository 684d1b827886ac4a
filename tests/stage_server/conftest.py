"""A live middle stage server (`tests.support.middle_stage`: the `job` and `server` fixtures),
for the stage server's tests."""

from tests.support.middle_stage import job, server  # noqa: F401
