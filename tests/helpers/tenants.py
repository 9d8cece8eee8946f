"""Helpers for tests with tenants: tokens files and their tokens."""

from __future__ import annotations

import hashlib
from pathlib import Path


def token_of(name: str) -> str:
    """A test tenant's bearer token (never written into a tokens file)."""
    return f"tok-{name}-Zq81"


def tokens_toml(tenants: list[dict[str, str]]) -> str:
    """A tokens file for ``tenants`` (name, role, optional namespace, quota and model); each
    token is :func:`token_of` its name, written only as its sha256."""
    out = []
    for t in tenants:
        digest = hashlib.sha256(token_of(t["name"]).encode()).hexdigest()
        out.append(f'[[tenant]]\nname = "{t["name"]}"\ntoken_sha256 = "{digest}"\n')
        out.append(f'role = "{t.get("role", "readwrite")}"\n')
        for key in ("namespace", "quota", "model"):
            if key in t:
                out.append(f'{key} = "{t[key]}"\n')
        out.append("\n")
    return "".join(out)


def write_tokens(path: Path, tenants: list[dict[str, str]]) -> Path:
    path.write_text(tokens_toml(tenants))
    return path
