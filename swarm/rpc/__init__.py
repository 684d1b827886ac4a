"""Calls between processes: swarm errors and gRPC status codes both ways (`status`), the one
servicer wrapper (`servicing`), the lease contract (`lease`), the stage client (`stage_client`;
its bounded state and update streams `state_streams`, their order `stream_order`), the replicas
a sender follows (`routes`) and the one hop loop through them (`hop`)."""
