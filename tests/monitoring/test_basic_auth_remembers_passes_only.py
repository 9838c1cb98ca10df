"""The exporter's basic auth remembers headers that passed (to skip bcrypt), and only those: over
any sequence of tries, from any clients, in any order and any number of times, a check passes
exactly when its credentials are right (a property test over sequences, beside the named cases).
"""
from __future__ import annotations

import base64

import bcrypt
import pytest
from hypothesis import given, settings, strategies as st

from r9k.monitoring.web_config import AUTH_CACHE_SIZE, BasicAuth

USERS = {"prometheus": b"scrape-secret", "grafana": b"other-secret"}


@pytest.fixture(scope="module")
def auth() -> BasicAuth:
    return BasicAuth({u: bcrypt.hashpw(p, bcrypt.gensalt(rounds=4)).decode() for u, p in USERS.items()})


def _header(user: str, password: bytes, scheme: str = "Basic") -> str:
    return f"{scheme} " + base64.b64encode(user.encode() + b":" + password).decode()


# (header, right?) : right and wrong passwords of both users, a prefix and an extension of the
# right one, another user's password, an unknown user, case and spacing of the scheme
TRIES = [(_header(u, p), True) for u, p in USERS.items()] + [
    (_header("prometheus", b"scrape-secreT"), False),
    (_header("prometheus", b"scrape-secre"), False),
    (_header("prometheus", b"scrape-secret "), False),
    (_header("prometheus", b"other-secret"), False),
    (_header("grafana", b"scrape-secret"), False),
    (_header("nobody", b"scrape-secret"), False),
    (_header("prometheus", b""), False),
    (_header("prometheus", b"scrape-secret", scheme="basic"), True),
    (_header("prometheus", b"x" * 100), False),
]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(range(len(TRIES))), st.sampled_from(["10.0.0.1", "10.0.0.2"])),
                min_size=2, max_size=24))
def test_a_check_passes_exactly_when_its_credentials_are_right(auth, tries):
    for index, client in tries:
        header, right = TRIES[index]
        assert auth.check(header, client) is right, (header, client)


def test_a_wrong_header_tried_again_after_each_pass_still_fails():
    auth = BasicAuth({"prometheus": bcrypt.hashpw(b"scrape-secret", bcrypt.gensalt(rounds=4)).decode()})
    right, wrong = _header("prometheus", b"scrape-secret"), _header("prometheus", b"scrape-secreT")
    assert [auth.check(h) for h in (wrong, wrong, right, wrong, right, right, wrong)] == \
        [False, False, True, False, True, True, False]


def test_passes_are_remembered_up_to_the_cache_size_and_each_still_passes(monkeypatch):
    """A remembered pass skips bcrypt; one pushed out of the cache is checked again, and passes."""
    auth = BasicAuth({"prometheus": bcrypt.hashpw(b"scrape-secret", bcrypt.gensalt(rounds=4)).decode()})
    calls: list[bytes] = []
    real = auth.verify
    monkeypatch.setattr(auth, "verify", lambda user, pw: calls.append(pw) or real(user, pw))
    # the same credentials, spelt AUTH_CACHE_SIZE + 1 ways (the scheme's case, the blanks after
    # it): distinct headers
    encoded = _header("prometheus", b"scrape-secret").split(" ", 1)[1]
    spellings = ["".join(c.upper() if i >> n & 1 else c for n, c in enumerate("basic"))
                 + " " * blanks + encoded for blanks in (1, 2, 3) for i in range(32)]
    headers = spellings[:AUTH_CACHE_SIZE + 1]
    assert len(set(headers)) == AUTH_CACHE_SIZE + 1
    assert all(auth.check(h) is True for h in headers)
    assert len(calls) == AUTH_CACHE_SIZE + 1
    assert all(auth.check(h) is True for h in headers[1:])      # remembered: no bcrypt
    assert len(calls) == AUTH_CACHE_SIZE + 1
    assert auth.check(headers[0]) is True and len(calls) == AUTH_CACHE_SIZE + 2   # pushed out


def test_a_check_that_outlasts_the_wait_returns_its_own_verdict(monkeypatch):
    """A check already running when the wait ends is waited for and its verdict returned (not
    dropped as 503, and a wrong password never turned into a pass), twice over."""
    import time

    from r9k.monitoring import web_config

    monkeypatch.setattr(web_config, "AUTH_WAIT_S", 0.05)
    auth = BasicAuth({"prometheus": bcrypt.hashpw(b"scrape-secret", bcrypt.gensalt(rounds=4)).decode()})
    real = auth.verify
    monkeypatch.setattr(auth, "verify", lambda user, pw: time.sleep(0.3) or real(user, pw))
    right, wrong = _header("prometheus", b"scrape-secret"), _header("prometheus", b"scrape-secreT")
    assert [auth.check(h) for h in (wrong, wrong, right, wrong)] == [False, False, True, False]
