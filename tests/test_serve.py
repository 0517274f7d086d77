"""The OpenAI-compatible server (engine.serve), driven by the official ``openai`` client against a
server started here on 127.0.0.1: its text equals engine.generate's for the same prompt and
parameters, stop strings, concurrent clients, bad requests and clients that leave mid-stream."""
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from engine.generate import generate                       # noqa: E402
from engine.serve import stream                            # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, QUESTION = "The capital of France is", "What is the capital of France?"
LONG = "Once upon a time"          # greedy, SmolLM2 goes on for more than 1500 tokens


class Server:
    """``python -m engine.serve --port 0`` in a subprocess; ``lines`` collects its stderr."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.serve", "--port", "0", *args], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines, self.new = [], queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.url = self.wait_for(r"serving \S+ at (http://\S+/v1)", 600).group(1)

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            self.new.put(line)
        self.new.put(None)

    def wait_for(self, pattern, timeout):
        """The match of the first stderr line (from now on) matching ``pattern``, within ``timeout`` s."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                line = self.new.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            assert line is not None, "the server exited:\n" + "".join(self.lines)
            m = re.search(pattern, line)
            if m:
                return m
        raise AssertionError(f"no stderr line matching {pattern!r} in {timeout} s:\n" + "".join(self.lines))

    def drain(self):
        """Forget the stderr lines so far, for a following ``wait_for``."""
        while not self.new.empty():
            assert self.new.get() is not None, "the server exited:\n" + "".join(self.lines)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=300, max_retries=0)


@pytest.fixture(scope="module")
def ref():
    """The same model in this process: ``ref(ids, max_tokens, **sampling)`` -> (text, ids) by
    engine.generate.generate; ``ref.chat_ids(question)`` the chat-templated prompt's ids."""
    from engine.model import Model
    from engine.weights import default_dtype, default_model_path, load_model
    path = default_model_path()
    cfg, params, tok = load_model(path, default_dtype(path, "cpu"))
    model = Model(cfg, params, backend="cpu")
    eos = tuple(cfg.eos_ids) + ((tok.eos_id,) if tok.eos_id is not None else ())

    class Ref:
        def __call__(self, ids, max_tokens, **kw):
            out, _ = generate(model, tok, ids, max_tokens, eos_ids=eos, **kw)
            return tok.decode(out), out

        def chat_ids(self, question):
            return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]))
    r = Ref()
    r.model, r.tok, r.eos = model, tok, eos
    return r


def model_id(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"] and models[0].object == "model"


def test_completion_equals_generate(client, ref):
    ids = ref.tok.encode(PROMPT)
    text, out = ref(ids, 10)
    r = client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=10, temperature=0)
    assert r.choices[0].text == text and text.strip()
    assert r.choices[0].finish_reason == ("length" if len(out) == 10 else "stop")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), len(out),
                                                                                       len(ids) + len(out))
    chunks = list(client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text
    assert len([c for c in chunks if c.choices[0].text]) > 1               # streamed in pieces, not at once
    assert [c.choices[0].finish_reason for c in chunks][-1] == r.choices[0].finish_reason


def test_chat_completion_equals_generate_chat(client, ref):
    ids = ref.chat_ids(QUESTION)
    text, out = ref(ids, 10)
    msgs = [{"role": "user", "content": QUESTION}]
    r = client.chat.completions.create(model=model_id(client), messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text and text.strip()
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(out))
    chunks = list(client.chat.completions.create(model=model_id(client), messages=msgs, max_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(out)


def test_sampling_parameters_reach_the_sampler(client, ref):
    kw = dict(temperature=0.9, top_p=0.9, seed=11)
    text, _ = ref(ref.tok.encode(PROMPT), 8, top_k=20, **kw)
    got = [client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=8, extra_body={"top_k": 20},
                                     **kw).choices[0].text for _ in range(2)]
    assert got == [text, text]


def test_stop_strings(client, ref):
    text, _ = ref(ref.tok.encode(PROMPT), 10)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want = text[:text.index(stop)]
    r = client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=10, temperature=0,
                                  stop=["never seen", stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=10, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_stream_holds_back_only_possible_stop_starts(ref):
    """A stop string whose start appears in the text but which never matches: everything comes out,
    and no piece ended with text that could still have begun the stop string."""
    ids = ref.tok.encode(PROMPT)
    text, _ = ref(ids, 10)
    stop = text[3:6] + "\x00"
    items = list(stream(ref.model, ref.tok, ids, 10, eos_ids=ref.eos, stop=[stop]))
    assert "".join(t for t, _, _ in items) == text and items[-1][2] in ("length", "stop")
    for t, _, finish in items[:-1]:
        assert not any(t.endswith(stop[:k]) for k in range(1, len(stop))), t


def test_two_clients_at_once(client, ref):
    want = {"completion": ref(ref.tok.encode(PROMPT), 8)[0], "chat": ref(ref.chat_ids(QUESTION), 8)[0]}
    got = {}

    def completion():
        got["completion"] = "".join(c.choices[0].text for c in client.completions.create(
            model=model_id(client), prompt=PROMPT, max_tokens=8, temperature=0, stream=True))

    def chat():
        got["chat"] = client.chat.completions.create(model=model_id(client), max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": QUESTION}]).choices[0].message.content
    threads = [threading.Thread(target=f) for f in (completion, chat)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert got == want


def test_bad_requests_get_4xx_and_the_server_goes_on(server, client, ref):
    r = httpx.post(server.url + "/chat/completions", content=b"{not json", timeout=60)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "JSON" in r.json()["error"]["message"]
    for kw, param in [({"n": 2}, "n"), ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"),
                      ({"max_tokens": -1}, "max_tokens"), ({"stop": ""}, "stop"), ({"prompt": ""}, "prompt")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": model_id(client), "prompt": PROMPT, "max_tokens": 4, **kw})
        assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_id(client), messages=[{"role": "user"}], max_tokens=4)
    assert e.value.body["param"] == "messages[0]"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert model_id(client) in e.value.body["message"]
    r = httpx.get(server.url + "/nowhere", timeout=60)
    assert r.status_code == 404 and "/v1/completions" in r.json()["error"]["message"]
    text, _ = ref(ref.tok.encode(PROMPT), 6)
    assert client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=6,
                                     temperature=0).choices[0].text == text


def test_client_leaving_mid_stream_stops_its_generation(server, client, ref):
    server.drain()
    s = client.completions.create(model=model_id(client), prompt=LONG, max_tokens=400, temperature=0, stream=True)
    pieces = [next(s).choices[0].text for _ in range(2)]
    s.close()
    m = server.wait_for(r"\[completion: \d+ prompt tokens, (\d+) generated, finish (\w+)", 300)
    assert m.group(2) == "cancelled" and int(m.group(1)) < 400 and pieces
    with pytest.raises(httpx.TimeoutException):                # a whole answer whose client gave up waiting
        httpx.post(server.url + "/completions", json={"prompt": LONG, "max_tokens": 1500, "temperature": 0},
                   timeout=1)                                  # 1500 tokens take far longer than 1 s on a CPU
    m = server.wait_for(r"\[completion: \d+ prompt tokens, (\d+) generated, finish (\w+)", 300)
    assert m.group(2) == "cancelled" and int(m.group(1)) < 1500
    text, _ = ref(ref.tok.encode(PROMPT), 6)
    assert client.completions.create(model=model_id(client), prompt=PROMPT, max_tokens=6,
                                     temperature=0).choices[0].text == text
    assert not [line for line in server.lines if "Traceback" in line], "".join(server.lines)


def test_startup_errors_are_one_line(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    for args, needle in [(["--model", str(tmp_path / "missing.gguf")], "missing.gguf"),
                         (["--port", str(port)], str(port))]:
        r = subprocess.run([sys.executable, "-m", "engine.serve", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=300)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    busy.close()
