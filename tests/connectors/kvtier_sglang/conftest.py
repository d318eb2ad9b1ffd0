"""The real-daemon fixtures of tests/kvtier/conftest.py (``kvtier_daemon``, ``kvtier_daemon_module``):
the connector tests live outside tests/kvtier/, and pytest shares a conftest's fixtures only with
the directories below it."""

from tests.kvtier.conftest import KvtierDaemon, kvtier_daemon, kvtier_daemon_module

__all__ = ["KvtierDaemon", "kvtier_daemon", "kvtier_daemon_module"]
