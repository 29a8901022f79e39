"""Routers: worker selection and load prediction (sans-I/O core) behind kvmesh.v1.Router."""
