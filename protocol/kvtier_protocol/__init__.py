"""kvtier_protocol: the kvtier wire contract (protocol/SPEC.md) in Python.

Keys and hashing, namespaces, the self-describing block header, codecs, layouts, data-plane
frames and KV events. Imports nothing else from the project.
"""

PROTOCOL_VERSION = 1
