"""The planner (DESIGN §8): sizes the worker pools to meet TTFT / ITL targets at the least cost.

Its sans-I/O core is driven by the live service and by ``kvmesh replay --planner`` alike.

- ``planner`` — the decision loop: an observation in, a decision out.
- ``options`` — what it aims for and how it decides, for every command that runs it.
- ``decision`` — the pools' sizes, and a decision with what led to it.
- ``load`` — what it observes of one interval, and what it predicts for the next.
- ``miss_budget`` — the SLA's misses: those no fleet could have served, and what that leaves sizing.
- ``growth_look`` — looks between decisions: growth for a pool clearly behind the goal, seconds after it falls behind.
- ``predictors`` — load predictors from past intervals.
- ``startup`` — how long a worker takes to serve, measured from the planner's own growths.
- ``correction`` — the performance model's corrections: observed ÷ modelled latencies, smoothed.
- ``capacity`` — the performance model: what a pool gives under a load, and the smallest that meets limits.
- ``sizing`` — the pools the model asks for: kvmesh's queueing model, or Dynamo's shares.
- ``service`` — ``kvmesh planner run``: observe, decide, act, every interval.
- ``connector`` — what every connector is, and the error it raises.
- ``connectors`` — how decisions reach the fleet (``local``, ``compose``, ``no-operation``).
- ``kubernetes`` — the ``kubernetes`` connector: Deployments resized through the API's scale subresource,
  the pod a shrink stops marked by its deletion cost.
- ``state`` — its memory: every step in SQLite.
- ``step_stream`` — its shared memory: every step in a replicated JetStream stream, for standbys.
- ``cli`` — ``kvmesh planner run|history``.
"""
