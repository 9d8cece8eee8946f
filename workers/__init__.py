"""The eg-kv process launcher: the ``eg-kv`` command, the supervisor and its workers."""
