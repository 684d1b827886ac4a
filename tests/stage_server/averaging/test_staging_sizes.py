"""The process's shared staging buffers (`stage_server.averaging.staging`), pinned on a CUDA host:
those of the two chunk sizes used last are kept, not one per size ever asked (a job's own
`chunk_bytes`, up to 16 MiB, pinned 2 x 16 MiB more for the process's life at every new value).
Its logic on the CPU (nothing pinned here): the same cache a GPU host's runs."""

from __future__ import annotations

from stage_server.averaging import staging


def test_the_shared_stagings_are_those_of_the_last_two_sizes() -> None:
    staging._shared.cache_clear()
    first = staging.staging(1 << 20)
    assert staging.staging(1 << 20) is first  # shared, not made at every round
    for size in (2 << 20, 3 << 20, 4 << 20):  # three more jobs, each its own chunk_bytes
        staging.staging(size)
    assert staging._shared.cache_info().currsize == 2
    assert staging.staging(4 << 20) is staging.staging(4 << 20)
