"""The interactive chat (``engine.chat``) on SmolLM2 with greedy decoding: through a
pseudo-terminal (pexpect), as a user types it, and with lines piped in; and the KV-cache
continuation it runs on (``Model.extend``) against a fresh prefill of the same ids."""
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

from engine.model import ContextFull, Model
from engine.weights import default_model_path, load_model

try:
    import pexpect
except ImportError:                      # pip install -e ".[test]" brings it
    pexpect = None
pty = pytest.mark.skipif(pexpect is None, reason="the chat's terminal tests need pexpect")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM = "You are a helpful assistant."
ARGS = ["-m", "engine.chat", "--temperature", "0", "--context", "256", "--system", SYSTEM]   # + --max-tokens
STATS = re.compile(r"\[(\d+) new prompt tokens \((\d+) cached\), prefill [\d.]+ s; (\d+) generated")
PROMPT = ">>>"          # prompt_toolkit draws the prompt, then moves the cursor past its space
PROMPT_DONE = "\x1b[?2004l"     # and turns bracketed paste off once it returns the line


@pytest.fixture(scope="module")
def smol():
    return load_model(default_model_path())


def test_extend_matches_a_fresh_prefill(smol):
    check_extend(*smol, backend="cpu")


def check_extend(cfg, params, tok, backend):
    """A continuation prefilled at pos (after a prefill and a decode), and one that rewinds into
    the cache, give the logits of one prefill of all the ids on ``backend``.  Near the cache's end
    the padded bucket would not fit (the clamped KV write would shift over earlier positions), so
    extend runs exact chunks; both cases below take that path.  On a GPU a chunk's row count picks
    its kernels: 16 rows or more the tiled matmul (f16 activations), fewer the GEMVs (q8_1
    activations against a quantized file), so the logits agree to the activations' rounding
    (0.017 at most in a logit of SmolLM2's Q4_1 file, measured on an H200), not to 2e-3."""
    text = ("<|im_start|>user\nMy name is Bob and I live in a small house by the sea.<|im_end|>\n"
            "<|im_start|>assistant\nNice to meet you, Bob! The sea must be lovely.<|im_end|>\n"
            "<|im_start|>user\nWhat is my name?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert 50 < len(ids) < 60, len(ids)
    fresh = Model(cfg, params, backend=backend, context=64, kv_dtype="f32")
    want = np.array(fresh.prefill(ids))
    m = Model(cfg, params, backend=backend, context=64, kv_dtype="f32")
    m.prefill(ids[:36])
    m.decode(ids[36])
    assert m.pos + m.bucket(len(ids) - 37) > m.context          # the padded bucket would not fit
    got = m.extend(ids[37:])
    assert m.pos == len(ids)
    tol = 2e-3 if backend == "cpu" else 3e-2
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert int(np.argmax(got)) == int(np.argmax(want))
    got = m.extend(ids[10:], start=10)         # rewind: 10.. written again, an exact chunk then a padded one
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    with pytest.raises(ContextFull, match="do not fit the KV cache"):
        m.extend(ids[:m.context - m.pos + 1])
    with pytest.raises(Exception, match="outside the cache's positions"):
        m.extend(ids[:2], start=m.pos + 1)


def test_an_answer_stopped_by_ctrl_c_leaves_the_cache_consistent(smol):
    """Ctrl-C (KeyboardInterrupt from the streaming callback) mid-answer: the partial answer stays in
    the conversation, ``cached`` names what the KV cache holds, and the next turn, prefilled on top
    of it, answers as a fresh conversation with the same turns prefilled from scratch does."""
    from engine.chat import Conversation
    cfg, params, tok = smol
    eos = tuple(cfg.eos_ids) + (tok.eos_id,)
    chat = Conversation(Model(cfg, params, context=256, kv_dtype="f32"), tok, eos, SYSTEM, 12, temperature=0)
    seen = []

    def stop_after_three(piece):
        seen.append(piece)
        if len(seen) == 3:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        chat.ask("Write a story about a dragon.", stop_after_three)
    assert chat.turns == [("Write a story about a dragon.", "".join(seen))]
    prompt = tok.encode(tok.apply_chat_template(chat.messages("Write a story about a dragon.", [])))
    assert len(chat.cached) == chat.model.pos == len(prompt) + 2      # two answer ids fed to decode
    assert chat.cached[:len(prompt)] == prompt
    got = []
    stats = chat.ask("Who is in the story?", got.append)
    assert stats["cached_tokens"] > 20
    fresh = Conversation(Model(cfg, params, context=256, kv_dtype="f32"), tok, eos, SYSTEM, 12, temperature=0)
    fresh.turns = list(chat.turns[:1])
    want = []
    assert fresh.ask("Who is in the story?", want.append)["cached_tokens"] == 0
    assert "".join(got) == "".join(want) and "".join(got).strip()


def spawn(*args):
    """The chat on a pseudo-terminal, as a user runs it."""
    env = dict(os.environ, TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1")
    # Ctrl-C as a user's shell leaves it: a test run started in the background inherits SIGINT ignored,
    # and Python keeps an ignored SIGINT ignored, so the chat would never hear the key
    reset = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)      # noqa: E731
    child = pexpect.spawn(sys.executable, ARGS + list(args), cwd=ROOT, env=env, encoding="utf-8",
                          timeout=600, dimensions=(40, 200), preexec_fn=reset)
    child.expect_exact(PROMPT)
    return child


def ask(child, line):
    """Send ``line``; return (answer text, new prompt tokens, cached tokens) once the prompt is back."""
    child.sendline(line)
    child.expect(STATS)
    new, cached = int(child.match.group(1)), int(child.match.group(2))
    answer = child.before.rsplit(PROMPT_DONE, 1)[-1]
    child.expect_exact(PROMPT)
    return answer, new, cached


@pytest.fixture(scope="module")
def session():
    child = spawn("--max-tokens", "24")
    yield child
    child.close(force=True)


@pty
def test_three_turns_the_third_recalls_the_first(session):
    first, _, _ = ask(session, "My name is Bob.")
    ask(session, "Name a fruit.")
    third, new, cached = ask(session, "What is my name?")
    assert "Bob" not in first and "Bob" in third, (first, third)
    assert cached > 60 and new < 25, (new, cached)             # only the new turn was prefilled


@pty
def test_reset_forgets(session):
    session.sendline("/reset")
    session.expect_exact("[conversation cleared]")
    ask(session, "My name is Bob.")
    session.sendline("/reset")
    session.expect_exact("[conversation cleared]")
    answer, _, _ = ask(session, "What is my name?")
    assert answer.strip() and "Bob" not in answer, answer


@pty
def test_system_and_help_commands(session):
    session.sendline("/help")
    session.expect_exact("/system TEXT")
    session.expect_exact(PROMPT)
    session.sendline("/system You are a pirate.")
    session.expect_exact("[system prompt set]")
    _, new, cached = ask(session, "Hello!")
    assert cached < 10 < new, (new, cached)         # prefilled from the new system prompt on (shared "You are a")
    session.sendline("/bogus")
    session.expect_exact("[unknown command /bogus; /help lists the commands]")


@pty
def test_exit_exits_zero(session):
    session.sendline("/exit")
    session.expect(pexpect.EOF)
    session.close()
    assert session.exitstatus == 0


@pty
def test_ctrl_c_stops_the_answer_not_the_session():
    """Ctrl-C once the answer streams: "[stopped]", the prompt again, and the next turn reuses the
    cache.  An answer that ends before the interrupt arrives (a busy machine can hold the test's
    process past the whole answer) prints its stats line instead: then ask again, at most 4 times."""
    child = spawn("--max-tokens", "200")
    for _ in range(4):
        child.sendline("Write a long story about a dragon.")
        child.expect(re.escape(PROMPT_DONE) + r"\W*\w+")          # the answer streams
        child.sendintr()
        if child.expect([re.escape("[stopped]"), STATS]) == 0:
            break
        child.expect_exact(PROMPT)                                 # finished first; Ctrl-C cleared the line
    else:
        pytest.fail("every answer ended before Ctrl-C reached it")
    child.expect_exact(PROMPT)
    answer, new, cached = ask(child, "Thank you!")             # the session goes on, its cache too
    assert answer.strip() and cached > 20, (answer, cached)
    child.sendeof()                                            # Ctrl-D leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_as_an_answer_ends_stops_the_turn_not_the_chat(monkeypatch, capsys):
    """Ctrl-C that lands after the answer's last token, while its stats line is written, ends that
    turn with "[stopped]" (the chat exited with status 130 there); the next line is answered."""
    import io

    from engine import chat as C
    from engine import model as M

    class Stub:
        context, cfg = 256, type("Cfg", (), {"name": "stub"})

        def compile(self):
            pass
    monkeypatch.setattr(M, "open_model", lambda *a: (Stub(), None, [0]))
    asked = []

    def ask(self, user, on_text, on_notice=None):
        asked.append(user)
        on_text(f"answer to {user}")
        return dict(prompt_tokens=9, cached_tokens=2, prefill_s=0.01, tokens=3, decode_tokens_per_s=50.0)
    monkeypatch.setattr(C.Conversation, "ask", ask)
    real_print, calls = print, []

    def print_once_interrupted(*a, **kw):          # the first stats line meets Ctrl-C
        if kw.get("file") is sys.stderr and "new prompt tokens" in str(a[0]) and not calls:
            calls.append(a[0])
            raise KeyboardInterrupt
        real_print(*a, **kw)
    monkeypatch.setattr("builtins.print", print_once_interrupted)
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n/exit\n"))
    assert C.main(["--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    assert asked == ["first", "second"] and calls
    assert err.count("[stopped]") == 1 and err.count("new prompt tokens") == 1, err
    assert "answer to second" in out


def test_piped_lines_and_a_full_context_drop_the_oldest_turns():
    """Without a terminal, lines are read plainly; a context that fills up drops the oldest
    turns, says so on stderr, and the session goes on."""
    questions = ["My name is Bob.", "Name a fruit.", "Name a color.", "Name an animal.", "Name a country.",
                 "Name a city.", "Name a planet.", "What is my name?"]
    r = subprocess.run([sys.executable, *ARGS, "--max-tokens", "24"], cwd=ROOT,
                       input="\n".join(questions) + "\n/exit\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    stats = STATS.findall(r.stderr)
    assert len(stats) == len(questions), r.stderr
    assert re.search(r"\[context full: dropped the oldest \d+ turns? \(\d+ kept\)\]", r.stderr), r.stderr
    assert all(int(new) + int(cached) + 24 <= 256 for new, cached, _ in stats), stats
    assert ">>>" not in r.stdout and r.stdout.count("\n") >= len(questions)
