"""The OpenAI-compatible HTTP facade.

- ``server`` — ``kvmesh frontend``: the HTTP API in front of the router replicas.
- ``app`` — routes, body validation, chat template, tokenisation, errors in OpenAI's shape.
- ``completion_routes`` — the completion endpoints called straight, past FastAPI's routing.
- ``gateway`` — an OpenAI request as a request on the mesh, and its outputs as text.
- ``endpoint_picker`` — Envoy's ext_proc for a Gateway API Inference Extension gateway: the worker
  chosen by the routers, named in the destination header; completion reported so load is freed.
- ``responses`` — one request's answer: a whole completion as JSON, or server-sent events.
- ``answer_chunks``, ``event_stream`` — the SSE chunks of a streamed answer; a response that stops
  when its client goes away.
- ``protocol`` — the request bodies the facade accepts (pydantic).
- ``tokenizer``, ``prompt_pieces`` — a model's tokenizer and template; prompts encoded piece by piece.
- ``admission`` — API key, body size and in-flight limits (ASGI middleware).
- ``errors`` — errors in OpenAI's format.
- ``load_window`` — what this frontend served, reported for the planner.
- ``config`` — the frontend's options.
"""
