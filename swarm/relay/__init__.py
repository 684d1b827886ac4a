"""The NAT relay (`swarm relay`, a stage server's `--relay`): it carries calls to peers behind NAT
over connections those peers opened themselves. The relay's side (`server`), a NAT'd peer's side
(`attach`), the bytes they exchange (`wire`), the copy of a joined tunnel's bytes off the event
loop (`copier`), the token-derived proofs each shows (`auth`), the key an attachment is bound to
(`identity`, held per id by `control`) and the relay's limits in all and per source (`limits`).
Callers reach a relayed peer through the one dialer, `swarm.net.dial.channel`, which knows how a
relayed address is written (`swarm.net.paths`). Not the "relay" data plane (`runtime.data_plane`),
in which the trainer carries every hop itself (`client/data_plane/carry.py`)."""
