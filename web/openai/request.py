"""OpenAI wire format, requests: chat and completion bodies -> prompt ids and SamplingParams.

Pure functions and small records, no IO, so every rule here is testable without a server.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from typing import Any, Literal

from trillm.engine.admission import RequestLimits
from trillm.engine.errors import InvalidRequest
from trillm.engine.grammar import GrammarSpec
from trillm.engine.sampling_params import MAX_TOP_LOGPROBS, SamplingParams
from trillm.engine.tokenizer import TokenizerLike as Tokenizer
from trillm.web.chat.features import ChatOptions, ToolRequest, model_features, template_inputs
from trillm.web.chat.output_events import OutputParsing
from trillm.web.chat.structured import AnswerSpec, output_plan
from trillm.web.openai.schema import ChatCompletionRequest, ChatMessage, CompletionRequest

Kind = Literal["chat", "completion"]
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


@dataclass(frozen=True, slots=True)
class Limits:
    """Server-side caps on what one request may ask for (flags of `trillm serve`; documented in README)."""

    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024
    max_prompt_bytes: int = 1 << 20  # text to template and tokenize, checked before doing either
    max_prompts: int = 256  # prompts in one /v1/completions batch
    max_engine_requests: int = 256  # generations one request may start: its prompts x n
    max_response_bytes: int = 32 << 20  # a non-streamed response's worst-case size (see response_bytes)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value < 1:
                raise ValueError(f"{f.name} must be >= 1")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One parsed /v1/chat/completions or /v1/completions body.

    Each prompt (a completions batch has several) runs as n engine requests with `params`; choice index
    = prompt index x n + choice, the order `EngineService.submit_prompts` gives their request ids.
    """

    kind: Kind
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice (n), the same for every prompt
    stream: bool
    include_usage: bool
    logprobs: bool
    priority: int = 0
    tools: ToolRequest | None = None  # the tools offered and tool_choice (None: no tools)
    answer: AnswerSpec | None = None  # what the answer must match (response_format and the extensions)
    grammar: GrammarSpec | None = None  # the compiled constraint every choice runs under
    parsing: OutputParsing = OutputParsing()  # how the output splits into reasoning, text and tool calls
    echo_texts: tuple[str, ...] = ()  # echo: each prompt's text, put before its choices' text
    top_logprobs: int = 0  # alternatives shown per token in `logprobs`
    prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` field in the response, with this many alternatives

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (the first, for a batch)."""
        return self.prompts[0]

    @property
    def echo(self) -> bool:
        return bool(self.echo_texts)


# ---- parsing ----

def _messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates want them: text content, tool calls' arguments as objects."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": c.type,
                                "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                               for c in m.tool_calls]
        out.append(d)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


def _utf8_len(text: str | None) -> int:
    return len(text.encode()) if text else 0


def _json_len(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode()) if value else 0


def prompt_bytes(body: ChatCompletionRequest | CompletionRequest) -> int:
    """How much text a body asks the server to template and tokenize: every message's content (system
    prompts and tool results included), name and tool calls (their arguments), the tools' definitions and
    the template's extra arguments. The Messages and Responses APIs arrive here translated (tool_use.input,
    function_call.arguments and their outputs are tool calls and tool messages), so this counts theirs too."""
    if isinstance(body, ChatCompletionRequest):
        size = _json_len(body.chat_template_kwargs)
        for m in body.messages:
            size += _utf8_len(m.text) + _utf8_len(m.name) + _utf8_len(m.tool_call_id)
            for call in m.tool_calls or ():
                size += _utf8_len(call.id) + _utf8_len(call.function.name) + _utf8_len(call.function.arguments)
        for tool in body.tools or ():
            f = tool.function
            size += _utf8_len(f.name) + _utf8_len(f.description) + _json_len(f.parameters)
        return size
    prompt = body.prompt
    if isinstance(prompt, str):
        return len(prompt.encode())
    return sum(len(p.encode()) for p in prompt if isinstance(p, str))


def chat_prompt_ids(messages: list[ChatMessage], tokenizer: Tokenizer, *,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Apply the model's chat template to `messages` (/tokenize's: it takes no tools)."""
    return render_chat(_messages(messages), tokenizer, template_kwargs=template_kwargs)


def render_chat(messages: list[dict[str, Any]], tokenizer: Tokenizer, *, tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt ids of template-ready messages (see `_messages`) and tool dicts."""
    try:
        return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                  **(template_kwargs or {})))
    except InvalidRequest:
        raise
    except Exception as exc:  # template errors are the request's fault (e.g. a role it does not allow)
        raise InvalidRequest(f"the chat template could not be applied: {exc}") from exc


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The body's prompts as given: texts, or token-id lists (a string or a token-id list is a batch of one)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(t, int) for t in prompt):
        return [[t for t in prompt if isinstance(t, int)]]
    return [p for p in prompt if isinstance(p, (str, list))]


def prompt_ids(prompt: str | list[int], tokenizer: Tokenizer) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if any(t >= tokenizer.vocab_size for t in prompt):
        raise InvalidRequest(f"prompt token ids must be in [0, {tokenizer.vocab_size})")
    return prompt


def sampling_params(body: ChatCompletionRequest | CompletionRequest, kind: Kind, prompt_len: int,
                    model: RequestLimits, limits: Limits) -> list[SamplingParams]:
    """Every sampling parameter the engine has, with OpenAI's names; one SamplingParams per choice."""
    if not body.n <= limits.max_n:
        raise InvalidRequest(f"'n' must be in [1, {limits.max_n}]")
    if isinstance(body, ChatCompletionRequest) and body.echo is not None and body.echo is not False:
        raise InvalidRequest("'echo' is not supported on chat completions (it is on /v1/completions)")
    if body.best_of is not None and not (type(body.best_of) is int and body.best_of == body.n):
        raise InvalidRequest("'best_of' is not supported (only best_of = n)")
    if body.suffix is not None and body.suffix != "":
        raise InvalidRequest("'suffix' is not supported")
    echo = isinstance(body, CompletionRequest) and body.echo
    if echo and body.n > 1 and body.temperature > 0:
        raise InvalidRequest("'echo' with n > 1 needs temperature 0: sampled choices would each score the prompt again")
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens
    else:
        max_tokens = body.max_tokens
    if max_tokens is None:
        # The rest of the context, or of the KV pool if that is smaller, so a request without max_tokens fits.
        room = min(model.max_model_len, model.num_usable_blocks * model.block_size) - prompt_len
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if kind == "completion" else max(1, room)
        if limits.max_tokens_limit is not None:
            max_tokens = min(max_tokens, limits.max_tokens_limit)
    elif limits.max_tokens_limit is not None and max_tokens > limits.max_tokens_limit:
        raise InvalidRequest(f"max_tokens is {max_tokens}; this server allows at most {limits.max_tokens_limit}")
    stop = body.stop_strings
    if len(stop) > limits.max_stop_strings:
        raise InvalidRequest(f"'stop' has {len(stop)} strings; this server allows at most {limits.max_stop_strings}")
    if any(len(s) > limits.max_stop_string_chars for s in stop):
        raise InvalidRequest(f"stop strings may be at most {limits.max_stop_string_chars} characters long")
    stop_ids = tuple(body.stop_token_ids or ())
    if len(stop_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(f"'stop_token_ids' has {len(stop_ids)} ids; this server allows at most "
                             f"{limits.max_stop_token_ids}")
    bias = body.logit_bias or {}
    if len(bias) > limits.max_logit_bias:
        raise InvalidRequest(f"'logit_bias' has {len(bias)} entries; this server allows at most "
                             f"{limits.max_logit_bias}")
    logit_bias = tuple((int(k), v) for k, v in bias.items())
    if any(t >= model.vocab_size for t, _ in logit_bias) or any(t >= model.vocab_size for t in stop_ids):
        raise InvalidRequest(f"token ids in 'logit_bias' and 'stop_token_ids' must be in [0, {model.vocab_size})")
    if isinstance(body, ChatCompletionRequest):
        logprobs, top_logprobs = body.logprobs, body.top_logprobs or 0
        if top_logprobs and not logprobs:
            raise InvalidRequest("'top_logprobs' requires 'logprobs': true")
    else:
        logprobs, top_logprobs = body.logprobs is not None, body.logprobs or 0
    if top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"at most {MAX_TOP_LOGPROBS} top logprobs per token")
    if body.prompt_logprobs is not None and body.prompt_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"'prompt_logprobs' must be in [0, {MAX_TOP_LOGPROBS}]")
    # The engine computes the prompt's logprobs once for both uses: echoed logprobs and vLLM's field.
    wanted = [k for k in (body.prompt_logprobs, top_logprobs if echo and logprobs else None) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    if max_tokens == 0 and not echo and body.prompt_logprobs is None:
        raise InvalidRequest("max_tokens 0 generates nothing: it is for scoring a prompt (with 'echo' or "
                             "'prompt_logprobs')")
    common: dict[str, Any] = dict(
        max_tokens=max_tokens, min_tokens=body.min_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=max(0, body.top_k), min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, logit_bias=logit_bias,
        stop=stop, stop_token_ids=stop_ids, ignore_eos=body.ignore_eos, logprobs=logprobs,
        top_logprobs=top_logprobs, skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output, cache_salt=body.cache_salt,
        prompt_logprobs=prompt_logprobs, speculative=body.speculative,
    )
    return [SamplingParams(seed=None if body.seed is None else choice_seed(body.seed, i), **common)
            for i in range(body.n)]


# Seeds the engine takes: |seed| < 2^63, i.e. 2^64 - 1 values.
_SEED_SPAN = 2**64 - 1
_SEED_MAX = 2**63 - 1


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: seed + index, wrapped into the engine's range (a seed near the top must not
    overflow it), so choice 0 keeps the seed as given, the n choices differ, and all are reproducible."""
    return (seed + index + _SEED_MAX) % _SEED_SPAN - _SEED_MAX


def answer_spec(body: ChatCompletionRequest | CompletionRequest) -> AnswerSpec | None:
    """The constraint on the answer: response_format (chat), or one of vLLM's structured_outputs / guided_*."""
    found: list[AnswerSpec] = []

    def schema_text(value: dict[str, Any] | str, where: str) -> str:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequest(f"'{where}' is not a JSON schema: {exc}") from None
        if not isinstance(value, dict):
            raise InvalidRequest(f"'{where}' must be a JSON schema object")
        return json.dumps(value)

    rf = body.response_format if isinstance(body, ChatCompletionRequest) else None
    if rf is not None and rf.type == "json_object":
        found.append(AnswerSpec("json_schema", '{"type": "object"}'))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise InvalidRequest("'response_format.json_schema.schema' is required for type 'json_schema'")
        found.append(AnswerSpec("json_schema", schema_text(rf.json_schema.schema_, "response_format.json_schema.schema"),
                                lenient=rf.json_schema.strict is not True))
    def vllm_constraints(json_: Any, regex: str | None, grammar: str | None, choice: Any, where: str) -> None:
        # vLLM's two spellings of the same constraints: structured_outputs.{json,...} and guided_{json,...}.
        if json_ is not None:
            found.append(AnswerSpec("json_schema", schema_text(json_, where.format("json")), lenient=True))
        if regex is not None:
            found.append(AnswerSpec("regex", regex))
        if grammar is not None:
            found.append(AnswerSpec("lark", grammar))
        if choice is not None:
            found.append(AnswerSpec("choice", json.dumps(choice)))

    so = body.structured_outputs
    if so is not None:
        vllm_constraints(so.json_, so.regex, so.grammar, so.choice, "structured_outputs.{}")
        if so.json_object:
            found.append(AnswerSpec("json_schema", '{"type": "object"}'))
    vllm_constraints(body.guided_json, body.guided_regex, body.guided_grammar, body.guided_choice, "guided_{}")
    if len(found) > 1:
        raise InvalidRequest("give at most one output constraint (response_format, structured_outputs or one "
                             "guided_* field)")
    return found[0] if found else None


def tool_request(body: ChatCompletionRequest) -> ToolRequest | None:
    """The tools and tool_choice (OpenAI's defaults: "auto" with tools, "none" without)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise InvalidRequest("'tool_choice' needs 'tools'")
        return None
    tools = tuple(t.model_dump(exclude_none=True) for t in body.tools)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("'tools' has two functions with the same name")
    parallel = body.parallel_tool_calls is not False
    if choice is None or isinstance(choice, str):
        return ToolRequest(tools, choice or "auto", None, parallel)
    return ToolRequest(tools, "named", choice.function.name, parallel)


def generation_prompt_ids(body: ChatCompletionRequest | CompletionRequest, tokenizer: Tokenizer,
                          tools: ToolRequest | None = None, options: ChatOptions = ChatOptions()) -> list[list[int]]:
    """The prompt ids a generation runs on, one list per prompt: the chat template over the messages (and the
    tools, in the form this model's template takes them), or each of the completion's prompts. A KV-aware
    router computes them too."""
    if isinstance(body, CompletionRequest):
        return [prompt_ids(p, tokenizer) for p in completion_prompts(body)]
    messages, tool_dicts = _messages(body.messages), None
    if tools is not None or any(m.tool_calls or m.role == "tool" for m in body.messages):
        messages, tool_dicts = template_inputs(messages, tools, model_features(tokenizer, options))
    return [render_chat(messages, tokenizer, tools=tool_dicts, template_kwargs=body.chat_template_kwargs)]


def parse_generation(body: ChatCompletionRequest | CompletionRequest, model_name: str, tokenizer: Tokenizer,
                     model: RequestLimits, limits: Limits, options: ChatOptions = ChatOptions()) -> GenerationRequest:
    """Turn a validated body into prompt ids and params (raising InvalidRequest for what does not fit)."""
    kind: Kind = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
    size = prompt_bytes(body)
    if size > limits.max_prompt_bytes:
        raise InvalidRequest(f"the prompt has {size} bytes (messages, tool calls and results, tool definitions); this "
                             f"server allows at most {limits.max_prompt_bytes} (--max-prompt-bytes)")
    answer = answer_spec(body)
    tools = tool_request(body) if isinstance(body, ChatCompletionRequest) else None
    echo_texts: tuple[str, ...] = ()
    given = completion_prompts(body) if isinstance(body, CompletionRequest) else []
    if len(given) > limits.max_prompts:
        raise InvalidRequest(f"'prompt' has {len(given)} prompts; this server allows at most {limits.max_prompts}")
    # Before any prompt is tokenized: what the request would put in the engine's queue.
    fan_out = body.n * max(1, len(given))
    if fan_out > limits.max_engine_requests:
        raise InvalidRequest(f"the request asks for {fan_out} generations (prompts x n); this server runs at most "
                             f"{limits.max_engine_requests} for one request (--max-engine-requests)")
    if isinstance(body, CompletionRequest) and body.echo:  # a text prompt echoes as given; token ids as they decode
        echo_texts = tuple(p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) for p in given)
    prompts = generation_prompt_ids(body, tokenizer, tools, options)
    for i, ids in enumerate(prompts):
        which = f"prompt {i}" if len(prompts) > 1 else "the prompt"
        if not ids:
            raise InvalidRequest(f"{which} is empty")
        if limits.max_prompt_tokens is not None and len(ids) > limits.max_prompt_tokens:
            raise InvalidRequest(f"{which} has {len(ids)} tokens; this server allows at most "
                                 f"{limits.max_prompt_tokens}")
    # Only the chat default of max_tokens depends on the prompt, and chat has one prompt.
    params = sampling_params(body, kind, max(len(ids) for ids in prompts), model, limits)
    grammar: GrammarSpec | None = None
    parsing = OutputParsing()
    if isinstance(body, ChatCompletionRequest):
        plan = output_plan(prompts[0], tokenizer, model_features(tokenizer, options), tools, answer)
        grammar, parsing = plan.grammar, plan.parsing
        if plan.keep_special_tokens:
            params = [dataclasses.replace(p, skip_special_tokens=False) for p in params]
    elif answer is not None:  # a completion's constraint does not depend on its prompt
        plan = output_plan(prompts[0], tokenizer, None, None, answer)
        grammar = plan.grammar
    if grammar is not None:
        params = [dataclasses.replace(p, grammar=grammar) for p in params]
    return GenerationRequest(
        kind=kind, model=model_name, prompts=prompts, params=params, stream=body.stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        logprobs=params[0].logprobs, priority=body.priority, tools=tools, answer=answer, grammar=grammar,
        parsing=parsing, echo_texts=echo_texts, top_logprobs=params[0].top_logprobs,
        prompt_logprobs=body.prompt_logprobs,
    )


# What one token costs in a non-streamed response, as an upper estimate: its text in the JSON, and one
# logprob entry (the token, its logprob and bytes; each top alternative is another entry).
TOKEN_TEXT_BYTES = 16
LOGPROB_ENTRY_BYTES = 96


def response_bytes(req: GenerationRequest) -> int:
    """The worst-case size of `req`'s whole response when it is not streamed: every choice at max_tokens,
    with its logprobs and top alternatives, plus the echoed prompt and the prompt's logprobs."""
    n = len(req.params)
    p = req.params[0]
    per_token = TOKEN_TEXT_BYTES + (LOGPROB_ENTRY_BYTES * (1 + req.top_logprobs) if req.logprobs else 0)
    total = 0
    for ids in req.prompts:
        total += n * p.max_tokens * per_token
        if req.echo:
            total += n * len(ids) * per_token
        if req.prompt_logprobs is not None:  # per choice on completions, once on chat
            copies = n if req.kind == "completion" else 1
            total += copies * len(ids) * LOGPROB_ENTRY_BYTES * (1 + req.prompt_logprobs)
    return total


def check_response_size(req: GenerationRequest, limits: Limits) -> None:
    """A non-streamed response is built whole in memory: refuse up front one that could exceed the cap."""
    if req.stream:
        return
    size = response_bytes(req)
    if size > limits.max_response_bytes:
        raise InvalidRequest(f"the response could reach {size} bytes (n x max_tokens x (1 + top_logprobs), with "
                             f"echo and prompt_logprobs); this server builds at most {limits.max_response_bytes} "
                             "bytes in memory (--max-response-bytes): use \"stream\": true, or lower n, max_tokens "
                             "or top_logprobs")


def needs_grammar(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether parsing `body` compiles a grammar (slow the first time: do it off the event loop)."""
    if isinstance(body, ChatCompletionRequest) and (body.tools or (body.response_format is not None
                                                                   and body.response_format.type != "text")):
        return True
    return any(v is not None for v in (body.structured_outputs, body.guided_json, body.guided_regex,
                                       body.guided_grammar, body.guided_choice))
