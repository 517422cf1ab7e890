"""SSE frames (m3serve/api/sse.py): one event is one line to any line splitter, and its JSON is
the payload."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from m3serve.api.sse import event, named_event

# Model text may hold any of these; str.splitlines() (httpx's iter_lines) ends a line at each.
SPLITTERS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


# Text comes from decoding UTF-8 (the detokenizer, request bodies), so it never holds a lone
# surrogate, which orjson refuses.
@given(st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from(SPLITTERS)))
def test_any_text_makes_one_data_line_whose_json_is_the_payload(text: str) -> None:
    payload = {"choices": [{"delta": {"content": text}}]}
    frame = event(payload).decode()
    (line,) = [line for line in frame.splitlines() if line]
    assert line.startswith("data: ")
    assert json.loads(line.removeprefix("data: ")) == payload


def test_a_line_separator_in_a_token_is_escaped_not_sent_raw() -> None:
    frame = event({"text": "a\u2028b\x85c\u2029d"})
    assert frame == b'data: {"text":"a\\u2028b\\u0085c\\u2029d"}\n\n'
    assert named_event({"type": "response.output_text.delta", "delta": "\u2028"}).count(b"\n") == 3
