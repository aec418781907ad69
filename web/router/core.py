"""The Router: the synchronous core every front (HTTP, websocket, the simulator) asks where a request goes.

A *worker* is one model on one replica (a replica may serve several models, each with its own engine, KV
cache and event stream). The router keeps, per worker, the KV index fed by its events, the load it last
reported, and what this router has sent it that is still in flight: the in-flight prompts' block hashes
count as cached-soon (the replica computes a shared prefix once and the followers reuse it) and as load,
and their uncached blocks, until their first token, as prefill queued there.
`choose` builds one Candidate per eligible worker and lets the policy pick; `release` undoes an assignment
when its response ends. A prompt that was computed stays cached-soon a little longer, until the worker's
next event batches (which carry its "stored" events) have surely arrived: a conversation's next turn often
comes back before the events of the previous one. No IO, no clock, no trio: the shells call in with what
they observed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trillm.engine.kv_events import KVCacheSpec, StepLoad, StepReport
from trillm.web.router.health import HealthState, HealthStatistics
from trillm.web.router.index import IndexStatistics, KVIndex
from trillm.web.router.policy import Candidate, Load, Policy

RECENT_BATCHES = 2  # event messages a computed prompt's blocks stay cached-soon after its response ended


@dataclass(frozen=True, slots=True, order=True)
class WorkerKey:
    replica: str  # the replica's base URL
    model: str  # the model's served name

    def __str__(self) -> str:
        return f"{self.replica}#{self.model}"


@dataclass(frozen=True, slots=True)
class Hello:
    """The first message of a worker's KV-event stream."""

    epoch: int
    spec: KVCacheSpec | None  # None until the engine has loaded once
    interval_s: float = 0.05

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Hello:
        spec = None
        if doc.get("hash_seed") is not None and doc.get("block_size"):
            spec = KVCacheSpec(str(doc.get("model_id") or ""), int(doc["block_size"]), str(doc["hash_seed"]),
                               bool(doc.get("prefix_caching", True)))
        return cls(int(doc.get("epoch") or 0), spec, float(doc.get("interval_s") or 0.05))


@dataclass(eq=False, slots=True)
class Assignment:
    """One request sent to one worker; `Router.release` it exactly once when its response ends."""

    worker: WorkerKey
    prompt_tokens: int
    prompt_blocks: int
    cached_blocks: int  # the prefix the router expected to be cached there
    hashes: tuple[str, ...] = ()  # the blocks this assignment adds to the worker's in-flight set
    owner: Worker | None = field(default=None, repr=False)  # the worker object that counts it (not its key:
    released: bool = False  # a replica's workers are rebuilt when its models change)
    prefilled: bool = False  # its first token came: no longer in the worker's prefill queue

    @property
    def prefill_blocks(self) -> int:
        return self.prompt_blocks - self.cached_blocks


@dataclass(frozen=True, slots=True)
class WorkerStatistics:
    key: WorkerKey
    index: IndexStatistics
    spec: KVCacheSpec | None
    reported: StepLoad | None
    load: Load
    num_inflight: int
    num_routed: int


@dataclass(frozen=True, slots=True)
class ReplicaStatistics:
    url: str
    health: HealthStatistics
    models: tuple[str, ...]
    num_routed: int
    workers: tuple[WorkerStatistics, ...]


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    policy: str
    num_routed: int
    num_unroutable: int  # choose() found no worker in the pool
    prompt_blocks: int  # over every routed request with a known prompt
    predicted_cached_blocks: int  # of those, what the router expected to be cached where it sent them
    replicas: tuple[ReplicaStatistics, ...]


class Worker:
    def __init__(self, key: WorkerKey) -> None:
        self.key = key
        self.index = KVIndex()
        self.spec: KVCacheSpec | None = None
        self.reported: StepLoad | None = None
        self._pending: Counter[str] = Counter()  # in-flight prompts' block hashes (refcounted)
        self._pending_tail_blocks = 0  # in-flight prompts' blocks without a hash (the partial tail)
        self._recent: dict[str, int] = {}  # computed prompts' blocks -> the event batch after which to forget
        self._num_batches = 0
        self._num_inflight = 0
        self._prefill_queue = 0  # uncached blocks of in-flight assignments before their first token
        self.num_routed = 0

    def cached(self, hashes: Sequence[str]) -> int:
        """Leading blocks cached there now, or being computed (or just computed) there by requests this router
        sent."""
        n = 0
        index, pending, recent = self.index, self._pending, self._recent
        for h in hashes:
            if h not in index and h not in pending and h not in recent:
                break
            n += 1
        return n

    def on_batch(self) -> None:
        """One message of event batches arrived: forget recent blocks whose events have surely come."""
        self._num_batches += 1
        if self._recent:
            now = self._num_batches
            self._recent = {h: until for h, until in self._recent.items() if until > now}

    @property
    def load(self) -> Load:
        own_requests = self._num_inflight
        own_blocks = len(self._pending) + self._pending_tail_blocks
        r = self.reported
        if r is None:
            return Load(own_requests, own_blocks, self._prefill_queue)
        return Load(max(own_requests, r.num_running + r.num_waiting), max(own_blocks, r.num_blocks_used),
                    self._prefill_queue)

    def add(self, a: Assignment) -> None:
        self._num_inflight += 1
        self._prefill_queue += a.prefill_blocks
        self.num_routed += 1
        self._pending.update(a.hashes)
        self._pending_tail_blocks += a.prompt_blocks - len(a.hashes)

    def prefilled(self, a: Assignment) -> None:
        self._prefill_queue -= a.prefill_blocks

    def remove(self, a: Assignment, computed: bool) -> None:
        self._num_inflight -= 1
        if not a.prefilled:
            self._prefill_queue -= a.prefill_blocks
        self._pending.subtract(a.hashes)
        for h in a.hashes:
            if self._pending[h] <= 0:
                del self._pending[h]
        self._pending_tail_blocks -= a.prompt_blocks - len(a.hashes)
        if computed:
            # The events of its blocks were published before its last step; they arrive in the next batch or
            # the one after (a batch already on its way may predate them).
            until = self._num_batches + RECENT_BATCHES
            for h in a.hashes:
                self._recent[h] = until

    def statistics(self) -> WorkerStatistics:
        return WorkerStatistics(self.key, self.index.statistics(), self.spec, self.reported, self.load,
                                self._num_inflight, self.num_routed)


@dataclass(slots=True)
class Replica:
    url: str
    health: HealthState
    models: list[str] = field(default_factory=list)  # in the replica's order: the first is its default
    workers: dict[str, Worker] = field(default_factory=dict)
    num_routed: int = 0


class Router:
    def __init__(self, replicas: Sequence[str], policy: Policy, *, rejoin_after: int = 1) -> None:
        if not replicas:
            raise ValueError("give at least one replica")
        if len(set(replicas)) != len(replicas):
            raise ValueError("a replica is listed twice")
        self.policy = policy
        self.replicas = {url: Replica(url, HealthState(rejoin_after=rejoin_after)) for url in replicas}
        self._num_routed = 0
        self._num_unroutable = 0
        self._prompt_blocks = 0
        self._predicted_cached_blocks = 0

    # ---- what the shells observed ----

    def set_models(self, url: str, models: Sequence[str]) -> tuple[list[WorkerKey], list[WorkerKey]]:
        """The models a replica serves (its /v1/models order); returns the workers (added, removed)."""
        replica = self.replicas[url]
        replica.models = list(dict.fromkeys(models))
        added = [WorkerKey(url, m) for m in replica.models if m not in replica.workers]
        removed = [WorkerKey(url, m) for m in replica.workers if m not in replica.models]
        for key in added:
            replica.workers[key.model] = Worker(key)
        for key in removed:
            del replica.workers[key.model]  # its in-flight assignments release into nothing
        return added, removed

    def worker(self, key: WorkerKey) -> Worker | None:
        replica = self.replicas.get(key.replica)
        return replica.workers.get(key.model) if replica is not None else None

    def on_hello(self, key: WorkerKey, hello: Hello) -> None:
        worker = self.worker(key)
        if worker is not None:
            worker.spec = hello.spec
            worker.index.start(hello.epoch)

    def on_steps(self, key: WorkerKey, epoch: int, reports: Iterable[StepReport]) -> bool:
        """One batch of step reports; False when the worker's stream broke (gap or new epoch): resubscribe."""
        worker = self.worker(key)
        if worker is None:
            return False
        ok = worker.index.apply(epoch, ())  # a batch without events still says which engine it is from
        for report in reports:
            worker.reported = report.load
            if ok:
                ok = worker.index.apply(epoch, report.kv_events)
        worker.on_batch()
        return ok

    def on_stream_lost(self, key: WorkerKey) -> None:
        worker = self.worker(key)
        if worker is not None:
            worker.index.lose()

    def on_health(self, url: str, ok: bool, now: float, reason: str = "") -> bool:
        """A health observation; True when the replica left or rejoined the pool."""
        health = self.replicas[url].health
        return health.on_success(now) if ok else health.on_failure(now, reason or "unhealthy")

    # ---- decisions ----

    def in_pool(self, url: str) -> bool:
        return self.replicas[url].health.in_pool

    def eligible(self, model: str | None, exclude: Iterable[str] = ()) -> list[Worker]:
        """Workers in the pool that serve `model` (None: each replica's default model). A model no replica
        serves goes to the default workers, so that a replica answers with its own error."""
        excluded = set(exclude)
        pool = [r for r in self.replicas.values() if r.health.in_pool and r.url not in excluded and r.models]
        if model is not None:
            serving = [r.workers[model] for r in pool if model in r.workers]
            if serving:
                return serving
        return [r.workers[r.models[0]] for r in pool]

    def choose(self, model: str | None, token_ids: Sequence[int] | None = None, *,
               exclude: Iterable[str] = (), cache_salt: str | None = None) -> Assignment | None:
        """Pick a worker for one request (its prompt's token ids when known) and count it as in flight there;
        None when no replica is in the pool (after `exclude`: the replicas this request already tried).
        A salted request's blocks are hashed under its salt, as the replica's prefix cache hashes them: it
        neither hits nor is steered by another salt's (or unsalted) blocks."""
        workers = self.eligible(model, exclude)
        if not workers:
            self._num_unroutable += 1
            return None
        ids = list(token_ids) if token_ids is not None else None
        # A worker whose stream has not said how it hashes yet is priced at another's block size, uncached.
        fallback = next((w.spec for w in workers if w.spec is not None), None)
        hashes_by_spec: dict[KVCacheSpec, list[str]] = {}
        candidates: list[Candidate] = []
        per_worker: list[tuple[int, list[str]]] = []
        for w in workers:
            hashes: list[str] = []
            blocks = 0
            spec = w.spec or fallback
            if ids is not None and spec is not None:
                blocks = -(-len(ids) // spec.block_size)
                if self.policy.uses_kv and w.spec is not None:
                    if w.spec not in hashes_by_spec:
                        hashes_by_spec[w.spec] = w.spec.matchable_hashes(ids, cache_salt)
                    hashes = hashes_by_spec[w.spec]
            cached = w.cached(hashes) if hashes else 0
            candidates.append(Candidate(w.load, blocks, cached))
            per_worker.append((blocks, hashes))
        i = self.policy.choose(candidates)
        worker = workers[i]
        blocks, hashes = per_worker[i]
        a = Assignment(worker.key, len(ids) if ids is not None else 0, blocks, candidates[i].cached_blocks,
                       tuple(hashes), worker)
        worker.add(a)
        self.replicas[worker.key.replica].num_routed += 1
        self._num_routed += 1
        self._prompt_blocks += blocks
        self._predicted_cached_blocks += a.cached_blocks
        return a

    def on_first_token(self, a: Assignment) -> None:
        """The assignment's first token came: its prompt is computed, it no longer delays what queues there."""
        if a.prefilled or a.released:
            return
        a.prefilled = True
        if a.owner is not None:
            a.owner.prefilled(a)

    def release(self, a: Assignment, *, computed: bool = False) -> None:
        """The assignment's response ended: `computed` if the replica answered it (so its prompt is cached
        there now), else it failed or moved to another replica. Idempotent."""
        if a.released:
            return
        a.released = True
        if a.owner is not None:
            a.owner.remove(a, computed)

    def statistics(self) -> RouterStatistics:
        replicas = tuple(
            ReplicaStatistics(r.url, r.health.statistics(), tuple(r.models), r.num_routed,
                              tuple(w.statistics() for w in r.workers.values()))
            for r in self.replicas.values())
        return RouterStatistics(self.policy.name.value, self._num_routed, self._num_unroutable, self._prompt_blocks,
                                self._predicted_cached_blocks, replicas)
