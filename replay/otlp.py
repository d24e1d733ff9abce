"""``export --format otlp``: per-request OpenTelemetry spans with cache attribution.

One trace per request life, as vLLM's own tracing would carry it if it knew the cache tiers:

- ``kvledger.request`` (the root, kind INTERNAL), from the request's ``RequestAdded`` to its
  ``Finished``, with vLLM's attribute names (``vllm.tracing.SpanAttributes``:
  ``gen_ai.request.id``, ``gen_ai.usage.prompt_tokens``, ``gen_ai.latency.time_in_queue``,
  ``gen_ai.latency.e2e``), so it joins vLLM's ``llm_request`` span by request id, and
  kvledger's own under ``kvledger.``: tokens asked, hit (vLLM's prefix cache, the host pool,
  the remote tier, the last token by rule), missed, missed by reason, loaded, load time;
- ``kvledger.admission``, one child per admission (the first, and each after a preemption),
  with the same figures for its lookup, and an event ``kvledger.miss`` per missed span (its
  tokens, reason and facts);
- ``kvledger.load``, a child of its admission, from the load plan to its result (status
  ERROR when it failed).

Every figure is ``replay.explain``'s (its ``Explainer``, as ``kvledger explain`` and ``stats``
count them). Times are the log's wall clock (each frame's), in nanoseconds since the epoch.
Ids are derived from the run id and the request's life, so an export is reproducible.

The file is OTLP/JSON (the JSON encoding of ``ExportTraceServiceRequest``, ids in hex, 64-bit
integers as strings), one request per line as the OTLP file exporter writes it, which an
OpenTelemetry Collector reads with its ``otlpjsonfile`` receiver; ``.binpb`` (or ``.pb``) is
the protobuf encoding of one ``ExportTraceServiceRequest`` (the ``otlp`` extra:
opentelemetry-proto).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

from kvledger.replay.explainer import Explainer
from kvledger.replay.extras import require
from kvledger.replay.misses import HITS, AdmissionMisses
from kvledger.replay.partial import PARTIAL_KEY, partial_reason, publish
from kvledger.replay.results import ExportResult
from kvledger.replay.source import LogPath, open_log
from kvledger.tracker import events as ev
from kvledger.tracker.framing import StopInfo
from kvledger.tracker.history import walk

__all__ = ["BINARY_SUFFIXES", "spans", "to_protobuf", "write_otlp"]

BINARY_SUFFIXES = (".binpb", ".pb")
KIND_INTERNAL = 1  # SpanKind.SPAN_KIND_INTERNAL
STATUS_ERROR = 2  # Status.STATUS_CODE_ERROR (spans are otherwise left unset)
# Request lives per line of the file: one ExportTraceServiceRequest each.
_PER_LINE = 512


def _id(size: int, *parts: str) -> str:
    """A non-zero id of ``size`` bytes, in hex, from ``parts``."""
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=size).digest()
    return (digest if any(digest) else b"\x01" * size).hex()


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def _attributes(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in values.items() if v is not None]


def _cache(prefix: str, admissions: list[AdmissionMisses]) -> dict[str, Any]:
    """The cache attribution of some admissions, as ``kvledger.`` attributes."""
    hits = dict.fromkeys(HITS, 0)
    reasons: dict[str, int] = {}
    asked = loaded = 0
    seconds = 0.0
    for a in admissions:
        asked += a.asked
        loaded += a.loaded
        seconds += a.load_seconds or 0.0
        for k, v in a.hit.items():
            hits[k] += v
        for m in a.misses:
            reasons[m.reason] = reasons.get(m.reason, 0) + m.tokens
    out: dict[str, Any] = {
        f"{prefix}.tokens_asked": asked,
        f"{prefix}.tokens_hit": sum(hits.values()),
        **{f"{prefix}.hit.{k}": v for k, v in hits.items()},
        f"{prefix}.missed_tokens": sum(reasons.values()),
        **{f"{prefix}.missed.{r}": n for r, n in reasons.items()},
        f"{prefix}.loaded_tokens": loaded,
        f"{prefix}.load_time_s": seconds,
    }
    return out


class _Life:
    __slots__ = ("added_ns", "admissions", "finish_reason", "finished_ns", "prompt", "req_id")

    def __init__(self, req_id: str, added_ns: int, prompt: int) -> None:
        self.req_id = req_id
        self.added_ns = added_ns
        self.prompt = prompt
        self.finished_ns: int | None = None
        self.finish_reason: str | None = None
        self.admissions: list[AdmissionMisses] = []


def _lives(log: LogPath) -> tuple[dict[str, _Life], int, dict[str, Any], StopInfo | None]:
    src = open_log(log)
    config = src.config()
    lives: dict[str, _Life] = {}
    last_ns = 0

    def keep(a: AdmissionMisses) -> None:
        life = lives.get(a.request)
        if life is not None:
            life.admissions.append(a)

    explainer = Explainer(config, keep, recorded=src.recorded)
    for item in walk(src.frames(), config, recorded=src.recorded):
        explainer.feed(item)
        e = item.event
        last_ns = max(last_ns, item.frame.wall_ns)
        if isinstance(e, ev.RequestAdded) and item.new:
            lives[item.life] = _Life(e.req_id, item.frame.wall_ns, len(e.prompt_token_ids))
        elif isinstance(e, ev.Finished):
            life = lives.get(item.life)
            if life is not None and life.finished_ns is None and item.before is not None:
                life.finished_ns = item.frame.wall_ns
                life.finish_reason = e.reason
    explainer.finish()
    resource = {
        "service.name": "kvledger",
        "kvledger.log": src.name,
        "kvledger.run_id": str(src.header.get("run_id", "")),
        "kvledger.version": str(src.header.get("library_version", "")),
        "vllm.version": src.run_info.get("vllm_version"),
        # On every span, to any OTLP backend: the log was read only in part (replay.partial).
        PARTIAL_KEY: partial_reason(src.damage, src.missing_segments()),
    }
    return lives, last_ns, resource, src.damage


def spans(log: LogPath) -> tuple[list[dict[str, Any]], dict[str, Any], StopInfo | None]:
    """The OTLP spans of a log (JSON objects), its resource attributes, and its damage."""
    lives, last_ns, resource, damage = _lives(log)
    run = str(resource["kvledger.run_id"])
    out: list[dict[str, Any]] = []
    for label, life in lives.items():
        trace_id = _id(16, run, label)
        root_id = _id(8, run, label, "request")
        end_ns = life.finished_ns if life.finished_ns is not None else last_ns
        adms = sorted(life.admissions, key=lambda a: a.admission)
        first = adms[0].wall_ns if adms else None
        root_attrs: dict[str, Any] = {
            "gen_ai.request.id": life.req_id,
            "gen_ai.usage.prompt_tokens": life.prompt,
            "gen_ai.latency.time_in_queue": None
            if first is None
            else max(0, first - life.added_ns) / 1e9,
            "gen_ai.latency.e2e": None
            if life.finished_ns is None
            else max(0, life.finished_ns - life.added_ns) / 1e9,
            "kvledger.request": label,
            "kvledger.admissions": len(adms),
            "kvledger.finish_reason": life.finish_reason,
            **_cache("kvledger.cache", adms),
        }
        out.append(
            _span(trace_id, root_id, None, "kvledger.request", life.added_ns, end_ns, root_attrs)
        )
        for i, a in enumerate(adms):
            span_id = _id(8, run, label, "admission", str(a.admission))
            a_end = adms[i + 1].wall_ns if i + 1 < len(adms) else end_ns
            attrs = {
                "kvledger.admission": a.admission,
                "kvledger.step": a.step,
                "kvledger.lookup_step": a.lookup_step,
                **_cache("kvledger.cache", [a]),
            }
            events = [
                {
                    "timeUnixNano": str(a.wall_ns),
                    "name": "kvledger.miss",
                    "attributes": _attributes(
                        {
                            "kvledger.miss.start": m.start,
                            "kvledger.miss.end": m.end,
                            "kvledger.miss.tokens": m.tokens,
                            "kvledger.miss.reason": m.reason,
                            "kvledger.miss.step": m.step,
                            "kvledger.miss.request": m.by,
                            "kvledger.miss.diverged_at": m.at_token,
                            "kvledger.miss.detail": m.detail or None,
                        }
                    ),
                }
                for m in a.misses
            ]
            out.append(
                _span(
                    trace_id,
                    span_id,
                    root_id,
                    "kvledger.admission",
                    a.wall_ns,
                    max(a.wall_ns, a_end),
                    attrs,
                    events,
                )
            )
            if a.loaded:
                start = a.wall_ns
                stop = start + int((a.load_seconds or 0.0) * 1e9)
                failed = a.load_result == "failed"
                out.append(
                    _span(
                        trace_id,
                        _id(8, run, label, "load", str(a.admission)),
                        span_id,
                        "kvledger.load",
                        start,
                        stop,
                        {
                            "kvledger.load.tokens": a.loaded,
                            "kvledger.load.result": a.load_result or "no result in the log",
                            "kvledger.load.hit.pool": a.hit["pool"],
                            "kvledger.load.hit.remote": a.hit["remote"],
                        },
                        status=(STATUS_ERROR, "the load failed: vLLM recomputed")
                        if failed
                        else None,
                    )
                )
    return out, resource, damage


def _span(
    trace_id: str,
    span_id: str,
    parent: str | None,
    name: str,
    start_ns: int,
    end_ns: int,
    attrs: dict[str, Any],
    events: list[dict[str, Any]] | None = None,
    status: tuple[int, str] | None = None,
) -> dict[str, Any]:
    span: dict[str, Any] = {"traceId": trace_id, "spanId": span_id}
    if parent is not None:
        span["parentSpanId"] = parent
    span.update(
        name=name,
        kind=KIND_INTERNAL,
        startTimeUnixNano=str(start_ns),
        endTimeUnixNano=str(max(start_ns, end_ns)),
        attributes=_attributes(attrs),
    )
    if events:
        span["events"] = events
    if status is not None:
        span["status"] = {"code": status[0], "message": status[1]}
    return span


def _requests(
    all_spans: list[dict[str, Any]], resource: dict[str, Any], per_line: int
) -> Iterator[dict[str, Any]]:
    """ExportTraceServiceRequest documents, ``per_line`` traces each."""
    # The instrumentation: the kvledger that recorded the log.
    scope = {"name": "kvledger", "version": str(resource.get("kvledger.version") or "")}
    traces: dict[str, list[dict[str, Any]]] = {}
    for s in all_spans:
        traces.setdefault(s["traceId"], []).append(s)
    ids = list(traces)
    for i in range(0, max(len(ids), 1), per_line):
        chunk = [s for t in ids[i : i + per_line] for s in traces[t]]
        yield {
            "resourceSpans": [
                {
                    "resource": {"attributes": _attributes(resource)},
                    "scopeSpans": [{"scope": scope, "spans": chunk}],
                }
            ]
        }


def to_protobuf(document: dict[str, Any]) -> Any:
    """An OTLP/JSON ``ExportTraceServiceRequest`` as the protobuf message (the ``otlp``
    extra): ids go from OTLP/JSON's hex to protobuf JSON's base64, as the spec says."""
    what = "an OTLP protobuf export (or write OTLP/JSON: .json)"
    pb = require("opentelemetry.proto.collector.trace.v1.trace_service_pb2", "otlp", what)
    json_format = require("google.protobuf.json_format", "otlp", what)

    def b64(hex_id: str) -> str:
        return base64.b64encode(bytes.fromhex(hex_id)).decode()

    doc = json.loads(json.dumps(document))
    for rs in doc.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for s in ss.get("spans", ()):
                for k in ("traceId", "spanId", "parentSpanId"):
                    if k in s:
                        s[k] = b64(s[k])
    message = pb.ExportTraceServiceRequest()
    json_format.ParseDict(doc, message)
    return message


def write_otlp(log: LogPath, out: str, *, per_line: int = _PER_LINE) -> ExportResult:
    """Write the log's spans to ``out``: OTLP/JSON lines, or protobuf for ``.binpb``/``.pb``
    (whole or not at all; a log read only in part to ``out``'s partial name:
    ``replay.partial``)."""
    binary = out.lower().endswith(BINARY_SUFFIXES)
    if binary:  # missing extra: say so before reading the log
        require(
            "opentelemetry.proto", "otlp", "an OTLP protobuf export (or write OTLP/JSON: .json)"
        )
    all_spans, resource, damage = spans(log)
    documents = list(_requests(all_spans, resource, per_line))
    tmp = out + ".tmp"
    try:
        if binary:
            whole = {"resourceSpans": [r for d in documents for r in d["resourceSpans"]]}
            with open(tmp, "wb") as f:
                f.write(to_protobuf(whole).SerializeToString())
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                for d in documents:
                    f.write(json.dumps(d, separators=(",", ":")))
                    f.write("\n")
        out = publish(tmp, out, resource[PARTIAL_KEY])
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    counts = {
        "traces": len({s["traceId"] for s in all_spans}),
        "spans": len(all_spans),
        "miss events": sum(len(s.get("events", ())) for s in all_spans),
    }
    return ExportResult(
        out,
        "otlp",
        "otlp",
        counts,
        [] if damage is None else [damage],
        (),
        None,
        resource[PARTIAL_KEY],
    )
