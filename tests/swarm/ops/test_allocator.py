"""`swarm.ops.allocator.give_back`: freed heap memory goes back to the system (glibc)."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

GLIBC = ctypes.util.find_library("c") is not None and os.confstr("CS_GNU_LIBC_VERSION") is not None


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_freed_heap_memory_below_a_buffer_in_use_goes_back() -> None:
    # A process of its own: the test process's heap is whatever earlier tests left.
    script = textwrap.dedent(
        """
        import os
        from swarm.ops import allocator

        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        big = bytearray(8 << 20); del big  # a mapped buffer freed: glibc's threshold rises
        held = [bytearray(1 << 20) for _ in range(128)]  # so these come from the heap
        pin = bytearray(1 << 20)  # above them, in use: free() alone gives nothing back
        del held
        before = rss()
        given = allocator.give_back()
        print(given, (before - rss()) >> 20)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) >= 100  # of the 128 MiB freed under the pinned buffer


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_freed_memory_that_dwarfs_what_is_allocated_beside_it_is_kept() -> None:
    # A small stage's commit beside its step's freed activations: a trim would cost a page fault
    # for each freed page the next step takes again and lower no peak; a large state's is worth it.
    script = textwrap.dedent(
        """
        import os
        from swarm.ops import allocator

        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        big = bytearray(8 << 20); del big
        held = [bytearray(1 << 20) for _ in range(128)]
        pin = bytearray(1 << 20)
        del held
        before = rss()
        small = allocator.give_back(beside=1 << 20)
        kept = (before - rss()) >> 20
        large = allocator.give_back(beside=64 << 20)
        print(small, kept, large, (before - rss()) >> 20)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[0] == "False" and int(out[1]) < 8
    assert out[2] == "True" and int(out[3]) >= 100
