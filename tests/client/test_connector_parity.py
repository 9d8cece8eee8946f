"""One connector interface, checked: the four connectors (one server or a set, sync or
async) offer the same public methods, the async ones as coroutines, each satisfying its
``typing.Protocol`` (eg_kv.client.interface) with the same parameters.

What the methods answer, sync against async on real servers, is test_async_parity.py's job.
"""

from __future__ import annotations

import inspect
import pathlib

import pytest

from eg_kv.client import interface
from eg_kv.client.aio import AsyncServerConnector
from eg_kv.client.aio_connectors import AsyncRemoteKVConnector
from eg_kv.client.aio_sets import AsyncSetConnector
from eg_kv.client.connectors import RemoteKVConnector
from eg_kv.client.sets import SetConnector
from eg_kv.client.sync import ServerConnector

SYNC = [ServerConnector, SetConnector, RemoteKVConnector]
ASYNC = [AsyncServerConnector, AsyncSetConnector, AsyncRemoteKVConnector]
#: Built, not called on a connector: the same on both sides, never a coroutine.
CONSTRUCTORS = {"from_env"}


def public_methods(cls: type) -> dict[str, object]:
    """Every public method of ``cls`` (its own and inherited; properties are not methods)."""
    out = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, (classmethod, staticmethod)) or inspect.isfunction(attr):
            out[name] = getattr(cls, name)
    return out


def protocol_methods(proto: type) -> set[str]:
    return {n for n, v in vars(proto).items() if not n.startswith("_") and inspect.isfunction(v)}


def parameters(fn: object) -> list[tuple[str, object]]:
    """The parameters a caller sees: names, kinds and whether each has a default."""
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    return [
        (p.name, p.kind, p.default is inspect.Parameter.empty)
        for p in sig.parameters.values()
        if p.name != "self"
    ]


def test_every_public_method_exists_on_all_four_connectors():
    names = {cls: set(public_methods(cls)) for cls in SYNC + ASYNC}
    every = set().union(*names.values())
    missing = {cls.__name__: sorted(every - have) for cls, have in names.items() if every - have}
    assert not missing, f"public methods on some connectors only: {missing}"


@pytest.mark.parametrize("cls", ASYNC, ids=lambda c: c.__name__)
def test_the_async_methods_are_coroutine_functions(cls):
    methods = public_methods(cls)
    plain = [n for n, fn in methods.items() if n not in CONSTRUCTORS]
    not_async = [n for n in plain if not inspect.iscoroutinefunction(methods[n])]
    assert not not_async, f"{cls.__name__}: not coroutine functions: {not_async}"
    assert inspect.iscoroutinefunction(cls.__aenter__)
    assert inspect.iscoroutinefunction(cls.__aexit__)


@pytest.mark.parametrize("cls", SYNC, ids=lambda c: c.__name__)
def test_the_sync_methods_are_plain_functions(cls):
    methods = public_methods(cls)
    coroutines = [n for n, fn in methods.items() if inspect.iscoroutinefunction(fn)]
    assert not coroutines, f"{cls.__name__}: coroutine functions on a sync client: {coroutines}"
    assert callable(cls.__enter__) and callable(cls.__exit__)


@pytest.mark.parametrize(
    ("proto", "cls"),
    [(interface.KvConnector, c) for c in SYNC] + [(interface.AsyncKvConnector, c) for c in ASYNC],
    ids=lambda v: v.__name__,
)
def test_each_connector_satisfies_its_protocol(proto, cls):
    wanted = protocol_methods(proto)
    have = public_methods(cls)
    # The protocol names every public method but the constructors, and no other.
    assert wanted == set(have) - CONSTRUCTORS, (
        f"{cls.__name__} vs {proto.__name__}: only on the class "
        f"{sorted(set(have) - CONSTRUCTORS - wanted)}, only in the protocol "
        f"{sorted(wanted - set(have))}"
    )
    for name in sorted(wanted):
        assert parameters(have[name]) == parameters(getattr(proto, name)), (
            f"{cls.__name__}.{name}{inspect.signature(have[name])} differs from "
            f"{proto.__name__}.{name}{inspect.signature(getattr(proto, name))}"
        )


@pytest.mark.parametrize(("sync", "aio"), list(zip(SYNC, ASYNC, strict=True)),
                         ids=lambda c: c.__name__)  # fmt: skip
def test_sync_and_async_twins_take_the_same_parameters(sync, aio):
    ours, theirs = public_methods(sync), public_methods(aio)
    for name in sorted(set(ours) - CONSTRUCTORS):
        assert parameters(ours[name]) == parameters(theirs[name]), name


def test_the_checker_sees_a_method_on_one_side_only():
    class Extra(ServerConnector):
        def only_here(self) -> None: ...

    class NotAsync(AsyncServerConnector):
        def get(self, key):  # type: ignore[override]
            return None

    assert "only_here" in set(public_methods(Extra)) - set(public_methods(AsyncServerConnector))
    assert not inspect.iscoroutinefunction(public_methods(NotAsync)["get"])
    assert protocol_methods(interface.KvConnector) >= {"get", "fetch", "member_stats"}


def test_every_client_module_stays_small_and_the_shells_hold_no_http_of_their_own():
    """The rules live once (core, rules, plans) and each transport in its own module
    (sync_http, aio_http): a client file past ~500 lines, or a connector that speaks HTTP
    itself again, is the mirrored code this layout removed coming back."""
    import eg_kv.client as pkg

    folder = pkg.__path__[0]
    sizes = {p.name: len(p.read_text().splitlines()) for p in pathlib.Path(folder).glob("*.py")}
    assert max(sizes.values()) <= 500, {n: s for n, s in sizes.items() if s > 500}
    for shell in ("sync.py", "aio.py"):
        text = (pathlib.Path(folder) / shell).read_text()
        assert "def _exchange" not in text and "aiohttp.ClientSession(" not in text, shell
