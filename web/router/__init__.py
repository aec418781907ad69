"""`trillm route`: a KV-aware router in front of several trillm replicas.

A synchronous, sans-IO core decides; thin trio shells do the IO, so the simulator (trillm.bench.simulate) runs
the very same decisions over inline mock services on a virtual clock:
- index.py: one worker's cached blocks, as its KV events describe them (gaps and restarts detected).
- policy.py: the per-worker load, the cost function and the policies (kv, round-robin, least-loaded).
- health.py: a replica's health state (in or out of the pool).
- core.py: the Router: workers (replica x model), what was routed where, choose() and its bookkeeping.
- prompt.py: a request body's prompt token ids, computed the way the replicas compute them.
- tokenizers.py: where those come from: a local tokenizer checked against the replica's, or its /tokenize.
- replica.py: the trio shells per replica: health checks, model discovery, KV-event subscriptions.
- proxy.py / ws.py: forwarding HTTP (streamed byte for byte, with retries) and the /v1/ws websocket.
- app.py: the quart-trio app and `route()`, which serves it on hypercorn; config.py: RouterConfig;
  metrics.py: the router's /metrics and /stats.
"""
