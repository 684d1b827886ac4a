"""The host id a stage server announces (`PeerAnnouncement.host_id`): which machine it runs on, so
placement spreads a stage's replicas over machines (`swarm.policy.domains`; docs/decisions.md,
"Failure domains"). Every stage server on one machine announces the same one.

It is the hostname and a hash of the machine id (`/etc/machine-id`, systemd's; macOS and other
systems without it: the hostname alone). The hostname keeps it readable in a warning; the hash
tells apart machines of one name ("localhost", a cloned image's), and the pair tells apart
containers cloned from one image (they keep its machine id, not its hostname). `SWARM_HOST_ID`
replaces it: where containers or VMs share hardware, give them the same one."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

__all__ = ["MACHINE_ID_FILES", "host_id"]

MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))


def host_id(files: tuple[Path, ...] = MACHINE_ID_FILES) -> str:
    """This machine's host id: `SWARM_HOST_ID`, else hostname-HASH (8 hex digits of the machine
    id's SHA-256), else the hostname when no machine id is found."""
    chosen = os.environ.get("SWARM_HOST_ID", "").strip()
    if chosen:
        return chosen
    name = socket.gethostname() or "host"
    for path in files:
        try:
            machine = path.read_text().strip()
        except OSError:
            continue
        if machine:
            return f"{name}-{hashlib.sha256(machine.encode()).hexdigest()[:8]}"
    return name
