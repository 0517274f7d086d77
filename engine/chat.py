"""Chat with a model: python -m engine.chat [--model PATH] [--system TEXT] [options].

Each line is a user turn; the answer streams back.  The conversation goes through the
model's chat template, and the KV cache is kept across turns, so a turn prefills only
its own tokens.  On a terminal, lines are edited with prompt_toolkit (arrows, history);
otherwise they are read plainly from standard input.  Statistics and notices go to stderr.
"""
from __future__ import annotations

import argparse
import sys
import time

from .errors import ModelError, Parser, run_cli
from .sampling import settings_error
from codegen.env import switch

HELP = """commands:
  /reset        forget the conversation (the system prompt stays)
  /system TEXT  set the system prompt, the conversation kept (/system alone removes it)
  /exit         leave (Ctrl-D too)
  /help         this list
Ctrl-C stops an answer; at the prompt it clears the line."""


class _Continuation:
    """The model as ``generate`` sees it: prefill continues the KV cache at ``start``, and the
    ids fed to decode are recorded, so the cache's contents are known even after Ctrl-C: once
    ``started``, positions below ``model.pos`` hold the prompt's ids, then ``fed``."""

    def __init__(self, model, start):
        self.model, self.start, self.fed, self.started = model, start, [], False

    def prefill(self, ids):
        self.model.pos = self.start
        self.started = True
        return self.model.extend(ids)

    def decode(self, token_id):
        self.fed.append(token_id)
        return self.model.decode(token_id)

    @property
    def backend(self):
        return self.model.backend

    def decode_ids(self, token_id, n, **kw):
        """``Model.decode_ids`` (ids drawn on the device), each id fed recorded as it is taken."""
        for nxt in self.model.decode_ids(token_id, n, **kw):
            self.fed.append(token_id)
            token_id = nxt
            yield nxt


class Conversation:
    """A conversation with ``model`` (``engine.model.Model``) through ``tok``'s chat template.

    ``turns`` holds (user, assistant) texts; ``cached`` the token ids that the model's KV cache
    holds at positions 0..len-1 (len <= ``model.pos``).  Each question renders the whole conversation and prefills only
    the ids after the longest prefix it shares with ``cached``.  ``max_tokens`` bounds an answer;
    when the prompt and room for an answer (``max_tokens``, at most half the context) would not
    fit the context, the oldest turns are dropped.
    ``sampling``: ``engine.generate.generate``'s keywords (temperature, top_k, top_p, min_p,
    repeat_penalty, stop, seed)."""

    def __init__(self, model, tok, eos_ids, system=None, max_tokens=512, **sampling):
        self.model, self.tok, self.eos_ids = model, tok, tuple(eos_ids)
        self.system, self.max_tokens, self.sampling = system or None, max_tokens, sampling
        self.turns: list[tuple[str, str]] = []
        self.cached: list[int] = []

    def messages(self, user=None, turns=None) -> list[dict]:
        """The chat messages: the system prompt (if any), ``turns`` (default all), ``user``."""
        m = [{"role": "system", "content": self.system}] if self.system else []
        for u, a in self.turns if turns is None else turns:
            m += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        return m + ([{"role": "user", "content": user}] if user is not None else [])

    def prompt_ids(self, user) -> tuple[list[int], int]:
        """Ids of the conversation with ``user`` next, and how many of the oldest turns were left
        out.  The prompt may take the context less an answer's room; past that, the oldest turns
        go until it takes half of it (or none are left), so that the next few turns again
        continue the KV cache instead of prefilling the whole conversation each time."""
        space = self.model.context - min(self.max_tokens, self.model.context // 2)
        limit = space
        for dropped in range(len(self.turns) + 1):
            text = self.tok.apply_chat_template(self.messages(user, self.turns[dropped:]))
            ids = self.tok.encode(text)
            if len(ids) <= limit:
                break
            limit = space // 2
        return ids, dropped

    def ask(self, user, on_text, on_notice=lambda line: None) -> dict:
        """Answer ``user``, streaming text pieces to ``on_text(piece)``; ``on_notice(line)`` hears
        of turns dropped for room.  The answer joins ``turns``.  Returns generate's stats plus
        prompt_tokens, cached_tokens (not prefilled again) and tokens (generated).

        Raises:
            ModelError: the message alone does not fit the context (nothing is changed).
            KeyboardInterrupt: Ctrl-C; the answer so far (if any) is kept as the turn's answer.
        """
        from .generate import generate
        ids, dropped = self.prompt_ids(user)
        context = self.model.context
        if len(ids) >= context:
            raise ModelError(f"this message makes a prompt of {len(ids)} tokens but the context holds "
                             f"{context}; write less or raise --context")
        if dropped:
            del self.turns[:dropped]
            on_notice(f"context full: dropped the oldest {dropped} turn{'s' * (dropped > 1)} "
                      f"({len(self.turns)} kept)")
        start, reuse = 0, switch("VEGAFUSE_CHAT_REUSE", True)    # 0: prefill it all, for A/B
        while reuse and start < min(len(ids) - 1, len(self.cached)) and ids[start] == self.cached[start]:
            start += 1
        feed, pieces = _Continuation(self.model, start), []

        def text(piece):
            pieces.append(piece)
            on_text(piece)
        self.cached = self.cached[:start]      # a true prefix of the cache, whenever Ctrl-C comes
        try:
            out, stats = generate(feed, self.tok, ids[start:], min(self.max_tokens, context - len(ids)),
                                  eos_ids=self.eos_ids, on_text=text, **self.sampling)
        finally:       # also on Ctrl-C: what the cache holds, and the answer so far
            if feed.started:
                self.cached = (ids + feed.fed)[:self.model.pos]
            if "".join(pieces):
                self.turns.append((user, "".join(pieces)))
        return dict(stats, prompt_tokens=len(ids), cached_tokens=start, tokens=len(out))

    def reset(self):
        """Forget the turns (the system prompt and the KV cache's contents stay usable)."""
        self.turns = []


def read_lines(interactive: bool):
    """Yield the user's lines: through prompt_toolkit on a terminal (line editing, history;
    Ctrl-C clears the line, Ctrl-D ends), else plainly from stdin."""
    if not interactive:
        for line in sys.stdin:
            yield line.rstrip("\n")
        return
    from prompt_toolkit import PromptSession
    session = PromptSession()
    while True:
        try:
            yield session.prompt(">>> ")
        except KeyboardInterrupt:
            continue
        except EOFError:
            return


def parse_args(argv=None):
    """The options of ``engine.chat`` (argparse.Namespace); a bad option prints one line
    ``error: ...`` and exits with status 2."""
    p = Parser("engine.chat", "Chat with a model, turn by turn; the KV cache is kept across turns, so a turn "
               "prefills only its own tokens.", epilog=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", metavar="PATH", help="a GGUF file, a Hugging Face directory, or the id of a "
                   "Hugging Face repo in the local cache (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--system", metavar="TEXT", help="the system prompt (default: none, even where the chat "
                   "template has a default)")
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda", "hip", "reference"],
                   help="where kernels run (default cpu; hip is untested on hardware)")
    p.add_argument("-n", "--max-tokens", metavar="N", type=int, default=512, help="most tokens per answer (default 512)")
    p.add_argument("--temperature", "--temp", metavar="T", type=float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument("--top-k", metavar="K", type=int, default=40,
                   help="keep the k most likely ids; <= 0: no limit (default 40)")
    p.add_argument("--top-p", metavar="P", type=float, default=0.95,
                   help="nucleus sampling mass; 1.0 keeps all (default 0.95)")
    p.add_argument("--min-p", metavar="P", type=float, default=0.0,
                   help="keep the ids at least this likely relative to the most likely one; 0: off (default 0)")
    p.add_argument("--repeat-penalty", metavar="R", type=float, default=1.0,
                   help="divide the logits of recent ids by this (multiply when negative); 1.0: off (default 1.0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end an answer before this text (repeatable)")
    p.add_argument("-s", "--seed", metavar="S", type=int, default=None, help="random seed for sampling")
    p.add_argument("-c", "--context", metavar="N", type=int, default=None,
                   help="KV-cache positions (default min(model, 2048))")
    p.add_argument("--dtype", default=None, choices=["native", "f16", "f32"],
                   help="weights in memory (default native for a GGUF or a GPTQ directory, else f16)")
    p.add_argument("--quant", default=None, choices=["q4_0", "q4_1", "q8_0"],
                   help="quantize every weight matrix and the embedding to this format at load")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32"], help="KV-cache element type (default f16)")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    bad = settings_error(args.temperature, args.top_p, args.min_p, args.repeat_penalty)
    if bad:
        p.error(bad)
    if "" in args.stop:
        p.error("--stop takes a non-empty text")
    if args.seed is not None and args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.context is not None and args.context < 1:
        p.error(f"--context must be at least 1, got {args.context}")
    return args


def main(argv=None):
    return run_cli(run, parse_args(argv))


def run(args):
    from .executable import get_device
    from .model import open_model
    from .models import resolve_model
    path = resolve_model(args.model)              # checked without opening it: a FIFO would block
    get_device(args.backend)                     # a GPU backend that is not there fails before the load
    model, tok, eos = open_model(path, args.backend, args.dtype, args.quant, args.context, args.kv_dtype)
    model.compile()
    chat = Conversation(model, tok, eos, args.system, args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        repeat_penalty=args.repeat_penalty, stop=tuple(args.stop), seed=args.seed)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    note = lambda line: print(f"[{line}]", file=sys.stderr, flush=True)       # noqa: E731
    if interactive:
        note(f"{model.cfg.name or path}, context {model.context} tokens; /help lists the commands")

    def emit(piece):
        sys.stdout.write(piece)
        sys.stdout.flush()
    for line in read_lines(interactive):
        line = line.strip()
        command, _, rest = line.partition(" ")
        if not line:
            continue
        elif command == "/exit":
            return 0
        elif command == "/help":
            print(HELP, flush=True)
        elif command == "/reset":
            chat.reset()
            note("conversation cleared")
        elif command == "/system":
            chat.system = rest.strip() or None
            note("system prompt set" if chat.system else "system prompt removed")
        elif command.startswith("/"):
            note(f"unknown command {command}; /help lists the commands")
        else:
            t0 = time.perf_counter()
            try:                # Ctrl-C anywhere in the turn, up to its stats line, ends the turn only
                s = chat.ask(line, emit, note)
                print(flush=True)
                note(f"{s['prompt_tokens'] - s['cached_tokens']} new prompt tokens ({s['cached_tokens']} cached), "
                     f"prefill {s['prefill_s']:.2f} s; {s['tokens']} generated, "
                     f"{s['decode_tokens_per_s']:.1f} tokens/s; {time.perf_counter() - t0:.2f} s")
            except KeyboardInterrupt:
                print(flush=True)
                note("stopped")
            except ModelError as e:
                note(f"error: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
