"""Indexer replicas: the prefix index (sans-I/O core) fed from the JetStream event stream."""
