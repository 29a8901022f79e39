"""Code the services share (DESIGN §1), by layer; a layer imports only the ones above it:

- ``wire/`` — wire types and their codecs (hashing, KV events, disaggregation messages, reports, names).
- ``core/`` — sans-I/O logic several services run (the prefix index, the step-time model).
- ``rpc/`` — gRPC servers, channels, errors, and the streams the request path rides.
- ``runtime/`` — config, service lifecycle, the NATS connection, discovery, metrics, logging.
- ``calling/`` — the request path as a caller walks it (``request_path``, ``router_client``).
- ``proto/`` — the generated gRPC code (``kvmesh gen-protos``).
- ``models/`` — the bundled ``kvmesh-tiny`` tokenizer and chat template.

Each subpackage's ``__init__`` lists its modules, one line each.
"""
