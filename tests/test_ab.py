"""engine.bench --ab: the A/B/A verdict's arithmetic on known rates, the switch parser's errors,
and one real A/B/A run on the CPU."""
import subprocess
import sys

import pytest

from engine.ab import _child_argv, parse_switch, summarize
from engine.errors import ModelError

from tests.test_model import ROOT


def test_summary_of_known_rates():
    s = summarize([100.0, 104.0, 102.0], [80.0, 81.0, 79.0], [101.0, 103.0, 99.0])
    assert s["A1"] == {"median": 102.0, "min": 100.0, "max": 104.0, "spread": 4.0}
    assert s["B"]["median"] == 80.0 and s["A2"]["median"] == 101.0
    assert s["ratio"] == pytest.approx(80.0 / 101.5)
    assert s["drift"] == pytest.approx(1 / 102) and s["noise"] == pytest.approx(4 / 102) and s["reliable"]
    drifted = summarize([100.0, 101.0], [90.0, 91.0], [110.0, 111.0])   # A moved 10%, repeats 1%
    assert not drifted["reliable"] and drifted["drift"] == pytest.approx(10 / 100.5)


def test_switches_parse_or_fail_with_one_line(monkeypatch):
    assert parse_switch("VEGAFUSE_QUANT_UNROLL=1") == ("VEGAFUSE_QUANT_UNROLL=1", {"VEGAFUSE_QUANT_UNROLL": "1"})
    monkeypatch.setenv("VEGAFUSE_FUSION_OFF", "horizontal")
    assert parse_switch("epilogue")[1] == {"VEGAFUSE_FUSION_OFF": "horizontal,epilogue"}
    for bad, says in (("VEGAFUSE_QUANT_UNROL=1", "not a switch"), ("HOME=1", "not a switch"),
                      ("epilog", "neither a fusion rule"), ("VEGAFUSE_FUSION_OFF=epilogue", "fusion rule's name")):
        with pytest.raises(ModelError, match=says):
            parse_switch(bad)
    assert _child_argv(["--ab", "x", "--tokens", "4", "--cooldown=2", "--ab=y", "--cooldown", "1"]) == ["--tokens", "4"]
    assert _child_argv(["--position", "4000", "--ab", "x", "--context", "4200"]) == ["--position", "4000", "--context", "4200"]


def test_an_a_b_a_run_on_the_cpu():
    r = subprocess.run([sys.executable, "-m", "engine.bench", "--ab", "VEGAFUSE_SPIN_US=0", "--tokens", "4",
                        "--repeat", "2"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| A") or ln.startswith("| B")]
    assert [c[0].strip() for c in rows] == ["A1", "B", "A2"] and rows[1][1].strip() == "VEGAFUSE_SPIN_US=0"
    assert all(float(c[2]) > 0 and float(c[3]) <= float(c[2]) <= float(c[4]) for c in rows)
    assert "B / A = " in r.stdout and ("reliable" in r.stdout or "UNRELIABLE" in r.stdout)
    bad = subprocess.run([sys.executable, "-m", "engine.bench", "--ab", "nonsense"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --ab 'nonsense'") and len(bad.stderr.splitlines()) == 1


def test_each_side_decodes_from_the_position_asked(monkeypatch, capsys):
    """``--position`` reaches each side's decode (it was once dropped, so an A/B/A at a long cache
    timed position 32): the real model's steps run at the positions asked."""
    from engine import ab, bench
    from engine.models import resolve_model
    from engine.model import Model
    seen, decode = [], Model.decode

    def recording(self, *a, **k):
        seen.append(self.pos)
        return decode(self, *a, **k)
    monkeypatch.setattr(Model, "decode", recording)
    args = bench.parse_args(["--tokens", "2", "--repeat", "1"])
    # the model resolved as bench.run does; the CPU refuses --position on the command line
    args.model, args.position = resolve_model(None), 40
    assert ab.decode_rates(args) == 0 and '"rates"' in capsys.readouterr().out
    assert seen == [40, 41, 40, 41]                # the untimed run, then the timed one
