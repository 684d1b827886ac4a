"""What several test files share, one home per concept.

- `ports`: free ports and addresses.
- `brokers`: a real Mosquitto in a child process.
- `cli`: `swarm ...` as its own process; the repository root.
- `jobs`: the tiny synthetic job with any key overridden.
- `equality`: "equal to `swarm local`" within a tolerance.
- `fakes`: stand-ins shared by several files (a bus nobody publishes on, an echoing stage).
- `api`: the job API on a real gRPC server over a real store, with a fake orchestration.
- `hostile`: a hostile member of a stage (DownloadState, Updates) on a real gRPC server.
- `scheduled`: a scheduler, the embedded broker and stage servers that join through it, all in
  the test's process.

Test files import from here, never from one another or from `conftest.py`.
"""
