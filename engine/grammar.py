"""Constrained decoding with llguidance: grammars compiled once per tokenizer and text, one matcher per request.

A request's `SamplingParams.grammar` (a `GrammarSpec`: JSON schema, regex, Lark, or llguidance's own JSON
form for composed grammars) is compiled against the served tokenizer by a `GrammarCompiler`. Compiling
builds a pristine llguidance matcher, cached by the grammar's text; each request gets a cheap deep copy of
it (a `GrammarMatcher`) that advances with every token the request samples. Each step the engine fills one
bitmask for all constrained rows together (`GrammarCompiler.fill_masks`, llguidance's parallel executor);
the sampler turns each row's bits into -inf logits for disallowed tokens. Rows without a grammar never
touch any of this.

llguidance rather than xgrammar or outlines-core: its wheel is self-contained (xgrammar's pulls in torch and
triton), it compiles JSON schemas, regexes and Lark (with inline `%json`, lazy lexemes and special tokens for
tool-call formats and thinking blocks) without an ahead-of-time vocabulary index (outlines-core builds one per
regex, seconds for large schemas), and it exposes plain numpy bitmasks, which the sampler applies with ordinary
mx ops on every backend (`llguidance.mlx` is a Metal kernel).

Thread-safety: the compiler is shared by the web layer (which validates a request's grammar before queuing it)
and the engine thread; its cache is guarded by a lock. Pristine matchers are only deep-copied, never advanced.
Matchers belong to the engine thread.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from trillm.engine.errors import InvalidRequest
from trillm.engine.tokenizer import TokenizerLike

GrammarKind = Literal["json_schema", "regex", "lark", "llguidance"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "regex", "lark", "llguidance")
MAX_GRAMMAR_CHARS = 1 << 20
_MAX_CACHED = 256
JSON_WHITESPACE = r"[ \t\n]{0,16}"


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What a request's output must match. `source` is the grammar's text: a JSON schema (as JSON), a regex,
    a Lark grammar, or an llguidance grammar object (JSON: {"grammars": [...]}) composing several."""

    kind: GrammarKind
    source: str
    # Set by `GrammarCompiler.validate`: the compiled grammar travels with the request, so the engine thread
    # never compiles it again, even when other grammars pushed it out of the cache meanwhile.
    compiled: _Compiled | None = field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(f"unknown grammar kind {self.kind!r}")
        if not isinstance(self.source, str) or not self.source:
            raise InvalidRequest("a grammar must be a non-empty string")
        if len(self.source) > MAX_GRAMMAR_CHARS:
            raise InvalidRequest(f"the grammar has {len(self.source)} characters; at most {MAX_GRAMMAR_CHARS}")


@dataclass(frozen=True, slots=True, eq=False)
class _Compiled:
    compiler: GrammarCompiler  # whose tokenizer it was compiled for
    matcher: Any  # the pristine llguidance matcher (only ever deep-copied)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask (bit t % 32 of word t // 32 allows token t)."""
    return (vocab_size + 31) // 32


def _grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar definition of `spec` (raises ValueError for malformed JSON)."""
    import llguidance

    if spec.kind == "json_schema":
        # Bounded whitespace between JSON tokens: a small model must not fill max_tokens with newlines.
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults={"whitespace_pattern": JSON_WHITESPACE})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    json.loads(spec.source)  # llguidance's own form: it must at least be JSON
    return spec.source


class _TokenizerView:
    """The tokenizer as llguidance's TokenizerWrapper wants it, built from token bytes (non-HF tokenizers)."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        specials = set(getattr(tokenizer, "all_special_ids", ())) | set(tokenizer.eos_token_ids)
        tokens: list[bytes] = []
        for i in range(tokenizer.vocab_size):
            raw = tokenizer.token_bytes(i)
            if i in specials:
                # llguidance marks special tokens with a leading 0xFF byte; they never match text.
                name = raw or f"<|special_{i}|>".encode()
                raw = b"\xff" + name
            tokens.append(raw)
        self.tokens = tokens
        self.eos_token_id = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else 0
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(specials)
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def _ll_tokenizer(tokenizer: TokenizerLike) -> Any:
    import llguidance

    eos = sorted(tokenizer.eos_token_ids)
    hf = getattr(tokenizer, "hf", None)
    if hf is not None and getattr(hf, "backend_tokenizer", None) is not None:
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf, n_vocab=tokenizer.vocab_size, eos_token=eos or None)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenizerView(tokenizer)),
                                  n_vocab=tokenizer.vocab_size, eos_token=eos or None)


class GrammarMatcher:
    """One request's position in its grammar. Engine thread only."""

    __slots__ = ("_m",)

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    @property
    def handle(self) -> Any:
        """The llguidance matcher (for the compiler's batched mask fill)."""
        return self._m

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher is then dead)."""
        return bool(self._m.consume_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        return str(self._m.get_error())


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer (llguidance's view of it is built on first use, ~1 s)."""

    def __init__(self, tokenizer: TokenizerLike, *, max_cached: int = _MAX_CACHED) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self.width = bitmask_width(tokenizer.vocab_size)
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._ll: Any = None
        self._executor: Any = None
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                self._ll = _ll_tokenizer(self.tokenizer)
            return self._ll

    def _pristine(self, spec: GrammarSpec) -> Any:
        import llguidance

        if spec.compiled is not None and spec.compiled.compiler is self:
            return spec.compiled.matcher
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            text = _grammar_text(spec)
            matcher = llguidance.LLMatcher(self._ll_tokenizer(), text, log_level=0)
        except (ValueError, TypeError) as exc:  # malformed options are the request's fault, never a 500
            raise InvalidRequest(f"invalid {spec.kind.replace('_', ' ')}: {_first_line(str(exc))}") from None
        if matcher.is_error():
            raise InvalidRequest(f"invalid {spec.kind.replace('_', ' ')}: {_first_line(matcher.get_error())}")
        with self._lock:
            self._cache[spec] = matcher
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return matcher

    def validate(self, spec: GrammarSpec) -> GrammarSpec:
        """Compile `spec` (into the cache); InvalidRequest names what is wrong with it. Returns `spec` holding
        its compiled form: queue that one, and `matcher` never compiles on the engine thread."""
        return replace(spec, compiled=_Compiled(self, self._pristine(spec)))

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec` (compiled once, then copied)."""
        return GrammarMatcher(self._pristine(spec).deep_copy())

    def fill_masks(self, matchers: list[GrammarMatcher]) -> np.ndarray:
        """One bitmask row per matcher (int32 [K, width]), computed together on llguidance's thread pool."""
        import llguidance
        import llguidance.numpy

        out = np.zeros((len(matchers), self.width), dtype=np.int32)
        if not matchers:
            return out
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, [(m.handle, i) for i, m in enumerate(matchers)],
                                                     out)
        return out


def _first_line(message: str) -> str:
    """llguidance's error as one line (it spans several, with a caret under the offending character)."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip() and set(line.strip()) != {"^"})
    return text[:500] or "rejected by the grammar engine"


_compilers: weakref.WeakKeyDictionary[Any, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def grammar_compiler(tokenizer: TokenizerLike) -> GrammarCompiler:
    """The one compiler of `tokenizer`, shared by the engine and the web layer (same cache, same view)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler


def allowed_tokens(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows (bool [vocab_size]); for tests and the mock runner."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)
