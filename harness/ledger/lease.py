"""Which `running` runs are still being measured: process leases on a run.

Each process measuring a run holds a lease (host, pid, the process's start time, a heartbeat
renewed at every stored unit) and drops it when it stops. A run stored as `running` whose leases
are all dead is shown as `died`: on this host a lease is dead when its process is gone (or the
pid now belongs to another process); on another host when its heartbeat is older than
`STALE_AFTER_S`. A run with no lease at all (written before leases existed) is `running?`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone

STALE_AFTER_S = 6 * 3600   # another host's lease: a unit can take minutes, a heartbeat not hours


@dataclass(frozen=True)
class Lease:
    """One process measuring a run."""

    run_id: str
    host: str
    pid: int
    process: str | None
    heartbeat: str

    def alive(self) -> bool:
        """Whether the process holding this lease may still be measuring."""
        if self.host == socket.gethostname():
            if not _exists(self.pid):
                return False
            started = process_start(self.pid)
            return started is None or self.process is None or started == self.process
        return _age_s(self.heartbeat) < STALE_AFTER_S

    def text(self) -> str:
        """Who holds the lease, for messages."""
        return f"pid {self.pid} on {self.host}, last heartbeat {self.heartbeat}"


def this_process() -> tuple[str, int, str | None]:
    """(host, pid, start time) of this process: its lease's identity."""
    return socket.gethostname(), os.getpid(), process_start(os.getpid())


def process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), None if unknown or
    gone: a pid reused by another process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[19]
    except (OSError, IndexError):
        return None


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _age_s(stamp: str) -> float:
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return float("inf")
    return (datetime.now(timezone.utc) - when).total_seconds()


def shown_status(status: str, leases: list[Lease]) -> str:
    """A run's status as `runs` shows it: `running` only while a lease is alive."""
    if status != "running":
        return status
    if not leases:
        return "running?"
    return "running" if any(lease.alive() for lease in leases) else "died"
