"""Where the router gets a request's prompt token ids (it needs them only to hash the prompt's blocks).

- local: the replicas' own tokenizer in this process: the mock engine's (known from the replica's model id),
  the default model's (when the replica's model id is the default model's), or one loaded from the model's
  files (`--tokenizer PATH`, used for replicas whose model id it matches).
  It is trusted only after it tokenized every probe exactly as the replica's POST /tokenize did. Cost: the
  chat template and the tokenizer's encode, in this process.
- remote: the replica's POST /tokenize (one extra round trip per request; used until a local one is trusted,
  or always with `--tokenizer remote`).
A prompt given as token ids needs neither. With a policy that ignores prompts nothing is tokenized.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import trio

from trillm.engine.mock import mock_tokenizer_for
from trillm.engine.tokenizer import TokenizerLike
from trillm.web.router.core import Router, Worker, WorkerKey
from trillm.web.router.prompt import PROBES, PromptKind, local_prompt_ids, probe_kind, token_id_prompt, tokenize_request

log = logging.getLogger("trillm.web.router")


class PromptSource:
    def __init__(self, router: Router, client: httpx.AsyncClient, mode: str = "auto", *,
                 headers: dict[str, str] | None = None) -> None:
        self.router = router
        self.client = client
        self.mode = mode
        self.headers = headers or {}
        self._given: tuple[TokenizerLike, str] | None = None  # --tokenizer PATH: (tokenizer, its model id)
        if mode not in ("auto", "remote"):
            from trillm.engine.loader import load_tokenizer

            self._given = load_tokenizer(mode)
        self._default_id: str | None = None  # the default model's id, once asked
        self._trusted: dict[str, TokenizerLike | None] = {}  # model id -> verified local tokenizer (None: remote)
        self._checking: set[str] = set()

    def statistics(self) -> dict[str, str]:
        """model id -> how its prompts are tokenized: "local" (trusted), "remote", or "checking"."""
        out = {m: "local" if t is not None else "remote" for m, t in self._trusted.items()}
        out.update({m: "checking" for m in self._checking})
        return out

    async def _candidate(self, model_id: str) -> TokenizerLike | None:
        if self.mode == "remote":
            return None
        if self._given is not None and self._given[1] == model_id:
            return self._given[0]
        if self.mode == "auto" and model_id.startswith("gguf:"):
            return await self._default_model_tokenizer(model_id)
        return mock_tokenizer_for(model_id)

    async def _default_model_tokenizer(self, model_id: str) -> TokenizerLike | None:
        """The default model's tokenizer when `model_id` is the default model's (read on a worker thread)."""
        from trillm.engine.errors import EngineError
        from trillm.engine.loader import default_model_path, load_tokenizer, model_id_of

        try:
            if self._default_id is None:
                self._default_id = await trio.to_thread.run_sync(model_id_of, default_model_path())
            if self._default_id != model_id:
                return None
            tokenizer, _ = await trio.to_thread.run_sync(load_tokenizer, None)
        except (EngineError, OSError):
            return None  # no default model installed here: tokenize remotely
        return tokenizer

    async def verify(self, key: WorkerKey) -> None:
        """Decide (once per model id) whether a local tokenizer matches this worker's replica."""
        worker = self.router.worker(key)
        if worker is None or worker.spec is None:
            return
        model_id = worker.spec.model_id
        if model_id in self._trusted or model_id in self._checking:
            return
        self._checking.add(model_id)
        try:
            candidate = await self._candidate(model_id)
            if candidate is None:
                self._trusted[model_id] = None
                return
            await self._check(worker, model_id, candidate)
        except Exception as exc:  # a bug here must not take the replica's monitor down: tokenize remotely
            log.exception("%s: checking the local tokenizer failed", key, exc_info=exc)
            self._trusted[model_id] = None
        finally:
            self._checking.discard(model_id)

    async def _check(self, worker: Worker, model_id: str, candidate: TokenizerLike) -> None:
        key = worker.key
        for body in PROBES:
            kind = probe_kind(body)
            remote = await self._remote_ids(worker, kind, body)
            if remote is None:
                return  # the replica did not answer: decide on a later hello
            if local_prompt_ids(kind, body, candidate) != remote:
                log.warning("%s: the local tokenizer disagrees with the replica's; tokenizing remotely", key)
                self._trusted[model_id] = None
                return
        log.info("%s: tokenizing prompts locally (%s)", key, type(candidate).__name__)
        self._trusted[model_id] = candidate

    async def token_ids(self, kind: PromptKind | None, body: Any, model: str | None) -> list[int] | None:
        """The prompt ids the replicas will compute for `body`, or None when the router cannot tell."""
        if kind is None or not isinstance(body, dict):
            return None
        ids = token_id_prompt(kind, body)
        if ids is not None:
            return ids
        worker = next((w for w in self.router.eligible(model) if w.spec is not None), None)
        if worker is None or worker.spec is None:
            return None
        local = self._trusted.get(worker.spec.model_id)
        if local is not None:
            return local_prompt_ids(kind, body, local)
        return await self._remote_ids(worker, kind, body)

    async def _remote_ids(self, worker: Worker, kind: PromptKind, body: dict[str, Any]) -> list[int] | None:
        payload = tokenize_request(kind, body, worker.key.model)
        if payload is None:
            return None
        try:
            with trio.fail_after(5):
                r = await self.client.post(worker.key.replica + "/tokenize", json=payload, headers=self.headers)
            if r.status_code != 200:
                return None
            tokens = r.json().get("tokens")
        except (httpx.HTTPError, trio.TooSlowError, ValueError):
            return None
        if isinstance(tokens, list) and all(isinstance(t, int) for t in tokens):
            return tokens
        return None
