"""The remote tier: block records shared by many hosts through an external engine (issue 23).

:mod:`~kvtier.daemon.remote.backend` is what the store sees (:class:`RemoteBlocks`, batched and
fault-free for the caller); :mod:`~kvtier.daemon.remote.redis_cluster` is the Redis/Valkey Cluster
engine behind it; :mod:`~kvtier.daemon.remote.verify` judges the untrusted bytes read back;
:mod:`~kvtier.daemon.remote.breaker` keeps a dead engine from costing a timeout per request.
This package imports redis-py only in ``redis_cluster`` (the ``kvtier[remote]`` extra).
"""
