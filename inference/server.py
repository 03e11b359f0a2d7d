"""`python serve.py`: OpenAI's completions API over batched decoding, and a page that shows S.

POST /v1/completions and GET /v1/models follow OpenAI's API for a base model (errors in its
shape: {"error": {"message", "type", "param", "code"}}), and POST /v1/chat/completions for a chat
fine-tuned one (data/chat.py's template; a base model answers it with a 400); the requests
decode together
(inference/batching.py). GET / is the page (inference/page.html), drawn from three JSON endpoints:
POST /api/attention (S of every layer for a text), POST /api/formula (one layer and head of the
formula, step by step: inference/attention_plot.py's formula_view) and POST /api/causality (how
far each position's next-token distribution moves when one token is replaced). GET /api/info
holds the model's shape, the limits and the jobs decoding and waiting. Nothing else is served.

Safe by default: it binds 127.0.0.1; every request is bounded (body bytes, prompt tokens,
max_tokens, n, jobs queued: 429 past it, page views too); an API key, when set, is required as
`Authorization: Bearer <key>` on /v1 and /api; a client that hangs up cancels its jobs, which leave
the batch at the next step; a bad request gets a 400 naming its field, never a traceback; one
job's failure ends that job alone. A local server is reachable by every web page its user opens,
so a request must name the server's own address as its Host (no DNS rebinding), come from no
other origin, and carry JSON as application/json (a cross-site form cannot send it without the
browser asking first); a client has `timeout_keep_alive` seconds to finish its headers, then
body_timeout_s for its body, and past max_connections open a request gets a 503.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import hmac
import json
import logging
import os
import re
import secrets
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import torch
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from tiktoken import Encoding
from uvicorn.protocols.http.h11_impl import H11Protocol

from base.errors import ConfigError, check, is_int, positive, user_errors
from base.files import read_utf8
from checkpoints.store import GPT2_NAMES, find_checkpoint, load_source
from data.chat import IM_END, IM_START, generation_prompt, render, text_of
from hardware.device import configure_backends, decoding_dtype, quantize_setting, resolve_device
from inference.attention_plot import formula_view, token_labels
from inference.batching import Batcher, Job
from inference.generate import SamplingParams, TextStream
from model import GPT
from model.inspection import attention_probs

PAGE = Path(__file__).with_name("page.html")
KEY_VARIABLE = "CAUSALGPT_API_KEY"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of half a UTF-16 pair


class ApiError(Exception):
    """A request the server refuses (4xx) or failed (5xx): its status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, **headers: str):
        self.status, self.headers = status, headers
        kind = "server_error" if status >= 500 else "invalid_request_error"
        self.body = error_body(message, param, kind)


class Strict(BaseModel):
    """A body with exactly these fields, of exactly these types: "5" is not a number here, so a
    client's mistake is a 400 naming the field, not a guess."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False  # a last chunk, its choices empty, with the request's usage


class Sampling(Strict):
    """The fields completions and chat completions share: OpenAI's, and our own filters. The
    penalties OpenAI defines that we do not implement are accepted at their neutral 0, which
    current clients send (repetition_penalty is ours)."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63)
    user: str | None = None
    top_k: int | None = Field(None, ge=1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)


class CompletionRequest(Sampling):
    """OpenAI's completion fields a base model can honour."""

    prompt: str | list[str]
    max_tokens: int = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)


class Message(Strict):
    """A turn; OpenAI's newer forms too: role "developer" (system's new name) is system, and
    content as a list of text parts is their text, joined."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None  # OpenAI's participant name: accepted, not in the chat template

    @field_validator("role")
    @classmethod
    def developer_is_system(cls, role: str) -> str:
        return "system" if role == "developer" else role

    @field_validator("content", mode="before")
    @classmethod
    def text_parts(cls, content: Any) -> Any:
        if isinstance(content := text_of(content), list):  # data/chat.py's, as chat files'
            raise ValueError('only text is supported: parts {"type": "text", "text": "..."}')
        return content


class ChatRequest(Sampling):
    """OpenAI's chat completion fields a chat model can honour; max_tokens: the server's limit
    when not given, as OpenAI's "up to the context"."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # max_tokens' newer name
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5)


class AttentionRequest(Strict):
    """A text, or a conversation (a chat model's) in the chat template: one of the two."""

    text: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)


class FormulaRequest(AttentionRequest):
    """A text or a conversation of at most page_tokens tokens, or ids (the attention view's, as
    the page sends them), and the layer, head and query row to show."""

    ids: list[int] | None = Field(None, min_length=1)
    layer: int = Field(0, ge=0)
    head: int = Field(0, ge=0)
    row: int | None = Field(None, ge=0)  # None: the last token's


class CausalityRequest(Strict):
    ids: list[int] = Field(min_length=1)
    position: int = Field(ge=0)
    replacement: str


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    """OpenAI's error shape, which its clients parse into their exceptions."""
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def cancel(jobs: list[Job]) -> None:
    """Mark the jobs cancelled: the batcher drops each at its next step (a no-op once done)."""
    for job in jobs:
        job.cancelled = True


async def _hang_up(request: Request) -> None:
    """Return when the client disconnects (the body is read by now)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclasses.dataclass
class Reply:
    """One request's completion as its jobs decode: their pieces arrive on `events` (put there
    by the batcher's thread), and go out as server-sent events or as one answer."""

    head: dict  # id, object, created, model
    jobs: list[Job]  # req.n per prompt
    events: asyncio.Queue  # pieces; None: the client hung up
    n: int
    chat: bool
    echoed: list[str]  # completions' echo=true: each choice's prompt, sent first

    async def choices(self) -> AsyncIterator[dict]:
        """Every choice's pieces as they come, until all are finished or the client hangs up (a
        None from the watcher; a stream's task is cancelled by StreamingResponse)."""
        for index, text in enumerate(self.echoed):
            if text:
                yield dict(text=text, index=index, logprobs=None, finish_reason=None)
        left = len(self.jobs)
        while left and (choice := await self.events.get()) is not None:
            if choice["finish_reason"] == "error":
                raise ApiError(500, "decoding failed (the server's log has the traceback)")
            left -= choice["finish_reason"] is not None
            yield choice

    def usage(self) -> dict:
        """The prompts' tokens once each, and every choice's generated tokens."""
        prompt = sum(len(job.ids) for job in self.jobs[:: self.n])
        completion = sum(len(job.tokens) for job in self.jobs)
        return dict(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    async def stream(self, with_usage: bool) -> AsyncIterator[str]:
        """The pieces as server-sent events (stream=true), the usage last if asked for."""
        chunk = {**self.head, "object": "chat.completion.chunk"} if self.chat else self.head
        try:
            if self.chat:  # each choice opens with the role, as OpenAI's chunks do
                for i in range(len(self.jobs)):
                    opening = dict(index=i, delta=dict(role="assistant", content=""))
                    yield f"data: {json.dumps({**chunk, 'choices': [opening]})}\n\n"
            async for choice in self.choices():
                if self.chat:
                    choice["delta"] = {"content": choice.pop("text")}
                yield f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n"
            if with_usage:
                yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': self.usage()})}\n\n"
            yield "data: [DONE]\n\n"
        except ApiError as e:  # the status is sent: the error is an event, as OpenAI's
            yield f"data: {json.dumps(e.body)}\n\n"
        finally:  # finished, or cancelled: the jobs leave the batch at its next step
            cancel(self.jobs)

    async def whole(self, request: Request) -> dict:
        """The pieces merged into one answer; a client that hangs up first cancels its jobs."""
        watcher = asyncio.ensure_future(_hang_up(request))
        watcher.add_done_callback(lambda _: self.events.put_nowait(None))  # ends the wait
        merged = [
            dict(text="", index=i, logprobs=None, finish_reason=None) for i in range(len(self.jobs))
        ]
        try:
            async for piece in self.choices():
                choice = merged[piece["index"]]
                choice["text"] += piece["text"]
                choice["finish_reason"] = piece["finish_reason"]
                for key, value in (piece["logprobs"] or {}).items():
                    choice["logprobs"] = choice["logprobs"] or {}
                    choice["logprobs"].setdefault(key, []).extend(value)
        finally:
            watcher.cancel()
            cancel(self.jobs)
        if self.chat:
            for choice in merged:
                choice["message"] = dict(role="assistant", content=choice.pop("text"))
        return {**self.head, "choices": merged, "usage": self.usage()}


class Server:
    """The model, its tokenizer, the batcher and the limits behind the app's routes."""

    def __init__(
        self,
        model: GPT,
        tokenizer: Encoding,
        name: str,
        limits: dict,
        hosts: set | None,
        quantize: str | None = None,
    ):
        """hosts: the Host headers a request may carry (None: any, for a wildcard address);
        quantize (int8, int4): the batch decodes from the Linear weights in 8 or 4 bits."""
        self.model, self.tokenizer, self.name, self.limits = model, tokenizer, name, limits
        self.keys, self.hosts, self.quantize = limits.pop("api_keys"), hosts, quantize
        self.batcher = Batcher(
            model, tokenizer.eot_token, tokenizer.n_vocab, limits["max_batch"],
            limits["max_queue"], quantize,
        )  # fmt: skip
        # A prompt of more characters than this has more than max_prompt_tokens tokens: refused
        # before it is tokenized
        longest = max(map(len, map(tokenizer.decode_single_token_bytes, range(tokenizer.n_vocab))))
        self.max_prompt_chars = limits["max_prompt_tokens"] * longest
        self.views = ThreadPoolExecutor(1)  # the page's views, one at a time: each uses all cores
        # The views' model: float32 whatever the decoding dtype, so that the numbers the page
        # teaches add up to the digits shown; a copy where the decoding dtype is another. Views
        # register nothing on a model (model/inspection.py): one they share with the batcher
        # (float32 on a GPU) sees none of their work, nor they the batcher's.
        float32 = model.lm_head.weight.dtype == torch.float32
        self.viewed = model if float32 else copy.deepcopy(model).float()  # 4 bytes a weight
        self.viewing = 0  # page views running or waiting
        self.page = PAGE.read_text(encoding="utf-8")
        chat = IM_END in tokenizer.special_tokens_set  # a chat fine-tuned model: its turns
        self.start, self.end = (
            tokenizer.encode_single_token(t) if chat else None for t in (IM_START, IM_END)
        )

    def admit(self, request: Request) -> None:
        """Every route's gate: the server's own Host, no other origin (see the top)."""
        host = request.headers.get("host", "")
        if self.hosts is not None and host not in self.hosts:
            raise ApiError(400, f"this server answers to {sorted(self.hosts)[0]}, not {host!r}")
        origin = request.headers.get("origin")
        if origin is not None and origin != f"{request.url.scheme}://{host}":
            raise ApiError(403, f"requests from other origins ({origin}) are refused")

    def authorize(self, request: Request) -> None:
        """Every API route's gate: the request's key, where keys are set, names its client (each
        key compared in constant time, every one of them); else its peer address does. The
        batcher shares its rows fairly between clients."""
        if not self.keys:
            request.state.client = request.client.host if request.client else ""
            return
        given = request.headers.get("authorization", "").encode()
        matches = [hmac.compare_digest(given, f"Bearer {key}".encode()) for key in self.keys]
        if not any(matches):
            raise ApiError(401, "a valid API key is required: Authorization: Bearer <key>")
        request.state.client = f"key {matches.index(True)}"

    async def parse(self, request: Request, kind: type[Strict]) -> Any:
        """The body as `kind`: at most max_body_bytes of JSON, sent as such, with exactly its
        fields."""
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise ApiError(415, f"send JSON as Content-Type: application/json, not {media!r}")
        try:
            body = await asyncio.wait_for(self.body(request), self.limits["body_timeout_s"])
        except asyncio.TimeoutError:  # the rest is not read: the connection closes after the 408
            deadline = self.limits["body_timeout_s"]
            why = f"the body did not arrive within body_timeout_s={deadline} seconds"
            raise ApiError(408, why, Connection="close") from None
        try:  # UTF-8 only (json.loads would also take UTF-16 and UTF-32 bytes), strictly: a
            # surrogate encoded into the bytes is no UTF-8
            fields = json.loads(text := body.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ApiError(400, f"the body is not UTF-8: {str(e)[:80]}") from None
        except (ValueError, RecursionError) as e:  # RecursionError: [[[[...
            raise ApiError(400, f"the body is not JSON: {str(e)[:80]}") from None
        if not isinstance(fields, dict):
            raise ApiError(400, f"the body must be a JSON object, not {type(fields).__name__}")
        messages, most = fields.get("messages"), self.limits["max_prompt_tokens"]
        if isinstance(messages, list) and len(messages) > most:  # before the slow validation:
            # each message is a token at least
            message = f"{len(messages)} messages, over the {most} tokens of a prompt: send fewer"
            raise ApiError(400, message, "messages")
        if SURROGATE.search(text):  # an escape of half a UTF-16 pair: not Unicode
            for name, value in fields.items():
                try:
                    json.dumps({name: value}, ensure_ascii=False).encode()
                except UnicodeEncodeError:
                    named = name.encode(errors="backslashreplace").decode()  # the answer is UTF-8
                    raise ApiError(
                        400,
                        f"{named} has a lone surrogate (a \\uD800-\\uDFFF escape without its "
                        "pair), which is no Unicode character: send valid Unicode",
                        named,
                    ) from None
        try:
            return kind.model_validate(fields)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"][:1])
            shown = repr(first["input"])[:60]
            raise ApiError(400, f"{param}: {first['msg']} (got {shown})", param) from None

    async def body(self, request: Request) -> bytes:
        """The body's bytes, at most max_body_bytes."""
        body = b""
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > (most := self.limits["max_body_bytes"]):
                    # the rest is not read: the connection closes after the answer
                    raise ApiError(413, f"the body is over {most} bytes", Connection="close")
        except ClientDisconnect:  # gone before its body came: nobody to answer
            raise ApiError(499, "the client closed the request") from None
        return body

    def encode(self, prompt: str | list[Message]) -> list[int]:
        """A prompt's tokens (sample.py's: <|endoftext|> for an empty one), or a conversation's
        in the chat template, asking for the assistant's reply; within the limit."""
        most, chat = self.limits["max_prompt_tokens"], not isinstance(prompt, str)
        param = "messages" if chat else "prompt"
        chars = sum(len(m.content) for m in prompt) if chat else len(prompt)
        if chars > self.max_prompt_chars:
            raise ApiError(400, f"{param} is {chars} characters, over {most} tokens", param)
        if chat:
            ids = generation_prompt([m.model_dump() for m in prompt], self.tokenizer)
        else:
            ids = self.tokenizer.encode_ordinary(prompt) or [self.tokenizer.eot_token]
        if len(ids) > most:
            raise ApiError(400, f"{param} is {len(ids)} tokens, over the limit of {most}", param)
        return ids

    def jobs(
        self, req: CompletionRequest | ChatRequest, prompts: list, emit: Any, client: str = ""
    ) -> list[Job]:
        """One job per prompt (a conversation, for chat) and choice (index prompt * n + choice;
        seed + index) of `client`, checked against the limits. It tokenizes: run it off the
        event loop."""
        for param in ("presence_penalty", "frequency_penalty"):
            if getattr(req, param):
                message = f"{param} is not implemented here: send 0, or use repetition_penalty"
                raise ApiError(400, message, param)
        if req.stream_options is not None and not req.stream:  # OpenAI's 400 too
            raise ApiError(400, "stream_options needs stream: true", "stream_options")
        stop = [req.stop] if isinstance(req.stop, str) else req.stop or []
        max_tokens = req.max_tokens or self.limits["max_tokens"]
        newer = isinstance(req, ChatRequest) and req.max_completion_tokens is not None
        tokens = "max_completion_tokens" if newer else "max_tokens"  # the name the client sent
        budget, spent = self.limits["max_request_tokens"], len(prompts) * req.n * max_tokens
        held = self.limits["max_batch"] + self.limits["max_queue"]
        for param, value, limit, what in [
            (tokens, max_tokens, self.limits["max_tokens"], ""),
            ("n", req.n, self.limits["max_n"], ""),
            ("prompt", len(prompts), self.limits["max_n"], ""),
            ("stop", len(stop), 4, ""),
            ("n", len(prompts) * req.n, held, " completions (n x prompts), max_batch + max_queue"),
            (tokens, spent, budget, f" x n x prompts (max_request_tokens={budget}): ask less"),
        ]:
            if value > limit:
                raise ApiError(400, f"{param} is at most {limit}{what}, got {value}", param)
        if not prompts or not all(stop):
            param = "stop" if prompts else "prompt"
            raise ApiError(400, f"{param} must not be empty", param)
        # Settings as the model can use them, whatever their neighbours in the batch: a top_k
        # past the vocabulary keeps all of it (and stays an int64 in the batch's column); the
        # other fields are bounded by the schema and the limits above
        top_k = None if req.top_k is None else min(req.top_k, self.tokenizer.n_vocab)
        top_p = None if req.top_p == 1 else req.top_p
        params = SamplingParams(req.temperature, top_k, top_p, req.min_p, req.repetition_penalty)
        seed = secrets.randbits(62) if req.seed is None else req.seed
        ids, jobs = [self.encode(p) for p in prompts], []
        for i in range(len(prompts) * req.n):  # each choice: its own generator and text
            gen, text = torch.Generator().manual_seed(seed + i), TextStream(self.tokenizer, stop)
            end = self.end if isinstance(req, ChatRequest) else None
            jobs.append(Job(ids[i // req.n], params, max_tokens, gen, text, emit, end, client))
        return jobs

    def logprobs(self, token: int, logits: torch.Tensor, top: int, chat: bool) -> dict:
        """OpenAI's logprobs of one token, its own and the `top` likeliest: the legacy form of
        completions, or chat's list of {token, logprob, bytes, top_logprobs}."""
        logprobs = logits.float().log_softmax(-1)
        values, ids = logprobs.topk(top)
        pairs = list(zip(ids.tolist(), values.tolist(), strict=True))
        text = self.tokenizer.decode
        if chat:

            def entry(i: int, logprob: float) -> dict:
                piece = self.tokenizer.decode_single_token_bytes(i)
                return dict(token=text([i]), logprob=logprob, bytes=list(piece))

            chosen = entry(token, float(logprobs[token]))
            return {"content": [{**chosen, "top_logprobs": [entry(i, v) for i, v in pairs]}]}
        return {
            "tokens": [text([token])],
            "token_logprobs": [float(logprobs[token])],
            "top_logprobs": [{text([i]): v for i, v in pairs}],
        }

    async def completions(self, request: Request) -> Any:
        """POST /v1/completions."""
        req = await self.parse(request, CompletionRequest)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        return await self.answer(request, req, prompts)

    async def chat_completions(self, request: Request) -> Any:
        """POST /v1/chat/completions: the assistant's next turn, for a chat model alone."""
        if self.end is None:
            raise ApiError(
                400,
                f"{self.name} is a base model without a chat template: use /v1/completions, or "
                "fine-tune it for chat (python train.py experiment=chat_sft)",
                "messages",
            )
        req = await self.parse(request, ChatRequest)
        if req.top_logprobs is not None and not req.logprobs:  # OpenAI's 400 too
            message = "top_logprobs needs logprobs: true (set it, or drop top_logprobs)"
            raise ApiError(400, message, "top_logprobs")
        if len({req.max_tokens, req.max_completion_tokens} - {None}) > 1:
            message = "max_tokens and max_completion_tokens (its newer name) differ: give one"
            raise ApiError(400, message, "max_completion_tokens")
        req.max_tokens = req.max_tokens or req.max_completion_tokens
        return await self.answer(request, req, [req.messages])

    async def answer(self, request: Request, req: CompletionRequest | ChatRequest, prompts: list):
        """Either kind of completion: the jobs go to the batcher; their pieces come back through
        an asyncio queue (the worker thread puts them on this event loop) as events (chat's
        chunks carry a `delta`) or one JSON."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        chat, top = isinstance(req, ChatRequest), req.logprobs  # completions: alternatives or None
        if chat:  # chat: logprobs on or off, and top_logprobs alternatives
            top = (req.top_logprobs or 0) if req.logprobs else None

        def emit(job: Job, text: str, token: int, reason: str | None, logits: torch.Tensor):
            wanted = top is not None and logits is not None  # logits None: decoding failed
            logprobs = self.logprobs(token, logits, top, chat) if wanted else None
            choice = dict(text=text, index=jobs.index(job), logprobs=logprobs, finish_reason=reason)
            loop.call_soon_threadsafe(events.put_nowait, choice)

        jobs = await asyncio.to_thread(self.jobs, req, prompts, emit, request.state.client)
        if not self.batcher.submit(jobs):
            raise ApiError(429, "the server is full; retry in a moment", **{"Retry-After": "1"})
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        kind = "chat.completion" if chat else "text_completion"
        head = dict(id=completion_id, object=kind, created=int(time.time()), model=self.name)
        echoed = [prompts[i // req.n] for i in range(len(jobs))] if not chat and req.echo else []
        reply = Reply(head, jobs, events, req.n, chat, echoed)
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(reply.stream(usage), media_type="text/event-stream")
        return await reply.whole(request)

    async def view(self, request: Request, kind: type[Strict], show: Callable) -> dict:
        """A page view `show(body)` on the views' thread, bounded as completions are: past
        max_queue waiting, a 429; a view whose client leaves before its turn never runs."""
        req = await self.parse(request, kind)
        if self.viewing > self.limits["max_queue"]:
            raise ApiError(429, "page views are busy; retry in a moment", **{"Retry-After": "1"})
        self.viewing += 1
        work = asyncio.get_running_loop().run_in_executor(self.views, show, req)
        gone = asyncio.ensure_future(_hang_up(request))
        try:
            await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ApiError(499, "the client closed the request")
            return work.result()
        finally:
            work.cancel()  # a view not yet started never starts
            gone.cancel()
            self.viewing -= 1

    def attention(self, req: AttentionRequest) -> dict:
        """S of every head of every layer over the text's first page_tokens tokens, or over a
        conversation's last page_tokens (its newest reply), with where each turn starts."""
        page = self.view_tokens(req)
        idx = torch.tensor([page["ids"]], device=self.model.lm_head.weight.device)
        probs = attention_probs(self.viewed, idx)[:, 0].double().cpu()  # (n_layer, nh, T, T)
        heads = probs.mul(1e6).round().div(1e6).tolist()  # 6 decimals: 3 MB at 8 x 4 x 64²
        return {**page, "heads": heads}

    def formula(self, req: FormulaRequest) -> dict:
        """One layer and head of the formula, step by step (formula_view), over `ids` or the
        text's or conversation's tokens, at most page_tokens: a longer one is refused, not cut
        as the attention view cuts it (the page sends that view's ids)."""
        limit = self.limits["page_tokens"]
        if req.ids is None:
            page = self.view_tokens(req)
            param = "text" if req.messages is None else "messages"
            if page["truncated"]:
                why = f"{param} is over page_tokens={limit} tokens: send at most {limit}, or ids"
                raise ApiError(400, why, param)
        elif req.text is not None or req.messages is not None:
            raise ApiError(400, "send one of ids, text or messages", "ids")
        elif not self.page_ids(req.ids):
            raise ApiError(400, f"ids must be at most {limit} of the tokenizer's ids", "ids")
        else:
            page = self.labelled(req.ids)
        idx = torch.tensor([page["ids"]], device=self.model.lm_head.weight.device)
        try:
            view = formula_view(self.viewed, idx, req.layer, req.head, req.row)
        except ConfigError as e:  # a layer, head or row out of range, named
            raise ApiError(400, str(e), e.key) from None
        return {**page, **view}

    def view_tokens(self, req: AttentionRequest) -> dict:
        """The ids a page view shows: the text's first page_tokens tokens, or a conversation's
        last page_tokens (its newest reply), their labels, and where each turn starts."""
        limit = self.limits["page_tokens"]
        if (req.text is None) == (req.messages is None):
            raise ApiError(400, "send either text or messages", "text")
        if req.messages is None:
            every = self.tokenizer.encode_ordinary(req.text) or [self.tokenizer.eot_token]
            ids = every[:limit]
        elif self.end is None:
            raise ApiError(400, f"{self.name} is a base model without a chat template", "messages")
        else:
            messages = [m.model_dump() for m in req.messages]
            every = render(messages, self.tokenizer, generation_prompt=False)[0]
            ids = every[-limit:]
        return self.labelled(ids, truncated=len(every) > len(ids))

    def page_ids(self, ids: list[int]) -> bool:
        """Whether a page view may take `ids`: at most page_tokens of the tokenizer's ids."""
        n_vocab = self.tokenizer.n_vocab
        return len(ids) <= self.limits["page_tokens"] and all(0 <= i < n_vocab for i in ids)

    def labelled(self, ids: list[int], truncated: bool = False) -> dict:
        """ids, their labels, whether they were cut, and where each turn starts."""
        return {
            "ids": ids,
            "tokens": token_labels(self.tokenizer, ids),
            "truncated": truncated,
            "turns": [i for i, token in enumerate(ids) if token == self.start],  # <|im_start|>
        }

    @torch.inference_mode()
    def causality(self, req: CausalityRequest) -> dict:
        """Each position's largest change in its next-token probabilities when the token at
        `position` is replaced: exactly 0 before it, for a causal model (manual attention)."""
        ids, j, limit = req.ids, req.position, self.limits["page_tokens"]
        new = self.tokenizer.encode_ordinary(req.replacement)
        for ok, param, rule in [
            (self.page_ids(ids), "ids", f"at most {limit} of the tokenizer's ids"),
            (j < len(ids), "position", "a position of ids"),
            (len(new) == 1, "replacement", "text that is one token"),
        ]:  # fmt: skip
            if not ok:
                raise ApiError(400, f"{param} must be {rule}", param)
        edited = [*ids[:j], new[0], *ids[j + 1 :]]
        both = torch.tensor([ids, edited], device=self.model.lm_head.weight.device)
        p, q = (self.viewed(x[None])[0][0].softmax(-1) for x in both)  # each alone, as a batch of 1
        diffs = (p - q).abs().amax(-1).tolist()  # (T,)
        return {
            "ids": edited,
            "tokens": token_labels(self.tokenizer, edited),
            "differences": diffs,
            "before": max(diffs[:j], default=0.0),
            "from": max(diffs[j:]),
        }

    def info(self) -> dict:
        """What the page needs before it draws: the model's shape and the limits."""
        c = self.model.config
        dtype = str(self.model.lm_head.weight.dtype).removeprefix("torch.")
        shape = dict(n_layer=c.n_layer, n_head=c.n_head, block_size=c.block_size, dtype=dtype)
        shape["quantize"] = self.quantize  # the decoding's weights (the views': `dtype`)
        counts = {**self.batcher.counts(), "views": self.viewing}
        chat = self.end is not None
        return {"model": self.name, **shape, "chat": chat, "limits": self.limits, **counts}


class HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1, where a request's headers must be complete `timeout_keep_alive`
    seconds after the connection opens or the last answer ends: uvicorn's own keep-alive timer
    stops at the first byte, so a client sending headers a byte at a time (slowloris) would hold
    its connection for ever (nothing in uvicorn, h11 or Starlette bounds a request's headers in
    time). The deadline is per request: armed while none is in flight, cancelled when one's
    headers are in, including a pipelined one that uvicorn starts from its buffer as the
    previous answer ends. A client's doing is its answer, not the log's: uvicorn warns at every
    connection past max_connections (its 503) and every invalid request, which a flood of them
    would fill; errors still show.

    And one address holds at most `per_client` of the connections (max_connections_per_client):
    past it, a connection is answered 503 as it opens and no longer counted, so that one client
    cannot hold every place under uvicorn's max_connections (its limit_concurrency). The answer
    ends with a half close: what the client sends meanwhile is read and dropped until it closes
    or the deadline does (closing on unread bytes would reset the connection, answer unread)."""

    def __init__(self, *args: Any, per_client: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.per_client, self.refused = per_client, False
        self.logger = logging.getLogger("uvicorn.error.clients")
        self.logger.setLevel(logging.ERROR)

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # counted among self.connections, its address known
        self.arm()
        peer = self.client and self.client[0]
        if sum(peer == (c.client and c.client[0]) for c in self.connections) > self.per_client:
            most = f"max_connections_per_client={self.per_client}"
            body = json.dumps(error_body(f"this address has {most} connections open")).encode()
            head = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            head += f"Retry-After: 1\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n"
            transport.write(head.encode() + body)
            transport.write_eof()
            self.connections.discard(self)
            self.refused = True

    def data_received(self, data: bytes) -> None:
        if not self.refused:
            super().data_received(data)

    def on_response_complete(self) -> None:
        self.arm()  # before uvicorn starts a pipelined request, whose headers then cancel it
        super().on_response_complete()

    def arm(self) -> None:
        self.deadline = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are in
            self.deadline.cancel()  # (on a closed connection, uvicorn's handler does nothing)


def create_app(server: Server) -> FastAPI:
    """The routes; no file but the page, no OpenAPI docs (their pages load from the internet)."""
    app = FastAPI(
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,  # a redirect names the Host: no redirects at all
        dependencies=[Depends(server.admit)],
    )
    api = APIRouter(dependencies=[Depends(server.authorize)])

    @app.exception_handler(ApiError)
    async def refused(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body, e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def not_here(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail)), e.status_code)

    @app.exception_handler(Exception)
    async def broken(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body("internal error", kind="server_error"), 500)

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return server.page

    @api.get("/v1/models")
    def models() -> dict:
        card = dict(id=server.name, object="model", created=0, owned_by="causalgpt")
        return {"object": "list", "data": [card]}

    api.post("/v1/completions")(server.completions)
    api.post("/v1/chat/completions")(server.chat_completions)
    api.get("/api/info")(server.info)

    def viewer(kind: type[Strict], show: Callable) -> Callable:
        """The route of the page view `show`, whose body is a `kind`."""

        async def view(request: Request) -> dict:
            return await server.view(request, kind, show)

        return view

    api.post("/api/attention")(viewer(AttentionRequest, server.attention))
    api.post("/api/formula")(viewer(FormulaRequest, server.formula))
    api.post("/api/causality")(viewer(CausalityRequest, server.causality))

    app.include_router(api)
    return app


def limits(cfg: Mapping[str, Any]) -> dict:
    """The limits and the key, checked (before a model is loaded)."""
    lows = dict(max_batch=1, max_queue=0, max_tokens=1, max_n=1, max_body_bytes=1)
    lows |= dict(max_request_tokens=1, max_connections=1, max_connections_per_client=1)
    values = {
        n: check(n, cfg[n], is_int(cfg[n], low), f"an integer >= {low}") for n, low in lows.items()
    }
    values["body_timeout_s"] = positive("body_timeout_s", cfg["body_timeout_s"])
    for n in ("max_prompt_tokens", "page_tokens"):  # null: set by the model's block_size
        values[n] = check(n, cfg[n], cfg[n] is None or is_int(cfg[n], 1), "an integer >= 1 or null")
    per, most = values["max_connections_per_client"], values["max_connections"]
    check("max_connections_per_client", per, per <= most, f"at most max_connections ({most})")
    return {**values, "api_keys": api_keys(cfg)}


def api_keys(cfg: Mapping[str, Any]) -> list[str]:
    """The API keys, one per client: api_key (one, or a list), else the lines of api_key_file
    (blank lines and # comments skipped), else $CAUSALGPT_API_KEY; none: no key required."""
    keys, path = cfg["api_key"], cfg["api_key_file"]
    if keys is not None and path is not None:
        raise ConfigError("api_key and api_key_file are both set: give one")
    if path is not None:
        lines = read_utf8(Path(str(path)).expanduser(), "api_key_file").splitlines()
        keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        check("api_key_file", path, len(keys) > 0, "a file with at least one key")
    keys = keys or os.environ.get(KEY_VARIABLE) or []
    keys = [keys] if isinstance(keys, str) else keys
    ok = isinstance(keys, Sequence) and all(isinstance(k, str) and k for k in keys)
    check("api_key", "<hidden>", ok, "a string, a list of strings, or null")
    return list(keys)


def main(cfg: Mapping[str, Any]) -> int:
    """Serve until interrupted; a bad config exits 2 with one `error:` line."""
    with user_errors():
        host, port, values = str(cfg["host"]), cfg["port"], limits(cfg)
        check("port", port, is_int(port, 0) and port < 65536, "an integer in [0, 65535]")
        named = cfg["allowed_hosts"]
        named = [named] if isinstance(named, str) else named  # one name, bare
        hostnames = "a list of host names like '[myhost.lan, 10.0.0.5]', or null"
        ok = isinstance(named, Sequence) and len(named) > 0
        ok = ok and all(isinstance(n, str) and n for n in named)
        check("allowed_hosts", named, named is None or ok, hostnames)
        if host not in LOOPBACK:
            keyless = "" if values["api_keys"] else f" (no API key: api_key= or {KEY_VARIABLE})"
            warning = f"host={host}: anyone who can reach this port can use the model{keyless}"
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        device = resolve_device(str(cfg["device"]))
        configure_backends(device)
        dtype = decoding_dtype(str(cfg["dtype"]), device)
        quantize = quantize_setting(cfg.get("quantize"))  # .get: a caller's config from before it
        ipv6 = ":" in host
        try:
            family = socket.AF_INET6 if ipv6 else socket.AF_INET
            sock = socket.create_server((host, port), family=family)
        except OSError as e:  # in use, not this machine's address, a privileged port
            why = str(e.strerror).split(" (while attempting")[0]  # create_server's addition
            raise ConfigError(
                f"cannot listen on {host}:{port}: {why}; choose another port= "
                "(port=0: any free one) or host="
            ) from None
        source = cfg["checkpoint"] or find_checkpoint()  # null: the newest run
        ckpt = load_source(source, device, attention="manual")  # the mask explicit: see causality
        model = ckpt.model.to(dtype).eval()
        block = model.config.block_size
        for n, default in (("max_prompt_tokens", block), ("page_tokens", min(64, block))):
            most = f"at most the model's block_size, {block} (or null: {default})"
            values[n] = check(n, values[n], (values[n] or 0) <= block, most) or default
        name = cfg["name"] or model_name(str(source), ckpt.path)
        where = f"{f'[{host}]' if ipv6 else host}:{sock.getsockname()[1]}"
        hosts = allowed_hosts(host, where, named)
        server = Server(model, ckpt.tokenizer(), str(name), values, hosts, quantize)
        if quantize:
            print(f"decoding: weights in {quantize} (quantize={quantize})", file=sys.stderr)
    server.batcher.start()
    print(f"serving {server.name} on http://{where} (the page: http://{where}/)", flush=True)
    uvicorn.Server(uvicorn_config(server)).run(sockets=[sock])
    return 0


def uvicorn_config(server: Server) -> uvicorn.Config:
    """How uvicorn serves the app: the header deadline and the connections per address, and a
    503 for a request that finds max_connections others open (uvicorn counts its own)."""
    return uvicorn.Config(
        create_app(server),
        http=functools.partial(
            HeaderDeadline, per_client=server.limits["max_connections_per_client"]
        ),
        log_level="warning",
        timeout_graceful_shutdown=1,
        limit_concurrency=server.limits["max_connections"] + 1,
    )


def model_name(source: str, path: Path) -> str:
    """The model id clients see: a GPT-2 name as given, else the run directory's name (a
    checkpoint's path is <run>/checkpoints/<name>), else the model directory's."""
    if source in GPT2_NAMES:
        return source
    path = Path(path).resolve()
    return path.parents[1].name if path.parent.name == "checkpoints" else path.name


def allowed_hosts(host: str, where: str, named: Sequence[str] | None) -> set[str] | None:
    """The Host headers a request may carry, each with the port: the names given (the
    allowed_hosts key), else the address served (`where`, host:port), and on loopback its other
    names; None (any) for a wildcard address, which has no one name."""
    served, port = where.rsplit(":", 1)
    names = named or (["127.0.0.1", "localhost", "[::1]"] if host in LOOPBACK else [served])
    if host in ("0.0.0.0", "::") and not named:
        return None
    return {f"{name}:{port}" for name in names}
