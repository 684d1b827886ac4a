"""The device a process computes on, in one home: what the machine and torch say of it (`facts`),
out of its memory, named (`oom`), the job's kernel switches on it (`kernels`), copies between it
and the host through pinned buffers (`host_copies`), compute timed to the end of its kernels
(`compute_clock`), a stage compiled for it (`compiled`), a forward's activation bytes by its
allocator's count (`activation_bytes`), and the activation windows of the servers on it sized
together against its memory (`sharing`, through the host's registry of who computes on it,
`claims`).

Each reaches the device through a seam (`DeviceFacts`, `Kernels`, `DeviceCopies`,
`ComputeClock`, `DeviceMemory`, `CompiledRuns`' compile), and `standin` holds the CPU stand-ins
behind them, so a CPU test runs the same logic a GPU does."""
