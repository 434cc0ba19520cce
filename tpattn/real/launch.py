"""Start one process per rank in one process group, watch them, fail fast (``run_on_ranks``):
the first rank that raises, exits or stops reporting ends the run with ``RankFailure``."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue as queue_lib
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = ["DEFAULT_TIMEOUT", "RankFailure", "run_on_ranks", "default_backend", "rank_device",
           "pin_gloo_to_loopback", "backend_message", "describe_error"]

#: Seconds any collective (and the rendezvous) may wait before the run fails.
DEFAULT_TIMEOUT = 60.0
#: After the first failure, how long the other ranks may take to report what they saw (up to
#: min(timeout, 5 s) while every report so far is a failed collective).
FAILURE_GRACE_S = 1.0


class RankFailure(RuntimeError):
    """A multi-process run failed; the message is one line naming the rank (``rank``)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


def default_backend(world_size: int) -> str:
    """``"nccl"`` when there is one CUDA device per rank, else ``"gloo"`` (CPU)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"


def rank_device(backend: str, local_rank: int) -> torch.device:
    """A rank's device, one CPU thread each: its GPU under NCCL (made current), else the CPU."""
    torch.set_num_threads(1)
    if backend != "nccl":
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def pin_gloo_to_loopback() -> None:
    """Make gloo talk over the loopback interface (single-host runs) unless the user chose one."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def backend_message(e: BaseException) -> str:
    """The useful part of a gloo/NCCL error: first sentence, no ``[file.cc:12]`` prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ")[0].rstrip(".")


def describe_error(e: BaseException) -> str:
    """One line: a collective's own message, or ``Type: message (file.py:line)``."""
    if getattr(e, "in_collective", False):
        return str(e)
    where = ""
    if e.__traceback__ is not None:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        where = f" ({os.path.basename(frame.filename)}:{frame.lineno})"
    return f"{type(e).__name__}: {backend_message(e)}{where}"


def _exit_with_parent() -> None:
    """End this rank process as soon as the process that started it is gone: no orphans."""
    parent = multiprocessing.parent_process()

    def watch():
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="tpattn-parent-watch", daemon=True).start()


def _rank_main(rank_fn, rank: int, world_size: int, port: int, plan, backend: str,
               timeout: float, messages) -> None:
    """Body of every rank process: join the group, run ``rank_fn``, report to the parent."""
    _exit_with_parent()
    pin_gloo_to_loopback()
    try:
        device = rank_device(backend, rank)
        wait = timedelta(seconds=timeout)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=wait)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=wait)
        messages.put(("ready", rank, time.monotonic()))
        result = rank_fn(rank, plan, device, lambda step: messages.put(("progress", rank, step)))
        messages.put(("done", rank, result))
        dist.destroy_process_group()
    except BaseException as e:  # report, then leave at once (backend threads may still block)
        messages.put(("error", rank, {"in_collective": bool(getattr(e, "in_collective", False)),
                                      "message": describe_error(e),
                                      "deviation": getattr(e, "deviation", None)}))
        messages.close()
        messages.join_thread()
        os._exit(1)


def run_on_ranks(rank_fn, world_size: int, plan, *, timeout: float, backend: str,
                 start_method: str = "forkserver", preload: tuple[str, ...] = ()):
    """``rank_fn(rank, plan, device, on_progress)`` (module-level, picklable result) in
    ``world_size`` fresh processes of one group (``"forkserver"``: ``preload`` imported once):
    ``(results by rank, {"startup_s", "total_s"})``; ``RankFailure`` on any failure."""
    if start_method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        start_method = "spawn"  # Windows
    ctx = torch.multiprocessing.get_context(start_method)
    if start_method == "forkserver" and preload:
        ctx.set_forkserver_preload(list(preload))
    started = time.monotonic()
    store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    messages = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, name=f"tpattn-rank-{rank}", daemon=True,
                         args=(rank_fn, rank, world_size, store.port, plan, backend, timeout, messages))
             for rank in range(world_size)]
    try:
        for p in procs:
            p.start()
        results, ready = _supervise(procs, messages, timeout)
    finally:
        _stop(procs)
        messages.close()
        del store
    return ([results[rank] for rank in range(world_size)],
            {"startup_s": max(ready.values()) - started, "total_s": time.monotonic() - started})


def _stop(procs) -> None:
    """Terminate, then kill, every rank process still alive; reap them all."""
    procs = [p for p in procs if p.pid is not None]  # the started ones
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _supervise(procs, messages, timeout: float):
    """Every rank's report, ``(results, ready_times)`` by rank; ``RankFailure`` at the first."""
    world_size = len(procs)
    ready, done, errors, silent_exit, stalled = {}, {}, {}, {}, {}
    heard = dict.fromkeys(range(world_size), time.monotonic())
    startup_limit = max(120.0, timeout)   # importing torch on a busy machine
    stall_limit = 2 * timeout + 30.0      # any collective times out long before this
    failed_at = None

    def drain(wait: float) -> None:
        end = time.monotonic() + wait
        while True:
            try:
                kind, rank, body = messages.get(timeout=max(0.0, end - time.monotonic()))
            except queue_lib.Empty:
                return
            heard[rank] = time.monotonic()
            {"ready": ready, "done": done, "error": errors}.get(kind, {})[rank] = body

    while len(done) < world_size:
        drain(0.05)
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if p.exitcode is not None and rank not in done and rank not in errors \
                    and rank not in silent_exit:
                drain(0.2)  # its last message may still be in the pipe
                if rank not in done and rank not in errors:
                    silent_exit[rank] = p.exitcode
            elif p.exitcode is None and rank not in done and rank not in stalled:
                if now - heard[rank] > (stall_limit if rank in ready else startup_limit):
                    stalled[rank] = now - heard[rank]
        if failed_at is None and (errors or silent_exit or stalled):
            failed_at = now
        if failed_at is not None:
            settled = all(r in done or r in errors or r in stalled or procs[r].exitcode is not None
                          for r in range(world_size))
            # A failed collective is usually a consequence: give the rank that caused it a
            # little longer to say so (its own wait may have started a moment later).
            cause_known = silent_exit or any(not e["in_collective"] or e["deviation"]
                                             for e in errors.values())
            grace = FAILURE_GRACE_S if cause_known else max(FAILURE_GRACE_S, min(timeout, 5.0))
            if settled or now - failed_at > grace:
                for rank, p in enumerate(procs):  # one that died since the scan above
                    if p.exitcode is not None and rank not in done and rank not in errors:
                        silent_exit.setdefault(rank, p.exitcode)
                raise _diagnose(errors, silent_exit, stalled)
    return done, ready


def _diagnose(errors, silent_exit, stalled) -> RankFailure:
    """One line blaming, in order, the first rank to exit silently, one that raised on its
    own, one that left the plan, one that stopped reporting, else the first failed collective."""
    own = {r: e["message"] for r, e in errors.items() if not e["in_collective"]}
    strayed = {r: e["deviation"] for r, e in errors.items() if e["deviation"]}
    if silent_exit:
        rank, *others = silent_exit  # dicts keep insertion order: the first one noticed
        cause = f"rank {rank} exited (exit code {silent_exit[rank]}) before finishing its work"
        if others:
            cause += " — " + "; ".join(f"rank {r} exited (exit code {silent_exit[r]})"
                                       for r in others)
    else:  # _supervise raises only after a failure: one of these is not empty
        found, say = next((d, say) for d, say in (
            (own, "rank {r} raised {v}"), (strayed, "rank {r} skipped a collective: {v}"),
            (stalled, "rank {r} stopped reporting ({v:.0f} s without progress)"),
            ({r: e["message"] for r, e in errors.items()}, "rank {r}: {v}")) if d)
        rank = min(found)
        cause = say.format(r=rank, v=found[rank])
    seen = [f"rank {r}: {e['message']}" for r, e in sorted(errors.items())
            if r != rank or rank in strayed]
    if seen:
        cause += " — then " + "; ".join(seen)
    return RankFailure("real-rank run failed: " + cause, rank)
