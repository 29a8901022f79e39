"""``kvmesh profile``: measure an engine's prefill and decode times into an engine profile."""
