"""The GPU text of an ``Attention`` statement: flash attention over the KV cache, with the tiles
``codegen.mapping.attention_tiles`` chose (``AttentionTiles``).

A workgroup takes one KV head, a tile of query rows (the group's heads at ``rows_q`` positions) and
one split of the cache.  K/V tiles move through registers (16-byte loads, the next tile's in flight
while this one is computed) into LDS; each row's scores are spread over ``key_lanes`` lanes (online
softmax in base 2: the scale carries log2 e); each thread accumulates output elements of its rows.
The splits' partial rows meet in file-scope buffers, where the last split of each group to finish
combines them (log-sum-exp).  Every number comes from the statement, so the text is the same on
every target with the same mapping; ``render`` returns it as lines, ``globals_of`` the file-scope
declarations.
"""
from __future__ import annotations

import re

from . import loopir as L
from .mapping import merge_blocks

LOG2E = 1.4426950408889634
CTYPE = {"f32": "float", "f16": "vf_half"}

# the names the template declares inside its block: a buffer or position symbol of the same name
# is read through a renamed local (``render``)
LOCALS = ("D", "S", "T", "G", "R", "KT", "CH", "NS", "SHORT", "ch", "q_tile", "k_tile", "v_tile", "p_tile", "rescale",
          "row_max", "row_sum", "last_flag", "kv_head", "tile", "first", "split", "p", "end", "lo", "hi",
          "i", "r", "rr", "t", "u", "j", "c", "d", "r0", "k_next", "v_next", "m", "l", "o", "start", "s", "top",
          "dot", "mx", "mn", "mc", "lc", "oc", "f", "corr", "sum", "pr", "v0", "v1", "v2", "v3", "splits",
          "group", "slot", "at", "w", "acc", "key", "tr", "tk", "H", "RP", "qf", "kf", "pf", "vv", "jj", "e", "head0")


def _indent(lines, n=1):
    return [("  " * n + ln) if ln and not ln.startswith("#") else ln for ln in lines]


def _loop(n, var, body):
    """``for (int var = 0; var < n; ++var)`` around ``body`` (lines), unrolled; for one trip the
    body alone with ``var`` 0 (in a block when it spans several lines, so its locals keep their
    scope)."""
    if n != 1:
        if len(body) == 1:
            return ["#pragma unroll", f"for (int {var} = 0; {var} < {n}; ++{var}) {body[0].strip()}"]
        return ["#pragma unroll", f"for (int {var} = 0; {var} < {n}; ++{var}) {{"] + _indent(body) + ["}"]

    def zero(x):
        x = re.sub(rf"(?<![.\w]){var}\b", "0", x)                            # (not a member: pr.x)
        x = re.sub(r" \+ \w+ \* 0\b| \+ 0 \* \w+", "", x)
        return re.sub(r"\((vf_wave|vf_lane)\)", r"\1", x)
    body = [zero(x) for x in body]
    return [body[0].strip()] if len(body) == 1 else ["{"] + _indent(body) + ["}"]


class Template:
    """The numbers and the text pieces of one attention (``a`` with its tiles)."""

    def __init__(self, a: L.Attention):
        m = self.m = a.tiles
        self.a, (self.qd, self.kd, self.vd) = a, a.dtypes
        self.G, self.D, self.NT, self.NS, self.KT, self.KL = a.hq // a.hkv, a.d, m.threads, m.splits, m.keys, m.key_lanes
        self.R = m.rows_q * self.G
        self.nqt = -(-a.t // m.rows_q)
        self.waves = m.threads // m.wave
        self.RW, self.KPL = m.wave // self.KL, self.KT // self.KL          # rows a wave scores at once, keys per lane
        self.RI = -(-self.R // (self.waves * self.RW))                       # score rows per lane
        self.shared_d = self.NT % self.D == 0                                # a thread keeps one column of several rows
        self.RP = self.NT // self.D if self.shared_d else 0
        self.OI = -(-self.R // self.RP) if self.shared_d else -(-self.R * self.D // self.NT)   # outputs per thread
        self.T1, self.tiled, self.partial_t = a.t == 1, self.nqt > 1, a.t % m.rows_q != 0
        self.clamp_srows = self.R % (self.waves * self.RW) != 0              # score rows past R (lanes reduce together)
        self.kcol = "vf_lane" if self.KL == m.wave else f"vf_lane % {self.KL}"
        self.j = self.kcol if self.KPL == 1 else f"{self.kcol} + {self.KL} * u"
        self.srow = (f"vf_wave + {self.waves} * i" if self.RW == 1
                     else f"(vf_wave + {self.waves} * i) * {self.RW} + vf_lane / {self.KL}")
        # the rows and columns a thread accumulates: r0 + RP * i and d, or pairs threadIdx.x + NT * i
        if self.shared_d:
            clamp = self.R % self.RP != 0
            self.out_row = f"min(r0 + {self.RP} * i, R - 1)" if clamp else f"r0 + {self.RP} * i"
            self.out_col, self.row_ok = "d", f"r0 + {self.RP} * i < R" if clamp else ""
        else:
            uneven = self.R * self.D % self.NT
            pair = f"min((int)threadIdx.x + {self.NT} * i, R * D - 1)" if uneven else f"threadIdx.x + {self.NT} * i"
            self.out_row, self.out_col = f"{pair} / D", f"{pair} % D"
            self.row_ok = f"threadIdx.x + {self.NT} * i < R * D" if uneven else ""
        self.stored = " && ".join(c for c in (self.row_ok, f"{self.t_of('r')} < T" if self.partial_t else "") if c)
        self.group, self.groups = f"kv_head * {self.nqt} + tile" if self.tiled else "kv_head", a.hkv * self.nqt

    # ------------------------------------------------------------------ rows and units
    def t_of(self, r):
        """The query position of tile row ``r``."""
        if self.T1:
            return "0"
        within = r if self.G == 1 else f"{r} / G"
        return f"first + {within}" if self.tiled else within

    def row_index(self, r):
        """The element where row ``r``'s (head, position) starts in q and out."""
        head = "kv_head" if self.G == 1 else f"kv_head * G + {r}" if self.T1 else f"kv_head * G + {r} % G"
        return f"(size_t)({head}) * D" if self.T1 else f"((size_t)({head}) * T + {self.t_of(r)}) * D"

    def h2f(self, dt, e):
        return f"vf_h2f({e})" if dt == "f16" else e

    def units(self, dt):
        """(elements per unit, units per row, the unit's C type) of a K or V row."""
        e = 16 // L.ITEMSIZE[dt] if self.m.vector else 1
        return e, self.D // e, "vf_vec16" if self.m.vector else CTYPE[dt]

    def _moves(self, dt, body):
        """The loop over the units of a K/V tile a thread moves (``body``: lines of i, u)."""
        _, per_row, _ = self.units(dt)
        total = self.KT * per_row
        return _loop(-(-total // self.NT), "u", [f"const int i = threadIdx.x + u * {self.NT}" + body[0]] + body[1:])

    # ------------------------------------------------------------------ pieces
    def header(self):
        a, m, G = self.a, self.m, self.G
        heads = f"{G} query head{'s' if G > 1 else ''}"
        rows = heads if m.rows_q == 1 else f"{m.rows_q} query positions x {heads}"
        split = f"one of {self.NS} splits of {m.chunk} positions; " if self.NS > 1 else "every position; "
        return [f"// {a.hq} query heads over {a.hkv} KV heads, {a.t} query row{'s' if a.t > 1 else ''}, {a.s} cache "
                f"positions, head dim {self.D}.  A workgroup: one KV head,",
                f"// {rows} ({self.R} rows), {split}tiles of {self.KT} positions in LDS"]

    def setup(self):
        a, m, NS = self.a, self.m, self.NS
        consts = [f"D = {self.D}", f"S = {a.s}"] + ([f"T = {a.t}"] if not self.T1 else []) \
            + ([f"G = {self.G}"] if self.G > 1 else []) + [f"R = {self.R}", f"KT = {self.KT}"] \
            + ([f"CH = {m.chunk}", f"NS = {NS}"] if NS > 1 else [])
        rows = "rescale[R], row_sum[R]" + (", row_max[R]" if NS > 1 else "")
        out = [f"constexpr int {', '.join(consts)};",
               "__shared__ float q_tile[R][D] __attribute__((aligned(16)));              // the rows' queries, scaled",
               f"__shared__ {CTYPE[self.kd]} k_tile[KT][D + {16 // L.ITEMSIZE[self.kd]}] __attribute__((aligned(16)));"
               "    // rows 16 bytes apart in the banks",
               f"__shared__ {CTYPE[self.vd]} v_tile[KT][D] __attribute__((aligned(16)));",
               "__shared__ float p_tile[R][KT] __attribute__((aligned(16)));             // the tile's probabilities",
               f"__shared__ float {rows};"]
        if NS > 1:
            out.append("__shared__ int last_flag;")
        out.append("const int vf_lane = threadIdx.x % VF_WAVE, vf_wave = threadIdx.x / VF_WAVE;")
        per = self.nqt * NS
        out.append(f"const int kv_head = blockIdx.x / {per};" if per > 1 else "const int kv_head = blockIdx.x;")
        if self.tiled:
            at = f"blockIdx.x / {NS} % {self.nqt}" if NS > 1 else f"blockIdx.x % {self.nqt}"
            out.append(f"const int tile = {self.nqt - 1} - {at}, first = tile * {m.rows_q};   // the longest tiles start first")
        return out + self.span("1" if self.T1 else (f"min(first + {m.rows_q}, T)" if self.tiled else "T"))

    def span(self, last):
        """The positions the workgroup reads: 0..pos plus its last row (``last``), or its split of them."""
        out = ["const int p = @pos@;", f"const int end = p + {last};    // the tile reads positions 0..pos+t of its last row t"]
        if self.NS > 1:
            return out + ["const int split = blockIdx.x % NS, lo = split * CH, hi = min(lo + CH, end);",
                          "if (lo >= hi) return;        // a split past the position: nothing to read"]
        return out + ["const int lo = 0, hi = end;"]

    def queries(self):
        qv = self.h2f(self.qd, f"@q@[{self.row_index('r')} + i % D]") + f" * {self.a.scale * LOG2E!r}f"
        value = f"{self.t_of('r')} < T ? {qv} : 0.0f" if self.partial_t else qv
        return ["// the rows' queries times the scale and log2(e): the softmax runs in base 2",
                f"for (int i = threadIdx.x; i < R * D; i += {self.NT}) {{", "  const int r = i / D;",
                f"  q_tile[r][i % D] = {value};", "}"]

    def fetch(self, start, what):
        """The K and V rows of the tile at ``start`` into registers (zeros past hi)."""
        out = [f"// {what}"]
        for buf, dt, regs in (("@k@", self.kd, "k_next"), ("@v@", self.vd, "v_next")):
            e, per_row, _ = self.units(dt)
            guard = f"i < KT * {per_row} && " if self.KT * per_row % self.NT else ""
            col = f"i % {per_row} * {e}" if e > 1 else f"i % {per_row}"
            at = f"{buf} + (size_t)(kv_head * S + key) * D + {col}"
            load = f"*(const vf_vec16*)({at})" if self.m.vector else f"{buf}[(size_t)(kv_head * S + key) * D + {col}]"
            zero = "vf_zero16()" if self.m.vector else ("vf_f2h(0.0f)" if dt == "f16" else "0.0f")
            out += self._moves(dt, [f", key = {start} + i / {per_row};", f"{regs}[u] = {zero};",
                                    f"if ({guard}key < hi) {regs}[u] = {load};"])
        return out

    def stash(self):
        """The registers into the LDS tiles."""
        out = []
        for tile, dt, regs in (("k_tile", self.kd, "k_next"), ("v_tile", self.vd, "v_next")):
            e, per_row, _ = self.units(dt)
            col = f"i % {per_row} * {e}" if e > 1 else f"i % {per_row}"
            dst = f"*(vf_vec16*)&{tile}[i / {per_row}][{col}]" if self.m.vector else f"{tile}[i / {per_row}][{col}]"
            guard = f"if (i < KT * {per_row}) " if self.KT * per_row % self.NT else ""
            out += self._moves(dt, [";", f"{guard}{dst} = {regs}[u];"])
        return out

    def scores(self):
        """Each row's scores over the tile on KL lanes, then its online-softmax update."""
        r = "rr" if self.clamp_srows else "r"
        valid = "start + j < hi" if self.T1 else f"start + j < hi && start + j <= p + {self.t_of(r)}"
        dot = (f"for (int d = 0; d < D; d += {self.units(self.kd)[0]}) dot = vf_dot_qk(dot, &q_tile[{r}][d], &k_tile[j][d]);"
               if self.m.vector else
               f"for (int d = 0; d < D; ++d) dot += q_tile[{r}][d] * {self.h2f(self.kd, 'k_tile[j][d]')};")
        guard = " && r < R" if self.clamp_srows else ""
        row = [f"const int r = {self.srow};"]
        if self.clamp_srows:
            row.append("const int rr = min(r, R - 1);      // rows past R compute along (the lanes reduce together)")
        row += [f"float s[{self.KPL}], top = -VF_INF;"]
        row += _loop(self.KPL, "u", [f"const int j = {self.j};", "float dot = 0.0f;", "#pragma unroll 4", dot,
                                     f"s[u] = {valid} ? dot : -VF_INF;", "top = fmaxf(top, s[u]);"])
        row += [f"const float mx = fmaxf(m[i], vf_group_max(top, {self.KL}));",
                "const float corr = mx == -VF_INF ? 1.0f : exp2f(m[i] - mx);   // -inf: no position yet",
                "float sum = 0.0f;"]
        row += _loop(self.KPL, "u", ["const float pr = s[u] == -VF_INF ? 0.0f : exp2f(s[u] - mx);", "sum += pr;",
                                     f"{'if (r < R) ' if self.clamp_srows else ''}p_tile[r][{self.j}] = pr;"])
        row += [f"l[i] = l[i] * corr + vf_group_sum(sum, {self.KL});", "m[i] = mx;",
                f"if ({self.kcol} == 0{guard}) rescale[r] = corr;"]
        keys = "one key" if self.KPL == 1 else f"{self.KPL} keys"
        return ([f"// scores: a row on {self.KL} lanes, each taking {keys} of the tile; online softmax"]
                + _loop(self.RI, "i", row) + ["__syncthreads();"])

    def values(self):
        """Each thread's output elements rescaled, plus the tile's probabilities times its values."""
        v = lambda j, col: self.h2f(self.vd, f"v_tile[{j}][{col}]")  # noqa: E731
        if self.shared_d:
            body = [f"const float v0 = {v('j', 'd')}, v1 = {v('j + 1', 'd')}, v2 = {v('j + 2', 'd')}, v3 = {v('j + 3', 'd')};"]
            body += _loop(self.OI, "i", [f"const vf_float4 pr = *(const vf_float4*)&p_tile[{self.out_row}][j];",
                                         "o[i] += pr.x * v0 + pr.y * v1 + pr.z * v2 + pr.w * v3;"])
        else:
            body = _loop(self.OI, "i", [f"const int r = {self.out_row}, d = {self.out_col};",
                                        "const vf_float4 pr = *(const vf_float4*)&p_tile[r][j];",
                                        f"o[i] += pr.x * {v('j', 'd')} + pr.y * {v('j + 1', 'd')} + pr.z * {v('j + 2', 'd')} "
                                        f"+ pr.w * {v('j + 3', 'd')};"])
        return (["// outputs: each thread's rows times the tile's values"]
                + _loop(self.OI, "i", [f"o[i] *= rescale[{self.out_row}];"])
                + ["#pragma unroll 2", "for (int j = 0; j < KT; j += 4) {"] + _indent(body) + ["}", "__syncthreads();"])

    def main(self):
        """The state, then the loop over the workgroup's tiles."""
        out = [f"{self.units(self.kd)[2]} k_next[{-(-self.KT * self.units(self.kd)[1] // self.NT)}];",
               f"{self.units(self.vd)[2]} v_next[{-(-self.KT * self.units(self.vd)[1] // self.NT)}];"]
        out += self.fetch("lo", "the first tile's K and V rows into registers (zeros past hi), in flight with the queries'")
        out += self.queries()
        out += [f"float m[{self.RI}], l[{self.RI}], o[{self.OI}];"]
        out += _loop(self.RI, "i", ["m[i] = -VF_INF;"]) + _loop(self.RI, "i", ["l[i] = 0.0f;"]) + _loop(self.OI, "i", ["o[i] = 0.0f;"])
        if self.shared_d:
            out.append("const int r0 = threadIdx.x / D, d = threadIdx.x % D;   // this thread's output column and first row")
        tile = self.stash() + ["__syncthreads();"] + self.fetch("start + KT", "the next tile's rows: in flight while this one is computed")
        tile += self.scores() + self.values()
        return out + ["for (int start = lo; start < hi; start += KT) {"] + _indent(tile) + ["}"]

    def finish(self):
        """Each row's sum (and max), then the outputs: divided, or merged with the other splits."""
        keep = "row_sum[r] = l[i];" + (" row_max[r] = m[i];" if self.NS > 1 else "")
        guard = " && r < R" if self.clamp_srows else ""
        out = [f"// each row's sum{' and max' if self.NS > 1 else ''}"]
        out += _loop(self.RI, "i", [f"const int r = {self.srow};", f"if ({self.kcol} == 0{guard}) {{ {keep} }}"])
        out.append("__syncthreads();")
        direct = self.each_output([f"@out@[{self.row_index('r')} + d] = o[i] / row_sum[r];"])
        if self.NS == 1:
            return out + direct
        return out + ["const int splits = (end + CH - 1) / CH;     // the splits that hold positions",
                      "if (splits == 1) {"] + _indent(direct) + ["} else {"] + _indent(self.combine()) + ["}"]

    def each_output(self, body, always=False):
        """``body`` for each output element the thread holds (``r``, ``d``), those past the rows or
        past T left out unless ``always``."""
        d = "" if self.shared_d else f", d = {self.out_col}"
        if self.stored and not always:
            body = [f"if ({self.stored}) {body[0]}"] if len(body) == 1 else [f"if ({self.stored}) {{"] + _indent(body) + ["}"]
        return _loop(self.OI, "i", [f"const int r = {self.out_row}{d};"] + body)

    def combine(self):
        """This split's partial rows to the file-scope buffers; the last split of the group to arrive
        merges every split's (log-sum-exp, online: every load is issued ahead of its use)."""
        o_part, m_part, l_part, arrived = (f"{self.a.out}_{n}" for n in ("o_part", "m_part", "l_part", "arrived"))
        group = self.group
        merge = ["float mx = -VF_INF, sum = 0.0f, acc = 0.0f;", "#pragma unroll 8", "for (int c = 0; c < splits; ++c) {",
                 "  const int at = (group * NS + c) * R + r;",
                 f"  const float mc = vf_load_arrived(&{m_part}[at]), lc = vf_load_arrived(&{l_part}[at]);",
                 f"  const float oc = vf_load_arrived(&{o_part}[(size_t)at * D + d]);",
                 "  const float mn = fmaxf(mx, mc);          // -inf: no position of the row so far",
                 "  const float f = mx == -VF_INF ? 0.0f : exp2f(mx - mn), w = mc == -VF_INF ? 0.0f : exp2f(mc - mn);",
                 "  sum = sum * f + w * lc;", "  acc = acc * f + w * oc;", "  mx = mn;", "}",
                 f"@out@[{self.row_index('r')} + d] = acc / sum;"]
        return (["// this split's partial rows to global memory; the last split of the group to arrive combines them",
                 f"const int group = {group}, slot = group * NS + split;"]
                + self.each_output([f"{o_part}[((size_t)slot * R + r) * D + d] = o[i];"])
                + [f"for (int r = threadIdx.x; r < R; r += {self.NT}) {{ {m_part}[slot * R + r] = row_max[r]; "
                   f"{l_part}[slot * R + r] = row_sum[r]; }}",
                   f"if (vf_last_to_arrive(&{arrived}[group], splits, &last_flag)) {{",
                   "  // the splits' states merged in turn"]
                + _indent(self.each_output(merge)) + ["}"])


class Blocked(Template):
    """The register-blocked prefill template (``a.tiles.block`` = (RM, KN)): ``key_lanes`` = TK lanes
    form a row group; a thread takes RM rows of the tile (``tr * RM + i``) and, of the scores, KN keys
    (``tk + TK * u``: consecutive lanes, consecutive K rows 16 bytes apart in the banks), of the
    outputs the columns ``4 tk + 4 TK g .. + 3``.  Each step over the head dim reads RM query and KN
    key vectors of 16 bytes from LDS for RM x KN x (8 or 4) FMAs; the probabilities go through LDS
    (a row's keys are spread over its row group), then each step over the keys reads RM probability
    vectors and the thread's V columns for RM x columns FMAs.  The two products are the loops a
    matrix-fragment version would replace.  A workgroup takes ``heads`` of the KV group's query heads
    (the others go to other workgroups) at ``rows_q`` positions; K/V tiles, splits and the combine are
    the tiled template's."""

    def __init__(self, a: L.Attention):
        self.H = a.tiles.heads
        super().__init__(a)
        m = self.m
        self.RM, self.KN = m.block
        self.TK = m.key_lanes
        self.NRT, self.RG = self.G // self.H, self.NT // self.TK
        self.R, self.RP = m.rows_q * self.H, self.RM * self.RG          # the rows, padded to the threads' rows
        self.E = 16 // L.ITEMSIZE[self.kd]                                # key elements per 16-byte read
        self.CG = -(-self.D // (4 * self.TK))                             # groups of 4 columns per thread
        self.DC = 4 * self.CG
        self.ragged_d = self.D % (4 * self.TK) != 0
        self.RI, self.OI, self.shared_d, self.clamp_srows = self.RM, self.RM * self.DC, False, False
        self.kcol = "tk"
        self.srow = "tr" if self.RM == 1 else f"tr * {self.RM} + i"
        self.out_row = "tr" if self.RM == 1 else f"tr * {self.RM} + i / {self.DC}"
        self.out_col = "4 * tk + i % 4" if self.CG == 1 else f"4 * tk + {4 * self.TK} * (i % {self.DC} / 4) + i % 4"
        self.row_ok = " && ".join(c for c in ("r < R" if self.RP > self.R else "", "d < D" if self.ragged_d else "") if c)
        self.stored = " && ".join(c for c in (self.row_ok, f"{self.t_of('r')} < T" if self.partial_t else "") if c)
        self.group, self.groups = "blockIdx.x / NS" if self.NS > 1 else "blockIdx.x", a.hkv * self.NRT * self.nqt

    def t_of(self, r):
        within = r if self.H == 1 else f"{r} / H"
        return f"first + {within}" if self.tiled else within

    def row_index(self, r):
        head = "head0" if self.H == 1 else f"head0 + {r} % H"
        return f"((size_t)({head}) * T + {self.t_of(r)}) * D"

    def o(self, c):
        """The accumulator of the thread's row i, column ``c`` of its DC."""
        return f"o[{c}]" if self.RM == 1 else f"o[i * {self.DC} + {c}]"

    def col(self, g):
        """The first of the 4 output columns of the thread's group ``g`` (clamped to the row: the
        columns past D compute along and are not stored)."""
        c = "4 * tk" if self.CG == 1 else f"4 * tk + {4 * self.TK} * {g}"
        return f"min({c}, D - 4)" if self.ragged_d else c

    def header(self):
        a, m = self.a, self.m
        heads = f"{self.H} of its {self.G} query heads" if self.NRT > 1 else f"{self.G} query head{'s' if self.G > 1 else ''}"
        split = f"one of {self.NS} splits of {m.chunk} positions; " if self.NS > 1 else "every position; "
        return [f"// {a.hq} query heads over {a.hkv} KV heads, {a.t} query rows, {a.s} cache positions, head dim {self.D}.  "
                "A workgroup: one KV head,",
                f"// {m.rows_q} query positions x {heads} ({self.R} rows), {split}tiles of {self.KT} positions in LDS;",
                f"// rows of {self.TK} lanes, each lane {self.RM} row{'s' if self.RM > 1 else ''} x {self.KN} key"
                f"{'s' if self.KN > 1 else ''} of the scores and {self.RM} x {self.DC} of the outputs"]

    def setup(self):
        a, m, NS = self.a, self.m, self.NS
        consts = [f"D = {self.D}", f"S = {a.s}", f"T = {a.t}", f"G = {self.G}"] + ([f"H = {self.H}"] if self.H > 1 else []) \
            + [f"R = {self.R}", f"RP = {self.RP}", f"KT = {self.KT}"] + ([f"CH = {m.chunk}", f"NS = {NS}"] if NS > 1 else [])
        rows = "row_sum[RP]" + (", row_max[RP]" if NS > 1 else "")
        out = [f"constexpr int {', '.join(consts)};",
               "__shared__ float q_tile[RP][D + 4] __attribute__((aligned(16)));     // the rows' queries, scaled (zero past R)",
               f"__shared__ {CTYPE[self.kd]} k_tile[KT][D + {16 // L.ITEMSIZE[self.kd]}] __attribute__((aligned(16)));"
               "    // rows 16 bytes apart in the banks",
               f"__shared__ {CTYPE[self.vd]} v_tile[KT][D] __attribute__((aligned(16)));",
               "__shared__ float p_tile[RP][KT + 4] __attribute__((aligned(16)));    // the tile's probabilities",
               f"__shared__ float {rows};"]
        if NS > 1:
            out.append("__shared__ int last_flag;")
        out.append(f"const int tr = threadIdx.x / {self.TK}, tk = threadIdx.x % {self.TK};   // the thread's row group, "
                   "its lane there")
        per, at = self.NRT * self.nqt * NS, "blockIdx.x" if NS == 1 else "blockIdx.x / NS"
        part = f" + {at} / {self.nqt} % {self.NRT} * H" if self.NRT > 1 and self.nqt > 1 else \
            f" + {at} % {self.NRT} * H" if self.NRT > 1 else ""
        out.append(f"const int kv_head = blockIdx.x / {per}, head0 = kv_head * G{part};   // the workgroup's first query head"
                   if per > 1 else f"const int kv_head = blockIdx.x, head0 = kv_head * G{part};")
        if self.tiled:
            out.append(f"const int tile = {self.nqt - 1} - {at} % {self.nqt}, first = tile * {m.rows_q};   "
                       "// the longest tiles start first")
        return out + self.span(f"min(first + {m.rows_q}, T)" if self.tiled else "T")

    def queries(self):
        qv = self.h2f(self.qd, f"@q@[{self.row_index('r')} + i % D]") + f" * {self.a.scale * LOG2E!r}f"
        ok = " && ".join(c for c in ("r < R" if self.RP > self.R else "", f"{self.t_of('r')} < T" if self.partial_t else "") if c)
        value = f"{ok} ? {qv} : 0.0f" if ok else qv
        return ["// the rows' queries times the scale and log2(e): the softmax runs in base 2",
                f"for (int i = threadIdx.x; i < RP * D; i += {self.NT}) {{", "  const int r = i / D;",
                f"  q_tile[r][i % D] = {value};", "}"]

    def scores(self):
        """Each thread's RM x KN scores over the head dim, then each row's online-softmax update on its
        row group; the probabilities to LDS, the thread's outputs rescaled."""
        RM, KN, E, TK = self.RM, self.KN, self.E, self.TK
        row = "tr" if RM == 1 else f"tr * {RM} + i"
        key = "tk" if KN == 1 else f"tk + {TK} * u"
        dot = [f"float qf[{RM}][{E}], kf[{KN}][{E}];"]
        dot += _loop(RM, "i", _loop(E // 4, "e", [f"vf_unpack_f32(*(const vf_vec16*)&q_tile[{row}][d + 4 * e], &qf[i][4 * e]);"]))
        dot += _loop(KN, "u", [f"vf_unpack_{self.kd}(*(const vf_vec16*)&k_tile[{key}][d], kf[u]);"])
        dot += _loop(RM, "i", _loop(KN, "u", _loop(E, "e", ["s[i][u] += qf[i][e] * kf[u][e];"])))
        out = [f"// scores: a lane's {RM} row{'s' if RM > 1 else ''} x {KN} key{'s' if KN > 1 else ''}, 16-byte LDS reads",
               f"float s[{RM}][{KN}];"] + _loop(RM, "i", _loop(KN, "u", ["s[i][u] = 0.0f;"]))
        out += ["#pragma unroll 1", f"for (int d = 0; d < D; d += {E}) {{"] + _indent(dot) + ["}"]
        upd = [f"const int r = {row};", "float top = -VF_INF;"]
        upd += _loop(KN, "u", [f"const int j = start + {key};",
                               f"if (!(j < hi && j <= p + {self.t_of('r')})) s[i][u] = -VF_INF;   // past the split or the row's position",
                               "top = fmaxf(top, s[i][u]);"])
        upd += [f"const float mx = fmaxf(m[i], vf_group_max(top, {TK}));",
                "const float corr = mx == -VF_INF ? 1.0f : exp2f(m[i] - mx);   // -inf: no position yet",
                "float sum = 0.0f;"]
        upd += _loop(KN, "u", ["const float pr = s[i][u] == -VF_INF ? 0.0f : exp2f(s[i][u] - mx);", "sum += pr;",
                               f"p_tile[r][{key}] = pr;"])
        upd += [f"l[i] = l[i] * corr + vf_group_sum(sum, {TK});", "m[i] = mx;"]
        upd += _loop(self.DC, "c", [f"{self.o('c')} *= corr;"])
        return out + [f"// online softmax: each row's max and sum over its {TK} lanes"] + _loop(RM, "i", upd) + ["__syncthreads();"]

    def values(self):
        """Each thread's outputs plus the tile's probabilities of its rows times its V columns."""
        RM, DC = self.RM, self.DC
        row = "tr" if RM == 1 else f"tr * {RM} + i"
        step = ["float vv[%d];" % DC] + _loop(self.CG, "g", [f"vf_lds4(&v_tile[j + jj][{self.col('g')}], &vv[4 * g]);"])
        step += _loop(RM, "i", _loop(DC, "c", [f"{self.o('c')} += pf[i][jj] * vv[c];"]))
        body = [f"float pf[{RM}][4];"] + _loop(RM, "i", [f"vf_unpack_f32(*(const vf_vec16*)&p_tile[{row}][j], pf[i]);"])
        body += _loop(4, "jj", step)
        return ([f"// outputs: a lane's {RM} row{'s' if RM > 1 else ''} x {DC} columns plus the probabilities times the values"]
                + ["for (int j = 0; j < KT; j += 4) {"] + _indent(body) + ["}", "__syncthreads();"])


class Decode:
    """The decode template (T = 1, ``a.tiles.heads`` set): a lane group of ``key_lanes`` lanes owns a
    key at a time, each lane 16 bytes of its K and V rows loaded straight into registers (``unroll``
    keys in flight per group, the next step's loads issued before this step is computed); every lane
    keeps its slice of the workgroup's query rows and output rows in registers with an online
    softmax per group, so the loop has no barrier.  At the end the groups of a wave merge through
    shuffles, the waves through LDS, and the splits as in the tiled template (the last to arrive)."""

    def __init__(self, a: L.Attention):
        m = self.m = a.tiles
        self.a, self.qd, self.kd = a, a.dtypes[0], a.dtypes[1]
        self.G, self.D, self.R, self.NS, self.LK, self.U = a.hq // a.hkv, a.d, m.heads, m.splits, m.key_lanes, m.unroll
        self.E = 16 // L.ITEMSIZE[self.kd]                        # elements per 16-byte load
        self.UNITS = self.D // self.E                               # loads per row
        self.UPL = -(-self.UNITS // self.LK)                        # loads per lane and row
        self.X = self.UPL * self.E                                  # elements of a row a lane keeps
        self.KPW, self.W, self.NRT = m.wave // self.LK, m.threads // m.wave, -(-self.G // self.R)
        self.uneven = self.G % self.R != 0                         # the group's last workgroup takes fewer heads
        self.rows = "RV" if self.uneven else "R"                    # the workgroup's heads that exist
        self.ragged = self.UNITS != self.UPL * self.LK              # lanes past the row's loads
        self.B = merge_blocks(self.NS)                              # splits merged together
        self.NB = -(-self.NS // self.B)
        self.short = m.short > m.chunk and self.NS > 1              # a short context read by one split

    def col(self, x):
        """The row element that a lane's value ``x`` (of X) holds."""
        return f"(c + {self.LK} * ({x} / {self.E})) * {self.E} + {x} % {self.E}" if self.UPL > 1 else f"c * {self.E} + {x}"

    def header(self):
        a, m = self.a, self.m
        split = f"one of {self.NS} splits of {m.chunk} positions" if self.NS > 1 else "every position"
        split += f" (up to {m.short} positions, the first takes them all)" if self.short else ""
        return [f"// {a.hq} query heads over {a.hkv} KV heads, 1 query row, {a.s} cache positions, head dim {self.D}.  A "
                f"workgroup: one KV head, {self.R} query head{'s' if self.R > 1 else ''},",
                f"// {split}; {self.LK} lanes per key (16 bytes each), {self.U} keys in flight per lane group, "
                f"{m.keys} per step of the workgroup"]

    def setup(self):
        a, NS, R = self.a, self.NS, self.R
        consts = [f"D = {self.D}", f"S = {a.s}", f"R = {R}", f"KT = {self.m.keys}"] + ([f"G = {self.G}"] if self.G > 1 else []) \
            + ([f"CH = {self.m.chunk}", f"NS = {NS}"] if NS > 1 else []) + ([f"B = {self.B}"] if self.NB > 1 else []) \
            + ([f"SHORT = {self.m.short}"] if self.short else [])
        out = [f"constexpr int {', '.join(consts)};",
               f"__shared__ float wave_m[{self.W}][R], wave_l[{self.W}][R], wave_o[{self.W}][R][D];   // each wave's state"]
        if NS > 1:
            out += [f"__shared__ float split_m[{max(self.B, self.NB)}][R], split_l[{max(self.B, self.NB)}][R];   "
                    "// the combine: each slot's max and sum, then its weight",
                    "__shared__ int last_flag;"]
        out.append("const int vf_lane = threadIdx.x % VF_WAVE, vf_wave = threadIdx.x / VF_WAVE;")
        per = self.NRT * NS
        kv = f"blockIdx.x / {per}" if per > 1 else "blockIdx.x"
        first = "kv_head * G" if self.G > 1 else "kv_head"
        if self.NRT > 1:
            first += f" + blockIdx.x / {NS} % {self.NRT} * R" if NS > 1 else f" + blockIdx.x % {self.NRT} * R"
        out += [f"const int kv_head = {kv}, head0 = {first};     // the workgroup's first query head"]
        if self.uneven:
            out.append("const int RV = min(R, G - (head0 - kv_head * G));   // its query heads (the group's last workgroup "
                       "takes fewer)")
        out += [
                "const int p = @pos@;", "const int end = p + 1;"]
        if self.short:
            out += ["const int ch = end <= SHORT ? SHORT : CH;   // up to SHORT positions one split reads them all: no combine",
                    "const int split = blockIdx.x % NS, lo = split * ch, hi = min(lo + ch, end);",
                    "if (lo >= hi) return;        // a split past the position: nothing to read"]
        elif NS > 1:
            out += ["const int split = blockIdx.x % NS, lo = split * CH, hi = min(lo + CH, end);",
                    "if (lo >= hi) return;        // a split past the position: nothing to read"]
        else:
            out += ["const int lo = 0, hi = end;"]
        out += [f"const int g = vf_lane / {self.LK}, c = vf_lane % {self.LK};   // the lane's key of a wave's "
                f"{self.KPW}, its first 16 bytes of the row",
                f"const int key0 = vf_wave * {self.U * self.KPW} + g;          // its first key of a step",
                "const vf_vec16* k_row = (const vf_vec16*)(@k@ + (size_t)kv_head * S * D) + c;",
                "const vf_vec16* v_row = (const vf_vec16*)(@v@ + (size_t)kv_head * S * D) + c;"]
        return out

    def fetch(self, start, what):
        """The K and V loads of the step at ``start`` into k_next, v_next (zeros past hi)."""
        ok = "key < hi" + (f" && c + {self.LK} * i < {self.UNITS}" if self.ragged else "")
        at = f"(size_t)key * {self.UNITS} + {self.LK} * i"
        inner = _loop(self.UPL, "i", ["k_next[u][i] = v_next[u][i] = vf_zero16();",
                                      f"if ({ok}) {{ k_next[u][i] = k_row[{at}]; v_next[u][i] = v_row[{at}]; }}"])
        return [f"// {what}"] + _loop(self.U, "u", [f"const int key = {start} + key0 + {self.KPW} * u;"] + inner)

    def queries(self):
        head = "head0 + min(r, RV - 1)" if self.uneven else "head0 + r"     # rows past RV repeat the last
        qv = self.h2f(self.qd, f"@q@[(size_t)({head}) * D + col]") + f" * {self.a.scale * LOG2E!r}f"
        value = f"col < D ? {qv} : 0.0f" if self.ragged else qv
        return ["// the lane's slice of each query row times the scale and log2(e): the softmax runs in base 2",
                f"float qr[R][{self.X}], m[R], l[R], o[R][{self.X}];"] + \
            _loop(self.R, "r", _loop(self.X, "x", [f"const int col = {self.col('x')};", f"qr[r][x] = {value};"])
                  + ["m[r] = -VF_INF;", "l[r] = 0.0f;"] + _loop(self.X, "x", ["o[r][x] = 0.0f;"]))

    def h2f(self, dt, e):
        return f"vf_h2f({e})" if dt == "f16" else e

    def unpack(self, src, dst):
        return _loop(self.UPL, "i", [f"vf_unpack_{self.kd}({src}[u][i], &{dst}[{self.E} * i]);"])

    def step(self):
        """One step: this step's K/V, the next step's loads, scores, online softmax, values."""
        out = [f"vf_vec16 k_cur[{self.U}][{self.UPL}], v_cur[{self.U}][{self.UPL}];"]
        out += _loop(self.U, "u", _loop(self.UPL, "i", ["k_cur[u][i] = k_next[u][i];", "v_cur[u][i] = v_next[u][i];"]))
        out += self.fetch("start + KT", "the next step's loads: in flight while this one is computed")
        score = [f"float kf[{self.X}];"] + self.unpack("k_cur", "kf") + \
            [f"const bool valid = start + key0 + {self.KPW} * u < hi;"] + \
            _loop(self.R, "r", ["float dot = 0.0f;"] + _loop(self.X, "x", ["dot += qr[r][x] * kf[x];"])
                  + [f"s[u][r] = vf_group_sum(dot, {self.LK});", "if (!valid) s[u][r] = -VF_INF;"])
        out += [f"// scores: each key's dot products over its {self.LK} lanes", f"float s[{self.U}][R];   // the scores, then the probabilities"]
        out += _loop(self.U, "u", score)
        row = ["float top = s[0][r];"] + _loop(self.U, "u", ["top = fmaxf(top, s[u][r]);"]) + [
            "const float mx = fmaxf(m[r], top);",
            "const float corr = mx == -VF_INF ? 1.0f : exp2f(m[r] - mx);   // -inf: no position yet",
            "l[r] *= corr;", "m[r] = mx;"] + _loop(self.X, "x", ["o[r][x] *= corr;"]) + \
            _loop(self.U, "u", ["s[u][r] = s[u][r] == -VF_INF ? 0.0f : exp2f(s[u][r] - mx);", "l[r] += s[u][r];"])
        out += ["// online softmax of each row over the group's keys"] + _loop(self.R, "r", row)
        value = [f"float vf[{self.X}];"] + self.unpack("v_cur", "vf") + \
            _loop(self.R, "r", _loop(self.X, "x", ["o[r][x] += s[u][r] * vf[x];"]))
        out += ["// outputs: the probabilities times the values"] + _loop(self.U, "u", value)
        return out

    def main(self):
        out = [f"vf_vec16 k_next[{self.U}][{self.UPL}], v_next[{self.U}][{self.UPL}];"]
        out += self.fetch("lo", "the first step's K and V, in flight with the queries' loads")
        out += self.queries()
        return out + ["for (int start = lo; start < hi; start += KT) {"] + _indent(self.step()) + ["}"] + self.merge_waves()

    def merge_waves(self):
        """The lane groups of each wave merged through shuffles, the waves' states to LDS."""
        row = ["const float mo = vf_shfl_xor(m[r], x), la = vf_shfl_xor(l[r], x), mn = fmaxf(m[r], mo);",
               "const float fa = m[r] == -VF_INF ? 0.0f : exp2f(m[r] - mn), fb = mo == -VF_INF ? 0.0f : exp2f(mo - mn);",
               "l[r] = l[r] * fa + la * fb;", "m[r] = mn;"] + \
            _loop(self.X, "y", ["o[r][y] = o[r][y] * fa + vf_shfl_xor(o[r][y], x) * fb;"])
        out = []
        if self.KPW > 1:
            out += ["// the lane groups of the wave merged (log-sum-exp)", "#pragma unroll",
                    f"for (int x = {self.LK}; x < VF_WAVE; x *= 2) {{"] + _indent(_loop(self.R, "r", row)) + ["}"]
        store = _loop(self.X, "x", [f"const int col = {self.col('x')};",
                                    f"{'if (col < D) ' if self.ragged else ''}wave_o[vf_wave][r][col] = o[r][x];"])
        out += ["// each wave's state to LDS", f"if (vf_lane < {self.LK}) {{"]
        out += _indent(_loop(self.R, "r", ["wave_m[vf_wave][r] = m[r];", "wave_l[vf_wave][r] = l[r];"] + store)) + ["}", "__syncthreads();"]
        return out

    def finish(self):
        """The waves' states merged per output element: divided, or this split's partial rows; then
        the combine (``merge_blocks``: the last split of each block of splits to arrive merges the
        block, the last block merges the blocks)."""
        body = ["const int r = i / D;", "float mx = wave_m[0][r];"] + _loop(self.W - 1, "w", ["mx = fmaxf(mx, wave_m[w + 1][r]);"]) + [
            "float sum = 0.0f, acc = 0.0f;"] + _loop(self.W, "w", [
                "const float f = wave_m[w][r] == -VF_INF ? 0.0f : exp2f(wave_m[w][r] - mx);",
                "sum += f * wave_l[w][r];", "acc += f * wave_o[w][r][i % D];"])
        direct = ("if (i < RV * D) " if self.uneven else "") + "@out@[(size_t)head0 * D + i] = acc / sum;"
        loop = f"for (int i = threadIdx.x; i < R * D; i += {self.m.threads}) {{"
        out = ["// the waves' states merged: a thread per output element"]
        if self.NS == 1:
            return out + [loop] + _indent(body + [direct]) + ["}"]
        part = self.names("part")
        body += ["if (splits == 1) {", "  " + direct, "} else {",
                 f"  {part[0]}[(size_t)blockIdx.x * R * D + i] = acc;",
                 f"  if (i % D == 0) {{ {part[1]}[blockIdx.x * R + r] = mx; {part[2]}[blockIdx.x * R + r] = sum; }}", "}"]
        ch = "ch" if self.short else "CH"
        out = [f"const int splits = (end + {ch} - 1) / {ch};     // the splits that hold positions"] + out + [loop] + _indent(body) + ["}"]
        arrived = f"{self.a.out}_arrived"
        if self.NB == 1:
            return out + [f"if (splits > 1 && vf_last_to_arrive(&{arrived}[blockIdx.x / NS], splits, &last_flag)) {{"] \
                + _indent(self.merge(part, "blockIdx.x / NS * NS", "splits", None)) + ["}"]
        blk = self.names("blk")
        level2 = self.merge(blk, f"group * {self.NB}", "blocks", None)
        level1 = ["const int base = group * NS + block * B, count = min(B, splits - block * B);"] + \
            self.merge(part, "base", "count", "blocks == 1", blk, f"group * {self.NB} + block") + \
            [f"if (blocks > 1 && vf_last_to_arrive(&{arrived}[group], blocks, &last_flag)) {{"] + _indent(level2) + ["}"]
        return out + ["const int group = blockIdx.x / NS, block = split / B, blocks = (splits + B - 1) / B;   // blocks of B splits",
                      f"if (splits > 1 && vf_last_to_arrive(&{arrived}[{self.a.hkv * self.NRT} + group * {self.NB} + block], "
                      "min(B, splits - block * B), &last_flag)) {"] + _indent(level1) + ["}"]

    def names(self, what):
        return tuple(f"{self.a.out}_{n}_{what}" for n in ("o", "m", "l"))

    def merge(self, src, base, count, final, dst=None, slot=None):
        """The last to arrive merges the partial rows ``src`` (o, m, l) of ``count`` slots from ``base``:
        each slot's weight per row into LDS, then the weighted sum of their rows, into the output when
        ``final`` (a C condition; None: always) or else into slot ``slot`` of ``dst``."""
        NT = self.m.threads
        scale = "1.0f / sum" if final is None else f"{final} ? 1.0f / sum : 1.0f"
        weight = ["float mx = -VF_INF, sum = 0.0f;",
                  f"for (int c = 0; c < {count}; ++c) mx = fmaxf(mx, split_m[c][r]);",
                  f"for (int c = 0; c < {count}; ++c) sum += exp2f(split_m[c][r] - mx) * split_l[c][r];",
                  f"const float scale = {scale};",
                  f"for (int c = 0; c < {count}; ++c) split_m[c][r] = exp2f(split_m[c][r] - mx) * scale;"]
        if final is not None:
            weight.append(f"if (!({final})) {{ {dst[1]}[({slot}) * R + r] = mx; {dst[2]}[({slot}) * R + r] = sum; }}")
        to = "@out@ + (size_t)head0 * D" if final is None else f"{final} ? @out@ + (size_t)head0 * D : {dst[0]} + (size_t)({slot}) * R * D"
        acc = ["const int r = i / (D / 4);", "float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;", "#pragma unroll 8",
               f"for (int c = 0; c < {count}; ++c) {{",
               f"  const vf_float4 oc = vf_load_arrived4(&{src[0]}[(size_t)({base} + c) * R * D + 4 * i]);",
               "  const float w = split_m[c][r];",
               "  a0 += w * oc.x; a1 += w * oc.y; a2 += w * oc.z; a3 += w * oc.w;", "}",
               "dst[4 * i] = a0; dst[4 * i + 1] = a1; dst[4 * i + 2] = a2; dst[4 * i + 3] = a3;"]
        return ["// each slot's weight per row, then the weighted sum of their rows",
                f"for (int i = threadIdx.x; i < {count} * R; i += {NT}) {{",
                f"  split_m[i / R][i % R] = vf_load_arrived(&{src[1]}[({base}) * R + i]);",
                f"  split_l[i / R][i % R] = vf_load_arrived(&{src[2]}[({base}) * R + i]);", "}", "__syncthreads();",
                f"for (int r = threadIdx.x; r < R; r += {NT}) {{"] + _indent(weight) + ["}", "__syncthreads();",
                f"float* dst = {to};", f"for (int i = threadIdx.x; i < {self.rows} * D / 4; i += {NT}) {{"] + _indent(acc) + ["}"]

    def globals(self):
        if self.NS == 1:
            return []
        a, groups = self.a, self.a.hkv * self.NRT
        part, blk = groups * self.NS * self.R, groups * self.NB * self.R
        out = [f"// {a.out}: the partial rows (output, max, sum) of each of the {self.NS} splits of the cache"
               + (f" and of each block of {self.B}," if self.NB > 1 else ","),
               "// and how many have arrived per group (zero when the module loads; the last to arrive resets it)",
               f"__device__ float {', '.join(f'{n}[{size}]' for n, size in zip(self.names('part'), (part * a.d, part, part)))};"]
        if self.NB > 1:
            out.append(f"__device__ float {', '.join(f'{n}[{size}]' for n, size in zip(self.names('blk'), (blk * a.d, blk, blk)))};")
        return out + [f"__device__ unsigned int {a.out}_arrived[{groups * (self.NB + 1) if self.NB > 1 else groups}];"]


DECODE_LOCALS = ("RV", "wave_m", "wave_l", "wave_o", "split_m", "split_l", "head0", "g", "key0", "k_row", "v_row", "qr", "x", "y",
                 "col", "k_cur", "v_cur", "kf", "vf", "valid", "la", "mo", "fa", "fb", "a0", "a1", "a2", "a3", "oc", "dst", "B",
                 "base", "count", "block", "blocks", "scale")


def _template(a: L.Attention):
    return Blocked(a) if a.tiles.block else Decode(a) if a.tiles.heads else Template(a)


def render(a: L.Attention, bare) -> list:
    """The lines of the attention ``a`` (mapped: ``a.tiles`` set); ``bare`` spells the position
    expression in C."""
    t = _template(a)
    lines = t.header() + ["{"] + _indent(t.setup() + t.main() + t.finish()) + ["}"]
    text = "\n".join(lines)
    outside = {a.q, a.k, a.v, a.out} | {e.name for e in L.walk_exprs(a.pos) if isinstance(e, L.Sym)}
    for name in set(LOCALS + DECODE_LOCALS) & outside:                       # a local would hide it: rename the local
        text = re.sub(rf"(?<![.\w]){name}\b", name + "_", text)                  # (not a member: pr.x, threadIdx.x)
    text = (text.replace("@q@", a.q).replace("@k@", a.k).replace("@v@", a.v).replace("@out@", a.out)
            .replace("@pos@", bare(a.pos)))
    return text.split("\n")


def lds_banks(k: L.Kernel) -> str:
    """Whether the main loop of a mapped attention kernel reads LDS free of bank conflicts (the
    ``banks`` column of ``codegen.inspect``): the register-blocked prefill's lanes read K rows whose
    16-byte vectors sit an odd number of 16-byte slots apart (8 lanes cover all 32 banks of 4 bytes),
    V and the probabilities as consecutive vectors or broadcasts, "ok"; another stride "check"; "-"
    for the other templates (decode reads no LDS in its key loop)."""
    (a,) = [s for s in k.body if isinstance(s, L.Attention)]
    if not a.tiles.block:
        return "-"
    return "ok" if (a.d * L.ITEMSIZE[a.dtypes[1]] + 16) // 16 % 2 else "check"


def globals_of(a: L.Attention) -> list:
    """File-scope buffers of a split attention: every split's partial rows and, per group of splits,
    how many have arrived (zero when the module loads; the last split sets it back)."""
    t = _template(a)
    if isinstance(t, Decode):
        return t.globals()
    if t.NS == 1:
        return []
    n = t.groups
    part = n * t.NS * t.R
    return [f"// {a.out}: the partial rows (output, max, sum) of each of the {t.NS} splits of the cache, and per",
            "// group of splits how many have arrived (zero when the module loads; the last split resets it)",
            f"__device__ float {a.out}_o_part[{part * a.d}], {a.out}_m_part[{part}], {a.out}_l_part[{part}];",
            f"__device__ unsigned int {a.out}_arrived[{n}];"]
