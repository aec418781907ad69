"""What a model's chat template does with tools and reasoning (detected once per tokenizer), and one
request's tools as its template gets them.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Literal

from trillm.engine.tokenizer import TokenizerLike
from trillm.web.chat.reasoning import ReasoningFormat, detect_reasoning, reasoning_format
from trillm.web.chat.tool_parsers import (
    ToolFormat, detect_tool_format, render_generic_history, template_renders_tools, tool_format,
)

ToolChoice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """Server flags: `--tool-parser` and `--reasoning-parser` (None: detect from the model; "none": off)."""

    tool_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_parser is not None:
            tool_format(self.tool_parser)  # raises ValueError for an unknown name
        if self.reasoning_parser not in (None, "none"):
            reasoning_format(self.reasoning_parser)


@dataclass(frozen=True, slots=True)
class ModelFeatures:
    tool_format: ToolFormat
    reasoning: ReasoningFormat | None


@dataclass(frozen=True, slots=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]
    choice: ToolChoice = "auto"
    name: str | None = None  # choice "named": the function
    parallel: bool = True


_features: weakref.WeakKeyDictionary[Any, dict[ChatOptions, ModelFeatures]] = weakref.WeakKeyDictionary()
_features_lock = threading.Lock()


def model_features(tokenizer: TokenizerLike, options: ChatOptions = ChatOptions()) -> ModelFeatures:
    """The model's tool-call format and reasoning markers (cached per tokenizer and options)."""
    with _features_lock:
        hit = _features.get(tokenizer, {}).get(options)
    if hit is not None:
        return hit
    hf = getattr(tokenizer, "hf", None)
    template = getattr(hf, "chat_template", None) if hf is not None else None
    template = template if isinstance(template, str) else None
    if options.tool_parser is not None:
        fmt = tool_format(options.tool_parser)
    else:
        vocab = set(hf.get_vocab()) if hf is not None else set()
        fmt = tool_format(detect_tool_format(template, vocab, template_renders_tools(tokenizer)))
    if options.reasoning_parser == "none":
        reasoning = None
    elif options.reasoning_parser is not None:
        reasoning = reasoning_format(options.reasoning_parser)
    else:
        reasoning = detect_reasoning(tokenizer, template)
    features = ModelFeatures(fmt, reasoning)
    with _features_lock:
        _features.setdefault(tokenizer, {})[options] = features
    return features


def template_inputs(messages: list[dict[str, Any]], tools: ToolRequest | None,
                    features: ModelFeatures) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. tool_choice "none" renders no tools."""
    rendered = list(tools.tools) if tools is not None and tools.choice != "none" else None
    if not features.tool_format.renders_tools:
        return render_generic_history(messages, rendered), None
    return messages, rendered
