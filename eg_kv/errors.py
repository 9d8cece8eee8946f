"""One exception tree for eg-kv.

The server maps each class to an HTTP status (``status``); the clients and the slab raise
the same classes, so a caller catches one tree whatever layer failed. Every message is one
line that says what was wrong and, where there is one, what to do about it.
"""

from __future__ import annotations


class EgKvError(Exception):
    """Base of every eg-kv error. ``status`` is the HTTP status the server answers with."""

    status = 500


class BadRequest(EgKvError):
    """The request itself is malformed (bad length, body cut short, bad JSON)."""

    status = 400


class InvalidAddress(BadRequest):
    """The block address is not 1-256 characters of the safe set, or is a reserved word."""


class Unauthorized(EgKvError):
    """A bearer token is required and was missing or wrong."""

    status = 401


class Forbidden(EgKvError):
    """The token is valid but its role does not allow this (e.g. a readonly PUT)."""

    status = 403


class NotFound(EgKvError):
    """No block is resident under that address."""

    status = 404


class Conflict(EgKvError):
    """A block is resident under that address with another length."""

    status = 409


class TooLarge(EgKvError):
    """The block is larger than the slab's maximum block size."""

    status = 413


class InsufficientStorage(EgKvError):
    """The block does not fit even after evicting every evictable block."""

    status = 507


class Busy(EgKvError):
    """A transient condition: the same request may succeed when retried."""

    status = 503


class SlabError(EgKvError):
    """The shared-memory slab cannot be created, attached or used as asked."""


class ConfigError(EgKvError):
    """A setting (flag or environment variable) has a value eg-kv cannot use."""


class RemoteError(EgKvError):
    """A client got an answer from the server that it cannot use (off the hot path)."""
