"""CPU placement of a worker: the engine's cores, and the cores left to everything else.

On a CPU-only node the engine's OpenMP team spins on the cores it runs on, and every wake-up of
the serving path (event loop, Ray's threads, the request plane) that lands on one of them
preempts a team member; the whole team then waits at the next barrier. Giving the engine cores
of its own and the rest of the process the others, as vLLM's CPU backend does with
``VLLM_CPU_OMP_THREADS_BIND``, keeps the two apart::

    CPUs the process may use:  0 1 2 ... 13 | 14 15
    engine_cpus="0-13":        engine thread + OpenMP team (inherit its mask when started)
    serving CPUs (the rest):                  event loop, Ray core worker, request plane

CPU lists use the Linux format (``cpuset.cpus``, ``taskset -c``): ``0-3,8,10-11``.
"""

from __future__ import annotations

import os


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a Linux CPU list such as ``0-3,8``; ValueError naming what is wrong."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range (expected a list such as 0-3,8)")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"{part!r} is a range that runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """The shortest Linux CPU list of ``cpus`` (``{0, 1, 2, 5}`` -> ``0-2,5``)."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def pin_current_thread(cpus: frozenset[int]) -> None:
    """Run the calling thread, and the threads it starts from now on, on ``cpus`` only."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as e:  # EINVAL: none of them is in this container's cpuset (or online)
        raise ValueError(f"engine_cpus: cannot run on CPUs {format_cpu_list(cpus)}: {e.strerror}") from e


def move_serving_threads(engine_cpus: frozenset[int]) -> frozenset[int]:
    """Move every thread of this process onto the CPUs it may use that are not the engine's, and
    return those; ValueError if none is left. Threads started later inherit their creator's mask."""
    allowed = frozenset(os.sched_getaffinity(0))
    serving = allowed - engine_cpus
    if not serving:
        raise ValueError(
            f"engine_cpus: {format_cpu_list(engine_cpus)} leaves no CPU for the serving threads "
            f"(this process may run on {format_cpu_list(allowed)})"
        )
    for name in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(name), serving)
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return serving


def thread_cpus() -> dict[int, frozenset[int]]:
    """Each thread of this process (native id) and the CPUs it may run on."""
    out = {}
    for name in os.listdir("/proc/self/task"):
        try:
            out[int(name)] = frozenset(os.sched_getaffinity(int(name)))
        except ProcessLookupError:
            continue
    return out
