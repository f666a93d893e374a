"""``cuda``: GPU memory and pinned host memory between processes of one machine (and within one).

What it moves: CUDA device memory (torch/cupy tensors, ``kvx.RawRegion(..., MemoryKind.CUDA)``)
to and from CUDA memory or pinned host memory (``kvx.alloc_host(n, pinned=True)``, torch pinned
tensors), in the same process or another process of the node, on the same GPU or a peer GPU.

How:

- **Reach.** A peer's GPU memory is imported with CUDA IPC: the target exports
  ``cudaIpcGetMemHandle`` of the *allocation base* (``cuMemGetAddressRange``: a tensor from a
  caching allocator is an offset inside a larger segment) on request over an AF_UNIX channel;
  the initiator opens it once (``cudaIpcOpenMemHandle``, cached and reference counted per
  handle) and closes it when the target revokes the region or the peer goes away. A peer's
  pinned host memory is its ``alloc_host`` memfd, passed with SCM_RIGHTS, mapped here and
  registered with CUDA here too (``cudaHostRegister``), so the local GPU reaches it directly.
- **Copies.** One launch per transfer, never a Python loop per block. Two paths
  (``CudaOptions.copy``, ``KVX_CUDA_COPY``): ``kernel``, a batched gather/scatter kernel compiled at run time with
  NVRTC (``native/cuda/kvx_copy.cu``; the prepared lists' address arrays stay on the device,
  each transfer uploads only its index arrays), and ``ce``, ``cuMemcpyBatchAsync`` on the copy
  engines (CUDA >= 12.8). ``auto`` (the default) picks per transfer by mean block size; see
  ``docs/history.md`` for the measurements behind the threshold.
- **Completion.** A CUDA event recorded after the copy; ``Request.test`` queries it, and a
  reaper thread retires finished transfers (counters, notifications) even if nobody polls.
- **Safety.** Remote descriptors are validated by the agent's ``prepare``. Release is final:
  like the host backend, each agent publishes a control table (memfd) with
  ``state = generation << 1 | live`` per slot and gives each peer a page of in-flight counters;
  the initiator raises the counters of the slots a transfer touches, checks their states, and
  lowers them when the transfer's event has completed; ``release`` clears the live bit, waits
  for the counters to drain, then tells the peers to close their mappings. A peer whose channel
  dies fails its pending transfers with ``PeerDisconnected``.

cupy is imported lazily; without it (or without a GPU) :meth:`CudaBackend.unavailable_reason`
says what is missing and ``import kvx`` is unaffected.

Settings: :class:`CudaOptions` (``AgentConfig(options={"cuda": CudaOptions(...)})``), read once
when the backend starts. The package's files: ``options`` (the options), ``errors`` (the one error
map), ``driver`` (libcuda entry points cupy does not wrap), ``device`` (a GPU: stream, kernels,
launch), ``staging`` (the index staging ring), ``indices`` (index forms and checks), ``prep``
(per prepared list state), ``request`` (a launched transfer), ``reaper`` (the completion thread),
``ipc`` (the control table, peers, importing their memory), ``route`` (a list pair's cached
route), ``launch`` (executing GPU, path, kernel and copy-engine launches), ``backend`` (the rest).
"""

from .backend import CudaBackend
from .errors import ERRORS, CudaError
from .options import CudaOptions

__all__ = ["ERRORS", "CudaBackend", "CudaError", "CudaOptions"]
