"""Each server setting is declared once (eg_kv.config.SERVER_SETTINGS), and everything said
about it follows: the docs' table (docs/configuration.md) is the generated one, every
declaration round-trips (flag -> Settings, variable -> Settings, shown default -> Settings
default), and
``eg-kv serve --help`` lists every flag with its variable.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eg_kv.config import (
    SERVER_SETTINGS,
    ServerSetting,
    Settings,
    default_markdown,
    parse_addr,
    settings_from_env,
    settings_markdown,
    show_value,
)
from eg_kv.errors import ConfigError
from eg_kv.units import parse_size
from workers.__main__ import SERVE_FLAGS, build_parser

ROOT = Path(__file__).resolve().parents[2]
#: The settings table lives here; the limits table in SECURITY.
CONFIGURATION = ROOT / "docs" / "configuration.md"
SECURITY = ROOT / "docs" / "security.md"
BY_NAME = {setting.name: setting for setting in SERVER_SETTINGS}

#: A value for each setting that is not its default: (as typed, as Settings holds it). A new
#: setting without one here fails test_every_setting_has_a_sample, so it gets round-tripped.
SAMPLES: dict[str, tuple[str, object]] = {
    "addr": ("127.0.0.2:9131", ("127.0.0.2", 9131)),
    "token": ("a-token", "a-token"),
    "tokens_file": ("tenants.toml", "tenants.toml"),
    "tls_cert": ("c.pem", "c.pem"),
    "tls_key": ("k.pem", "k.pem"),
    "workers": ("3", 3),
    "capacity": ("2GiB", 2 << 30),
    "page_size": ("128KiB", 128 << 10),
    "max_block_size": ("32MiB", 32 << 20),
    "keep": ("", True),
    "fresh": ("", True),
    "slab_name": ("/eg-kv-settings-test", "/eg-kv-settings-test"),
    "drain_timeout_s": ("3.5", 3.5),
    "access_log": ("", True),
    "upload_share": ("0.25", 0.25),
    "lease_share": ("0.75", 0.75),
    "chunked_spool": ("64MiB", 64 << 20),
    "header_timeout_s": ("3", 3.0),
    "body_timeout_s": ("4", 4.0),
    "min_upload_rate": ("1MiB", 1 << 20),
    "keepalive_timeout_s": ("5", 5.0),
    "max_connections": ("6", 6),
    "lease_ms": ("250", 250),
    "events": ("4096", 4096),
    "heartbeat_timeout_s": ("7", 7.0),
    "lock_timeout_s": ("0.5", 0.5),
    "kv_events_endpoint": ("tcp://127.0.0.1:5599", "tcp://127.0.0.1:5599"),
    "kv_events_replay_endpoint": ("tcp://127.0.0.1:5598", "tcp://127.0.0.1:5598"),
    "kv_events_medium": ("STORAGE", "STORAGE"),
    "kv_events_locality": ("REMOTE", "REMOTE"),
    "kv_events_pool": ("node:a", "node:a"),
    "kv_events_model": ("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),
    "kv_events_arrays": ("", True),
    "disk": ("/var/lib/eg-kv", "/var/lib/eg-kv"),
    "disk_capacity": ("2GiB", 2 << 30),
}
#: A setting that cannot stand alone (TLS needs both halves) -> the one given with it.
COMPANION = {"tls_cert": "tls_key", "tls_key": "tls_cert",
             "kv_events_replay_endpoint": "kv_events_endpoint"}  # fmt: skip


def held(settings: Settings, setting: ServerSetting) -> object:
    """The value ``settings`` holds for ``setting`` (the address is two fields)."""
    if setting.kind == "addr":
        return (settings.host, settings.port)
    return getattr(settings, setting.name)


def from_argv(*argv: str, env: dict[str, str] | None = None) -> Settings:
    """What ``eg-kv serve <argv>`` builds, as workers/__main__.py's _serve does."""
    args = build_parser().parse_args(["serve", *argv])
    return settings_from_env(env or {}, **{k: getattr(args, k) for k in SERVE_FLAGS})


def flag_argv(name: str, text: str | None = None) -> list[str]:
    """``name``'s flag given ``text`` (its sample if None), and its companion's sample."""
    setting = BY_NAME[name]
    assert setting.flag
    text = SAMPLES[name][0] if text is None else text
    argv = [setting.flag] if setting.kind == "switch" else [setting.flag, text]
    if name in COMPANION:
        other = BY_NAME[COMPANION[name]]
        argv += [other.flag or "", SAMPLES[other.name][0]]
    return argv


def sample_env(name: str) -> dict[str, str]:
    """``name``'s variable set to its sample, and its companion's."""
    names = [name, COMPANION[name]] if name in COMPANION else [name]
    return {BY_NAME[one].env or "": SAMPLES[one][0] for one in names}


def docs_table() -> str:
    with open(CONFIGURATION, encoding="utf-8") as f:
        text = f.read()
    found = re.search(r"<!-- settings[^>]*-->\n(.*?)<!-- /settings -->", text, re.S)
    assert found, "docs/configuration.md lost its <!-- settings --> ... <!-- /settings --> markers"
    return found.group(1)


def test_the_docs_table_is_the_generated_one():
    assert docs_table() == settings_markdown(), (
        "docs/configuration.md's settings table differs from eg_kv/config.py's declarations: "
        "paste the output of `.venv/bin/python -m eg_kv.config --markdown` between its markers"
    )
    out = subprocess.run(
        [sys.executable, "-m", "eg_kv.config", "--markdown"], cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=True,
    )  # fmt: skip
    assert out.stdout == settings_markdown() and not out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "eg_kv.config"], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "--markdown" in bad.stderr


def test_every_settings_field_is_declared_once():
    names = [setting.name for setting in SERVER_SETTINGS]
    assert len(names) == len(set(names))
    fields = {f.name for f in dataclasses.fields(Settings)}
    declared = {"host", "port"} | (set(names) - {"addr"})
    assert declared == fields, "a Settings field without a declaration, or the reverse"
    flags = [setting.flag for setting in SERVER_SETTINGS if setting.flag]
    envs = [setting.env for setting in SERVER_SETTINGS if setting.env]
    assert len(flags) == len(set(flags)) and len(envs) == len(set(envs))
    assert all(setting.flag or setting.env for setting in SERVER_SETTINGS)
    assert set(SERVE_FLAGS) == {setting.name for setting in SERVER_SETTINGS if setting.flag}
    # A default shown from the field needs a field default that says something.
    for setting in SERVER_SETTINGS:
        if not setting.default_text:
            default = Settings.__dataclass_fields__[setting.name].default
            assert default not in (None, "", dataclasses.MISSING), setting.name
            assert setting.kind == "switch" or default != 0, setting.name


def test_every_setting_has_a_sample():
    assert set(SAMPLES) == set(BY_NAME)


@pytest.mark.parametrize("name", [s.name for s in SERVER_SETTINGS if s.flag])
def test_flag_reaches_settings(name):
    setting = BY_NAME[name]
    expected = SAMPLES[name][1]
    assert expected != held(from_argv(), setting), "the sample must differ from the default"
    assert held(from_argv(*flag_argv(name)), setting) == expected


@pytest.mark.parametrize("name", [s.name for s in SERVER_SETTINGS if s.env])
def test_variable_reaches_settings_and_a_flag_overrides_it(name):
    setting = BY_NAME[name]
    assert setting.env
    expected = SAMPLES[name][1]
    assert held(settings_from_env(sample_env(name)), setting) == expected
    # An empty variable is an unset one.
    assert held(settings_from_env({setting.env: ""}), setting) == held(Settings(), setting)
    if setting.flag:
        other = "127.0.0.3:9132" if setting.kind == "addr" else "from-the-environment"
        env = {**sample_env(name), setting.env: other}
        assert held(from_argv(*flag_argv(name), env=env), setting) == expected


@pytest.mark.parametrize("name", [s.name for s in SERVER_SETTINGS])
def test_the_shown_default_is_the_settings_default(name):
    """The default the docs and --help show, typed back as the flag, is the default."""
    setting = BY_NAME[name]
    default = held(from_argv(), setting)
    assert default == held(settings_from_env({}), setting)
    shown = default_markdown(setting)
    if setting.kind == "addr":
        literal = shown.strip("`")
        assert parse_addr(literal) == default == held(Settings(), setting)
        assert held(from_argv(*flag_argv(name, literal)), setting) == default
    elif setting.kind == "switch":
        assert default is False and shown == "`off`"
    elif not setting.default_text:
        typed = show_value(setting, default)
        assert shown.startswith(f"`{typed}`")
        if setting.flag:
            assert held(from_argv(*flag_argv(name, typed)), setting) == default


def test_the_max_connections_words_name_the_servers_number():
    from eg_kv.server.connections import DEFAULT_MAX_CONNECTIONS

    assert str(DEFAULT_MAX_CONNECTIONS) in BY_NAME["max_connections"].default_text


def test_serve_help_lists_every_flag_with_its_variable():
    out = subprocess.run(
        [sys.executable, "-m", "workers", "serve", "--help"], cwd=ROOT, capture_output=True,
        text=True, timeout=60, env={**os.environ, "COLUMNS": "100"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    options, _, epilog = out.stdout.partition("\nFrom the environment only:")
    # One entry per option: from its "  --flag" line to the next one.
    entries = {
        entry.split()[0]: " ".join(entry.split())
        for entry in re.split(r"\n  (?=-)", options)
        if entry.startswith("-")
    }
    for setting in SERVER_SETTINGS:
        if setting.flag:
            entry = entries.get(setting.flag)
            assert entry, f"{setting.flag} missing from eg-kv serve --help"
            assert "(default " in entry, entry
            if setting.env:
                assert f"env {setting.env})" in entry, entry
        else:
            assert setting.env and setting.env in epilog


def test_the_limits_table_names_only_declared_flags():
    """The limits table (docs/security.md, "Limits") names real serve flags."""
    with open(SECURITY, encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("| Limit | Default | Flag | Beyond it |") :].split("\n\n")[0]
    named = set(re.findall(r"`(--[a-z-]+)`", table))
    declared = {setting.flag for setting in SERVER_SETTINGS if setting.flag}
    assert named and named <= declared, named - declared


@pytest.mark.parametrize("text", ["1GB", "8gb", "64KB", "512 MB", "1.5TB"])
def test_sizes_in_units_that_may_be_decimal_are_refused_naming_the_binary_one(text):
    with pytest.raises(ConfigError, match=r"ambiguous size .*iB \("):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [("8GiB", 8 << 30), ("8G", 8 << 30), ("64kib", 64 << 10), ("4096", 4096), ("4096B", 4096)],
)
def test_binary_sizes_and_bytes_are_read(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("value", [float("nan"), -5.0, float("inf")])
def test_a_drain_timeout_that_is_no_bound_is_refused(value):
    """NaN never compares past a deadline: SIGTERM would wait for a stuck worker for good;
    a negative one cut in-flight work at once."""
    with pytest.raises(ConfigError, match=r"--drain-timeout must be 0 or more seconds"):
        Settings(drain_timeout_s=value)
