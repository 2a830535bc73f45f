"""Collectives of a tensor-parallel run, each bounded in time and failing with one line.

`Comm` holds the process group of the model's data (NCCL on CUDA, gloo on CPU)
and a gloo group for control messages (rank 0's commands and sampled ids, which
live on the host). Every collective is bounded by the process groups' timeout:
gloo enforces it per operation, NCCL through its watchdog, which aborts the
communicator; a peer that died is seen at once by gloo (its sockets close). A
failure that the call itself sees becomes a `ParallelError` naming the rank and the
operation, which the CLI prints as ``qfuse: error: ...``.

Not every failure is seen there. NCCL collectives are asynchronous: `all_reduce`
returns once the kernel is queued, and a peer lost during it surfaces later (at a
synchronization, or as the watchdog's abort, which ends the process). Collectives
captured in a CUDA graph are not watched at all: a replay whose peer is gone waits
on the GPU. In those cases the backstop is torchrun's teardown: when one rank
exits, its agent stops the others (they exit without a line of their own).

All-reduce on CUDA, ``allreduce=``:

- ``"nccl"``: `dist.all_reduce`, captured inside the decode step's CUDA
  graph like every other kernel (NCCL supports capture).
- ``"symm_mem"``: PyTorch symmetric memory's one-shot all-reduce
  (`torch.ops.symm_mem.one_shot_all_reduce`: every rank reads the peers' buffers
  over NVLink and sums; no multicast, no multimem instructions). Used for tensors up
  to SYMM_MEM_MAX_BYTES (the decode step's); larger ones (prefill) take NCCL. One
  symmetric buffer per shape: the op synchronizes the ranks at its start and end, so
  the next call may overwrite it.
- ``"p2p"`` (default): qfuse's own one-shot kernel (`qfuse.kernels.comm.p2p_allreduce`):
  each rank pushes its rows into every rank's symmetric buffer over NVLink and raises
  a flag; one launch, no copy in, no closing barrier. What it does not take (more
  rows than its CHANNELS: prefill) takes NCCL.

NVLink multicast stays off in every process (`MULTICAST_OFF`, set before any
process group exists): see the device README for why.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import os
import sys
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..errors import UserError

if TYPE_CHECKING:
    from ..kernels.comm.p2p_allreduce import P2PWorkspace

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
ALLREDUCE_KINDS = ("nccl", "symm_mem", "p2p")
SYMM_MEM_MAX_BYTES = 1 << 20  # a decode step's hidden vector at batch 64, hidden 8192, bf16
_MESSAGE_BYTES = 512  # an error message exchanged between ranks, UTF-8, cut to this


class ParallelError(UserError, RuntimeError):
    """A tensor-parallel run that lost a rank, timed out, or could not start."""


_started = False  # whether this process called init (the CLI's rule for ranks other than 0)
_comms: list[Comm] = []  # the Comms init made: shutdown drops their groups


def started() -> bool:
    """Whether this process joined a process group (`init`): an error a rank other than 0
    raises before that comes from checks every rank makes alike, and rank 0 reports it;
    one raised after may be this rank's alone."""
    return _started


def multicast_off() -> None:
    """Keep NVLink multicast off in this process (and those it starts): set outright,
    whatever the environment said (the rule has no exceptions). On one host (torchrun's
    LOCAL_WORLD_SIZE equal to WORLD_SIZE) gloo's and NCCL's bootstrap sockets stay on
    the loopback interface, unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise."""
    for key, value in MULTICAST_OFF.items():
        os.environ[key] = value
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    if local and local == world:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


# torch 2.13 renamed all_gather_into_tensor (the GPU machine has 2.11).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world_from_env() -> int:
    """WORLD_SIZE of a torchrun job, 1 outside one."""
    try:
        return int(os.environ.get("WORLD_SIZE") or "1")
    except ValueError as e:
        raise UserError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not a number") from e


def one_line(e: BaseException, limit: int | None = None) -> str:
    """The error's message on one line (its whitespace runs made single spaces), cut
    to ``limit`` characters; its type's name when it has none."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if limit is None else text[:limit]


@functools.cache  # asked at every all-reduce (per layer, per step): imported once
def _p2p_kernels():
    """`qfuse.kernels.comm.p2p_allreduce`: Triton, imported only where a kernel launches."""
    from ..kernels.comm import p2p_allreduce

    return p2p_allreduce


class Comm:
    """One rank's view of the tensor-parallel group.

    rank, world: this process's rank and the number of ranks; device: its device.
    A world of 1 makes every collective the identity (no process group needed)."""

    def __init__(self, rank: int = 0, world: int = 1, device="cpu", group=None, control=None,
                 timeout_s: float = 600.0, allreduce: str = "p2p"):
        if allreduce not in ALLREDUCE_KINDS:
            raise UserError(f"--tp-allreduce must be one of {', '.join(ALLREDUCE_KINDS)}, "
                            f"got {allreduce!r}")
        self.rank, self.world, self.device = rank, world, torch.device(device)
        self.group, self.control, self.timeout_s = group, control, timeout_s
        self.allreduce = allreduce if self.device.type == "cuda" else "nccl"
        self._symm: dict = {}
        self._p2p: dict = {}

    # -- the model's collectives (graph-capturable on CUDA) -------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Σ over ranks of x (any shape), as a new or the same tensor."""
        if self.world == 1:
            return x
        if self.allreduce == "symm_mem" and x.numel() * x.element_size() <= SYMM_MEM_MAX_BYTES:
            return self._symm_all_reduce(x)
        if self.allreduce == "p2p":  # CUDA only (see __init__), where Triton is
            p2p_allreduce = _p2p_kernels()
            if p2p_allreduce.unsupported_reason(x) is None:
                return p2p_allreduce.p2p_all_reduce(x, self._p2p_workspace(x))
        x = x.contiguous()
        self.collective("all-reduce", lambda: dist.all_reduce(x, group=self.group))
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank concatenated in rank order: [..., world·n]."""
        if self.world == 1:
            return x
        x = x.contiguous()
        # The concatenated form [world·n0, ...]: the one both NCCL and gloo accept.
        out = x.new_empty(self.world * x.shape[0], *x.shape[1:])
        self.collective("all-gather", lambda: _all_gather_single(out, x, group=self.group))
        return torch.cat(out.chunk(self.world, 0), dim=-1)

    def _symm_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """One-shot all-reduce through a symmetric buffer of x's shape (made and exchanged
        on first use, eagerly: before CUDA-graph capture, as the warm-up step does)."""
        import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

        key = (tuple(x.shape), x.dtype)
        buf = self._symm.get(key)
        if buf is None:
            buf = symm_mem.empty(*x.shape, dtype=x.dtype, device=x.device)
            self.collective("symmetric-memory rendezvous",
                            lambda: symm_mem.rendezvous(buf, self.group.group_name))
            self._symm[key] = buf
        buf.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group.group_name)

    def _p2p_workspace(self, x: torch.Tensor) -> P2PWorkspace:
        """The p2p kernel's workspace for rows like x's (made and exchanged on first use,
        eagerly, like the symmetric buffer above; its flags zeroed on every rank before
        any rank can push)."""
        key = (x.shape[-1], x.dtype)
        entry = self._p2p.get(key)
        if entry is None:  # the imports here too: this runs at every all-reduce
            import torch.distributed._symmetric_memory as symm_mem  # CUDA builds only

            p2p_allreduce = _p2p_kernels()
            nbytes = p2p_allreduce.P2PWorkspace.nbytes(self.world, x.shape[-1], x.dtype)
            buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=x.device)
            buf.zero_()
            try:
                handle = self.collective("symmetric-memory rendezvous",
                                         lambda: symm_mem.rendezvous(buf, self.group.group_name))
            except ParallelError as e:  # e.g. GPUs without peer access
                raise ParallelError(f"{e}; --tp-allreduce nccl needs no symmetric memory") from e
            torch.cuda.synchronize(x.device)
            self.barrier("the p2p workspace's zeroing")
            # the allocation may start before the tensor: address the tensor itself
            shift = buf.data_ptr() - handle.buffer_ptrs[self.rank]
            bases = torch.tensor([p + shift for p in handle.buffer_ptrs], dtype=torch.int64,
                                 device=x.device)
            epochs = torch.zeros(p2p_allreduce.CHANNELS, dtype=torch.int32, device=x.device)
            ws = p2p_allreduce.P2PWorkspace(bases, epochs, self.rank, self.world,
                                            x.shape[-1], x.dtype)
            entry = self._p2p[key] = (ws, buf, handle)  # buf and handle keep the mapping
        return entry[0]

    def release(self) -> None:
        """Drop this Comm's references to the process groups and their buffers (`shutdown`:
        after the group is destroyed, so that it can be freed); its collectives fail after."""
        self.group = self.control = None
        self._symm.clear()
        self._p2p.clear()

    # -- control messages (host tensors on the gloo group) --------------------------------
    def broadcast(self, t: torch.Tensor, what: str = "a command") -> torch.Tensor:
        """Rank 0's ``t`` (a CPU tensor) into every rank's ``t``, in place."""
        if self.world > 1:
            self.collective(f"broadcast of {what}",
                            lambda: dist.broadcast(t, 0, group=self.control))
        return t

    def agree(self, error: str | None) -> list[tuple[int, str]]:
        """Every rank's error of a step (None: it went well), so all ranks stop together:
        [(rank, message)] of the ranks that failed, the same list on every rank."""
        if self.world == 1:
            return [(0, error)] if error is not None else []
        mine = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.uint8)
        if error is not None:
            data = error.encode()[:_MESSAGE_BYTES]
            mine[0] = 1
            mine[1: 1 + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        every = [torch.zeros_like(mine) for _ in range(self.world)]
        self.collective("exchange of status",
                        lambda: dist.all_gather(every, mine, group=self.control))
        return [(r, bytes(t[1:].tolist()).rstrip(b"\0").decode(errors="replace"))
                for r, t in enumerate(every) if t[0]]

    def barrier(self, what: str = "a barrier") -> None:
        if self.world > 1:
            self.collective(what, lambda: dist.barrier(group=self.control))

    def collective(self, what: str, op):
        """``op()`` (a collective called ``what`` in errors) and its result; a failure,
        such as a rank that stopped or timed out, becomes a ParallelError."""
        try:
            return op()
        except (RuntimeError, dist.DistError) as e:  # DistBackendError, gloo's IO errors
            raise ParallelError(
                f"rank {self.rank} of {self.world}: {what} failed: another rank stopped "
                f"or did not answer within {self.timeout_s:g} s ({one_line(e, 200)})") from e


def init(device: torch.device, timeout_s: float = 600.0, allreduce: str = "p2p") -> Comm:
    """The process group of a torchrun job (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
    environment), NCCL on CUDA (this rank's GPU: LOCAL_RANK) and gloo on CPU, with a
    gloo group beside NCCL for control messages. Every rank must call it; a rank that
    does not come within ``timeout_s`` makes the others fail with a ParallelError."""
    global _started
    multicast_off()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    _started = True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if device.type == "cuda":
            dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                    device_id=device)
            control = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
            control = dist.group.WORLD
    except (RuntimeError, dist.DistError, ValueError) as e:
        raise ParallelError(f"rank {rank} of {world}: the {world} processes did not all start "
                            f"within {timeout_s:g} s ({one_line(e, 200)})") from e
    comm = Comm(rank, world, device, dist.group.WORLD, control, timeout_s, allreduce)
    _comms.append(comm)
    return comm


def shutdown(timeout_s: float = 10.0) -> bool:
    """Destroy the process group and free it, waiting at most ``timeout_s`` (it has been
    seen to hang after NCCL runs); False if it did not finish, and the caller should then
    leave with os._exit, since the hung thread would hold the interpreter's exit.

    Freeing is what makes the exit safe. destroy_process_group leaves gloo's worker
    threads running while anything references the group (every Comm does), and a worker
    still releasing the tensors of the last collective takes the GIL to do so: if the
    interpreter is finalizing by then, Python ends that thread inside a C++ destructor and
    the process aborts ("terminate called without an active exception", SIGABRT). Dropping
    the last reference joins the workers here, while the interpreter is whole (torch's
    binding releases the GIL for that join)."""
    if not dist.is_initialized() and not _comms:
        return True
    done = threading.Event()

    def destroy():
        # A failing teardown is as good as a finished one: the process is leaving.
        with contextlib.suppress(Exception):
            if dist.is_initialized():
                dist.destroy_process_group()
        while _comms:
            _comms.pop().release()
        gc.collect()  # a group held by a cycle is freed here too, not at exit
        done.set()

    threading.Thread(target=destroy, daemon=True, name="qfuse-tp-shutdown").start()
    return done.wait(timeout_s)


def hard_exit(code: int) -> None:
    """Leave now with ``code``, after flushing what this process printed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
