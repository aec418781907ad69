"""The router's one frozen config (the HTTP front's own settings are a ServerConfig, as for `trillm serve`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trillm.web.config import ServerConfig
from trillm.web.router.policy import CostWeights, PolicyName


@dataclass(frozen=True, slots=True)
class RouterConfig:
    replicas: tuple[str, ...]  # base URLs, e.g. http://10.0.0.2:8000
    server: ServerConfig = field(default_factory=ServerConfig)  # host, port, --api-key, timeouts of the front
    policy: PolicyName = PolicyName.KV
    weights: CostWeights = field(default_factory=CostWeights)
    tokenizer: str = "auto"  # auto | remote | a model file or folder (see web/router/tokenizers.py)
    replica_api_key: str | None = None  # sent to the replicas; None: forward the client's Authorization
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    connect_timeout_s: float = 2.0  # a replica that does not accept within this is skipped (and unhealthy)
    rejoin_after: int = 1  # good health checks in a row before a replica rejoins the pool
    resubscribe_max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("give at least one --replica")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")) or url.endswith("/"):
                raise ValueError(f"a replica is a base URL like http://host:port (no trailing /), got {url!r}")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError("a replica is listed twice")
        if min(self.health_interval_s, self.health_timeout_s, self.connect_timeout_s) <= 0:
            raise ValueError("intervals and timeouts must be > 0")
        if self.replica_api_key == "":
            raise ValueError("replica_api_key must not be empty")
        object.__setattr__(self, "policy", PolicyName(self.policy))
