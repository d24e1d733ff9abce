"""Test rigs, kept out of the product (like ``numpy.testing``).

- ``harness``: vLLM's real v1 scheduler driven on CPU, with no model and no worker;
- ``oracle``: the KV-content oracle, which knows what every computed token's KV must be;
- ``run``: the end-to-end runner (vLLM's scheduler, KVLedgerConnector's worker role over the
  oracle's caches, fault injection) used by the tests, the benches and ``kvledger demo``.

Nothing else in ``connector/`` imports this package: vLLM loads ``connector.vllm`` and what it
imports, never these. Importing this package imports none of its modules (they need torch or
vLLM); import the one you need.
"""
