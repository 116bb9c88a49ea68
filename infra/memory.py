"""The process's memory (plumbing, no number of the algorithm changes here): resident memory by phase (RESULTS'
memory profile), glibc's heap handed back between phases, oneDNN's kernel cache bounded, the peak so far."""
from __future__ import annotations

import contextlib
import os
import time

class PhaseMemory:
    """Resident memory by phase (RESULTS' memory profile): a daemon thread reads /proc/self/statm every 20 ms
    and charges each reading to the innermost open phase (`with MEMORY.phase("π SFT"):`). `rows()`: per phase
    name, its peak resident GiB, the resident GiB when it last ended, its seconds and how often it ran.
    Linux only; elsewhere it records nothing."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.stack, self.stats, self.thread = interval, ["between phases"], {}, None
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def rss_gib(self) -> float:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self.page / 2 ** 30
        except OSError:
            return 0.0

    def _charge(self) -> None:
        rss = self.rss_gib()
        st = self._stats(self.stack[-1])
        st["peak_gib"] = max(st["peak_gib"], rss)

    def _stats(self, name: str) -> dict:
        return self.stats.setdefault(name, {"peak_gib": 0.0, "end_gib": 0.0, "seconds": 0.0, "runs": 0})

    def _sample(self) -> None:
        import time
        while True:
            self._charge()
            time.sleep(self.interval)

    def phase(self, name: str):
        import contextlib
        import threading
        import time
        if self.thread is None and os.path.exists("/proc/self/statm"):
            self.thread = threading.Thread(target=self._sample, daemon=True, name="phase-memory")
            self.thread.start()

        @contextlib.contextmanager
        def opened():
            self._charge()
            self.stack.append(name)
            t0 = time.time()
            try:
                yield
            finally:
                self._charge()
                release_memory()         # what the phase freed goes back to the OS before the next one starts
                st = self._stats(name)
                st["end_gib"], st["seconds"], st["runs"] = self.rss_gib(), st["seconds"] + time.time() - t0, st["runs"] + 1
                self.stack.pop()
        return opened()

    def rows(self) -> list[dict]:
        return [{"phase": k, **{m: round(v, 3) for m, v in st.items()}} for k, st in self.stats.items()]


MEMORY = PhaseMemory()
MMAP_THRESHOLD = 4 * 2 ** 20
ONEDNN_KERNELS = 32


def steady_heap() -> None:
    """Blocks of 4 MiB or more (KV caches, a pass's activations) straight from the OS, handed back when freed:
    glibc's default raises this threshold after every freed block up to 32 MiB, so decoding's caches came
    from its heap, and the heap stayed at every round's high-water mark (RESULTS, "memory": a 100-question
    evaluation 5.6 → 4.7 GiB; π SFT and decoding take the same time, within 5%, measured alternately).
    Every script's main sets it (main_guard); a no-op where glibc's mallopt is not there.

    And oneDNN, which runs bf16 matmuls on CPU, keeps the last 1024 kernels it compiled, one per matrix shape
    and about 0.8 MiB each: every new token count compiles new ones, so the autocast path held about 0.8 GiB
    of them (issue 43). ONEDNN_KERNELS keep a decoding step's and a pass's shapes, at the same speed
    (measured); set before the first bf16 matmul, and a user's ONEDNN_PRIMITIVE_CACHE_CAPACITY wins."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_KERNELS))
    import ctypes
    try:
        ctypes.CDLL(None).mallopt(-3, MMAP_THRESHOLD)          # M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):
        pass


def release_memory() -> None:
    """Hand freed memory back to the OS. glibc keeps the blocks of freed tensors in its heap, so without this
    a process stays at its biggest phase's footprint and adds the next phase's on top (RESULTS, "memory"):
    the garbage collector first, then glibc's malloc_trim (a no-op where there is none)."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_gib() -> float:
    """The process's peak resident memory so far in GiB (Linux reports KiB), logged with every update."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


@contextlib.contextmanager
def timed(row: dict, key: str):
    """row["seconds_<key>"], and the phase's resident memory in the run's memory profile (MEMORY)."""
    t0 = time.time()
    with MEMORY.phase(key):
        yield
    row[f"seconds_{key}"] = time.time() - t0
