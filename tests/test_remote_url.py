"""``remote_url``: the forms accepted, every malformed one refused as a ``ConnectorConfigError``
naming ``remote_url``, the query options accepted (``client_name``, ``db``) and every other
one refused by name, the tier's bounds out of the URL's reach, and the password nowhere:
not in an error, a log line, the kvlog, ``repr`` of the config or of the store, wherever the
URL held it (a property, over generated URLs)."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import pytest
import structlog
from _redis import RedisServer, redis_server, require_redis_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvledger.connector.config import REMOTE_URL_OPTIONS, ConnectorConfig, ConnectorConfigError
from kvledger.connector.remote import RemoteStore, describe, remote_key
from kvledger.connector.values import ValueSeal

__all__ = ["redis_server"]  # the fixture, imported for pytest


def _config(url: object) -> ConnectorConfig:
    return ConnectorConfig.from_extra_config({"remote_url": url, "chunk_size": 32}, environ={})


def _closed_port() -> int:
    """A port nothing listens on: connections are refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- malformed: each a ConnectorConfigError naming remote_url and what is wrong -----------------

MALFORMED = [
    # The scheme.
    ("REDIS://127.0.0.1:6379/0", "in lower case"),
    ("Redis://127.0.0.1:6379/0", "in lower case"),
    ("http://127.0.0.1:6379", "must start with redis://"),
    ("redis:/127.0.0.1:6379", "must start with redis://"),
    ("127.0.0.1:6379", "must start with redis://"),
    ("//127.0.0.1:6379/0", "must start with redis://"),
    # Spaces and control characters, anywhere.
    (" redis://127.0.0.1:6379/0", "a space or a control character"),
    ("redis://127.0.0.1:6379/0 ", "a space or a control character"),
    ("redis://127.0.0.1:6379/0\n", "a space or a control character"),
    ("redis://127.0.0.1:6379/0\x00", "a space or a control character"),
    ("redis://127.0.0.1 :6379/0", "a space or a control character"),
    # The host.
    ("redis://", "names no host"),
    ("redis:///0", "names no host"),
    ("redis://:6379/0", "names no host"),
    ("redis://[::1:P/0", "is not a URL"),
    ("redis://[::1/0", "is not a URL"),
    ("redis://ho$t:6379/0", "bad host name"),
    ("redis://h%6Fst:6379/0", "bad host name"),
    ("redis://[not-v6]:6379/0", "is not a URL"),
    # The port.
    ("redis://127.0.0.1:notaport/0", "bad port"),
    ("redis://127.0.0.1:99999/0", "bad port"),
    ("redis://127.0.0.1:65536/0", "bad port"),
    ("redis://127.0.0.1:0/0", "bad port"),
    ("redis://127.0.0.1:-1/0", "bad port"),
    ("redis://[::1]:x/0", "bad port"),
    # The database.
    ("redis://127.0.0.1:6379/zero", "bad database"),
    ("redis://127.0.0.1:6379/-1", "bad database"),
    ("redis://127.0.0.1:6379/1/2", "bad database"),
    ("redis://127.0.0.1:6379/0/", "bad database"),
    ("redis://127.0.0.1:6379/%30", "bad database"),
    ("redis://127.0.0.1:6379/99999999999", "bad database"),
    ("redis://127.0.0.1:6379/\u0661", "bad database"),  # an Arabic-Indic digit one
    ("redis://127.0.0.1:6379/1?db=1", "gives the database twice"),
    ("unix:///tmp/redis.sock?db=abc", "bad db option"),
    ("unix:///tmp/redis.sock?db=-1", "bad db option"),
    ("unix:///tmp/redis.sock?db=", "bad db option"),
    ("unix:///tmp/redis.sock?db", "gives query option 'db' no value"),
    ("unix:///tmp/redis.sock?db=1&db=2", "gives query option 'db' twice"),
    # Unix sockets.
    ("unix://", "names no socket path"),
    ("unix:///", "names no socket path"),
    ("unix://localhost/tmp/redis.sock", "names a host"),
    ("unix://:6379/tmp/redis.sock", "names a host"),
    ("unix:///tmp/%ff.sock", "unix:// socket path has percent-escapes that are not UTF-8 (%ff)"),
    ("unix:///tmp/a%0a.sock", "control or invisible character, percent-encoded (%0a)"),
    # Query options other than client_name and db, each refused by name.
    ("redis://127.0.0.1:6379/0?socket_timeout=3", "'socket_timeout' is not accepted"),
    ("redis://127.0.0.1:6379/0?socket_timeout=abc", "'socket_timeout' is not accepted"),
    ("redis://127.0.0.1:6379/0?socket_connect_timeout=9", "'socket_connect_timeout' is not"),
    ("redis://127.0.0.1:6379/0?timeout=9", "'timeout' is not accepted"),
    ("redis://127.0.0.1:6379/0?retry_on_timeout=true", "'retry_on_timeout' is not accepted"),
    ("redis://127.0.0.1:6379/0?health_check_interval=1", "'health_check_interval' is not"),
    ("redis://127.0.0.1:6379/0?max_connections=1", "'max_connections' is not accepted"),
    ("redis://127.0.0.1:6379/0?password=x", "'password' is not accepted (credentials go in"),
    ("redis://127.0.0.1:6379/0?username=x", "'username' is not accepted (credentials go in"),
    ("redis://127.0.0.1:6379/0?protocol=3", "'protocol' is not accepted (accepted: client_name"),
    ("redis://127.0.0.1:6379/0?ssl_cert_reqs=none", "'ssl_cert_reqs' is not accepted"),
    ("redis://127.0.0.1:6379/0?foo=1", "'foo' is not accepted"),
    ("redis://127.0.0.1:6379/0?Db=1", "'Db' is not accepted"),
    ("redis://127.0.0.1:6379/0?=1", "a query option that is not a name"),
    ("redis://127.0.0.1:6379/0?&", "a query option that is not a name"),
    ("redis://127.0.0.1:6379/0?client_name=a%20b", "bad client_name"),
    ("redis://127.0.0.1:6379/0?client_name=", "bad client_name"),
    ("redis://127.0.0.1:6379/0?client_name=" + "x" * 65, "bad client_name"),
    # A password's / ? # @ left unencoded: the rest of it would be read as path or query.
    ("redis://:pa/ss@127.0.0.1:6379/0", "an @ after its host"),
    ("redis://:pa?ss@127.0.0.1:6379/0", "an @ after its host"),
    ("redis://:pa#ss@127.0.0.1:6379/0", "an @ after its host"),
    ("unix://:pa/ss@/tmp/redis.sock", "an @ after its host"),
    ("redis://127.0.0.1:6379/0#frag", "has a fragment"),
    ("redis://127.0.0.1:6379/0#", "has a fragment"),
    # Not a string at all.
    (6379, "must be a Redis URL string, got int"),
    (b"redis://127.0.0.1:6379/0", "must be a Redis URL string, got bytes"),
    ({"password": "x"}, "must be a Redis URL string, got dict"),
    # Empty: what is accepted, and that it may be left unset.
    ("", "is empty (''): give a URL (redis://host:6379/0, rediss://host:6379/0, unix:///"),
    ("  ", "is empty ('  ')"),
    ("\t", "or leave remote_url unset (null) for no remote tier"),
    ("", "file:///path/to/dir, or a registered tier's: "),
]


@pytest.mark.parametrize(("url", "says"), MALFORMED)
def test_a_malformed_remote_url_is_a_config_error_naming_the_key(url: object, says: str) -> None:
    with pytest.raises(ConnectorConfigError, match=r"^remote_url") as info:
        _config(url)
    assert says in str(info.value)


@pytest.mark.parametrize(("url", "says"), [m for m in MALFORMED if isinstance(m[0], str)])
def test_the_store_refuses_what_the_config_refuses(url: str, says: str) -> None:
    """A URL that did not come through ConnectorConfig is checked the same."""
    with pytest.raises(ConnectorConfigError, match=r"^remote_url") as info:
        RemoteStore(url, timeout_s=0.05, retry_s=0.05)
    assert says in str(info.value)


# --- accepted: what redis-py is then given ---------------------------------------------------------

ACCEPTED = [
    ("redis://127.0.0.1", {"host": "127.0.0.1"}),
    ("redis://127.0.0.1:6380", {"host": "127.0.0.1", "port": 6380}),
    ("redis://127.0.0.1:6380/", {"host": "127.0.0.1", "port": 6380}),
    ("redis://cache.internal:6379/3", {"host": "cache.internal", "port": 6379, "db": 3}),
    ("redis://127.0.0.1:6379/0?", {"host": "127.0.0.1", "db": 0}),
    ("redis://[::1]:6379/1", {"host": "::1", "db": 1}),
    ("redis://alice:s3cret@127.0.0.1:6379/0", {"username": "alice", "password": "s3cret"}),
    ("redis://:p%40ss%2Fw%3Ard@127.0.0.1/0", {"password": "p@ss/w:rd"}),
    ("rediss://127.0.0.1:6380/2", {"host": "127.0.0.1", "db": 2, "connection_class": "SSL"}),
    ("redis://127.0.0.1/0?client_name=kvledger-a.1", {"client_name": "kvledger-a.1"}),
    ("unix:///tmp/redis.sock", {"path": "/tmp/redis.sock", "connection_class": "Unix"}),
    ("unix:///tmp/redis.sock?db=2", {"path": "/tmp/redis.sock", "db": 2}),
    ("unix://:pw@/tmp/redis.sock?db=2&client_name=kv", {"password": "pw", "client_name": "kv"}),
]


@pytest.mark.parametrize(("url", "given"), ACCEPTED)
def test_an_accepted_url_reaches_redis_py_with_the_tiers_bounds(
    url: str, given: dict[str, Any]
) -> None:
    config = ConnectorConfig.from_extra_config(
        {"remote_url": url, "remote_timeout_ms": 700}, environ={}
    )
    assert config.remote_url == url
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    for scheduler, bound in ((True, 0.05), (False, 0.7)):
        store = RemoteStore.from_config(config, scheduler=scheduler)
        kwargs = store.client.connection_pool.connection_kwargs
        for key, value in given.items():
            if key == "connection_class":
                assert value in store.client.connection_pool.connection_class.__name__
            else:
                assert kwargs[key] == value, key
        # The URL sets nothing else, and cannot loosen a bound: the lookup's 50 ms on the
        # scheduler thread, the workers' command timeout, no retries inside the client.
        assert kwargs["socket_timeout"] == bound
        assert kwargs["socket_connect_timeout"] == bound
        assert kwargs["retry"].get_retries() == 0
        assert kwargs["health_check_interval"] == 0
        assert kwargs["protocol"] == 2
        assert set(URL_QUERY_ARGUMENT_PARSERS) & set(kwargs) <= {
            "db", "socket_timeout", "socket_connect_timeout", "health_check_interval", "protocol"
        }  # fmt: skip


def test_the_accepted_options_are_the_documented_ones() -> None:
    docs = (Path(__file__).parent.parent / "docs" / "remote.md").read_text()
    assert REMOTE_URL_OPTIONS == ("client_name", "db")
    for name in REMOTE_URL_OPTIONS:
        assert f"`{name}`" in docs


# --- the server's own refusals, at startup --------------------------------------------------------


@pytest.mark.redis
def test_a_database_the_server_does_not_have_is_a_startup_error(redis_server: RedisServer) -> None:
    from kvledger.connector.scheduler import SchedulerSide
    from kvledger.connector.worker import WorkerSide

    url = f"redis://127.0.0.1:{redis_server.port}/99999"
    config = _config(url)  # a number: how many databases a server has is its own setting
    with pytest.raises(ConnectorConfigError, match=r"^remote_url") as info:
        SchedulerSide(config, block_size=16, num_slots=4)
    assert "refused the connection (ResponseError: DB index is out of range)" in str(info.value)
    with pytest.raises(ConnectorConfigError, match="DB index is out of range"):
        WorkerSide(config)
    # Database 15 of 16 is served.
    SchedulerSide(_config(f"redis://127.0.0.1:{redis_server.port}/15"), block_size=16, num_slots=4)


@pytest.mark.redis
def test_a_unix_socket_url_is_served(redis_server: RedisServer) -> None:
    store = RemoteStore(redis_server.unix_url + "?db=3", timeout_s=2.0, retry_s=0.05)
    assert store.check(startup=True) is None
    value = ValueSeal(rank=0, layout=b"L" * 16).seal(b"u" * 16, memoryview(b"xyz"))
    assert store.put([(b"u" * 16, value)]) == [None]
    assert store.exists([b"u" * 16]) == [1]
    assert redis_server.client().exists(remote_key(b"u" * 16, 0)) == 0
    raw = redis_server.client()
    raw.select(3)
    assert raw.exists(remote_key(b"u" * 16, 0)) == 1


@pytest.mark.redis
def test_a_wrong_password_in_any_form_is_refused_without_echoing_it(tmp_path: Path) -> None:
    from kvledger.connector.scheduler import SchedulerSide

    server = RedisServer(require_redis_server(), tmp_path, password="right-pw")
    server.start()
    try:
        for url in (
            f"redis://:wr%2Fong-pw@127.0.0.1:{server.port}/0",
            f"redis://default:wr%2Fong-pw@127.0.0.1:{server.port}/0",
            f"unix://:wr%2Fong-pw@{server.socket_path}",
        ):
            with pytest.raises(ConnectorConfigError, match="refused the credentials") as info:
                SchedulerSide(_config(url), block_size=16, num_slots=4)
            text = str(info.value)
            assert "wr%2Fong-pw" not in text and "wr/ong-pw" not in text
            assert "right-pw" not in text
        ok = f"redis://:right-pw@127.0.0.1:{server.port}/0"
        SchedulerSide(_config(ok), block_size=16, num_slots=4)
    finally:
        server.stop()


# --- the password, nowhere -------------------------------------------------------------------------

_PASSWORD = st.builds(
    lambda body: "Zq7" + body,
    st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=3, max_size=12
    ),
)


def _forms(password: str) -> set[str]:
    """Every form of ``password`` that would give it away."""
    forms = {password, quote(password, safe=""), quote(password), unquote(password)}
    forms.add(repr(password.encode())[2:-1])
    forms.add(repr(password)[1:-1])
    return {f for f in forms if len(f) >= 4}


def _embed(password: str, where: str, rest: str, encoded: bool) -> str:
    pw = quote(password, safe="") if encoded else password
    return {
        "userinfo": f"redis://:{pw}@{rest}",
        "user-and-password": f"redis://alice:{pw}@{rest}",
        "username": f"redis://{pw}@{rest}",
        "query-password": f"redis://{rest}?password={pw}",
        "query-other": f"redis://{rest}?client_name={pw}",
        "query-db": f"unix:///tmp/kvl-none.sock?db={pw}",
        "unix-userinfo": f"unix://:{pw}@/tmp/kvl-none.sock",
        "scheme-upper": f"REDIS://:{pw}@{rest}",
        "leading-space": f" redis://:{pw}@{rest}",
        "twice": f"redis://:{pw}@{rest}?password={pw}",
    }[where]


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    password=_PASSWORD,
    where=st.sampled_from(
        [
            "userinfo",
            "user-and-password",
            "username",
            "query-password",
            "query-other",
            "query-db",
            "unix-userinfo",
            "scheme-upper",
            "leading-space",
            "twice",
        ]
    ),
    rest=st.sampled_from(
        ["127.0.0.1:{port}/0", "127.0.0.1:{port}", "127.0.0.1:99999/0", "[::1:{port}/0", "h$/0"]
    ),
    encoded=st.booleans(),
)
def test_a_password_anywhere_in_the_url_appears_nowhere(
    tmp_path: Path, password: str, where: str, rest: str, encoded: bool
) -> None:
    from kvledger.connector.scheduler import SchedulerSide

    url = _embed(password, where, rest.format(port=_closed_port()), encoded)
    forms = _forms(password)
    seen: list[str] = []
    with structlog.testing.capture_logs() as logs:
        try:
            config = ConnectorConfig.from_extra_config(
                {"remote_url": url, "chunk_size": 32, "log_dir": str(tmp_path / "logs")},
                environ={},
            )
        except ConnectorConfigError as exc:
            seen.append(str(exc))
        else:
            seen.append(repr(config))
            try:
                side = SchedulerSide(config, block_size=16, num_slots=4)
            except ConnectorConfigError as exc:
                seen.append(str(exc))
            else:
                seen.append(repr(side.remote))
                side.shutdown()
                assert side.log_path is not None
                seen.append(Path(side.log_path).read_bytes().decode("utf-8", "replace"))
    seen.extend(repr(entry) for entry in logs)
    for text in seen:
        for form in forms:
            assert form not in text, (where, text)


def test_describe_scrubs_credentials_echoed_in_an_error() -> None:
    """A hostile server can echo what it was sent (AUTH's arguments) in a reply that is not
    RESP: redis-py's message quotes the reply, as a bytes repr."""
    store = RemoteStore("redis://alice:p%C3%A4ss%2Fw@127.0.0.1:1/0", timeout_s=0.05, retry_s=0.05)
    echoed = Exception("Protocol Error: b'AUTH alice p\\xc3\\xa4ss/w' or päss/w or p%C3%A4ss%2Fw")
    text = store.describe(echoed)
    assert "ss/w" not in text and "%2Fw" not in text and "alice" not in text
    assert describe(Exception("x" * 10_000)).endswith("...")
    assert len(describe(Exception("x" * 10_000))) <= 300
