"""The cuda backend's options: one frozen dataclass, seeded from ``KVX_CUDA_*`` when made."""

from __future__ import annotations

from dataclasses import dataclass, field

from ... import config as _cfg
from ...errors import UsageError

__all__ = ["AUTO_PLAN", "COPY_PATHS", "CudaOptions", "EXEC_POLICIES", "KERNELS"]

#: Copy paths (``CudaOptions.copy``).
COPY_PATHS = ("kernel", "ce", "split", "auto")
#: Executing-GPU policies (``CudaOptions.exec_on``).
EXEC_POLICIES = ("initiator", "owner", "pull")
#: Copy kernel variants (``CudaOptions.kernel``), as compiled from ``native/cuda/kvx_copy.cu``.
KERNELS = ("warpx", "warp", "warp16", "bulk", "pf")
#: ``auto``'s plan for GPU<->GPU transfers (the default of ``CudaOptions.auto_plan``).
AUTO_PLAN: tuple[tuple[int, str, float], ...] = ((0, "kernel", 0.0), (8 << 20, "ce", 0.0))


@dataclass(frozen=True, slots=True)
class CudaOptions:
    """Options of the ``cuda`` backend (``AgentConfig(options={"cuda": CudaOptions(...)})``).

    The backend reads them once, when it starts; a benchmark that compares variants makes one
    agent per variant. The first three are the deployment knobs (each seeded from its ``KVX_*``
    variable); the rest are **advanced**: the tuning sweeps (``benchmarks/gpu_tune.py``) vary them,
    their defaults are what those sweeps measured best on H100s (``docs/history.md``), and a
    deployment has no reason to change them.

    Parameters
    ----------
    copy
        Copy path: ``kernel`` (the batched NVRTC gather kernel), ``ce`` (``cuMemcpyBatchAsync`` on
        the copy engines, CUDA >= 12.8), ``split`` (part of the bytes on each at once) or ``auto``
        (per transfer by mean block size: :attr:`auto_plan` GPU<->GPU, :attr:`ce_min_block` with
        host memory) (``KVX_CUDA_COPY``).
    spin_us
        Microseconds a waiter polls its transfer's CUDA event natively (no GIL) before sleeping
        between polls; 0 or less: a Python poll loop (``KVX_CUDA_SPIN_US``).
    order
        How a copy is ordered with the caller's GPU work: ``legacy`` (a blocking stream: after
        everything queued on the legacy default stream -- torch's and cupy's default -- before
        the post, and before what is queued after it) or ``caller`` (a non-blocking stream: the
        caller makes sure the bytes are ready before posting, e.g. by waiting for a CUDA event;
        compute queued later never waits behind the copy nor the copy behind it, which is what
        lets layer-wise writes overlap the next layers) (``KVX_CUDA_ORDER``).
    exec_on
        Which GPU runs a GPU<->GPU copy with another process's memory when both GPUs are visible:
        ``initiator`` (the GPU of the initiator's memory: a write pushes, a read pulls), ``owner``
        (the GPU holding the peer's memory, where it is imported) or ``pull`` (the destination's
        GPU; the peer's memory is imported on both GPUs) (``KVX_CUDA_EXEC``).
    ce_min_block
        Advanced. ``auto`` with host memory on one side: the copy engines when the mean block is
        at least this many bytes, else the kernel.
    auto_plan
        Advanced. ``auto`` GPU<->GPU: sorted ``(minimum mean block, path, copy-engine fraction)``;
        the last entry whose minimum the mean block reaches decides (path ``kernel``, ``ce`` or
        ``split``; the fraction is used by ``split``).
    split_fraction
        Advanced. ``split``: the fraction of a transfer's bytes given to the copy engines.
    pipe_pairs
        Advanced. Kernel path: above this many pairs, stage and launch in pieces of this many
        pairs (0: one launch).
    staging_slots
        Advanced. Index staging slots per GPU (pinned host + device buffer each, reused).
    index_zerocopy
        Advanced. The kernel reads the indices from the pinned staging slot (mapped host memory)
        instead of an upload before the launch.
    index_i32
        Advanced. Stage indices as int32 when every list fits (False: always int64).
    native_post
        Advanced. Upload, launch and event record in one native call (False: three Python-level
        CUDA calls).
    native_staging
        Advanced. Equal-length lists: indices checked and staged natively without the GIL
        (False: numpy).
    route
        Advanced. The pair's cached route launches in one native call where it can (False: every
        post through the general path).
    reaper_poll
        Advanced. The completion reaper polls every this many seconds (0: it sleeps on events).
    reaper_lazy
        Advanced. With ``reaper_poll`` 0: a post without a notification does not wake an active
        reaper, which looks at such transfers every this many seconds (0: woken by every post).
    reaper_deep_after
        Advanced. Seconds with nothing pending after which the reaper sleeps until a post wakes it.
    chunk_shift
        Advanced. log2 of the bytes one warp copies per work item.
    chunk_shift_min
        Advanced. Small transfers: work items are halved down to 2**this many bytes while they
        still fit the kernel's warps.
    threads
        Advanced. Threads per CTA of the copy kernel (a multiple of 32, at most 1024).
    blocks_per_sm
        Advanced. Resident CTAs per SM aimed for, GPU<->GPU.
    blocks_per_sm_host
        Advanced. Resident CTAs per SM when one side is host memory.
    kernel
        Advanced. Copy kernel variant: ``warpx`` (chunk-major work items), ``warp`` (block-major),
        ``warp16`` (16 loads in flight per lane), ``bulk`` (Hopper TMA bulk copies) or ``pf``
        (next item's descriptors prefetched).
    blocks_per_sm_bulk
        Advanced. CTAs (of one warp) per SM for the ``bulk`` kernel.
    strided_group
        Advanced. Strided lists of small pieces (head slices): one warp copies a group of
        consecutive pieces of up to this many bytes (0: one warp per piece).
    """

    copy: str = _cfg.option("KVX_CUDA_COPY")
    spin_us: float = _cfg.option("KVX_CUDA_SPIN_US")
    exec_on: str = _cfg.option("KVX_CUDA_EXEC")
    order: str = _cfg.option("KVX_CUDA_ORDER")
    ce_min_block: int = 2 << 20
    auto_plan: tuple[tuple[int, str, float], ...] = field(default=AUTO_PLAN)
    split_fraction: float = 0.3
    pipe_pairs: int = 0
    staging_slots: int = 8
    index_zerocopy: bool = True
    index_i32: bool = True
    native_post: bool = True
    native_staging: bool = True
    route: bool = True
    reaper_poll: float = 0.0
    reaper_lazy: float = 0.002
    reaper_deep_after: float = 0.05
    chunk_shift: int = 14
    chunk_shift_min: int = 12
    threads: int = 256
    blocks_per_sm: int = 4
    blocks_per_sm_host: int = 8
    kernel: str = "warpx"
    blocks_per_sm_bulk: int = 6
    strided_group: int = 8192

    def __post_init__(self) -> None:
        # the option() fields are checked against their settings by config.check_options
        # (AgentConfig); these are the advanced ones, which have no variable
        def bad(name: str, why: str) -> UsageError:
            return UsageError(f"CudaOptions.{name}={getattr(self, name)!r}: {why}")

        def integer(name: str, lo: int, hi: int) -> None:
            v = getattr(self, name)
            if type(v) is not int or not lo <= v <= hi:
                raise bad(name, f"expected an integer between {lo} and {hi}")

        def number(name: str, lo: float, hi: float) -> None:
            v = getattr(self, name)
            if type(v) not in (int, float) or not lo <= v <= hi:
                raise bad(name, f"expected a number between {lo:g} and {hi:g}")

        for name in ("index_zerocopy", "index_i32", "native_post", "native_staging", "route"):
            if type(getattr(self, name)) is not bool:
                raise bad(name, "expected True or False")
        integer("ce_min_block", 0, 1 << 62)
        number("split_fraction", 0.0, 1.0)
        integer("pipe_pairs", 0, 1 << 31)
        integer("staging_slots", 1, 1024)
        number("reaper_poll", 0.0, 1.0)
        number("reaper_lazy", 0.0, 1.0)
        number("reaper_deep_after", 0.0, 3600.0)
        integer("chunk_shift", 4, 30)
        integer("chunk_shift_min", 4, 30)
        integer("threads", 32, 1024)
        if self.threads % 32:
            raise bad("threads", "expected a multiple of 32")
        integer("blocks_per_sm", 1, 64)
        integer("blocks_per_sm_host", 1, 64)
        integer("blocks_per_sm_bulk", 1, 64)
        integer("strided_group", 0, 1 << 20)
        if self.kernel not in KERNELS:
            raise bad("kernel", f"expected one of {', '.join(KERNELS)}")
        plan = self.auto_plan
        if (not isinstance(plan, tuple) or not plan
                or not all(isinstance(e, tuple) and len(e) == 3 and type(e[0]) is int and e[0] >= 0
                           and e[1] in ("kernel", "ce", "split") and type(e[2]) in (int, float) and 0 <= e[2] <= 1
                           for e in plan)
                or [e[0] for e in plan] != sorted(e[0] for e in plan)):
            raise bad("auto_plan", "expected a non-empty tuple of (minimum mean block, kernel|ce|split, fraction "
                                   "in [0, 1]) sorted by minimum")
