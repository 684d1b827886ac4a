"""The trainer's data plane: how one microbatch travels through the stages. One seam
(`DataPlane`), two implementations, each in its own file: `carry` (the trainer carries every hop
itself; a job names it `runtime.data_plane = "relay"`, which is not the NAT relay, `swarm.relay`)
and `push` (the trainer hands the microbatch to stage 0, and each replica sends it on). Both make
their hops through `hops.StageHops`, the trainer's face of the one hop loop (`swarm.rpc.hop`);
the carry plane keeps what it sent in a `boundary_cache.BoundaryCache`."""
