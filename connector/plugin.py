"""The vLLM plugin: ``KVLedgerConnector`` and ``KVLedgerRecorder`` by name, no module path.

vLLM calls every ``vllm.general_plugins`` entry point (``pyproject.toml`` declares
``kvledger = "kvledger.connector.plugin:register"``) in each process it starts: the API
server, the engine core, every worker. :func:`register` adds our two connectors to vLLM's
``KVConnectorFactory``, so that::

    --kv-transfer-config '{"kv_connector": "KVLedgerConnector", "kv_role": "kv_both"}'

finds them in whichever process builds one. Registration is lazy on vLLM's side (a module path
and a class name), so this module imports nothing of ours and nothing heavy.

A plugin runs inside vLLM's startup, and vLLM does not catch what a plugin's function raises:
an exception here would stop every vLLM in the environment, kvledger in use or not. So
:func:`register` never raises. Each reason it cannot register becomes one warning,
``kvledger.plugin_skipped``, naming the connector, the reason and what to do instead
(``kv_connector_module_path`` still works), and vLLM starts as it would without us.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Mapping
from typing import Any

from kvledger.connector.logsafe import safe_logger

__all__ = ["CONNECTORS", "MODULE", "register"]

_log = safe_logger("kvledger.plugin")

# Where both classes are found: KVLedgerRecorder is loaded from the same module (connector/vllm.py).
MODULE = "kvledger.connector.vllm"
CONNECTORS: Mapping[str, str] = {
    "KVLedgerConnector": "KVLedgerConnector",
    "KVLedgerRecorder": "KVLedgerRecorder",
}
_BOTH = ", ".join(CONNECTORS)
# The names this process registered (vLLM's factory keeps no owner of a name).
_REGISTERED: set[str] = set()
# What a user can write instead, said in every warning.
_INSTEAD = f'name the module instead: "kv_connector_module_path": "{MODULE}"'


def register() -> None:
    """Register both connectors with vLLM's ``KVConnectorFactory``; never raises (the module
    docstring says why). Calling it again in the same process changes nothing."""
    try:
        _register()
    except Exception as exc:  # a vLLM of another shape; our bookkeeping never stops vLLM
        _skip(_BOTH, f"{type(exc).__name__}: {exc}")


def _register() -> None:
    # Found, not imported: importing connector/vllm.py loads torch, which vLLM's API server
    # process would otherwise not need yet. A kvledger without torch cannot run either class.
    for needed in (MODULE, "torch"):
        if importlib.util.find_spec(needed) is None:
            _skip(_BOTH, f"{needed} cannot be imported here")
            return
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError as exc:
        _skip(_BOTH, f"this vLLM has no KVConnectorFactory ({exc})")
        return
    add = getattr(KVConnectorFactory, "register_connector", None)
    if not callable(add):
        _skip(_BOTH, "this vLLM's KVConnectorFactory has no register_connector")
        return
    registry: Any = getattr(KVConnectorFactory, "_registry", None)
    for name, class_name in CONNECTORS.items():
        if (isinstance(registry, dict) and name in registry) or name in _REGISTERED:
            # Ours from an earlier call in this process, or another package's of the same
            # name: either way vLLM keeps the first, and overwriting another's would be rude.
            if name not in _REGISTERED:
                _skip(name, "the name is already registered by another package")
            continue
        try:
            add(name, MODULE, class_name)
        except Exception as exc:  # ValueError: registered between our look and our add
            _skip(name, f"{type(exc).__name__}: {exc}")
            continue
        _REGISTERED.add(name)


def _skip(names: str, reason: str) -> None:
    # A logging setup that raises must not stop vLLM either.
    with contextlib.suppress(Exception):
        _log.warning("kvledger.plugin_skipped", connectors=names, reason=reason, instead=_INSTEAD)
