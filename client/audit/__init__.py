"""The trainer's audits (issue 55), beside its data planes: a plane is wrapped, not threaded.
`audited.Audited` wraps the carry plane and reads each microbatch's work from its boundary cache
after the microbatch; `audits` draws and judges the re-executions (`reexecute` runs them
over gRPC); on the push plane `push_audit` holds each replica's commitments to its neighbours'
(`disputes`), fetches the drawn records (`push_fetch`) and redoes the drawn contributions
(`push_contributions`). Nothing here imports `client.data_plane`: the plane's composition point
(`client.data_plane.plane.make_plane`) is the one place that joins the two."""
