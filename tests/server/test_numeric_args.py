"""Numeric query arguments and headers take ASCII digits only (issue 31, item 6).

``str.isdigit()`` is true of ``²``, ``①`` and every script's digits, and ``int()`` or
``float()`` then raised (a 500 with a logged traceback) or read another script's digits as
a number. Every numeric argument the server reads is ASCII digits or a 400 with a one-line
reason, whatever the string; a long run of zeros is zero.
"""

from __future__ import annotations

import json
import string
from urllib.parse import quote

import pytest
from helpers.server_http import request
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(120)

#: Odd forms of numbers: signs, spaces, bases, separators, exponents, other scripts' digits.
ODD = ["²", "①", "³", "٣", "５", "१२", "+5", "-1", " 5", "5 ", "0x10", "1_000", "1e3",
       "1.5", "", "٠", "nan", "inf", "-0", "00", "9" * 40, "0" * 40, "1\u00a0"]  # fmt: skip


@pytest.fixture(scope="module")
def srv(module_server_factory):
    server = module_server_factory(workers=1, capacity="16MiB")
    # One event in the log: a valid wait then answers at once (since=0 is behind it).
    assert request(server, "PUT", "/kv/numeric-args-block", body=b"x").status in (200, 201)
    return server


def _status(srv, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    reply = request(srv, "GET", path, headers=headers, timeout=10)
    return reply.status, reply.body


def lookup(srv, lease: str):
    """A batch lookup of one address asking for a lease of ``lease``."""
    body = json.dumps({"addresses": ["a"]}).encode()
    headers = {"X-Eg-Kv-Lease-Ms": lease, "Content-Type": "application/json"}
    return request(srv, "POST", "/kv/batch/exists", body=body, headers=headers)


def _only_ascii_digits(text: str) -> bool:
    return bool(text) and all(c in string.digits for c in text)


def _whole(text: str) -> bool:
    """ASCII digits, at most 18 significant ones (eg_kv.wire.whole_number)."""
    return _only_ascii_digits(text) and len(text.lstrip("0")) <= 18


def _valid(name: str, value: str) -> bool:
    """What the server takes: ASCII digits (``wait``: perhaps with a decimal part of
    them), ``limit`` at least 1."""
    if name == "wait":
        whole, dot, part = value.partition(".")
        return _only_ascii_digits(whole) and (not dot or _only_ascii_digits(part))
    return _whole(value) and not (name == "limit" and int(value) == 0)


@pytest.mark.parametrize("name", ["since", "limit", "wait"])
@pytest.mark.parametrize("value", ODD)
def test_odd_forms_of_event_arguments_are_400_or_a_number(srv, name, value):
    status, body = _status(srv, f"/kv/events?{name}={quote(value)}")
    ok = _valid(name, value)
    assert status == (200 if ok else 400), (value, status, body[:200])
    if status == 400:
        assert body.count(b"\n") <= 1 and name.encode() in body  # one line, names the argument


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(name=st.sampled_from(["since", "limit", "wait", "epoch"]), value=st.text(max_size=24))
def test_no_query_string_makes_a_500(srv, name, value):
    status, _ = _status(srv, f"/kv/events?{name}={quote(value)}")
    assert status in (200, 400, 409), (name, value, status)
    if name != "epoch":
        assert status == (200 if _valid(name, value) else 400), (name, value, status)


def _in_a_header(text: str) -> bool:
    """Whether ``text`` can be sent in an HTTP header (latin-1)."""
    try:
        text.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


@pytest.mark.parametrize("value", [v for v in ODD if _in_a_header(v)])
def test_odd_lease_headers_are_400(srv, value):
    reply = lookup(srv, value)
    stripped = value.strip(" \t")
    # a huge ask gets the server's most (test_server_leases): digits are enough
    assert reply.status == (200 if _only_ascii_digits(stripped) else 400), (value, reply)


def test_a_long_run_of_zeros_is_no_lease(srv):
    for zeros in ("0000000000000", "0" * 200):
        reply = lookup(srv, zeros)
        assert reply.status == 200 and reply.headers["X-Eg-Kv-Lease-Ms"] == "0", reply
