"""Inference workers: the mock engine (sans-I/O core) and its gRPC / NATS shell."""
