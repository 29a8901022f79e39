"""The planner (DESIGN §8): scales prefill and decode workers to meet TTFT / ITL targets.

Not built yet: no issue asks for it so far, and ``kvmesh`` exposes no planner command until one does.
"""
