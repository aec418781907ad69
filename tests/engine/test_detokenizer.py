"""Stop strings over streamed text: the KMP matcher equals a plain search over the whole text, however the
text is split into tokens."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from trillm.engine.detokenizer import StopStringMatcher


def reference(text: str, stops: tuple[str, ...], include: bool) -> tuple[str, str | None]:
    """The earliest-ending occurrence of any stop string (of those, the earliest-starting)."""
    found = [(i + len(s), i, s) for s in stops if (i := text.find(s)) >= 0]
    if not found:
        return text, None
    end, start, s = min(found)
    return (text[:end] if include else text[:start]), s


@settings(max_examples=400, deadline=None)
@given(text=st.text("ab c", max_size=40), stops=st.lists(st.text("ab c", min_size=1, max_size=5), min_size=1,
                                                          max_size=4, unique=True),
       cuts=st.lists(st.integers(1, 5), max_size=40), include=st.booleans())
def test_streamed_matching_equals_a_search_of_the_whole_text(text: str, stops: list[str], cuts: list[int],
                                                             include: bool) -> None:
    m = StopStringMatcher(tuple(stops), include_stop=include)
    out, matched, i = "", None, 0
    pieces = []
    for n in cuts + [len(text)]:
        pieces.append(text[i:i + n])
        i += n
    for piece in pieces:
        emitted, matched = m.feed(piece)
        out += emitted
        if matched is not None:
            break
    if matched is None:
        out += m.flush()
    assert (out, matched) == reference(text, tuple(stops), include)
