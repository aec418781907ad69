"""A replica's health, from active checks (GET /health) and from what forwarding requests ran into.

A replica leaves the pool at once when a request cannot connect to it or a check fails, and rejoins after
`rejoin_after` consecutive good checks. Pure state: the shell feeds it results and the time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Health(str, enum.Enum):
    UNKNOWN = "unknown"  # not checked yet: kept out of the pool
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


@dataclass(frozen=True, slots=True)
class HealthStatistics:
    state: Health
    reason: str | None  # why it is out of the pool
    since: float | None  # when it entered this state (the shell's clock)
    num_failures: int  # failed checks and refused connections, all told
    num_transitions: int  # times it left or rejoined the pool


class HealthState:
    def __init__(self, *, rejoin_after: int = 1) -> None:
        if rejoin_after < 1:
            raise ValueError("rejoin_after must be >= 1")
        self.rejoin_after = rejoin_after
        self._state = Health.UNKNOWN
        self._reason: str | None = "not checked yet"
        self._since: float | None = None
        self._good_in_a_row = 0
        self._num_failures = 0
        self._num_transitions = 0

    @property
    def state(self) -> Health:
        return self._state

    @property
    def in_pool(self) -> bool:
        return self._state is Health.HEALTHY

    def on_success(self, now: float) -> bool:
        """A good health check; True when this made the replica rejoin the pool."""
        self._good_in_a_row += 1
        if self._state is not Health.HEALTHY and self._good_in_a_row >= self.rejoin_after:
            self._move(Health.HEALTHY, None, now)
            return True
        return False

    def on_failure(self, now: float, reason: str) -> bool:
        """A failed check or a refused connection; True when this took the replica out of the pool."""
        self._num_failures += 1
        self._good_in_a_row = 0
        if self._state is Health.UNHEALTHY:
            self._reason = reason
            return False
        self._move(Health.UNHEALTHY, reason, now)
        return True

    def _move(self, state: Health, reason: str | None, now: float) -> None:
        if self._state is not Health.UNKNOWN or state is Health.HEALTHY:
            self._num_transitions += 1
        self._state, self._reason, self._since = state, reason, now

    def statistics(self) -> HealthStatistics:
        return HealthStatistics(self._state, self._reason, self._since, self._num_failures, self._num_transitions)
