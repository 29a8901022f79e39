"""``kvmesh bench``: a live load generator for any OpenAI-compatible endpoint."""
