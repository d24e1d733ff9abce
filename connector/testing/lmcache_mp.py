"""LMCache's multiprocess (MP) mode under vLLM's real scheduler, on CPU (a test rig, not product).

vLLM 0.33 loads ``LMCacheMPConnector`` from its registry, which resolves to the class LMCache
ships (``lmcache.integration.vllm.lmcache_mp_connector``): its scheduler role (request trackers,
lookups, the ``need_flush_before_forward`` hint at a preemption) and its worker role
(``LMCacheMPWorkerAdapter``, its transfer context) are LMCache's own, and so is the server they
talk to: LMCache's MP cache server (``lmcache.v1.multiprocess.server.run_cache_server``: its
storage manager, its L1 in CPU memory, its ``LMCacheDrivenTransferModule``), started in the rig's
child process and reached over ZMQ on the loopback address. Nothing of LMCache is replaced.

The transfer mode is LMCache's LMCache-driven path (``LMCACHE_MP_TRANSFER_MODE=lmcache_driven``),
which LMCache 0.5.x runs on CPU through POSIX shared memory: at ``register_kv_caches`` the
worker adapter re-points the oracle's paged caches at SHM segments
(``migrate_to_shm_and_wrap``) and the server maps the same pages. A store is then the
server's: ``wait_for_save`` sends STORE with the block ids and returns; the server's STORE
handler copies the blocks out later, on its own thread, exactly the window LMCache #4955 is
about.

What the rig adds is timing, never bookkeeping:

- **the server's store reads its blocks as late as LMCache's own synchronization lets it**
  (``ServerTiming``): the server's STORE handler waits until the worker waits on that store's
  future (LMCache's ``MessagingFuture.wait`` / ``result`` on the future its transfer context
  returned: a drain at a preemption, ``get_finished``), else until the step after the one
  that issued it has run its forward pass. On a GPU the server's copy races the next
  forward; here it always loses the race unless LMCache waits for it;
- **a lookup is answered between steps**: LMCache's lookups are asynchronous (the scheduler
  sends LOOKUP, then polls the server's acknowledgement each step). The acknowledgement of a
  LOOKUP is shown to the scheduler only after the step that sent it (``MessagingFuture.query``
  answers False until then), and between steps the rig waits until the server has
  acknowledged it and gives its prefetch a moment, as a real forward pass takes time: each
  lookup is answered at its second poll, whatever the machine's load, and the schedule is
  the same from run to run. ``lmcache.mp.nonblocking_lookup_status`` is off (LMCache waits
  for the prefetch status in that poll);
- the KV cache layout, which vLLM's engine core resolves before the worker starts
  (``resolve_kv_cache_layout``), is set to the oracle's (``NHD``).

Each version runs in a child process (``run_version`` here: ``LMCacheMPRun`` workloads run
here, the adapter rig's through ``connector.testing.lmcache``), with ``build/lmcache-mp-deps``
(what the server imports beyond the adapter's deps) on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvledger.connector.testing.driver import built_by_vllm
from kvledger.connector.testing.harness import named_prompts
from kvledger.connector.testing.lmcache import (
    BUILD,
    LMCacheReport,
    LMCacheRun,
    _LMCacheRunner,
    adapter_jobs,
    installed,
    run_job,
    run_jobs,
    wrapped_in_recorder,
    write_report,
)

__all__ = [
    "MP_DEPS",
    "LMCacheMPRun",
    "MPRequest",
    "ServerTiming",
    "mp_installed",
    "mp_kv_connector",
    "run",
    "run_version",
]

MP_DEPS = BUILD / "lmcache-mp-deps"
# The environment the MP mode runs under (the child process's, set before LMCache is imported).
MP_ENV = {
    "LMCACHE_MP_TRANSFER_MODE": "lmcache_driven",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
}


def mp_installed(version: str) -> bool:
    """The release and the MP server's extra deps, installed by ``make lmcache``."""
    return installed(version) and (MP_DEPS / ".installed").exists()


@dataclasses.dataclass(frozen=True)
class MPRequest:
    """One request: its prompt is the first ``prompt_len`` tokens of the token stream
    ``prompt``; it arrives at the start, or once request ``after`` finished."""

    req_id: str
    prompt: str
    prompt_len: int
    max_tokens: int
    after: str | None = None


@dataclasses.dataclass(frozen=True)
class LMCacheMPRun:
    """A workload for LMCache's MP mode and the engine it runs under."""

    name: str
    requests: tuple[MPRequest, ...]
    block_size: int = 16
    num_gpu_blocks: int = 9
    chunk_size: int = 16
    enable_prefix_caching: bool = False
    model_runner_v2: bool = False
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 256
    seed: int = 0
    max_steps: int = 200
    # The L1 (CPU) cache of LMCache's server.
    l1_size_gb: float = 0.05

    # The LMCacheRun fields the shared runner reads.
    @property
    def async_scheduling(self) -> bool:
        return False

    def prompts(self) -> dict[str, list[int]]:
        return named_prompts(self.name, self.seed, self.requests)

    def to_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_fields(cls, fields: Mapping[str, Any]) -> LMCacheMPRun:
        data = dict(fields)
        data["requests"] = tuple(MPRequest(**r) for r in data["requests"])
        return cls(**data)


def mp_kv_connector(spec: LMCacheMPRun, port: int) -> dict[str, Any]:
    """The ``--kv-transfer-config`` an LMCache MP user passes, for a server on ``port``."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": port,
            "lmcache.mp.nonblocking_lookup_status": False,
        },
    }


def recorded_mp_kv_connector(
    spec: LMCacheMPRun, port: int, log_dir: str, digests: str = "sampled"
) -> dict[str, Any]:
    """LMCache's MP ``--kv-transfer-config`` wrapped in ``KVLedgerRecorder``."""
    return wrapped_in_recorder(mp_kv_connector(spec, port), log_dir, digests, spec.chunk_size)


# --------------------------------------------------------------------------------------------
# The store's timing
# --------------------------------------------------------------------------------------------


class ServerTiming:
    """When LMCache's server is seen to act (see the module docstring): each STORE is held in
    the server until LMCache waits for it or the step after the one that issued it has run
    its forward pass; each LOOKUP's acknowledgement is shown once the step that sent it ends.

    Stores are numbered in the order the worker's transfer context issues them, which is the
    order the server handles them (one worker, one connection). ``released`` is the number of
    stores the server may run.
    """

    def __init__(self, step: Callable[[], int]) -> None:
        self._step = step
        self._cond = threading.Condition()
        self.issued = 0
        self.arrived = 0
        self.released = 0
        # (step, req id, tokens): when the server read a store's blocks / wrote a retrieve's.
        self.reads: list[tuple[int, str, int]] = []
        self.writes: list[tuple[int, str, int]] = []
        # (store number, step, who waited): LMCache waiting on a store's future.
        self.waits: list[tuple[int, int, str]] = []
        # LOOKUP acknowledgements not shown to the scheduler yet, and LMCache's own query.
        self._hidden: list[Any] = []
        self._query: Callable[[Any], bool] = lambda future: bool(future.query())

    def release(self, upto: int) -> None:
        with self._cond:
            if upto > self.released:
                self.released = upto
                self._cond.notify_all()

    def release_all(self) -> None:
        self.release(sys.maxsize)

    def _issue(self, future: Any) -> None:
        with self._cond:
            future._kvledger_store = self.issued
            self.issued += 1

    def _arrive(self) -> None:
        with self._cond:
            number = self.arrived
            self.arrived += 1
            # A bound, so that a rig bug cannot hang the run: a minute is forever here.
            self._cond.wait_for(lambda: self.released > number, timeout=60)

    def settle(self) -> None:
        """Between steps: wait until the server has acknowledged every LOOKUP sent so far,
        show those acknowledgements, then give the server's prefetch a moment."""
        deadline = time.monotonic() + 30
        for future in self._hidden:
            while not self._query(future) and time.monotonic() < deadline:
                time.sleep(0.001)
            future._kvledger_hidden = False
        self._hidden = []
        time.sleep(0.05)

    def _waited(self, future: Any, who: str) -> None:
        number = getattr(future, "_kvledger_store", None)
        if number is not None:
            self.waits.append((number, self._step(), who))
            self.release(number + 1)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Wrap, for this run, the server's STORE and RETRIEVE handlers (the gate, and what
        they moved), the worker's LMCache-driven ``submit_store`` (numbering its future), and
        the waits of LMCache's futures. Signatures are kept (the server checks its handlers'),
        and every wrapper calls the original."""
        transfer = importlib.import_module(
            "lmcache.v1.multiprocess.modules.lmcache_driven_transfer"
        )
        worker = importlib.import_module("lmcache.v1.multiprocess.transfer_context.worker_transfer")
        futures = importlib.import_module("lmcache.v1.multiprocess.futures")
        client = importlib.import_module("lmcache.v1.multiprocess.transport.zmq_impl.client")
        module_cls = transfer.LMCacheDrivenTransferModule
        context_cls = worker.LMCacheDrivenTransferContext
        client_cls = client.ZmqMultiprocessClient
        future_cls = futures.MessagingFuture
        saved: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, wrapper: Any) -> None:
            saved.append((owner, name, owner.__dict__[name]))
            setattr(owner, name, wrapper)

        real_store, real_retrieve = module_cls.store, module_cls.retrieve
        real_submit = context_cls.submit_store
        real_lookup, real_query = client_cls.lookup, future_cls.query
        self._query = real_query

        @functools.wraps(real_store)
        def store(module: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
            self._arrive()
            self.reads.append((self._step(), str(key.request_id), int(key.end - key.start)))
            return real_store(module, key, *args, **kwargs)

        @functools.wraps(real_retrieve)
        def retrieve(module: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
            result = real_retrieve(module, key, *args, **kwargs)
            self.writes.append((self._step(), str(key.request_id), int(key.end - key.start)))
            return result

        @functools.wraps(real_submit)
        def submit_store(context: Any, *args: Any, **kwargs: Any) -> Any:
            future = real_submit(context, *args, **kwargs)
            self._issue(future)
            return future

        @functools.wraps(real_lookup)
        def lookup(client: Any, *args: Any, **kwargs: Any) -> Any:
            future = real_lookup(client, *args, **kwargs)
            future._kvledger_hidden = True
            self._hidden.append(future)
            return future

        @functools.wraps(real_query)
        def query(future: Any) -> bool:
            if getattr(future, "_kvledger_hidden", False):
                return False
            answer: bool = real_query(future)
            return answer

        patch(client_cls, "lookup", lookup)
        patch(future_cls, "query", query)
        patch(module_cls, "store", store)
        patch(module_cls, "retrieve", retrieve)
        patch(context_cls, "submit_store", submit_store)
        for cls in (futures.MessagingFuture, getattr(futures, "DeviceMessagingFuture", None)):
            for name in ("wait", "result", "wait_on_stream"):
                real = None if cls is None else cls.__dict__.get(name)
                if real is None:
                    continue

                def waiting(future: Any, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
                    caller = traceback.extract_stack(limit=2)[0]
                    self._waited(future, f"{Path(caller.filename).name}:{caller.name}")
                    return _real(future, *args, **kwargs)

                patch(cls, name, functools.wraps(real)(waiting))
        try:
            yield
        finally:
            self.release_all()
            for owner, name, value in reversed(saved):
                setattr(owner, name, value)


# --------------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def mp_server(spec: LMCacheMPRun) -> Iterator[int]:
    """LMCache's MP cache server, as its command line builds it, in this process; yields its
    port. LMCache-driven transfer only; no Prometheus endpoint."""
    server_mod = importlib.import_module("lmcache.v1.multiprocess.server")
    port = _free_port()
    argv = [
        "lmcache-mp-server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--chunk-size",
        str(spec.chunk_size),
        "--l1-size-gb",
        str(spec.l1_size_gb),
        "--no-l1-use-lazy",
        "--eviction-policy",
        "LRU",
        "--supported-transfer-mode",
        "lmcache_driven",
        # STORE/RETRIEVE on one thread (in the order the worker issued them), LOOKUP on another.
        "--max-workers",
        "1",
    ]
    saved_argv = sys.argv
    sys.argv = argv
    try:
        args = server_mod.parse_args()
    finally:
        sys.argv = saved_argv
    started = server_mod.run_cache_server(
        server_mod.parse_args_to_mp_server_config(args),
        server_mod.parse_args_to_config(args),
        server_mod.parse_args_to_observability_config(args),
        return_engine=True,
        start_prometheus_http_server=False,
        coordinator_config=server_mod.parse_args_to_coordinator_config(args),
    )
    assert started is not None
    server, engine = started
    try:
        yield port
    finally:
        with contextlib.suppress(Exception):
            server.close()
        with contextlib.suppress(Exception):
            engine.close()


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


class _ServerLedger:
    """What the shared runner asks of a store each step: what moved, which retrieves failed
    (LMCache reports its own: none are the rig's)."""

    def __init__(self, gate: ServerTiming) -> None:
        self.gate = gate
        self._reads = 0
        self._writes = 0
        self.failed: set[str] = set()

    def take_step(self) -> tuple[dict[str, int], dict[str, int], set[str]]:
        retrieved: dict[str, int] = {}
        stored: dict[str, int] = {}
        for _, req, n in self.gate.writes[self._writes :]:
            retrieved[req] = retrieved.get(req, 0) + n
        for _, req, n in self.gate.reads[self._reads :]:
            stored[req] = stored.get(req, 0) + n
        self._writes, self._reads = len(self.gate.writes), len(self.gate.reads)
        return retrieved, stored, set()


def _make_worker(harness: Any) -> Any:
    # vLLM's engine core resolves the layout before any worker starts; the oracle's is NHD.
    harness.vllm_config.cache_config.kv_cache_layout = "NHD"
    return built_by_vllm(harness)


class _MPRunner(_LMCacheRunner):
    """The LMCache rig's runner over LMCache's MP connector: the gate's step boundary, the
    lookups settled between steps, the workload's arrivals."""

    def __init__(
        self,
        spec: LMCacheMPRun,
        kv_connector: Mapping[str, Any],
        report: LMCacheReport,
        gate: ServerTiming,
    ) -> None:
        self.gate = gate
        self._issued_before_step = 0
        super().__init__(
            spec,  # type: ignore[arg-type]
            kv_connector,
            report,
            _ServerLedger(gate),  # type: ignore[arg-type]
            make_worker=_make_worker,
        )

    def execute_model(self, out: Any) -> Any:
        self._issued_before_step = self.gate.issued
        return super().execute_model(out)

    def finished_step(self, out: Any, output: Any) -> set[str]:
        # The stores issued before this step have waited through its forward pass.
        self.gate.release(self._issued_before_step)
        return super().finished_step(out, output)

    def run_spec(self) -> None:
        spec: LMCacheMPRun = self.spec  # type: ignore[assignment]
        prompts = spec.prompts()
        pending = list(spec.requests)
        harness = self.harness

        def arrive() -> None:
            for r in list(pending):
                if r.after is None or r.after in harness.finished:
                    harness.add_request(r.req_id, prompts[r.prompt][: r.prompt_len], r.max_tokens)
                    pending.remove(r)

        arrive()
        while self.step < spec.max_steps:
            result = harness.step()
            if result is None:
                if not pending:
                    break
                arrive()
                continue
            self.after_step(result)
            self.step += 1
            arrive()
            self.gate.settle()
        self.report.steps = self.step
        self.report.finished = sorted(harness.finished)


def run(
    spec: LMCacheMPRun,
    *,
    version: str = "",
    record_to: str | None = None,
    digests: str = "sampled",
) -> LMCacheReport:
    """Run ``spec`` in this process against LMCache's MP server (LMCache importable here, the
    ``MP_ENV`` variables set before it was imported); with ``record_to``, wrapped in
    ``KVLedgerRecorder`` (``digests`` on the worker)."""
    for name, value in MP_ENV.items():  # read when the worker builds its transfer context
        os.environ.setdefault(name, value)
    report = LMCacheReport(version=version, workload=spec.name)
    runners: list[_MPRunner] = []
    gate = ServerTiming(lambda: runners[0].step if runners else -1)
    with gate.installed(), mp_server(spec) as port:
        kv = (
            mp_kv_connector(spec, port)
            if record_to is None
            else recorded_mp_kv_connector(spec, port, record_to, digests)
        )
        try:
            runners.append(_MPRunner(spec, kv, report, gate))
            runners[0].run_spec()
        except Exception as exc:  # the engine would have died here: report where
            step = runners[0].step if runners else -1
            where = traceback.extract_tb(exc.__traceback__)[-1]
            report.error = (
                f"step {step}: {type(exc).__name__}: {exc} "
                f"({Path(where.filename).name}:{where.lineno})"
            )
        finally:
            gate.release_all()
            if runners:
                runners[0].close()
    report.store_waits = list(gate.waits)
    return report


def run_version(
    version: str,
    workloads: Sequence[str | LMCacheRun | LMCacheMPRun],
    *,
    record_to: str | None = None,
    digests: str = "sampled",
    steady_decode: bool = True,
    timeout: float = 1200,
    bare: bool = True,
) -> dict[str, LMCacheReport]:
    """``connector.testing.lmcache.run_version`` for a mix of the adapter rig's workloads and
    ``LMCacheMPRun`` ones, in one child process (this module's ``main``)."""
    jobs = [
        job
        for workload in workloads
        for job in version_jobs(workload, record_to, digests, steady_decode, bare)
    ]
    return run_mixed(version, jobs, timeout=timeout)


def version_jobs(
    workload: str | LMCacheRun | LMCacheMPRun,
    record_to: str | None,
    digests: str,
    steady_decode: bool,
    bare: bool,
) -> list[dict[str, Any]]:
    """The child's jobs for one workload, of either rig: bare, recorded, or both."""
    if not isinstance(workload, LMCacheMPRun):
        return adapter_jobs(workload, record_to, digests, steady_decode, bare)
    job = {"mp": True, "spec": workload.to_fields(), "digests": digests}
    jobs = []
    if bare or record_to is None:
        jobs.append({**job, "label": workload.name, "record_to": None})
    if record_to is not None:
        jobs.append({**job, "label": f"{workload.name}+recorded", "record_to": record_to})
    return jobs


def run_mixed(
    version: str, jobs: Sequence[Mapping[str, Any]], *, timeout: float = 1200
) -> dict[str, LMCacheReport]:
    """Jobs of both rigs (``version_jobs``) in one child process: with the MP server's
    dependencies and environment where any job runs that server."""
    mp = any(job.get("mp") for job in jobs)
    if mp and not mp_installed(version):
        raise FileNotFoundError(f"LMCache {version} or {MP_DEPS} not installed (make lmcache)")
    return run_jobs(
        version,
        jobs,
        module="kvledger.connector.testing.lmcache_mp",
        paths=[MP_DEPS] if mp else [],
        env=MP_ENV if mp else {},
        timeout=timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Child process: a JSON request on stdin, one marked report line per run on stdout."""
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    request = json.loads(sys.stdin.read())
    for job in request["jobs"]:
        if not job.get("mp"):
            write_report(run_job(job, request["version"]))
            continue
        report = run(
            LMCacheMPRun.from_fields(job["spec"]),
            version=request["version"],
            record_to=job["record_to"],
            digests=job["digests"],
        )
        report.workload = job["label"]
        write_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
