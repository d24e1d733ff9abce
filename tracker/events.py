"""Immutable events: facts the connector observed, and decisions it made.

Rule of this module: an event is a value. It is copied out of vLLM's mutable objects at the
moment of the callback and never refers back to them. Every event class carries a wire ``TAG``
(stable forever), a ``VERSION`` (bumped when its fields change, with an upcaster in
``codec.py``) and a ``KIND``: ``"input"`` events are what a callback told us, ``"decision"``
events are what the tracker derived from state, logged so that replay can compare what this
code decides now with what the recorded run decided then.

Field order is wire order (the codec packs fields positionally and drops trailing fields that
equal their defaults), so new fields go at the end with a default. Sequences are tuples.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterable
from typing import Any, ClassVar

import attrs

__all__ = [
    "EVENT_TYPES",
    "Admission",
    "Allocated",
    "BlockDigested",
    "ChunkEvicted",
    "ChunkStored",
    "DecisionEvent",
    "Event",
    "Finished",
    "InnerFinishedAnswered",
    "InnerLoadErrors",
    "InnerLookupAnswered",
    "InnerRaised",
    "InnerRecvDone",
    "InnerSendDone",
    "InnerStats",
    "InputEvent",
    "LoadDigested",
    "LoadDone",
    "LoadFailed",
    "LoadPlanned",
    "LookupAnswered",
    "LookupAsked",
    "Preempted",
    "RecordLost",
    "RemoteFound",
    "RemoteLoadFailed",
    "RemoteOutage",
    "RemoteRestored",
    "RemoteSaveDone",
    "RemoteSaveFailed",
    "RequestAdded",
    "SaveDone",
    "SaveFailed",
    "SavePlanned",
    "Scheduled",
    "StepDecoded",
    "ViolationRecorded",
    "int_tuple",
]


class Admission(enum.IntEnum):
    """How a request appeared in a scheduler step (``Scheduled.admission``)."""

    RUNNING = 0  # already running: block ids are appended
    NEW = 1  # first admission, or MRV2 / async-load re-admission: block table replaced
    RESUMED = 2  # back from preemption (``resumed_req_ids``): block table replaced


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    # Converters copy whatever sequence vLLM hands us (lists, ConstantList views) into a tuple,
    # so an event can never alias a list that vLLM goes on mutating.
    return value if type(value) is tuple else tuple(value)


def int_tuple(values: Iterable[Any]) -> tuple[int, ...]:
    """``values`` as a tuple of ints: integer-likes (numpy and torch integers) become ints;
    anything else raises TypeError naming it, never a value the fold accepts and the log
    cannot hold. The ``Tracker``'s helpers pass every id from vLLM through it (events built
    from a log hold msgpack's ints already, and the hot path's request numbers are ours)."""
    t = values if type(values) is tuple else tuple(values)
    if t and set(map(type, t)) != _INT:
        try:
            t = tuple(map(operator.index, t))
        except TypeError:
            bad = next(v for v in t if not hasattr(v, "__index__"))
            raise TypeError(f"expected integers, got {type(bad).__name__} {bad!r}") from None
    return t


_INT = {int}


def _keys(value: Iterable[bytes]) -> tuple[bytes, ...]:
    return value if type(value) is tuple else tuple(value)


@attrs.frozen(slots=True)
class Event:
    """Base of all events. ``step`` is the scheduler step the fact belongs to."""

    TAG: ClassVar[int] = -1
    VERSION: ClassVar[int] = 1
    KIND: ClassVar[str] = ""

    step: int
    req_id: str


@attrs.frozen(slots=True)
class InputEvent(Event):
    """A fact a vLLM callback told us."""

    KIND: ClassVar[str] = "input"


@attrs.frozen(slots=True)
class DecisionEvent(Event):
    """What the tracker decided; derivable from state, logged for comparison on replay."""

    KIND: ClassVar[str] = "decision"


# --- input events -------------------------------------------------------------------------


@attrs.frozen(slots=True)
class RequestAdded(InputEvent):
    """``on_new_request``, or first sight of a request: its prompt and cache salt."""

    TAG: ClassVar[int] = 1
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_ints)
    cache_salt: str = ""


@attrs.frozen(slots=True)
class LookupAsked(InputEvent):
    """``get_num_new_matched_tokens(request, local_hit)``: a query, asked again every step
    while the request waits. ``token_ids`` are ``all_token_ids[token_start:]`` (the connector
    sends only what the tracker does not know yet); ``num_tokens`` is ``len(all_token_ids)``.
    """

    TAG: ClassVar[int] = 2
    local_hit: int
    num_tokens: int
    token_start: int = 0
    token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    preempted: bool = False


@attrs.frozen(slots=True)
class Allocated(InputEvent):
    """``update_state_after_alloc``: vLLM allocated blocks and accepted ``num_external``
    tokens from us. Called a second time with ``num_external=0`` after an async load."""

    TAG: ClassVar[int] = 3
    block_ids: tuple[int, ...] = attrs.field(converter=_ints)
    num_external: int = 0


@attrs.frozen(slots=True)
class Scheduled(InputEvent):
    """One request's share of a ``build_connector_meta`` step.

    ``num_computed`` is vLLM's count before this step's tokens; ``num_scheduled`` the tokens it
    computes now. ``token_ids`` are ``all_token_ids[token_start:]`` up to what exists (under
    async scheduling the newest input token may not be sampled yet). ``block_ids`` are appended
    for a running request and are the full table on admission.
    """

    TAG: ClassVar[int] = 4
    num_computed: int
    num_scheduled: int
    token_start: int = 0
    token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    block_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    admission: Admission = attrs.field(default=Admission.RUNNING, converter=Admission)


@attrs.frozen(slots=True)
class Preempted(InputEvent):
    """``preempted_req_ids``, or inferred at re-admission where vLLM has none (the releases:
    connector/edge.py): blocks revoked."""

    TAG: ClassVar[int] = 5


@attrs.frozen(slots=True)
class Finished(InputEvent):
    """``request_finished``: exactly once, before vLLM frees the blocks."""

    TAG: ClassVar[int] = 6
    VERSION: ClassVar[int] = 2  # v1 carried `aborted: bool` instead of `reason: str`
    reason: str = "stopped"


@attrs.frozen(slots=True)
class SaveDone(InputEvent):
    """The worker confirmed that these chunks are in the host pool."""

    TAG: ClassVar[int] = 7
    keys: tuple[bytes, ...] = attrs.field(converter=_keys)


@attrs.frozen(slots=True)
class SaveFailed(InputEvent):
    """The worker could not store these chunks; their slots are released."""

    TAG: ClassVar[int] = 8
    keys: tuple[bytes, ...] = attrs.field(converter=_keys)


@attrs.frozen(slots=True)
class LoadDone(InputEvent):
    """The worker finished the request's planned load."""

    TAG: ClassVar[int] = 9


@attrs.frozen(slots=True)
class LoadFailed(InputEvent):
    """The worker could not load into these blocks (``invalid_block_ids``); vLLM's recompute
    policy rolls the request's ``num_computed_tokens`` back to before the first of them."""

    TAG: ClassVar[int] = 10
    block_ids: tuple[int, ...] = attrs.field(converter=_ints)


@attrs.frozen(slots=True)
class ChunkStored(InputEvent):
    """A chunk appeared in the pool outside our plans (a warm pool). ``req_id`` is empty."""

    TAG: ClassVar[int] = 11
    key: bytes = b""
    slot: int = -1
    num_tokens: int = 0


@attrs.frozen(slots=True)
class ChunkEvicted(InputEvent):
    """A chunk left the pool outside our plans (``reset_cache``). ``req_id`` is empty."""

    TAG: ClassVar[int] = 12
    key: bytes = b""


@attrs.frozen(slots=True)
class StepDecoded(InputEvent):
    """Running requests that each computed exactly one more token this step, steadily: vLLM's
    ``num_computed_tokens`` was what the tracker expected, at most one block was appended
    (listed in ``blocks``), no load is pending and no save can be due. The one event about
    several requests (``req_id`` is empty): ``nums`` are the tracker's request numbers (the
    lowest free number, taken at the ``RequestAdded`` that starts a request's life and freed at
    its ``Finished``: a reader resolves them from those two recorded facts alone). It exists
    for the hot path: a decode step costs one record for all requests. Anything unsteady
    about a request goes through ``Scheduled`` instead. In kvledger's own log the token ids of
    steady steps are not in the record: they are learned, in bulk, by the next event that
    needs them. A recorder's log (connector/recorder.py) carries them in ``tokens``, one per
    number: there each entry stands for exactly the ``Scheduled`` the recorder would have
    written (tracker/recorded_steps.py).
    """

    TAG: ClassVar[int] = 13
    # v1 had no `blocks` (a steady step appended none); v2 no `tokens` (none carried).
    VERSION: ClassVar[int] = 3
    nums: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    # Flat (number, block id) pairs: the requests whose table grew by exactly one block in
    # this step (every block_size tokens), appended as Scheduled would append it.
    blocks: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    # A recorder's log only: the token id each step made known, aligned with `nums` (empty in
    # kvledger's own log).
    tokens: tuple[int, ...] = attrs.field(default=(), converter=_ints)

    def new_blocks(self) -> dict[int, int] | None:
        """``blocks`` as number -> block id; None when the pairs are malformed (odd length, a
        number twice, or a number not in ``nums``)."""
        grown = self.block_pairs()
        if grown is None or not grown.keys() <= set(self.nums):
            return None
        return grown

    def block_pairs(self) -> dict[int, int] | None:
        """:meth:`new_blocks` less the test that each number is in ``nums``, for a caller
        that holds ``nums`` as a set already (the replay's batch)."""
        pairs = self.blocks
        grown = dict(zip(pairs[::2], pairs[1::2], strict=False))  # odd: refused below
        if len(pairs) % 2 or len(grown) * 2 != len(pairs):
            return None
        return grown


# --- remote tier (tags 30-39): facts about the shared store (connector/tiers.py) -----------


@attrs.frozen(slots=True)
class RemoteFound(InputEvent):
    """A lookup asked the remote store which of ``keys`` exist: ``found[i]`` is 1 if
    ``keys[i]`` existed when it asked, else 0. The answer that follows counts on it."""

    TAG: ClassVar[int] = 30
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    found: tuple[int, ...] = attrs.field(default=(), converter=_ints)


@attrs.frozen(slots=True)
class RemoteSaveDone(InputEvent):
    """The remote store confirmed these chunks written (after their local save)."""

    TAG: ClassVar[int] = 31
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)


@attrs.frozen(slots=True)
class RemoteSaveFailed(InputEvent):
    """These chunks could not be written to the remote store; ``reason`` says why:
    ``refused: <error>`` (the server refused the write: out of memory, a read-only replica) or
    ``unavailable[: <error>]`` (the store was down)."""

    TAG: ClassVar[int] = 32
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    reason: str = ""


@attrs.frozen(slots=True)
class RemoteLoadFailed(InputEvent):
    """A load read these chunks from the remote store and could not use them: the key was
    gone (``missing``), the value had the wrong length (``length``) or the wrong bytes
    (``checksum``), the server refused the read (``refused: <error>``: a key of another
    type), or the store was down (``unavailable[: <error>]``). The load itself is reported as
    ``LoadFailed``."""

    TAG: ClassVar[int] = 33
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    reason: str = ""


@attrs.frozen(slots=True)
class RemoteOutage(InputEvent):
    """The remote store stopped serving us (recorded once per outage): ``error`` is the
    cause, ``Type: message`` (refused, timed out, a reply that is not RESP, ...). ``req_id``
    is empty."""

    TAG: ClassVar[int] = 34
    error: str = ""


@attrs.frozen(slots=True)
class RemoteRestored(InputEvent):
    """The remote store answers again after an outage. ``req_id`` is empty."""

    TAG: ClassVar[int] = 35


# --- the recorder (tags 40-59): what a wrapped connector answered (connector/recorder.py) ---
# A recorder's log holds vLLM's facts as the input events above (RequestAdded, LookupAsked,
# Allocated, Scheduled, Preempted, Finished) and, next to them, what the wrapped ("inner")
# connector answered. They are facts too (KIND "input"): nothing in a recorder's log was
# decided by kvledger. Events about no one request have an empty ``req_id``.


@attrs.frozen(slots=True)
class InnerLookupAnswered(InputEvent):
    """The inner's answer to the ``get_num_new_matched_tokens`` recorded just before it (a
    ``LookupAsked``): ``external`` tokens offered (-1: ``None``, "ask again later") and
    whether it loads them asynchronously."""

    TAG: ClassVar[int] = 40
    external: int = 0
    load_async: bool = False


@attrs.frozen(slots=True)
class InnerFinishedAnswered(InputEvent):
    """The inner's answer to ``request_finished`` (recorded after the ``Finished``): ``delay``
    True keeps ``block_ids`` (group 0) until the worker reports the request in
    ``finished_sending``; ``params`` names the keys of the ``kv_transfer_params`` it
    returned (comma-separated, empty for None)."""

    TAG: ClassVar[int] = 41
    delay: bool = False
    block_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    params: str = ""


@attrs.frozen(slots=True)
class InnerSendDone(InputEvent):
    """The worker reported the request in ``finished_sending``: its saves are done and vLLM
    may free the blocks it kept."""

    TAG: ClassVar[int] = 42


@attrs.frozen(slots=True)
class InnerRecvDone(InputEvent):
    """The worker reported the request in ``finished_recving`` (an asynchronous load ended);
    ``failed``: also in ``failed_recving`` (where vLLM has it: connector/edge.py)."""

    TAG: ClassVar[int] = 43
    failed: bool = False


@attrs.frozen(slots=True)
class InnerLoadErrors(InputEvent):
    """The worker's ``get_block_ids_with_load_errors`` (``invalid_block_ids``): blocks whose
    load failed this step. ``req_id`` is empty: vLLM reports blocks, not requests."""

    TAG: ClassVar[int] = 44
    block_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)


@attrs.frozen(slots=True)
class InnerStats(InputEvent):
    """The inner's connector stats (``kv_connector_stats``, or the scheduler side's own), as
    JSON cut to a few KiB; ``side`` is ``worker`` or ``scheduler``. ``req_id`` is empty."""

    TAG: ClassVar[int] = 45
    side: str = "worker"
    data: str = ""


@attrs.frozen(slots=True)
class InnerRaised(InputEvent):
    """The inner raised in ``callback`` (the exception went on to vLLM unchanged)."""

    TAG: ClassVar[int] = 46
    callback: str = ""
    error: str = ""


@attrs.frozen(slots=True)
class RecordLost(InputEvent):
    """The recorder failed while recording ``callback`` (a vLLM object it could not read, a
    value the log cannot hold), or the KV-content digests failed (``digest_plan``,
    ``digest_report``, ``digest_before_load``, ``digest_after_forward``: those digests are
    missing): that record is missing; vLLM and the inner never saw the failure. The rules do
    not judge what a lost record would have shown."""

    TAG: ClassVar[int] = 47
    callback: str = ""
    error: str = ""


@attrs.frozen(slots=True)
class InnerStored(InputEvent):
    """The inner published a KV event (vLLM's ``BlockStored``, from ``take_events``): it
    stored blocks ``hashes`` (its own keys, in order, each for ``block_size`` tokens of
    ``token_ids``; the first one's parent ``parent``, b"" for none) on ``medium``. A key is the
    inner's bytes, or an integer key written as ``b"#"`` and its decimal digits. ``token_ids``
    may be empty (an inner that does not publish them). ``req_id`` is empty: KV events name
    blocks, not requests."""

    TAG: ClassVar[int] = 48
    hashes: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    parent: bytes = b""
    token_ids: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    block_size: int = 0
    medium: str = ""


@attrs.frozen(slots=True)
class InnerRemoved(InputEvent):
    """The inner published that it no longer holds blocks ``hashes`` on ``medium`` (vLLM's
    ``BlockRemoved``); ``hashes`` empty: it dropped every block (``AllBlocksCleared``)."""

    TAG: ClassVar[int] = 49
    hashes: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    medium: str = ""


# --- KV-content digests (tags 60-69): what the worker found in the blocks (tracker/digests.py)


@attrs.frozen(slots=True)
class BlockDigested(InputEvent):
    """After a forward pass, the worker digested the blocks that became full: block
    ``start + i`` of the request, keyed ``keys[i]`` (its token prefix), held ``digests[i]``
    (a 64-bit digest of its bytes, a signed int, on worker ``rank``).

    ``carried``: the digests came with a value the request loaded from the remote tier
    (connector/values.py): the engine that saved the chunk computed them, and this log can
    judge the load by them without that engine's log."""

    TAG: ClassVar[int] = 60
    VERSION: ClassVar[int] = 2  # v1 had no `carried`
    start: int
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    digests: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    rank: int = 0
    carried: bool = False


@attrs.frozen(slots=True)
class LoadDigested(InputEvent):
    """A load into blocks ``start + i`` (keyed ``keys[i]``) completed: the blocks' digests
    ``before`` the load was issued and ``after`` it completed, on worker ``rank``. Judged
    against the ``BlockDigested`` of the same keys (``digest_mismatch``, ``load_unchanged``).
    The worker's report reaches the scheduler a step after the digests were taken, so the
    event's own step is that later one; ``load_step`` is the step whose plan digested the
    blocks after the load (a synchronous load's: the step that scheduled it), -1 where unknown
    (version 1). A verdict is stamped with :attr:`judged_step`."""

    TAG: ClassVar[int] = 61
    VERSION: ClassVar[int] = 2  # v1 had no `load_step`
    start: int
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    before: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    after: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    rank: int = 0
    load_step: int = -1

    @property
    def judged_step(self) -> int:
        """The step of the load this event judges (its own step where the log predates
        ``load_step``)."""
        return self.load_step if self.load_step >= 0 else self.step


# --- decision events ----------------------------------------------------------------------


@attrs.frozen(slots=True)
class LookupAnswered(DecisionEvent):
    """The answer to a ``LookupAsked``: ``hit`` tokens found in the pool, ``external`` tokens
    offered to vLLM (``max(0, hit - local_hit - full_hit)``)."""

    TAG: ClassVar[int] = 20
    hit: int
    external: int


@attrs.frozen(slots=True)
class LoadPlanned(DecisionEvent):
    """Load tokens ``[start, end)`` from the chunks ``keys`` (host ``slots``) into the
    request's blocks. ``refused_blocks`` are blocks vLLM believes loaded that we refuse to fill
    (the request fell back to recompute): the connector reports them as load errors."""

    TAG: ClassVar[int] = 21
    start: int
    end: int
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    slots: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    refused_blocks: tuple[int, ...] = attrs.field(default=(), converter=_ints)


@attrs.frozen(slots=True)
class SavePlanned(DecisionEvent):
    """Save tokens ``[start, end)`` as the chunks ``keys`` into host ``slots``; ``evicted``
    are the keys whose slots were reclaimed (least recently used) to make room; ``skip_to`` is
    how far the request's saved watermark moves at once because the pool already holds those
    chunks (stored by an earlier request with the same prefix)."""

    TAG: ClassVar[int] = 22
    start: int
    end: int
    keys: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    slots: tuple[int, ...] = attrs.field(default=(), converter=_ints)
    evicted: tuple[bytes, ...] = attrs.field(default=(), converter=_keys)
    skip_to: int = 0


@attrs.frozen(slots=True)
class ViolationRecorded(DecisionEvent):
    """A rule was broken at this step; the request fell back to recompute."""

    TAG: ClassVar[int] = 23
    rule: str
    event: str
    detail: str = ""


EVENT_TYPES: tuple[type[Event], ...] = (
    RequestAdded,
    LookupAsked,
    Allocated,
    Scheduled,
    Preempted,
    Finished,
    SaveDone,
    SaveFailed,
    LoadDone,
    LoadFailed,
    ChunkStored,
    ChunkEvicted,
    StepDecoded,
    RemoteFound,
    RemoteSaveDone,
    RemoteSaveFailed,
    RemoteLoadFailed,
    RemoteOutage,
    RemoteRestored,
    InnerLookupAnswered,
    InnerFinishedAnswered,
    InnerSendDone,
    InnerRecvDone,
    InnerLoadErrors,
    InnerStats,
    InnerRaised,
    RecordLost,
    InnerStored,
    InnerRemoved,
    BlockDigested,
    LoadDigested,
    LookupAnswered,
    LoadPlanned,
    SavePlanned,
    ViolationRecorded,
)


def _check_tags() -> None:
    # Tags are the wire identity of a type: a duplicate would make logs ambiguous forever.
    seen: dict[int, str] = {}
    for cls in EVENT_TYPES:
        if cls.TAG in seen:
            raise RuntimeError(f"event tag {cls.TAG} used by {seen[cls.TAG]} and {cls.__name__}")
        seen[cls.TAG] = cls.__name__


_check_tags()
