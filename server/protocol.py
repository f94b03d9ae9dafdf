"""OpenAI wire format: request validation (4xx with a reason), response and stream-chunk shapes,
incremental detokenisation with stop strings.

Requests are parsed by hand rather than by pydantic so every refusal names the parameter and says
what is accepted, in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

ROLES = ("system", "developer", "user", "assistant")
COMMON = {"model", "max_tokens", "temperature", "n", "stream", "stream_options", "stop", "seed", "metadata", "user", "ignore_eos"}
# Parameters accepted only at their neutral value, so clients that always send them keep working.
NEUTRAL = {
    "top_p": (1, 1.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None,),
    "response_format": (None, {"type": "text"}),
}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens"} | set(NEUTRAL) - {"best_of", "echo", "suffix"}
COMPLETION_KEYS = COMMON | {"prompt"} | set(NEUTRAL) - {"top_logprobs", "response_format"}


def request_schema(chat: bool) -> dict:
    """JSON Schema of a (chat) completion request body, as published in the OpenAPI document. It states the
    types, ranges and keys `parse_request` accepts; limits that depend on the loaded model (context length,
    max_tokens_limit, vocabulary) are checked there only."""
    nullable = lambda t, **kw: {"type": [t, "null"], **kw}  # noqa: E731
    text = {"type": "string", "minLength": 1}
    props = {
        "model": {"type": "string"},
        "max_tokens": nullable("integer", minimum=1),
        "temperature": nullable("number", minimum=0, maximum=2),
        "n": {"enum": [1, None]},
        "stream": nullable("boolean"),
        "stream_options": nullable("object", properties={"include_usage": {"type": "boolean"}}),
        "stop": {"anyOf": [text, {"type": "array", "items": text, "maxItems": 4}, {"type": "null"}]},
        "seed": nullable("integer", minimum=-(2**63), maximum=2**63 - 1),
        "metadata": nullable("object", additionalProperties={"type": "string"}),
        "user": nullable("string"),
        "ignore_eos": nullable("boolean"),
        **{k: {"enum": list(v)} for k, v in NEUTRAL.items()},
    }
    if chat:
        part = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
        message = {
            "type": "object",
            "required": ["role", "content"],
            "properties": {"role": {"enum": list(ROLES)}, "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}},
        }
        props.update(messages={"type": "array", "items": message, "minItems": 1}, max_completion_tokens=nullable("integer", minimum=1))
    else:
        props["prompt"] = {
            "anyOf": [
                text,
                {"type": "array", "items": text, "minItems": 1, "maxItems": 1},
                {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
            ]
        }
    allowed = CHAT_KEYS if chat else COMPLETION_KEYS
    return {
        "type": "object",
        "required": ["model", "messages" if chat else "prompt"],
        "additionalProperties": False,
        "properties": {k: v for k, v in props.items() if k in allowed},
    }


def openapi_body(chat: bool) -> dict:
    """`openapi_extra` of a generation route: its request body (the handler reads the raw body itself)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": request_schema(chat)}}}}


class APIError(Exception):
    """An HTTP error in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type_, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


@dataclass
class GenParams:
    """A validated generation request."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None  # None: unseeded (the engine samples with the rejection rule)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    domain: str | None = None
    ignore_eos: bool = False  # vLLM's and SGLang's extension: generate max_tokens past EOS


@dataclass
class Limits:
    model_name: str
    aliases: list[str]  # other accepted "model" values
    max_model_len: int  # prompt + max_tokens + block slack must fit
    token_budget: int  # longest prompt one engine step prefills
    block: int  # drafter block size: slack the engine reserves beyond max_tokens
    default_max_tokens: int
    max_tokens_limit: int
    vocab_size: int


def body_limit(limits: Limits) -> int:
    """Largest request body accepted (bytes): a prompt of token_budget tokens at 256 bytes a token (long
    tokens, JSON escapes) plus 64 KiB for the other fields. A larger prompt would be refused anyway, but only
    after tokenizing it on the event loop: 17 s for 10 MB, with every other client stalled."""
    return 256 * limits.token_budget + (1 << 16)


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad JSON or bytes, an integer of > 4300 digits, nesting too deep
        raise bad(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object", code="invalid_json")
    try:  # a lone surrogate escape ("\ud800") is no text: the tokenizer, Parquet and the response JSON refuse it
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise bad(f"request body is not valid Unicode text: {e.reason} at {e.object[e.start : e.end]!r}", code="invalid_json") from None
    return body


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _message_text(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(f"{where} must be an object with 'role' and 'content'", where)
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    if isinstance(content, list):  # content parts: only text parts are supported
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad(f'{where}.content parts must all be {{"type": "text", "text": str}}', f"{where}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_request(body: dict, chat: bool, limits: Limits, encode_chat: Callable, encode_text: Callable) -> GenParams:
    """Validate an OpenAI (chat) completion request -> GenParams; raises APIError (400/404)."""
    allowed = CHAT_KEYS if chat else COMPLETION_KEYS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unsupported parameter(s) {unknown}; supported: {sorted(allowed)}", unknown[0], "unsupported_parameter")
    for key, values in NEUTRAL.items():
        if key in body and body[key] not in values:
            raise bad(f"{key}={body[key]!r} is not supported; omit it or send {values[0]!r}", key, "unsupported_value")
    model = body.get("model")
    if not isinstance(model, str):
        raise bad("'model' is required and must be a string", "model")
    if model != limits.model_name and model not in limits.aliases:
        raise APIError(
            404, f"model {model!r} does not exist; this server serves {limits.model_name!r} (see /v1/models)", "model", "model_not_found"
        )
    n = body.get("n", 1)
    if n is not None and (not _is_int(n) or n != 1):
        raise bad(f"only n=1 is supported, got n={n!r}", "n")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool):
        raise bad("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature  # OpenAI's default
    if not _is_num(temperature) or not 0 <= temperature <= 2:
        raise bad(f"'temperature' must be a number in [0, 2], got {temperature!r}", "temperature")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not -(2**63) <= seed < 2**63):
        raise bad(f"'seed' must be a 64-bit integer, got {seed!r}", "seed")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stops, list) and len(stops) <= 4 and all(isinstance(s, str) and s for s in stops)):
        raise bad("'stop' must be a non-empty string or a list of up to 4 non-empty strings", "stop")
    meta = body.get("metadata") or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise bad('\'metadata\' must be an object of string values, e.g. {"domain": "math"}', "metadata")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("'user' must be a string", "user")
    if body.get("ignore_eos") is not None and not isinstance(body["ignore_eos"], bool):
        raise bad("'ignore_eos' must be a boolean", "ignore_eos")

    ids = _prompt_ids(body, chat, limits, encode_chat, encode_text)
    room = limits.max_model_len - len(ids) - limits.block
    if len(ids) > limits.token_budget:
        raise bad(
            f"the prompt has {len(ids)} tokens; this server prefills at most {limits.token_budget} (engine.token_budget)",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens, room)
    elif not _is_int(max_tokens) or not 1 <= max_tokens <= limits.max_tokens_limit:
        raise bad(f"'{key}' must be an integer in [1, {limits.max_tokens_limit}], got {max_tokens!r}", key)
    if max_tokens < 1 or len(ids) + max_tokens + limits.block > limits.max_model_len:
        raise bad(
            f"this model's maximum context length is {limits.max_model_len} tokens; the prompt has {len(ids)} tokens "
            f"and {key} is {max_tokens} (plus {limits.block} tokens of speculation slack): shorten the prompt "
            f"or lower {key}",
            "messages" if chat else "prompt",
            "context_length_exceeded",
        )
    return GenParams(
        chat,
        ids,
        max_tokens,
        float(temperature),
        seed,
        stops,
        bool(body.get("stream")),
        bool(opts.get("include_usage")),
        meta.get("domain"),
        bool(body.get("ignore_eos")),
    )


def _prompt_ids(body: dict, chat: bool, limits: Limits, encode_chat: Callable, encode_text: Callable) -> list[int]:
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
        try:
            return list(encode_chat([_message_text(m, i) for i, m in enumerate(msgs)]))
        except APIError:
            raise
        except Exception as e:  # the chat template refused the conversation
            raise bad(f"the chat template cannot render these messages: {e}", "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("'prompt' must not be empty", "prompt")
        ids = list(encode_text(prompt))
        if not ids:  # e.g. control characters the tokenizer drops: the engine needs a token to start from
            raise bad("'prompt' has no tokens once tokenized; send text or token ids", "prompt")
        return ids
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if not all(0 <= t < limits.vocab_size for t in prompt):
            raise bad(f"token ids in 'prompt' must be in [0, {limits.vocab_size})", "prompt")
        return list(prompt)
    raise bad("'prompt' must be a non-empty string, a list with one string, or a non-empty list of token ids", "prompt")


# ------------------------------------------------------------------ text


def find_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop string in text, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def stop_rule(decode: Callable[[list[int]], str], stops: list[str]) -> Callable[[list[int]], int | None]:
    """Engine stop callback: output ids -> tokens to keep (through the token completing a stop string) or None.

    Only the tail that can hold a new match is decoded (the tokens committed since the last call plus
    4 tokens per stop character before them), so a long output costs O(new tokens) per step."""
    tail = 4 * max(len(s) for s in stops) + 4
    seen = [0]

    def rule(out: list[int]) -> int | None:
        start = max(0, seen[0] - tail)
        seen[0] = len(out)
        if find_stop(decode(out[start:]), stops) is None:
            return None
        k = len(out)
        while k - 1 > start and find_stop(decode(out[start : k - 1]), stops) is not None:
            k -= 1
        return k

    return rule


class TextStream:
    """Incremental detokenisation: hands out only text that can no longer change.

    Holds back a trailing incomplete UTF-8 character and, with stop strings, the last
    (longest stop - 1) characters, which could still become the start of a stop string."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def _text(self) -> str:
        text = self.decode(self.ids)
        idx = find_stop(text, self.stops)
        if idx is not None:
            self.stopped = True
            return text[:idx]
        return text

    def push(self, ids: list[int]) -> str:
        self.ids += ids
        text = self._text()
        safe = len(text) if self.stopped else len(text) - self.hold
        while not self.stopped and safe > self.sent and text[safe - 1] == "\ufffd":
            safe -= 1
        delta = text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta

    def finish(self) -> str:
        text = self._text()
        delta = text[self.sent :]
        self.sent = len(text)
        return delta


# ------------------------------------------------------------------ responses


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def response(rid: str, model: str, chat: bool, text: str, finish: str, use: dict, stats: dict) -> dict:
    choice = (
        {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        if chat
        else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    )
    return {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": use,
        "adaflash": stats,
    }


def chunk(rid: str, model: str, chat: bool, text: str | None, finish: str | None = None, role: bool = False, **extra) -> dict:
    """One stream chunk; text None with finish None and no role = a choices-less chunk (usage)."""
    choices = []
    if text is not None or finish is not None or role:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        else:
            choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    return {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
