"""kvtierd, the daemon: data plane, REST API, metrics and KV events around one tiered store.

:func:`kvtier.daemon.server.daemon.run_daemon` assembles and runs it; ``kvtier serve`` is its command.
Nothing is imported here, so that importing one service module stays cheap.
"""
