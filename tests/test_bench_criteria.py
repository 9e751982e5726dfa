"""bench/attention_span.py: issue 8's cost-follows-spans criteria computed from measured rows."""

import numpy as np
import pytest

from bench import attention_span


def _row(span, case, keys, seconds):
  return {"span": span, "case": case, "attention_keys": keys, "seconds": seconds}


def test_criteria_recover_a_known_cost_model():
  # time = 0.1 s outside attention + keys x rate; the mixed layer pays 1.2x its keys' share,
  # the all-long adaptive layer a higher rate than the fixed one (the span mask's work).
  base, rate_long, rate_fixed = 0.1, 20e-6, 15e-6
  rows = [_row(1024, "short", 2048, base + 2048 * rate_long),
          _row(1024, "long", 32768, base + 32768 * rate_long),
          _row(1024, "fixed", 32768, base + 2048 * rate_long + 30720 * rate_fixed),
          _row(1024, "mixed", 5888, base + 5888 * rate_long * 1.2),
          _row(8192, "short", 2048, 1.1 * (base + 2048 * rate_long))]
  lines = attention_span.criteria(rows)
  assert lines[0].startswith("short spans, S=8192 against S=1024: 1.10x")
  long_line = next(l for l in lines if "(long)" in l)
  assert "1.20x" in long_line and "20.0 us per key" in long_line
  fixed_line = next(l for l in lines if "(fixed)" in l)
  assert "15.0 us per key" in fixed_line and "1.20x" not in fixed_line


def test_criteria_skip_spans_without_the_cases_they_need():
  assert attention_span.criteria([_row(1024, "fixed", 32768, 1.0)]) == []


@pytest.mark.slow
@pytest.mark.parametrize("case,expect_long", [("long", 4), ("mixed", 1), ("short", 0)])
def test_cases_set_the_long_heads(case, expect_long):
  args = type("A", (), dict(d_model=32, layers=1, heads=4, d_ff=64, short_span=64,
                            dtype="float32"))()
  cfg, plan, params = attention_span.make_case(case, 256, args)
  z = np.asarray(params["layers_0"]["attn"]["span_ratio"])
  assert int(np.sum(z == 1.0)) == expect_long
  assert plan.attention_keys() >= expect_long * 256
