"""An OpenAI-compatible server: ``python -m engine.serve [--model PATH] [--host H] [--port P]``.

Endpoints ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions``, streamed as
server-sent events (``"stream": true``) or answered whole.  One model; requests wait in a queue
and one worker thread generates for one at a time, so the event loop stays free to accept,
stream and notice clients that went away (their generation stops).  Bad requests get a 4xx with
OpenAI's error JSON; start-up failures (missing model, port in use) print one ``error:`` line
and exit with status 2.  Needs ``pip install 'vegafuse[serve]'`` (FastAPI and uvicorn).
"""
import asyncio
import importlib.util
import json
import os
import queue
import socket
import sys
import threading
import time
import uuid

from .errors import ModelError, Parser, run_cli


def stream(model, tok, prompt_ids, max_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=None,
           eos_ids=(), stop=(), cancelled=lambda: False):
    """:func:`engine.generate.stream` as ``(text, n, finish)`` items: the new text, the ids generated
    so far, and ``None`` until the last item, whose ``finish`` is "stop" (an EOS id, or a ``stop``
    string: the text ends before it), "length" (``max_tokens``) or "cancelled" (``cancelled()``
    turned true: checked before the prefill and after each piece of text).  No repeat penalty:
    OpenAI's requests have none of llama.cpp's kind."""
    from .generate import Finished
    from .generate import stream as generate
    if cancelled():
        yield "", 0, "cancelled"
        return
    pieces = generate(model, tok, prompt_ids, max_tokens, temperature, top_k, top_p, seed=seed, eos_ids=eos_ids,
                      stop=stop, repeat_last_n=0)
    try:
        for item in pieces:
            if isinstance(item, Finished):
                yield "", len(item.ids), item.finish_reason
                return
            n = model.pos - len(prompt_ids) + 1          # the last id sampled is not in the KV cache yet
            finish = "cancelled" if cancelled() else None
            yield item, n, finish
            if finish:
                return
    finally:
        pieces.close()


class RequestError(Exception):
    """A bad request: answered with ``status`` and OpenAI's error JSON naming ``param``."""

    def __init__(self, message, param=None, status=400, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.param, self.status, self.code, self.kind = param, status, code, kind

    def body(self):
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}

    def response(self):
        from fastapi.responses import JSONResponse
        return JSONResponse(self.body(), status_code=self.status)


def _get(body, name, kinds, default, ok=lambda v: True, rule=""):
    """``body[name]`` if it is one of ``kinds`` and passes ``ok``, ``default`` when absent or null;
    otherwise a RequestError saying what ``name`` must be."""
    v = body.get(name)
    if v is None:
        return default
    if (isinstance(v, bool) and bool not in kinds) or not isinstance(v, kinds) or not ok(v):
        raise RequestError(f"'{name}' must be {rule}, got {json.dumps(v)[:60]}", param=name)
    return v


class Engine:
    """One loaded model (``engine.model.Model``, its ``Tokenizer``, the EOS ids) served under
    ``name``, with a queue of requests and the one worker thread that generates for them."""

    def __init__(self, model, tok, eos_ids, name):
        self.model, self.tok, self.eos_ids, self.name = model, tok, tuple(eos_ids), name
        self.created = int(time.time())
        self.jobs, self.closing = queue.Queue(), threading.Event()
        threading.Thread(target=self._work, name="generate", daemon=True).start()

    def _work(self):
        while True:
            loop, out, cancel, kind, ids, opts = self.jobs.get()
            t0, last = time.perf_counter(), ("", 0, "error")
            try:
                stopped = lambda: cancel.is_set() or self.closing.is_set()      # noqa: E731
                for last in stream(self.model, self.tok, ids, eos_ids=self.eos_ids, cancelled=stopped, **opts):
                    loop.call_soon_threadsafe(out.put_nowait, last)
            except Exception as e:                  # reported to its request; the worker goes on
                last = ("", 0, f"error ({type(e).__name__}: {e})")
                try:
                    loop.call_soon_threadsafe(out.put_nowait, e)
                except RuntimeError:                # the event loop is gone (shutting down)
                    pass
            print(f"[{kind}: {len(ids)} prompt tokens, {last[1]} generated, finish {last[2]}, "
                  f"{time.perf_counter() - t0:.2f} s]", file=sys.stderr, flush=True)

    async def events(self, request, kind, ids, opts):
        """Queue one generation; yield its ``(text, n, finish)`` items as they come.  A client
        that disconnects (noticed within 0.5 s, or when a write fails) cancels it."""
        out, cancel = asyncio.Queue(), threading.Event()
        self.jobs.put((asyncio.get_running_loop(), out, cancel, kind, ids, opts))
        checked = time.monotonic()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(out.get(), 0.5)
                except asyncio.TimeoutError:
                    item = None
                if time.monotonic() - checked >= 0.5:
                    checked = time.monotonic()
                    if await request.is_disconnected():
                        return
                if item is None:
                    continue
                if isinstance(item, Exception):
                    raise item
                if item[2] == "cancelled" and self.closing.is_set():
                    raise RequestError("the server is shutting down; send the request again once it is back",
                                       status=503, kind="server_error")
                yield item
                if item[2]:
                    return
        finally:
            cancel.set()

    def prepare(self, body, chat):
        """Check an OpenAI request body (a dict); return ``(prompt_ids, options for stream())``.
        Raises RequestError (400, or 404 for another model) naming the bad parameter."""
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.name:
            raise RequestError(f"model {json.dumps(model)[:60]} is not served here; use \"{self.name}\" "
                               "(see /v1/models)", param="model", status=404, code="model_not_found")
        _get(body, "n", (int,), 1, lambda v: v == 1, "1 (one choice per request)")
        _get(body, "best_of", (int,), 1, lambda v: v == 1, "1")
        _get(body, "echo", (bool,), False, lambda v: not v, "false (echo is not supported)")
        _get(body, "logprobs", (bool, int), None, lambda v: not v, "null (logprobs are not supported)")
        text = self._chat_prompt(body) if chat else None
        ids = self.tok.encode(text) if chat else self._completion_ids(body)
        if not ids:
            raise RequestError("the prompt encodes to no tokens: give some text", param="prompt")
        room = self.model.context - len(ids)
        if room <= 0:
            raise RequestError(f"the prompt has {len(ids)} tokens but the context holds {self.model.context}; "
                               "shorten it", param="messages" if chat else "prompt", code="context_length_exceeded")
        max_tokens = _get(body, "max_tokens", (int,), None, lambda v: v >= 0, "an integer >= 0")
        if chat:
            max_tokens = _get(body, "max_completion_tokens", (int,), max_tokens, lambda v: v >= 0,
                              "an integer >= 0")
        stop = _get(body, "stop", (str, list), [], lambda v: v if isinstance(v, str) else 0 < len(v) <= 4 and all(
            isinstance(s, str) and s for s in v), "a non-empty string or a list of 1 to 4 of them")
        num = (int, float)
        return ids, {
            "max_tokens": min(room, (room if chat else 16) if max_tokens is None else max_tokens),
            "temperature": _get(body, "temperature", num, 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]"),
            "top_p": _get(body, "top_p", num, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
            "top_k": _get(body, "top_k", (int,), 0, rule="an integer (<= 0: no limit)"),
            "seed": _get(body, "seed", (int,), None, lambda v: v >= 0, "an integer >= 0"),
            "stop": [stop] if isinstance(stop, str) else stop}

    def _completion_ids(self, body):
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            p = p[0]
        if isinstance(p, str) and p:
            return self.tok.encode(p)
        if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool)
                                             and 0 <= i < self.tok.vocab_size for i in p):
            return p
        raise RequestError("'prompt' must be a non-empty string (or one list of token ids below the "
                           f"vocabulary size {self.tok.vocab_size}); one prompt per request", param="prompt")

    def _chat_prompt(self, body):
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise RequestError("'messages' must be a non-empty list of {\"role\", \"content\"} objects",
                               param="messages")
        out = []
        for i, m in enumerate(msgs):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list) and all(isinstance(c, dict) and c.get("type") == "text"
                                                 and isinstance(c.get("text"), str) for c in content):
                content = "".join(c["text"] for c in content)
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant") \
                    or not isinstance(content, str):
                raise RequestError(f"messages[{i}] must have a role (system, user or assistant) and a text "
                                   "content", param=f"messages[{i}]")
            out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        try:
            return self.tok.apply_chat_template(out)
        except ModelError as e:
            raise RequestError(str(e), param="messages") from None


async def _body(request):
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e}); send a JSON object") from None


async def _answer(engine, request, chat):
    """One /v1/completions or /v1/chat/completions request, whole or as server-sent events."""
    from fastapi.responses import StreamingResponse
    body = await _body(request)
    ids, opts = engine.prepare(body, chat)
    streaming = _get(body, "stream", (bool,), False, rule="true or false")
    usage_chunk = streaming and bool(_get(body, "stream_options", (dict,), {}, rule="an object").get("include_usage"))
    kind = "chat.completion" if chat else "text_completion"
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
            "object": kind + (".chunk" if chat and streaming else ""), "model": engine.name}

    def choice(text, finish, delta=None):
        c = {"index": 0, "logprobs": None, "finish_reason": finish}
        if not chat:
            c["text"] = text
        elif streaming:
            c["delta"] = delta
        else:
            c["message"] = {"role": "assistant", "content": text}
        return c

    def usage(n):
        return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

    events = engine.events(request, "chat" if chat else "completion", ids, opts)
    if not streaming:
        parts, n, finish = [], 0, None
        async for piece, n, finish in events:
            parts.append(piece)
        return {**head, "choices": [choice("".join(parts), finish)], "usage": usage(n)}

    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

    async def chunks():
        n = 0
        try:
            if chat:
                yield sse({**head, "choices": [choice("", None, {"role": "assistant", "content": ""})]})
            async for piece, n, finish in events:
                if piece:
                    yield sse({**head, "choices": [choice(piece, None, {"content": piece})]})
                if finish:
                    yield sse({**head, "choices": [choice("", finish, {})]})
        except Exception as e:                      # headers are sent: report in the stream
            err = e if isinstance(e, RequestError) else RequestError(f"generation failed: {type(e).__name__}: {e}",
                                                                     status=500, kind="server_error")
            yield sse(err.body())
            return
        if usage_chunk:
            yield sse({**head, "choices": [], "usage": usage(n)})
        yield "data: [DONE]\n\n"
    return StreamingResponse(chunks(), media_type="text/event-stream")


def make_app(engine):
    """The FastAPI application serving ``engine`` (an :class:`Engine`)."""
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException

    app = FastAPI(title="vegafuse", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestError)
    async def bad_request(request, e):
        return e.response()

    @app.exception_handler(HTTPException)
    async def http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return RequestError(f"{request.method} {request.url.path}: {e.detail}; the endpoints are GET /v1/models, "
                            "POST /v1/completions and POST /v1/chat/completions",
                            status=e.status_code, code=code).response()

    @app.exception_handler(Exception)
    async def server_error(request, e):
        return RequestError(f"{type(e).__name__}: {e}", status=500, kind="server_error").response()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "created": engine.created,
                                            "owned_by": "vegafuse"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(engine, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(engine, request, chat=True)
    return app


def parse_args(argv=None):
    """The command line (``argv``: a list of str, default ``sys.argv[1:]``) as an argparse Namespace."""
    p = Parser("engine.serve", __doc__.split("\n")[0].replace("``", ""))
    p.add_argument("-m", "--model", help="a GGUF file, a Hugging Face directory or a repo id in the local Hugging "
                                         "Face cache (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--name", help="the model id clients send (default: the file or directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "hip", "reference"],
                   help="where kernels run (default cpu; hip is untested on hardware)")
    p.add_argument("--context", type=int, default=None, help="KV-cache positions (default min(model, 2048))")
    p.add_argument("--dtype", default=None, choices=["native", "f16", "f32"],
                   help="weights in memory (default native for a GGUF or a GPTQ directory, else f16)")
    p.add_argument("--quant", default=None, choices=["q4_0", "q4_1", "q8_0"],
                   help="quantize every weight matrix and the embedding to this format at load")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"], help="KV-cache element type (default f16)")
    return p.parse_args(argv)


def main(argv=None):
    """The ``vegafuse-serve`` command: serve until Ctrl-C; returns the exit status (2: one ``error:`` line)."""
    return run_cli(run, parse_args(argv))


def _listen(host, port):
    """A socket bound to (host, port), before the model loads, so a taken port fails at once."""
    if not 0 <= port < 65536:
        raise ModelError(f"--port must be in 0..65535, got {port}")
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ModelError(f"cannot listen on {host}:{port} ({e.strerror or e}); "
                         "pick another --port (or --host)") from None
    return sock


def run(args):
    """Bind the port, load the model, compile its decode step and serve; raises ModelError on bad input."""
    if args.context is not None and args.context < 1:
        raise ModelError(f"--context must be at least 1, got {args.context}")
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(f"the server needs {' and '.join(missing)}: pip install 'vegafuse[serve]'")
    sock = _listen(args.host, args.port)          # before anything slow: a taken port fails at once
    import uvicorn
    from .model import open_model
    from .models import resolve_model
    path = resolve_model(args.model)              # checked without opening it: a FIFO would block
    model, tok, eos = open_model(path, args.backend, args.dtype, args.quant, args.context, args.kv_dtype)
    model.compile()
    name = args.name or os.path.basename(os.path.normpath(path)).removesuffix(".gguf")
    engine = Engine(model, tok, eos, name)
    app = make_app(engine)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"serving {name} at http://{shown}:{port}/v1 (OpenAI API, backend {args.backend}); Ctrl-C stops",
          file=sys.stderr, flush=True)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):          # Ctrl-C: end the running and queued generations first
            engine.closing.set()
            super().handle_exit(sig, frame)
    Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
