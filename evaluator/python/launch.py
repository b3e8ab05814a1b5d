"""Starting a job of ranks on this machine, as a launcher would: one process
per rank with torch.distributed's environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, a fresh ``MASTER_PORT`` on loopback),
nodes simulated as groups of ``ranks_per_node`` consecutive ranks. The
memory tier's benchmark and its fault campaign start their jobs, kill them
and start them again through this module, so a restart is timed from the
moment its processes are started, without torchrun in between.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

__all__ = ["free_port", "rank_env", "start_ranks", "kill_ranks", "finish_ranks"]


def free_port() -> int:
    """A free TCP port on loopback (the job's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, ranks_per_node: int, port: int) -> dict:
    """This process's environment plus what torch.distributed's ``env://``
    rendezvous and the memory tier read for ``rank``."""
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank % ranks_per_node), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(ranks_per_node), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                OMP_NUM_THREADS="1")


def start_ranks(script: str, args: list, world: int, ranks_per_node: int, stdout=subprocess.DEVNULL) -> list:
    """Start ``python script *args`` as ``world`` ranks of one job; their
    stderr is kept (``finish_ranks`` reports it)."""
    port = free_port()
    return [subprocess.Popen([sys.executable, script, *args], env=rank_env(r, world, ranks_per_node, port),
                             stdout=stdout, stderr=subprocess.PIPE, text=True) for r in range(world)]


def kill_ranks(procs: list, first: list = ()) -> None:
    """SIGKILL the ranks ``first`` (indices), then every rank still running,
    as a launcher tears a job down, and reap them all."""
    for r in first:
        procs[r].send_signal(signal.SIGKILL)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()


def finish_ranks(procs: list, timeout: float, what: str) -> None:
    """Wait for every rank; if one fails or ``timeout`` s pass, kill the job
    and raise with the end of the ranks' stderr."""
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=timeout)[1] or "")
    except subprocess.TimeoutExpired:
        kill_ranks(procs)
        raise RuntimeError(f"{what}: the job ran past {timeout:.0f} s") from None
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{what}: the job failed (exit {[p.returncode for p in procs]}): {''.join(errs)[-3000:]}")
