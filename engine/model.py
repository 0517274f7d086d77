"""A Llama-family model bound to a backend: static KV cache, prefill, decode step.

    m = Model(cfg, params, backend="cpu", context=2048)   # kv_dtype="f16" (default) or "f32"
    logits = m.prefill(prompt_ids)     # f32 [V] for the last prompt token
    logits = m.decode(next_id)         # f32 [V]; the KV cache grows by one position
    logits = m.extend(more_ids)        # a continuation: prefilled at m.pos, the cache before it kept

Prefill pads the prompt to a power-of-two bucket, so a new prompt length rarely
compiles anything; the padded rows sit past the prompt in the cache and are
overwritten by decode before they are ever attended to.  The KV write clamps its
offset so that all T rows fit the cache (as ``dynamic_update_slice`` does), so a
bucket that would run past the cache's end is never launched: ``extend`` then runs
exact power-of-two chunks that fit.
"""
from __future__ import annotations

import time

import numpy as np

import dsl
from stdlib import llama
from stdlib.sampling import sample as draw_token
from stdlib.config import LlamaConfig

from .errors import ModelError
from .executable import get_device


class ContextFull(ModelError):
    """The KV cache has no free position left."""


KV_DTYPES = {"f16": np.float16, "f32": np.float32}


def _device_sampling(sampling) -> dict:
    """``Model.decode_ids``' ``sampling`` dict checked and completed with ``engine.sampling.sample``'s
    defaults: {temperature, top_k, top_p, min_p}.  Raises ModelError naming the bad setting."""
    unknown = sorted(set(sampling) - {"temperature", "top_k", "top_p", "min_p"})
    if unknown:
        raise ModelError(f"sampling on the device takes temperature, top_k, top_p and min_p, not "
                         f"{', '.join(unknown)} (a repeat penalty needs the host's draws)")
    s = dict(dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), **sampling)
    t, k, p, mp = s["temperature"], s["top_k"], s["top_p"], s["min_p"]
    if not 0 < t < np.inf:
        raise ModelError(f"sampling on the device needs 0 < temperature < inf, got {t} (greedy: sampling=None)")
    if not 0 < p <= 1 or not 0 <= mp <= 1:
        raise ModelError(f"sampling on the device needs 0 < top_p <= 1 and 0 <= min_p <= 1, got {p}, {mp}")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ModelError(f"top_k must be an integer (<= 0: no limit), got {k!r}")
    return s


class Model:
    """``cfg`` and ``params`` (``engine.weights.load_model``) on ``backend`` with a static KV cache
    of ``context`` positions per layer, k and v each [Hkv, context, hd] of ``kv_dtype``: "f16"
    (the default on every backend: half the bytes attention streams) or "f32".  The KV write
    rounds k and v to the cache's dtype; attention computes in f32 either way.  Bad ``context``
    or ``kv_dtype`` raise ``ModelError``."""

    def __init__(self, cfg: LlamaConfig, params, backend="cpu", context=None, fusion=None, kv_dtype="f16"):
        self.cfg, self.params, self.backend = cfg, params, backend
        self.context = int(context or min(cfg.max_seq_len, 2048))
        if self.context < 1:
            raise ModelError(f"context must be at least 1, got {self.context}")
        if kv_dtype not in KV_DTYPES:
            raise ModelError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}: pass f16 or f32")
        self.kv_dtype = kv_dtype
        shape = (cfg.n_kv_heads, self.context, cfg.head_dim)
        self.device = get_device(backend)
        put = self.device.put if self.device is not None else (lambda a: a)
        self.cache = [(put(np.zeros(shape, KV_DTYPES[kv_dtype])), put(np.zeros(shape, KV_DTYPES[kv_dtype])))
                      for _ in range(cfg.n_layers)]
        self.pos = 0
        self.compile_s = 0.0              # seconds spent compiling, ahead of time or at the first decode
        self._decode_ready = False

        def forward(params, tokens, pos, last, cache):
            return llama.forward(cfg, params, tokens, pos, last, cache)

        def greedy(params, tokens, pos, last, cache):
            nxt, _, cache = llama.greedy_forward(cfg, params, tokens, pos, last, cache)
            return dsl.reshape(nxt, (1,)), cache
        def sampled(params, tokens, pos, last, cache, uniforms, settings, top_k):
            logits, cache = llama.forward(cfg, params, tokens, pos, last, cache)
            u = dsl.reshape(dsl.take(uniforms, dsl.reshape(pos, (1,))), ())    # this position's draw
            return dsl.reshape(draw_token(logits, u, settings, top_k), (1,)), cache
        # persistent: a later process loads the compiled programs without tracing them
        self.step = dsl.jit(forward, donate_argnums=(4,), backend=backend, fusion=fusion, persistent=True)
        self.greedy_step = dsl.jit(greedy, donate_argnums=(4,), backend=backend, fusion=fusion, persistent=True)
        self.sample_step = dsl.jit(sampled, donate_argnums=(4,), static_argnums=(7,), backend=backend,
                                   fusion=fusion, persistent=True)
        self._draw = self._ring = None            # decode_ids' uniforms and settings; its id ring

    def _run(self, tokens, last):
        logits, self.cache = self.step(self.params, tokens, self.pos, last, self.cache)
        return logits

    def reset(self):
        self.pos = 0

    def prefill(self, ids) -> np.ndarray:
        """Run the prompt ``ids`` (list of ints) from position 0; returns f32 logits [V]."""
        n = len(ids)
        if n == 0:
            raise ModelError("the prompt is empty: give some text to continue")
        if n >= self.context:
            raise ModelError(f"the prompt has {n} tokens but the context holds {self.context}; "
                             f"shorten the prompt or raise --context")
        return self.extend(ids, start=0)

    def extend(self, ids, start=None) -> np.ndarray:
        """Prefill ``ids`` (list of ints) as a continuation at positions ``start``.. (default
        ``self.pos``): the KV cache's positions before ``start`` are kept and attended to, so
        a conversation's earlier turns are not prefilled again.  ``start`` may rewind (0 <=
        start <= pos) to drop what the cache holds after it.  Returns f32 logits [V] for the
        last id; ``pos`` becomes start + len(ids).

        Raises:
            ModelError: no ids, or ``start`` outside 0..pos.
            ContextFull: the ids do not fit the cache's free positions.
        """
        start = self.pos if start is None else int(start)
        n = len(ids)
        if n == 0:
            raise ModelError("nothing to prefill: give at least one token id")
        if not 0 <= start <= self.pos:
            raise ModelError(f"start {start} is outside the cache's positions 0..{self.pos}")
        if start + n > self.context:
            raise ContextFull(f"{n} more tokens at position {start} do not fit the KV cache "
                              f"({self.context} positions); raise --context")
        self.pos, done = start, 0
        while done < n:
            rows = self.bucket(n - done) if n - done > 1 else 1     # one id: the decode step's shape
            if self.pos + rows > self.context:
                # padded rows past the cache's end would shift the clamped KV write back over
                # earlier positions: run an exact power-of-two chunk that fits instead
                rows = 1 << (min(n - done, self.context - self.pos).bit_length() - 1)
            real = min(rows, n - done)
            tokens = np.zeros(rows, np.int32)
            tokens[:real] = ids[done:done + real]
            logits = self._run(tokens, real - 1)
            self.pos, done = self.pos + real, done + real
        return logits

    def decode(self, token_id) -> np.ndarray:
        """Append one token at the current position; returns f32 logits [V]."""
        if self.pos >= self.context:
            raise ContextFull(f"the KV cache is full ({self.context} positions); raise --context")
        if not self._decode_ready:
            self.compile()
        logits = self._run(np.array([token_id], np.int32), 0)
        self.pos += 1
        return logits

    def _device_step(self, sampling=None, uniforms=None):
        """The decode step that draws its next id on the device, bound to this model's cache:
        (executable, its token input buffer, its position scalar's name, its next-id buffer).
        ``sampling``: None for greedy (argmax), else a dict of temperature, top_k, top_p, min_p
        (``stdlib.sampling.sample``; the settings and ``uniforms``, f32 [context], one per position,
        are uploaded before binding; top_k selects the program)."""
        args = [self.params, np.zeros(1, np.int32), self.pos, 0, self.cache]
        if sampling is None:
            ex = self.greedy_step.compile(*args)
        else:
            dev = self.device
            if self._draw is None:
                self._draw = (dev.empty((self.context,), "f32"), dev.empty((3,), "f32"))
            dev.copy_in(self._draw[0], uniforms)
            dev.copy_in(self._draw[1], np.array([sampling["temperature"], sampling["top_p"],
                                                 sampling["min_p"]], np.float32))
            args += list(self._draw)
            ex = self.sample_step.compile(*args, int(sampling["top_k"]))
        bufs = ex.bind(*dsl.tree_flatten(args)[0])
        tokens = bufs[ex.plan.inputs[len(dsl.tree_flatten(self.params)[0])]]
        pos_name = [name for name in ex.plan.inputs if name in ex.plan.scalars][0]
        return ex, tokens, pos_name, ex.output_buffers()[0]

    def decode_greedy(self, token_id, n):
        """Greedy-decode ``n`` tokens after ``token_id`` with everything on the device: the argmax
        runs in a kernel, its id is copied device-to-device into the next step's input, the
        position advances in device memory, and the host waits once at the end.  Returns the ids."""
        if self.pos + n > self.context:
            raise ContextFull(f"{n} more tokens do not fit the KV cache ({self.context} positions)")
        ex, tokens, pos_name, nxt = self._device_step()
        dev = self.device
        dev.copy_in(tokens, np.array([token_id], np.int32))
        ids = dev.empty((n,), "i32")
        for i in range(n):
            ex.set_scalar(pos_name, self.pos)
            ex.launch()
            dev.copy(tokens, nxt, 4)
            dev.copy(ids.ptr + 4 * i if hasattr(ids, "ptr") else ids[i:i + 1], nxt, 4)
            self.pos += 1
        return [int(x) for x in dev.to_host(ids)]

    def decode_ids(self, token_id, n, sampling=None, rng=None, lag=4):
        """Yield up to ``n`` ids decoded after ``token_id``, each drawn on the device.

        Each step's id comes from a kernel (argmax, or ``stdlib.sampling.sample`` when ``sampling``
        is a dict of temperature, top_k, top_p, min_p, as ``engine.sampling.sample`` takes them and
        with its defaults, with one uniform number a step drawn from ``rng``, an
        ``np.random.Generator``, and uploaded up front).  It is copied on the device into the next
        step's input and asynchronously into pinned host memory; the host reads it ``lag`` (>= 1)
        steps later, so the GPU never waits for the host, and a captured graph replays each step.
        Closing the generator stops decoding: ``pos`` then counts the ids yielded (the steps run
        past them are overwritten by the next decode).  The arguments are checked when it is called.

        Raises:
            ModelError: the reference backend (no device), sampling without ``rng``, a setting out of
                range (temperature not in (0, inf), top_p not in (0, 1], min_p not in [0, 1], top_k
                not an integer, another key), or ``lag`` < 1.
            ContextFull: the KV cache filled before ``n`` ids (the ids that fitted were yielded).
        """
        dev = self.device
        if dev is None or not hasattr(dev, "id_ring"):
            raise ModelError(f"decode_ids runs compiled kernels: the {self.backend} backend has none")
        if sampling is not None:
            sampling = _device_sampling(sampling)
            if rng is None:
                raise ModelError("sampling on the device needs an np.random.Generator")
        if not (isinstance(lag, (int, np.integer)) and lag >= 1):
            raise ModelError(f"lag must be an integer >= 1 (the steps the host reads behind), got {lag!r}")
        return self._ids(token_id, n, sampling, rng, int(lag))

    def _ids(self, token_id, n, sampling, rng, lag):
        """:meth:`decode_ids`' loop, its arguments checked."""
        dev = self.device
        uniforms = rng.random(self.context, dtype=np.float32) if sampling is not None else None
        ex, tokens, pos_name, nxt = self._device_step(sampling, uniforms)         # u for each position
        dev.copy_in(tokens, np.array([token_id], np.int32))
        if self._ring is None or self._ring.n <= lag:
            self._ring = dev.id_ring(max(16, lag + 1))
        ring, start, launched, done = self._ring, self.pos, 0, 0
        try:
            while done < n:
                while launched < n and launched - done < lag and start + launched < self.context:
                    ex.set_scalar(pos_name, start + launched)
                    ex.launch()
                    dev.copy(tokens, nxt, 4)                  # the next step's input, on the device
                    ring.post(launched, nxt)
                    launched += 1
                if done == launched:
                    raise ContextFull(f"the KV cache is full ({self.context} positions); raise --context")
                token = ring.read(done)
                done += 1
                self.pos = start + done
                yield token
        finally:            # pos stays as set above: a generator closed late must not rewind a newer one
            dev.synchronize()

    def bucket(self, n):
        """Padded prefill length for an n-token prompt: a power of two, at least 8."""
        return min(self.context, max(8, 1 << (n - 1).bit_length()))

    def compile(self, n_prompt=None, decode=True):
        """Compile the prefill bucket of an n_prompt-token prompt and the decode step ahead of time;
        returns the decode executable (``.fusion_report()``, ``.kernels``).  ``decode=False``: the
        prefill bucket only (returns None); the decode step then compiles at the first ``decode``,
        so the first token needs only what the prefill runs.  ``compile_s`` adds up the time."""
        t0 = time.perf_counter()
        try:
            if n_prompt:
                self.step.compile(self.params, np.zeros(self.bucket(n_prompt), np.int32), 0, 0, self.cache)
            if not decode:
                return None
            ex = self.step.compile(self.params, np.zeros(1, np.int32), 0, 0, self.cache)
            self._decode_ready = True
            return ex
        finally:
            self.compile_s += time.perf_counter() - t0


def open_model(path, backend="cpu", dtype=None, quant=None, context=None, kv_dtype="f16"):
    """``(model, tokenizer, eos_ids)`` for the model file or directory ``path`` on ``backend``
    (``engine.weights.load_model``; ``dtype`` None: the backend's default for the file, ``quant`` a
    load-time quantization), with a KV cache of ``context`` positions (None: min(model, 2048)).
    eos_ids: the config's and the tokenizer's EOS ids.  Raises ModelError for a bad file or a
    ``context`` beyond the positions the model was trained for."""
    from .weights import default_dtype, load_model
    cfg, params, tok = load_model(path, dtype or default_dtype(path, backend), quant)
    if context is not None and context > cfg.max_seq_len:
        raise ModelError(f"--context {context} exceeds the {cfg.max_seq_len} positions the model was "
                         f"trained for; use --context {cfg.max_seq_len} or less")
    model = Model(cfg, params, backend=backend, context=context, kv_dtype=kv_dtype)
    return model, tok, tuple(cfg.eos_ids) + ((tok.eos_id,) if tok.eos_id is not None else ())
