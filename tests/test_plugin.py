"""connector/plugin.py: vLLM's ``vllm.general_plugins`` entry point registers both connectors by
name with vLLM's real ``KVConnectorFactory``, and never raises into vLLM's startup.

The engine rig (connector/testing/engine.py) and the served tests (tests/engine/test_served.py)
name ``KVLedgerConnector`` and ``KVLedgerRecorder`` without a module path, so every engine test
loads them through this plugin, in every process vLLM starts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from structlog.testing import capture_logs

from kvledger.connector import plugin

pytestmark = pytest.mark.vllm

FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"


@pytest.fixture
def factory(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's real KVConnectorFactory with a registry of this test's own (vLLM's names in it),
    and a process that has registered nothing of ours yet."""
    from kvledger.connector.testing.harness import skip_reason

    reason = skip_reason()
    if reason is not None:
        pytest.skip(reason)
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    monkeypatch.setattr(plugin, "_REGISTERED", set())
    yield KVConnectorFactory


def skipped() -> Iterator[list[dict[str, Any]]]:
    return capture_logs()  # type: ignore[return-value]


def test_the_distribution_declares_the_entry_point_vllm_loads() -> None:
    """What vLLM's load_plugins_by_group finds: our register function, by the installed
    distribution's metadata (editable or wheel)."""
    found = [
        ep
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins")
        if ep.name == "kvledger"
    ]
    assert [ep.value for ep in found] == ["kvledger.connector.plugin:register"]
    assert found[0].load() is plugin.register


def test_vllm_loads_the_plugin_and_builds_both_connectors_by_name(factory: Any) -> None:
    """vLLM's own plugin loader runs our entry point; its factory then gives our classes for
    the bare names, as a --kv-transfer-config without kv_connector_module_path asks."""
    import vllm.plugins
    from vllm.config import KVTransferConfig

    from kvledger.connector.vllm import KVLedgerConnector, KVLedgerRecorder

    with skipped() as logs:
        for register in vllm.plugins.load_plugins_by_group("vllm.general_plugins").values():
            register()
    assert [e for e in logs if e["event"] == "kvledger.plugin_skipped"] == []
    assert factory.get_connector_class_by_name("KVLedgerConnector") is KVLedgerConnector
    assert factory.get_connector_class_by_name("KVLedgerRecorder") is KVLedgerRecorder
    config = KVTransferConfig(kv_connector="KVLedgerConnector", kv_role="kv_both")
    assert factory.get_connector_class(config) is KVLedgerConnector


def test_registering_again_in_one_process_changes_nothing(factory: Any) -> None:
    """vLLM calls plugins once per process but warns they may run more often: a second call is
    silent and keeps the first registration."""
    plugin.register()
    first = dict(factory._registry)
    with skipped() as logs:
        plugin.register()
    assert logs == []
    assert factory._registry == first


def test_a_name_another_package_registered_is_left_to_it(factory: Any) -> None:
    """vLLM keeps the first of a name; ours does not overwrite it, says so, and still registers
    the other connector."""
    factory.register_connector("KVLedgerConnector", "someone.else", "TheirConnector")
    theirs = factory._registry["KVLedgerConnector"]
    with skipped() as logs:
        plugin.register()
    assert factory._registry["KVLedgerConnector"] is theirs
    assert "KVLedgerRecorder" in factory._registry
    [warning] = logs
    assert warning["event"] == "kvledger.plugin_skipped"
    assert warning["connectors"] == "KVLedgerConnector"
    assert "already registered by another package" in warning["reason"]
    assert "kv_connector_module_path" in warning["instead"]


_FIND_SPEC = importlib.util.find_spec


def _no_factory(mp: pytest.MonkeyPatch, factory: Any) -> None:
    mp.setitem(sys.modules, FACTORY, None)  # a vLLM without the module (older or newer shape)


def _no_register_api(mp: pytest.MonkeyPatch, factory: Any) -> None:
    mp.delattr(factory, "register_connector")


def _register_raises(mp: pytest.MonkeyPatch, factory: Any) -> None:
    def sealed(*_: Any) -> None:
        raise RuntimeError("the registry is sealed")

    mp.setattr(factory, "register_connector", sealed)


def _no_torch(mp: pytest.MonkeyPatch, factory: Any) -> None:
    # An environment without torch: neither class could run.
    mp.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else _FIND_SPEC(name, *a),
    )


def _anything_else(mp: pytest.MonkeyPatch, factory: Any) -> None:
    mp.setattr(plugin, "CONNECTORS", None)  # whatever breaks inside: one warning, no raise


@pytest.mark.parametrize(
    "break_it, says",
    [
        (_no_factory, "has no KVConnectorFactory"),
        (_no_register_api, "has no register_connector"),
        (_register_raises, "RuntimeError: the registry is sealed"),
        (_no_torch, "torch cannot be imported here"),
        (_anything_else, "AttributeError"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_a_plugin_that_cannot_register_warns_and_vllm_starts(
    factory: Any, monkeypatch: pytest.MonkeyPatch, break_it: Any, says: str
) -> None:
    before = dict(factory._registry)
    with monkeypatch.context() as mp:
        break_it(mp, factory)
        with skipped() as logs:
            plugin.register()  # returns: vLLM's load_general_plugins does not catch
    assert factory._registry == before
    assert logs and all(e["event"] == "kvledger.plugin_skipped" for e in logs)
    assert any(says in e["reason"] for e in logs), logs
