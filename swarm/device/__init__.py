"""The device a process computes on, in one home: what the machine and torch say of it (`facts`),
out of its memory, named (`oom`), the job's kernel switches on it (`kernels`), copies between it
and the host through pinned buffers (`host_copies`), compute timed to the end of its kernels
(`compute_clock`), a stage compiled for it (`compiled`), a forward's activation bytes by its
allocator's count (`activation_bytes`), and the activation windows of the servers on it sized
together against its memory (`sharing`, through the host's registry of who computes on it,
`claims`), and the handover of tensors between co-located servers through memory
(`handover`: its Protocol, what an `offer` gives its maker, the `site` that tells two processes
may share memory, POSIX shared memory on the CPU in `shm_handover`, CUDA IPC in `cuda_handover`).

Each reaches the device through a seam (`DeviceFacts`, `Kernels`, `HostCopies`,
`ComputeClock`, `DeviceMemory`, `CompiledRuns`' compile, `CudaIpc`), and `standin` (with
`cuda_ipc`'s `HostIpc`) holds the CPU stand-ins behind them, so a CPU test runs the same logic a
GPU does."""
