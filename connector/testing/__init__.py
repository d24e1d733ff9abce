"""Test rigs, kept out of the product (like ``numpy.testing``).

- ``harness``: vLLM's real v1 scheduler driven on CPU, with no model and no worker (also what
  bench/scheduler_overhead.py measures);
- ``oracle``: the KV-content oracle, which knows what every computed token's KV must be;
- ``driver``: the rigs' one model runner, calling any worker-role connector in vLLM 0.33's
  order over the oracle's caches (``run``, ``recorded``, ``lmcache`` and ``zoo`` use it, and
  bench/scheduler_overhead.py's worker, with no KV computed);
- ``run``: the end-to-end runner (vLLM's scheduler, KVLedgerConnector's worker role over the
  oracle's caches, fault injection) used by the tests and ``kvledger demo``;
- ``faults``: ``FaultyWorkerSide``, a ``WorkerSide`` whose chosen chunk loads fail (through the
  worker's public ``load_chunk``), and ``vllm``: ``FaultyKVLedgerConnector``, which builds it
  through the connector's public ``make_worker_side``.

Nothing else in ``connector/`` imports this package: vLLM loads ``connector.vllm`` and what it
imports, never these. Importing this package imports none of its modules (they need torch or
vLLM); import the one you need.
"""
