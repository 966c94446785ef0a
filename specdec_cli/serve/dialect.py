"""What the two translated dialects (Anthropic's Messages, OpenAI's Responses) share on the way to chat.

A dialect's request becomes chat messages, each remembering the client's
field it came from (``system``, ``messages[2]``, ``input[5]``), so that an
error found in the chat request names the field the client sent. No MLX, no HTTP.
"""

from __future__ import annotations

import re
from typing import Any, Optional, Sequence

from pydantic import BaseModel, ValidationError

from .protocol import ApiError, ChatRequest, _unpaired_surrogate, check_finite, validation_error

# A chat field path's message index: "messages[3].content" (validation_error's) or "messages.3.content".
_MESSAGE = re.compile(r"^messages(?:\.|\[)(\d+)\]?")


def check_text(req: BaseModel, *, exclude: Sequence[str] = ()) -> None:
    """Refuse text no tokenizer can encode (a lone UTF-16 surrogate) and numbers no JSON answer can hold
    (``1e999``, ``NaN``), naming the client's field.

    Raises:
        ApiError: A 400 naming where the surrogate or the number is.
    """
    body = req.model_dump(exclude_none=True, exclude=set(exclude))
    where = _unpaired_surrogate(body, "")
    if where:
        raise ApiError(400, f"{where}: the text holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape), "
                       "which no tokenizer can encode: send valid Unicode text", where, "invalid_value")
    check_finite(body)


def client_param(param: Optional[str], origins: Sequence[str]) -> Optional[str]:
    """A chat field path (``messages[3].content``) as the client's (``input[5].content``)."""
    if not param:
        return param
    m = _MESSAGE.match(param)
    if m is None or int(m.group(1)) >= len(origins):
        return param
    rest = param[m.end():].lstrip(".")
    return f"{origins[int(m.group(1))]}.{rest}" if rest else origins[int(m.group(1))]


def chat_request(body: dict[str, Any], origins: Sequence[str]) -> ChatRequest:
    """The chat request a dialect's translated ``body`` is; ``origins[i]`` names the client's field behind
    ``body["messages"][i]``.

    Raises:
        ApiError: A 400 naming the client's field.
    """
    try:
        return ChatRequest.model_validate(body)
    except ValidationError as e:
        raise validation_error(e, rename=lambda param: client_param(param, origins)) from None
