"""``kvledger export --format otlp``: the spans are valid OTLP, by the protocol's own schema
(opentelemetry-proto's ``ExportTraceServiceRequest``: every line of the OTLP/JSON file parses
into it, unknown fields refused; the ``.binpb`` file is that message), and their cache
attribution is ``kvledger explain``'s, request by request.

No OpenTelemetry Collector can be installed here (it is a Go program, in no registry these
machines reach), so the schema is the receiver: the same message a collector's OTLP receiver
decodes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from test_explain import Run, _remote, _saved_then, prompt

from kvledger.replay.cli import main
from kvledger.replay.explain import explain
from kvledger.replay.extras import MissingExtra
from kvledger.replay.otlp import to_protobuf, write_otlp
from kvledger.tracker import events as ev

pb = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
json_format = pytest.importorskip("google.protobuf.json_format")

CLEAN = Path(__file__).parent / "data" / "replay-clean.kvlog"


def _run(tmp_path: Path) -> Path:
    """Hits from the pool and the remote tier, a failed load, misses of several reasons."""
    r = Run(tmp_path / "run.kvlog", num_slots=4)
    p = prompt(16, 30)
    keys = _remote(r, p)
    r.add("remote-hit", [*p, 9])
    r.t.apply(ev.RemoteFound(r.t.step, "remote-hit", keys, (1, 1)))
    r.admit("remote-hit")
    r.step()
    r.load("remote-hit")
    r.step()
    q = prompt(16, 31)
    _saved_then(r, "b", q)
    r.step()
    r.add("fails", [*q, 1, 2])
    r.admit("fails")
    r.step()
    r.load("fails", failed_block=2)
    return r.close()


def _attrs(obj: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for a in obj.get("attributes", ()):
        ((kind, value),) = a["value"].items()
        out[a["key"]] = int(value) if kind == "intValue" else value
    return out


def validate(path: Path) -> list[dict[str, Any]]:
    """Every line an ExportTraceServiceRequest by the schema; ids, parents and times sound.
    Returns the spans (OTLP/JSON objects)."""
    spans = []
    for line in path.read_text().splitlines():
        doc = json.loads(line)
        message = to_protobuf(doc)  # raises on a field or a value the schema does not have
        assert isinstance(message, pb.ExportTraceServiceRequest)
        for rs in message.resource_spans:
            assert any(a.key == "service.name" for a in rs.resource.attributes)
            for ss in rs.scope_spans:
                assert ss.scope.name == "kvledger"
                for s in ss.spans:
                    assert len(s.trace_id) == 16 and any(s.trace_id)
                    assert len(s.span_id) == 8 and any(s.span_id)
                    assert s.parent_span_id == b"" or len(s.parent_span_id) == 8
                    assert 0 < s.start_time_unix_nano <= s.end_time_unix_nano
        for rs in doc["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                spans.extend(ss["spans"])
    ids = {(s["traceId"], s["spanId"]) for s in spans}
    assert len(ids) == len(spans), "a span id twice"
    for s in spans:
        if "parentSpanId" in s:
            assert (s["traceId"], s["parentSpanId"]) in ids, "a parent outside its trace"
    return spans


@pytest.mark.parametrize("which", ["run", "clean"])
def test_the_spans_are_otlp_and_carry_explains_figures(
    tmp_path: Path, capsys: Any, which: str
) -> None:
    log = _run(tmp_path) if which == "run" else CLEAN
    out = tmp_path / "spans.otlp.json"
    assert main(["export", str(log), "-o", str(out)]) == 0
    assert "OpenTelemetry spans, OTLP/JSON" in capsys.readouterr().err
    spans = validate(out)
    x = explain(log).to_dict()
    roots = {_attrs(s)["kvledger.request"]: s for s in spans if s["name"] == "kvledger.request"}
    assert set(roots) == {r["request"] for r in x["requests"]} | set(roots)
    for r in x["requests"]:
        a = _attrs(roots[r["request"]])
        assert a["gen_ai.request.id"] == r["req_id"]
        assert a["kvledger.cache.tokens_asked"] == r["tokens_asked"]
        assert a["kvledger.cache.tokens_hit"] == r["tokens_hit"]
        assert a["kvledger.cache.missed_tokens"] == r["missed_tokens"]
        for part, n in r["hit"].items():
            assert a[f"kvledger.cache.hit.{part}"] == n
        for reason, n in r["reasons"].items():
            assert a[f"kvledger.cache.missed.{reason}"] == n
        kids = [s for s in spans if s.get("parentSpanId") == roots[r["request"]]["spanId"]]
        assert len([k for k in kids if k["name"] == "kvledger.admission"]) == len(r["admissions"])
        missed = sum(
            _attrs(e)["kvledger.miss.tokens"]
            for k in kids
            for e in k.get("events", ())
            if e["name"] == "kvledger.miss"
        )
        assert missed == r["missed_tokens"]
    if which == "run":
        hit = _attrs(roots["remote-hit"])
        assert (hit["kvledger.cache.hit.remote"], hit["kvledger.cache.hit.pool"]) == (16, 0)
        (load,) = [
            s
            for s in spans
            if s["name"] == "kvledger.load" and s["traceId"] == roots["fails"]["traceId"]
        ]
        assert load["status"]["code"] == 2 and _attrs(load)["kvledger.load.result"] == "failed"


def test_the_protobuf_file_is_the_same_message(tmp_path: Path, capsys: Any) -> None:
    log = _run(tmp_path)
    assert main(["export", str(log), "-o", str(tmp_path / "s.otlp.json")]) == 0
    assert main(["export", str(log), "-o", str(tmp_path / "s.binpb")]) == 0
    assert "protobuf" in capsys.readouterr().err
    message = pb.ExportTraceServiceRequest()
    message.ParseFromString((tmp_path / "s.binpb").read_bytes())
    spans = validate(tmp_path / "s.otlp.json")
    got = [s for rs in message.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in got] == [s["name"] for s in spans]
    assert [s.span_id.hex() for s in got] == [s["spanId"] for s in spans]


def test_the_schema_check_refuses_what_is_not_otlp() -> None:
    """The validation can fail: a misspelt field, a string where a number goes."""
    good = {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "01" * 16, "name": "x"}]}]}]}
    to_protobuf(good)
    with pytest.raises(json_format.ParseError):
        to_protobuf({"resourceSpans": [{"scopeSpan": []}]})
    with pytest.raises(json_format.ParseError):
        bad = json.loads(json.dumps(good))
        bad["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["kind"] = "sideways"
        to_protobuf(bad)


def test_format_and_output_must_agree(tmp_path: Path, capsys: Any) -> None:
    assert main(["export", str(CLEAN), "--format", "otlp", "-o", str(tmp_path / "x.json")]) == 0
    validate(tmp_path / "x.json")
    assert main(["export", str(CLEAN), "--format", "otlp", "-o", str(tmp_path / "dir")]) == 2
    assert "OTLP spans are one file" in capsys.readouterr().err
    assert (
        main(["export", str(CLEAN), "--format", "perfetto", "-o", str(tmp_path / "a.binpb")]) == 2
    )
    assert "names otlp" in capsys.readouterr().err


def test_protobuf_without_the_extra_says_which_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.proto", None)
    with pytest.raises(MissingExtra, match=r"kvledger\[otlp\]"):
        write_otlp(CLEAN, str(tmp_path / "s.binpb"))
    assert not (tmp_path / "s.binpb").exists()


def test_the_spans_of_a_torn_log_are_marked_partial(tmp_path: Path, capsys: Any) -> None:
    """The file is named *.partial.otlp.json, and every span's resource says why: a backend
    that reads only the spans shows it on each."""
    from _logfiles import torn_copy

    torn = torn_copy(_run(tmp_path), tmp_path / "torn.kvlog", 5)
    out = tmp_path / "s.otlp.json"
    out.write_text("an earlier whole export")
    assert main(["export", str(torn), "-o", str(out)]) == 2
    assert "s.partial.otlp.json" in capsys.readouterr().err
    assert not out.exists()
    marked = tmp_path / "s.partial.otlp.json"
    assert validate(marked)  # still OTLP
    for line in marked.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            assert "torn_tail" in _attrs(rs["resource"])["kvledger.partial"]
    assert main(["export", str(torn), "-o", str(tmp_path / "s.binpb")]) == 2
    assert (tmp_path / "s.partial.binpb").exists() and not (tmp_path / "s.binpb").exists()
    # A whole export afterwards replaces the partial one.
    assert main(["export", str(CLEAN), "-o", str(out)]) == 0
    assert out.exists() and not marked.exists()
    assert all(
        "kvledger.partial" not in _attrs(rs["resource"])
        for line in out.read_text().splitlines()
        for rs in json.loads(line)["resourceSpans"]
    )
