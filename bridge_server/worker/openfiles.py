"""How many files a worker holds open, against its limit: what a client's objects may take of it.

Why: what a client makes lives in the worker as long as its ref does, and some of it holds files
(a process group ~13 sockets, an entered `suppress_stdout` two descriptors, an engine dozens).
A stranger who made such objects in a loop took a worker to its limit: then the engine's own
probe could not open `/proc`, the healthy engine was declared dead, its rebuild failed, and the
worker died, with every client's refs and sessions. So a call that may make or enter something is
refused once the worker holds a share of its limit (`FILES_SHARE`), which leaves the rest to the
engine and to the worker's own sockets; releasing refs makes room again. What only reads or ends
something (a context's exit) is never refused for it, nor are the published engine's requests,
which hold no files. And what a call's object took is counted against its maker's share of that room
(`refs.py`), so that one client cannot take all of it.
"""

from __future__ import annotations

import os
import resource

import grpc

from bridge_server.wire.errors import BridgeError

__all__ = ["FILES_SHARE", "files_cap", "open_files", "room_for_files"]

FILES_SHARE = 0.25      # of the soft RLIMIT_NOFILE, what calls that make things may bring the worker to


def open_files() -> int | None:
    """The files the worker holds open now (listing `/proc/self/fd`: ~20 µs for a few hundred);
    None where there is no /proc to count them in."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except FileNotFoundError:
        return None
    except OSError:         # none left even to list them with: as many as may be
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def files_cap(share: float = FILES_SHARE) -> int | None:
    """The open files calls that make things may bring the worker to (None: no limit); read each
    time, as the limit may change under a running worker."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else int(soft * share)


def room_for_files(label: str, share: float = FILES_SHARE) -> None:
    """Refuses (RESOURCE_EXHAUSTED) a call that may hold more files, past `share` of the limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    cap = int(soft * share)
    used = open_files()
    if used is not None and used >= cap:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "worker",
                          f"{label}: this worker holds {used:,} open files, and a call that may make or enter "
                          f"something runs only while it holds fewer than {cap:,} ({share:.0%} of its limit of "
                          f"{soft:,}, the rest kept for its engines and connections): release refs first",
                          target=label, reason="too many open files")
