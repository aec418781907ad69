"""trillm.web: the service: trio shells around the engine, and its HTTP, SSE and websocket APIs.

Owns: EngineService (one model's engine on its own thread, or inline for the mock), the OpenAI-compatible
routes and their request models, SSE and websocket streaming, metrics, KV-event publishing, the playground
page, and the `trillm` command's dispatcher (`cli`). Imports trillm.engine (and so trillm.kernels), trio,
quart-trio and hypercorn; never trillm.bench, except that the dispatcher names its subcommands by module path.
"""
