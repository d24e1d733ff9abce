"""``kv_connector_extra_config``: every key, its default, and its validation, for both
connector classes vLLM loads.

An unknown key or a bad value is an error at construction that names the key and what is
accepted, so a typo in ``--kv-transfer-config`` fails at startup instead of silently running
with defaults. A key means the same in ``KVLedgerConnector`` (:class:`ConnectorConfig`) and
``KVLedgerRecorder`` (:class:`RecorderConfig`): each key has one validator (:data:`_CHECKS`),
so a bad value gets the same error from both; the event log's keys are declared once
(:class:`LogSettings`, which both classes' settings extend).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any
from urllib.parse import unquote, unquote_plus, urlsplit

import attrs

from kvledger.tracker.digests import DIGEST_MODES

__all__ = [
    "ENV_LOG_DIR",
    "REDIS_SCHEMES",
    "REMOTE_URL_OPTIONS",
    "TIER_ENTRY_POINTS",
    "TIER_SCHEMES",
    "ConnectorConfig",
    "ConnectorConfigError",
    "LogSettings",
    "RecorderConfig",
    "check_chunk_size",
    "check_redis_url",
    "check_remote_url",
    "connector_name",
    "redacted",
    "tier_target",
    "url_path",
]

# Turns the event log on without touching the serving command line.
ENV_LOG_DIR = "KVLEDGER_LOG_DIR"

# The recorder's default chunk size for `check --differential` (when not given, the largest
# multiple of vLLM's block size not above it).
DEFAULT_CHUNK_SIZE = 256


class ConnectorConfigError(ValueError):
    """A ``kv_connector_extra_config`` key is unknown or its value is out of range."""


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConnectorConfigError(f"{name} must be true or false, got {value!r}")


def _pos_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConnectorConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


# --- remote_url ------------------------------------------------------------------------------
# The URL names the remote tier by its scheme (connector/tiers.py opens it): a Redis URL, or
# a scheme tier_target knows, whose tier checks the rest of its URL when it opens.
# scheme -> (module, class) of a connector.tiers.Tier; connector.tiers.register_tier adds one.
TIER_SCHEMES: dict[str, tuple[str, str]] = {"file": ("kvledger.connector.disk", "DiskTier")}
# The entry-point group a package names its tiers in, by scheme: found in every process vLLM
# starts (its workers too), where a register_tier call in the serving script is not.
TIER_ENTRY_POINTS = "kvledger.tiers"


def tier_target(scheme: str) -> tuple[str, str] | None:
    """The (module, class) a ``remote_url`` of ``scheme`` opens, other than Redis's: one in
    :data:`TIER_SCHEMES`, else an installed package's entry point ``<scheme> =
    "module:Class"`` in the group :data:`TIER_ENTRY_POINTS` (remembered; its module is not
    imported here). None: no such tier."""
    if scheme in TIER_SCHEMES:
        return TIER_SCHEMES[scheme]
    if scheme in REDIS_SCHEMES or not scheme.isascii() or not scheme.isalnum():
        return None
    for point in entry_points(group=TIER_ENTRY_POINTS, name=scheme):
        module, sep, attr = point.value.partition(":")
        if sep and module and attr and "[" not in attr:
            TIER_SCHEMES.setdefault(scheme, (module.strip(), attr.strip()))
            return TIER_SCHEMES[scheme]
    return None


# A Redis URL is checked here without importing redis (this module stays light);
# connector/remote.py then hands the checked URL to redis-py's own parser. What is accepted is
# exactly what redis-py reads the same way and what cannot loosen the tier's bounds:
# docs/remote.md#remote_url.

# The query options remote_url accepts; every other one is refused by name.
REMOTE_URL_OPTIONS = ("client_name", "db")
REDIS_SCHEMES = ("redis", "rediss", "unix")
# redis-py options that would loosen a bound the tier relies on (the lookup's 50 ms on vLLM's
# scheduler thread, the workers' command timeout, no retries inside the client).
_BOUND_OPTIONS = frozenset(
    {
        "health_check_interval",
        "max_connections",
        "retry",
        "retry_on_error",
        "retry_on_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_keepalive_options",
        "socket_read_size",
        "socket_timeout",
        "timeout",
    }
)
_OPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")
_CLIENT_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_DB = re.compile(r"[0-9]{1,10}")
_HOST = re.compile(r"[A-Za-z0-9._-]{1,253}")
_IPV6 = re.compile(r"[0-9A-Fa-f:.]{2,45}")
_MAX_DB = 2**31 - 1  # Redis's `databases` is an int; the server says how many it has
_SHOWN = 200


def redacted(url: str) -> str:
    """``url`` fit for an error or a log line: everything before its last ``@`` (the userinfo,
    with whatever it holds), every query value and the fragment masked. Masked by position in
    the raw text, so a URL too malformed to parse (an unencoded ``/``, ``?`` or ``#`` in a
    password, say) is masked the same; repr-escaped and bounded in length."""
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    at = rest.rfind("@")
    if at >= 0:
        rest = "***@" + rest[at + 1 :]
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    tail = rest[cut:]
    rest = rest[:cut]
    if tail.startswith("?"):
        query = tail[1:].partition("#")[0]
        fields = []
        for field in query.split("&"):
            name, eq, _ = field.partition("=")
            shown = name if _OPTION_NAME.fullmatch(name) else "***"
            fields.append(f"{shown}=***" if eq else shown)
        rest += "?" + "&".join(fields) + ("#***" if "#" in tail else "")
    elif tail:
        rest += "#***"
    shown = repr(head + sep + rest)
    return shown if len(shown) <= _SHOWN else shown[: _SHOWN - 4] + "...'"


def _option(name: str, value: str, url: str) -> str | int:
    """One query option's value, checked."""
    if name == "db":
        if not _DB.fullmatch(value) or int(value) > _MAX_DB:
            raise _url_error(f"has a bad db option (a number from 0 to {_MAX_DB})", url)
        return int(value)
    if not _CLIENT_NAME.fullmatch(value):
        raise _url_error("has a bad client_name (1 to 64 letters, digits or . _ : -)", url)
    return value


def _url_error(why: str, url: str) -> ConnectorConfigError:
    return ConnectorConfigError(f"remote_url {why}: {redacted(url)}")


def _refused_option(name: str) -> str:
    accepted = ", ".join(REMOTE_URL_OPTIONS)
    if name in ("password", "username"):
        hint = (
            "credentials go in the URL's userinfo, redis://[user]:PASSWORD@host:port/db, "
            "with any of : / ? # @ % in them percent-encoded"
        )
    elif name in _BOUND_OPTIONS:
        hint = (
            "the tier's bounds are remote_timeout_ms, remote_lookup_timeout_ms and "
            "remote_retry_ms, never the URL's"
        )
    else:
        hint = f"accepted: {accepted}"
    return f"query option {name!r} is not accepted ({hint})"


def _check_url_chars(value: str) -> None:
    if any(ch.isspace() or not ch.isprintable() for ch in value):
        raise _url_error("has a space or a control character (percent-encode it)", value)


_ESCAPES = re.compile(r"(?:%[0-9A-Fa-f]{2})+")


def _shown_escapes(runs: list[str]) -> str:
    shown = [run if len(run) <= 24 else run[:21] + "..." for run in runs[:3]]
    return " ".join(shown) + (f" and {len(runs) - 3} more" if len(runs) > 3 else "")


def url_path(url: str, what: str) -> str:
    """The path of ``url``, percent-decoded as UTF-8; else ``ConnectorConfigError`` naming
    ``remote_url``, ``what`` (``file:// path``) and the escapes at fault: escapes whose bytes
    are not UTF-8 (urllib's ``unquote`` would make each a U+FFFD, a path nobody named), or that
    decode to a control or invisible character (a newline, a NUL) where a space is the only
    one a path may have."""
    _check_url_chars(url)
    path = urlsplit(url).path
    runs = _ESCAPES.findall(path)
    not_utf8 = []
    for run in runs:
        try:
            unquote(run, errors="strict")
        except UnicodeDecodeError:
            not_utf8.append(run)
    if not_utf8:
        raise _url_error(
            f"{what} has percent-escapes that are not UTF-8 ({_shown_escapes(not_utf8)}): a "
            "path is UTF-8 text, each byte of a character percent-encoded (é is %C3%A9)",
            url,
        )
    hidden = [run for run in runs if any(ch != " " and not ch.isprintable() for ch in unquote(run))]
    if hidden:
        raise _url_error(
            f"{what} has a control or invisible character, percent-encoded "
            f"({_shown_escapes(hidden)}): name a path without one",
            url,
        )
    return unquote(path, errors="strict")


def check_remote_url(value: Any) -> str:
    """``value`` if it names a remote tier: a URL of a scheme :func:`tier_target` knows (its
    tier checks the rest when it opens), or a Redis URL (:func:`check_redis_url`); else
    ``ConnectorConfigError`` naming ``remote_url`` and what is wrong."""
    if isinstance(value, str) and "://" in value and tier_target(value.partition("://")[0]):
        _check_url_chars(value)
        return value
    return check_redis_url(value)


def _other_schemes() -> set[str]:
    """The schemes of the tiers other than Redis: registered, or installed packages'."""
    return {*TIER_SCHEMES, *(p.name for p in entry_points(group=TIER_ENTRY_POINTS))}


def check_redis_url(value: Any) -> str:
    """``value`` if it is a Redis URL the remote tier accepts, else ``ConnectorConfigError``
    naming ``remote_url`` and what is wrong, with the URL shown ``redacted``: no password, no
    query value. Accepted: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` the
    same, ``unix://[[user]:password@]/path/to/socket``; query options ``REMOTE_URL_OPTIONS``
    only (``db``, for a socket; ``client_name``)."""
    if not isinstance(value, str):
        raise ConnectorConfigError(
            f"remote_url must be a Redis URL string, got {type(value).__name__}"
        )
    if not value.strip():
        registered = sorted(_other_schemes() - {"file"})
        theirs = ", ".join(f"{name}://..." for name in registered) or "its-scheme://..."
        raise ConnectorConfigError(
            f"remote_url is empty ({value!r}): give a URL (redis://host:6379/0, "
            "rediss://host:6379/0, unix:///path/to/redis.sock, file:///path/to/dir, or a "
            f"registered tier's: {theirs}), or leave remote_url unset (null) for no remote tier"
        )
    _check_url_chars(value)
    scheme, sep, _ = value.partition("://")
    if not sep or scheme not in REDIS_SCHEMES:
        known = _other_schemes()
        case = " (in lower case)" if scheme.lower() in (*REDIS_SCHEMES, *known) else ""
        schemes = [f"{name}://" for name in (*REDIS_SCHEMES, *sorted(known))]
        listed = ", ".join(schemes[:-1]) + " or " + schemes[-1]
        raise _url_error(f"must start with {listed}{case}", value)
    try:
        parts = urlsplit(value)
    except ValueError:  # an unclosed [ of an IPv6 host; characters NFKC folds into / ? # @
        raise _url_error("is not a URL (a bad [IPv6] host?)", value) from None
    if "@" in parts.path + parts.query + parts.fragment:
        raise _url_error(
            "has an @ after its host: percent-encode / ? # @ in a password (%2F %3F %23 %40)",
            value,
        )
    if parts.fragment or value.endswith("#"):
        raise _url_error("has a fragment (#...): percent-encode # in a password as %23", value)
    try:
        port = parts.port
    except ValueError:
        raise _url_error("has a bad port (a number from 1 to 65535)", value) from None
    options: dict[str, str | int] = {}
    for field in parts.query.split("&") if parts.query else ():
        raw_name, eq, raw_value = field.partition("=")
        name = unquote_plus(raw_name)
        if not _OPTION_NAME.fullmatch(name):
            raise _url_error("has a query option that is not a name", value)
        if name not in REMOTE_URL_OPTIONS:
            raise _url_error(_refused_option(name), value)
        if not eq:
            raise _url_error(f"gives query option {name!r} no value", value)
        if name in options:
            raise _url_error(f"gives query option {name!r} twice", value)
        options[name] = _option(name, unquote_plus(raw_value), value)
    host = parts.hostname or ""
    if scheme == "unix":
        if host or port is not None:
            raise _url_error("names a host: a socket is unix:///path/to/redis.sock", value)
        if parts.path in ("", "/"):
            raise _url_error("names no socket path (unix:///path/to/redis.sock)", value)
        url_path(value, "unix:// socket path")  # redis-py's unquote would replace, not refuse
        return value
    if not host:
        raise _url_error("names no host (redis://host:6379/0)", value)
    if not (_HOST.fullmatch(host) or ("[" in parts.netloc and _IPV6.fullmatch(host))):
        raise _url_error("has a bad host name", value)
    if port == 0:
        raise _url_error("has a bad port (a number from 1 to 65535)", value)
    if parts.path not in ("", "/"):
        db = parts.path[1:]
        if not _DB.fullmatch(db) or int(db) > _MAX_DB:
            raise _url_error(
                f"has a bad database (a number from 0 to {_MAX_DB}: redis://host:6379/0)", value
            )
        if "db" in options:
            raise _url_error("gives the database twice (the path /N and ?db=)", value)
    return value


def _nonneg_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConnectorConfigError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _fsync_mode(name: str, value: Any) -> str:
    if value not in ("close", "step", "never"):
        raise ConnectorConfigError(f"{name} must be 'close', 'step' or 'never', got {value!r}")
    return str(value)


def _digest_mode(name: str, value: Any) -> str:
    if not isinstance(value, str) or value not in DIGEST_MODES:
        raise ConnectorConfigError(
            f"{name} must be one of {', '.join(map(repr, DIGEST_MODES))}, got {value!r}"
        )
    return value


def _path(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ConnectorConfigError(f"{name} must be a path string, got {value!r}")
    return value


def _nonempty_str(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ConnectorConfigError(f"{name} must be a non-empty string, got {value!r}")
    return value


def connector_name(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConnectorConfigError(
            f"{name} must name a connector (a vLLM registry name or module:Class), got {value!r}"
        )
    return value


def _map(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConnectorConfigError(f"{name} must be a map, got {value!r}")
    return dict(value)


# One validator per key, for both classes. (remote_url has its own: ConnectorConfig.)
_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    **dict.fromkeys(
        (
            "chunk_size",
            "host_pool_bytes",
            "log_rotate_bytes",
            "log_queue_bytes",
            "remote_timeout_ms",
            "remote_lookup_timeout_ms",
            "remote_retry_ms",
            "remote_max_chunk_bytes",
        ),
        _pos_int,
    ),
    **dict.fromkeys(
        (
            "save_decode_cache",
            "discard_partial_chunks",
            "block_hits",
            "strict",
            "log_background",
            "log_required",
            "steady_decode",
        ),
        _bool,
    ),
    "remote_ttl_s": _nonneg_int,
    "log_fsync": _fsync_mode,
    "digests": _digest_mode,
    "inner": connector_name,
    "inner_extra_config": _map,
    "remote_secret_file": _nonempty_str,
    "remote_secret_env": _nonempty_str,
}


def _read(
    cls: type, extra: Any, environ: Mapping[str, str] | None, *, hint: str = ""
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the validated values of ``extra``'s keys, ``extra`` as a dict): an unknown key or a
    bad value raises :class:`ConnectorConfigError` naming it. ``log_dir`` falls back on the
    environment (:data:`ENV_LOG_DIR`)."""
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConnectorConfigError(f"kv_connector_extra_config must be a map, got {extra!r}")
    extra = dict(extra)
    environ = os.environ if environ is None else environ
    known = {f.name for f in attrs.fields(cls)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConnectorConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown}; accepted keys: "
            f"{sorted(known)}{hint}"
        )
    values = {name: _CHECKS[name](name, extra[name]) for name in extra if name in _CHECKS}
    values["log_dir"] = _path("log_dir", extra.get("log_dir", environ.get(ENV_LOG_DIR) or None))
    return values, extra


def check_chunk_size(chunk_size: int, block_size: int) -> None:
    """A chunk is whole blocks of vLLM's: the rule of both classes."""
    if chunk_size % block_size:
        raise ConnectorConfigError(
            f"chunk_size ({chunk_size}) must be a multiple of vLLM's block_size "
            f"({block_size}); for example {block_size * max(1, chunk_size // block_size)}"
        )


@attrs.frozen
class LogSettings:
    """The event log's settings: the same keys, defaults and meaning for both classes
    (connector/logfile.py opens the log by them)."""

    log_dir: str | None = None
    log_rotate_bytes: int = 256 << 20
    # Durability of the log, like SQLite's `synchronous`: "close" fsyncs at each rotation and
    # at close, "step" after every step too, "never" leaves it to the OS.
    log_fsync: str = "close"
    # Write the log on a thread of its own, so a slow or hung disk never stalls the scheduler:
    # past log_queue_bytes waiting, steps are dropped and the gap recorded.
    log_background: bool = True
    log_queue_bytes: int = 64 << 20
    # A log_dir that cannot be written: by default a loud error and the engine serves without
    # a log; with log_required, the connector refuses to start, naming the directory.
    log_required: bool = False


@attrs.frozen
class ConnectorConfig(LogSettings):
    """``KVLedgerConnector``'s settings (see docs/using-with-vllm.md for each one)."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    host_pool_bytes: int = 4 << 30
    save_decode_cache: bool = False
    discard_partial_chunks: bool = True
    # Hits at block granularity (tracker/config.py, design note 14); false: whole chunks.
    block_hits: bool = True
    strict: bool = False
    # The remote chunk tier (connector/tiers.py, docs/remote.md): a Redis URL
    # (redis://[user:password@]host:port/db, rediss:// for TLS, unix://), a directory
    # (file:///path: connector/disk.py), or a URL of a registered tier's scheme
    # (TIER_SCHEMES); None: no remote tier.
    remote_url: str | None = attrs.field(
        default=None, repr=lambda url: "None" if url is None else redacted(url)
    )
    # Bounds: every command of the worker's client; every lookup on the scheduler thread (a
    # lookup that waits longer counts the server as down); the first back-off after a failure
    # (doubling, at most 30 s); a chunk larger than remote_max_chunk_bytes refuses to start.
    remote_timeout_ms: int = 2000
    remote_lookup_timeout_ms: int = 50
    remote_retry_ms: int = 500
    remote_ttl_s: int = 0  # expire chunks after this long (0: never; the server's policy)
    remote_max_chunk_bytes: int = 512 << 20  # Redis's default proto-max-bulk-len
    # A secret shared by the engines of one tier (connector/values.py): every value carries a
    # MAC under it, and a value without the right one is never loaded. From a file, or from
    # the environment variable named; never from the config itself (it is logged), never
    # printed. None: values carry checksums only.
    remote_secret_file: str | None = None
    remote_secret_env: str | None = None
    # KV-content digests (connector/digests.py, tracker/digests.py): "off", "sampled" (one layer
    # of each block, chosen by its key) or "full" (every layer). Off by default: opt in per
    # deployment once its cost is measured (docs/performance.md).
    digests: str = "off"

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> ConnectorConfig:
        values, extra = _read(cls, extra, environ)
        if extra.get("remote_url") is not None:
            values["remote_url"] = check_remote_url(extra["remote_url"])
        secrets = [k for k in ("remote_secret_file", "remote_secret_env") if values.get(k)]
        if len(secrets) > 1:
            raise ConnectorConfigError(
                "remote_secret_file and remote_secret_env are both set: give the secret one way"
            )
        if secrets and values.get("remote_url") is None:
            raise ConnectorConfigError(
                f"{secrets[0]} is set but remote_url is not: no tier to sign"
            )
        return cls(**values)

    def check_block_size(self, block_size: int) -> None:
        check_chunk_size(self.chunk_size, block_size)


@attrs.frozen
class RecorderConfig(LogSettings):
    """``KVLedgerRecorder``'s settings (docs/recording.md): the connector it wraps and that
    connector's own extra config, the chunk size ``check --differential`` gives kvledger's
    pool by default (None: :data:`DEFAULT_CHUNK_SIZE`, rounded down to whole blocks), the
    digests, whether steady decode steps are batched, and the event log's settings, as
    ``KVLedgerConnector`` takes them."""

    inner: str = ""
    inner_extra_config: dict[str, Any] = attrs.field(factory=dict)
    chunk_size: int | None = None
    digests: str = "off"
    # Steady decode steps batched into one StepDecoded record per run (tracker/recorded_steps.py);
    # false: every scheduled request its own Scheduled record, as before the batching.
    steady_decode: bool = True

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> RecorderConfig:
        values, extra = _read(
            cls, extra, environ, hint=" (the inner's own keys go in inner_extra_config)"
        )
        if "inner" not in extra:
            raise ConnectorConfigError("KVLedgerRecorder needs `inner`: the connector it wraps")
        return cls(**values)

    def chunk_size_for(self, block_size: int) -> int:
        """The chunk size for vLLM's ``block_size``: the one given, which must be whole blocks
        (as for ``KVLedgerConnector``), else the default in whole blocks."""
        if self.chunk_size is None:
            return max(block_size, DEFAULT_CHUNK_SIZE // block_size * block_size)
        check_chunk_size(self.chunk_size, block_size)
        return self.chunk_size
