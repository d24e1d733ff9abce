"""vLLM's own OffloadingConnector on a CPU-only machine: its scheduler role, its worker role and
its CPU tier's manager are vLLM's; only the copy engine is the rig's.

vLLM's ``CPUOffloadingSpec`` refuses to build its worker off CUDA and XPU
(``vllm/v1/kv_offload/cpu/spec.py``, ``get_worker``: "CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs"): its copies are CUDA kernels on CUDA streams. ``RigCPUOffloadingSpec``
is that spec with one method replaced, ``get_worker``, and is loaded the way vLLM lets a user plug
a spec in, through ``OffloadingSpecFactory`` (``kv_connector_extra_config``: ``spec_name`` and
``spec_module_path``, see ``offloading_extra_config``). Everything else stays vLLM's:
``OffloadingConnectorScheduler`` (lookups, store cursors, the jobs to flush),
``CPUOffloadingManager`` (which chunks the tier holds, LRU), ``OffloadingConnectorWorker``
(stores deferred to the next step, ``handle_preemptions``' flush).

``RigOffloadingWorker`` moves the bytes between the KV-content oracle's caches and a host tensor,
with the copy plan of vLLM's ``SingleDirectionOffloadingHandler`` for the direct layout (one KV
group, no canonical layout): block ``i`` of a transfer is sub-block ``(block_index + i) %
blocks_per_chunk`` of its chunk. Its timing is the latest vLLM's contract allows
(``OffloadingWorker``: stores and loads are asynchronous, ``wait`` blocks until they are done):

- a load writes its blocks when it is submitted (it is done before vLLM hears of it, and a
  synchronous load is waited on in the same step anyway);
- a store reads its blocks at the latest moment: when it is waited on (``jobs_to_flush``: the
  scheduler fences a block it hands out again while a store still reads it), or else at the
  worker's report after the step's loads and forward pass, as a CUDA store stream that has not
  run yet would. A fence the scheduler forgets is then a store that reads what the step wrote.

Nothing here is imported by what vLLM loads in production.
"""

from __future__ import annotations

from typing import Any

import torch

# RigCPUOffloadingSpec (RIG_SPEC) is made on first use (module __getattr__): vLLM's base class
# is imported then, not when this module is.
__all__ = [
    "RIG_SPEC",
    "RigOffloadingWorker",
    "offloading_extra_config",
    "rig_workers",
]

RIG_SPEC = "RigCPUOffloadingSpec"


def offloading_extra_config(
    *, offloaded_block_size: int, cpu_bytes: int = 1 << 22, **more: Any
) -> dict[str, Any]:
    """OffloadingConnector's ``kv_connector_extra_config`` with the rig's spec: chunks of
    ``offloaded_block_size`` tokens (whole GPU blocks), a CPU tier of ``cpu_bytes``."""
    return {
        "spec_name": RIG_SPEC,
        "spec_module_path": __name__,
        "block_size": offloaded_block_size,
        "cpu_bytes_to_use": cpu_bytes,
        **more,
    }


def _spec_base() -> type:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    return CPUOffloadingSpec


class RigOffloadingWorker:
    """vLLM's ``OffloadingWorker`` interface over CPU tensors; see the module docstring."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, num_chunks: int) -> None:
        if len(kv_caches.group_data_refs) != 1:
            raise NotImplementedError("the rig's copy engine handles one KV cache group")
        self.blocks_per_chunk = blocks_per_chunk
        self.refs = list(kv_caches.group_data_refs[0])
        self.gpu: list[torch.Tensor] = []
        self.cpu: list[torch.Tensor] = []
        for cache in kv_caches.tensors:
            page = int(cache.page_size_bytes)
            self.gpu.append(cache.tensor.view(torch.int8).view(-1, page))
            self.cpu.append(torch.zeros((num_chunks, page * blocks_per_chunk), dtype=torch.int8))
        self._stores: dict[int, tuple[Any, Any]] = {}  # submitted, not read yet
        self._done: list[int] = []
        self.stores_read: list[tuple[int, str]] = []  # (job id, "waited" or "reported")

    # -- vLLM's OffloadingWorker --------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self._stores[job_id] = (src_spec, dst_spec)
        return True

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        self._copy(dst_spec, src_spec.block_ids, to_cpu=False)
        self._done.append(job_id)
        return True

    def get_finished(self) -> list[Any]:
        from vllm.v1.kv_offload.base import TransferResult

        for job_id in list(self._stores):
            self._run_store(job_id, "reported")
        done, self._done = self._done, []
        return [TransferResult(job_id=j, success=True) for j in done]

    def wait(self, job_ids: set[int]) -> None:
        for job_id in sorted(job_ids):
            if job_id in self._stores:
                self._run_store(job_id, "waited")

    def shutdown(self) -> None:
        self._stores.clear()

    # -- copies -------------------------------------------------------------------------------

    def _run_store(self, job_id: int, how: str) -> None:
        src_spec, dst_spec = self._stores.pop(job_id)
        self._copy(src_spec, dst_spec.block_ids, to_cpu=True)
        self._done.append(job_id)
        self.stores_read.append((job_id, how))

    def _copy(self, gpu_spec: Any, chunk_ids: Any, *, to_cpu: bool) -> None:
        """Copy ``gpu_spec``'s blocks to (or from) the chunks ``chunk_ids``, as vLLM's copy plan
        for the direct layout lays them out."""
        (group_size,) = gpu_spec.group_sizes
        (block_index,) = gpu_spec.block_indices
        bpc = self.blocks_per_chunk
        skip = int(block_index) % bpc
        for i, block in enumerate(gpu_spec.block_ids[:group_size]):
            chunk, sub = divmod(i + skip, bpc)
            for ref in self.refs:
                gpu, cpu = self.gpu[ref.tensor_idx], self.cpu[ref.tensor_idx]
                size = int(ref.page_size_bytes)
                start = sub * gpu.shape[1]
                host = cpu[int(chunk_ids[chunk]), start : start + size]
                if to_cpu:
                    host.copy_(gpu[int(block), :size])
                else:
                    gpu[int(block), :size].copy_(host)


def rig_workers(connector: Any) -> list[RigOffloadingWorker]:
    """The rig's copy engines under a worker-role connector, in order: an OffloadingConnector's,
    looked for through the recorder (``inner``) and vLLM's MultiConnector (its children)."""
    inner = getattr(connector, "inner", None)
    if inner is not None:  # the recorder (which forwards what it lacks to its inner)
        return rig_workers(inner)
    found: list[RigOffloadingWorker] = []
    for child in getattr(connector, "_connectors", ()):
        found += rig_workers(child)
    worker = getattr(getattr(connector, "connector_worker", None), "worker", None)
    if isinstance(worker, RigOffloadingWorker):
        found.append(worker)
    return found


def __getattr__(name: str) -> Any:
    # vLLM's spec class is built on first use: importing this module needs no vLLM.
    if name == RIG_SPEC:
        cls = _make_spec()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _make_spec() -> type:
    base = _spec_base()

    class RigCPUOffloadingSpec(base):  # type: ignore[misc, valid-type]
        """vLLM's ``CPUOffloadingSpec`` (its manager, its sizes) with the rig's copy engine
        as its worker."""

        def get_worker(self, kv_caches: Any) -> Any:
            if self.config.canonical_layout:  # vLLM's copy plan of pages shared by ranks
                raise NotImplementedError("the rig's copy engine has no canonical layout")
            worker: Any = getattr(self, "_worker", None)  # CPUOffloadingSpec's worker slot
            if worker is None:
                worker = RigOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
                self._worker = worker
            return worker

    RigCPUOffloadingSpec.__module__ = __name__
    RigCPUOffloadingSpec.__qualname__ = RIG_SPEC
    return RigCPUOffloadingSpec
