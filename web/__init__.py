"""trillm.web: the service, trio shells around the engine, and its HTTP, SSE and websocket APIs. By surface and
role: service/ (EngineService: one model's engine on its own thread, or inline for the mock; streams, the
model registry, metrics, traces), chat/ (one choice's output events, tool and reasoning formats, grammars),
http/ (bodies, SSE, guards, keys), one folder per API surface (openai/, anthropic/, responses/, ws/), router/,
and cli/ (the `trillm` dispatcher). Imports trillm.engine (and so trillm.kernels), trio, quart-trio and
hypercorn; never trillm.bench, except that the dispatcher names its subcommands by module path.
"""
