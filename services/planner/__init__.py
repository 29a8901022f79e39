"""The planner (DESIGN §8): sizes the worker pools to meet TTFT / ITL targets at the least cost.

Sans-I/O core (``load``, ``predictors``, ``capacity``, ``planner``) driven by the live service and by
``kvmesh replay --planner`` alike; ``state`` keeps its history in SQLite.
"""
