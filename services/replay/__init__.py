"""``kvmesh replay``: the real routing, indexing and mock-engine code driven in virtual time."""
