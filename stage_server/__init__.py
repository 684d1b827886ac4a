"""stage_server."""
