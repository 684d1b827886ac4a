"""A real gRPC echo of the chunked wire (`tests.support.echo.stub`), for the wire's tests."""

from tests.support.echo import stub  # noqa: F401
