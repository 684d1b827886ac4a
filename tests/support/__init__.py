"""What several test files share, one home per concept.

- `ports`: free ports and addresses, and a port in use.
- `brokers`: a real Mosquitto in a child process (or on a written config); either broker behind
  one interface (the `broker` fixture).
- `mosquitto`: real Mosquitto on the files `swarm broker-config` writes, its certificate (the
  `broker_certs` fixture), a raw TLS login to it.
- `buses`: bus clients with the tests' settings, bounded receives, the logins a broker must take.
- `raw_mqtt`: MQTT packets written by hand, for what no well-behaved client sends.
- `tls`: the swarm's CA and a stranger's (`pki`), identities loaded from them.
- `cli`: `swarm ...` as its own process; the repository root.
- `forked`: swarm processes forked from a server that imported torch once.
- `reaper`: every process a test started killed after it, orphans of a killed parent too.
- `jobs`: the tiny synthetic job with any key overridden; the keys of each training rule; a
  wide vocabulary (`WIDE`).
- `pretrained`: a pretrained checkpoint and a job fine-tuning from it.
- `equality`: "equal to `swarm local`" within a tolerance.
- `fakes`: stand-ins shared by several files (a bus nobody publishes on, an echoing stage).
- `echo`: the echoing stage on a real gRPC server, and a chunked round trip through it.
- `stages`: one fake stage behind the data planes' client seam.
- `replicas`: in-memory replicas for the step coordinator.
- `coordinator`: the step coordinator over them (`Harness`, the `make_harness` fixture).
- `middle_stage`: one live middle stage server in the test's process (`job`, `server`).
- `inprocess`: stage servers and trainers in the test's process (`Swarm`, `make_swarm`).
- `servers`: stage servers as their own processes, for the fault tests, and a job trained on them.
- `pools`: real pool replicas for averaging tests, and the butterfly over all of them at once.
- `hostile`: a hostile member of a stage (DownloadState, Updates) on a real gRPC server.
- `api`: the job API on a real gRPC server over a real store, with a fake orchestration.
- `downloads`: a state download's messages decoded into the state they carry.
- `disks`: a real full disk.
- `scheduled`: a scheduler, the embedded broker and stage servers that join through it, all in
  the test's process.

Test files import from here, never from one another or from `conftest.py`; a `conftest.py`
only makes this package's fixtures visible to its folder.
"""
