"""The matmuls of an HLO module's text, counted: `hlo_dot_flops` (its dot instructions, and the
convolutions XLA:TPU writes matmuls as).

It is how model/costs.py's analytic counts are checked against what XLA compiled: tools/flops.py's
xla_costs reads it of the real train step, the tests of the HLO kept in tests/fixtures/tpu_hlo.
A parser of the text, no more: it imports nothing of span_lm.
"""
import functools
import math
import re

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"\w+\[([\d,]*)\]")
_CALLS = re.compile(r"\b(calls|to_apply|body|branch_computations|true_computation|"
                    r"false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")


def _closing(s: str, i: int) -> int:
  """The index of the bracket closing the one at s[i] (any of ( [ {)."""
  depth = 0
  for j in range(i, len(s)):
    if s[j] in "([{":
      depth += 1
    elif s[j] in ")]}":
      depth -= 1
      if depth == 0:
        return j
  return len(s)


def _split_top(s: str) -> list[str]:
  """s split at the commas outside brackets."""
  out, depth, start = [], 0, 0
  for j, ch in enumerate(s):
    depth += ch in "([{"
    depth -= ch in ")]}"
    if ch == "," and depth == 0:
      out.append(s[start:j].strip())
      start = j + 1
  out.append(s[start:].strip())
  return [x for x in out if x]


def _parse_instruction(rhs: str):
  """'f32[2,3]{1,0} dot(%a, %b), attrs' -> (dims or None for a tuple, opcode, operands, attrs)."""
  if rhs.startswith("("):
    dims, end = None, _closing(rhs, 0) + 1
  else:
    m = _ARRAY.match(rhs)
    dims = [int(x) for x in m.group(1).split(",") if x] if m else None
    end = rhs.find(" ")
  rest = rhs[end:].lstrip() if end > 0 else ""
  paren = rest.find("(")
  if paren <= 0:
    return dims, rest, [], ""
  close = _closing(rest, paren)
  return dims, rest[:paren], _split_top(rest[paren + 1:close]), rest[close + 1:]


def _window_hits(n: int, step: int, off: int, last: int, dil: int) -> int:
  """#{j in [0, n): q = j * step + off lies in [0, last] and q % dil == 0}."""
  lo, hi = max(0, -(off // step)), min(n - 1, (last - off) // step)  # -(a // b) = ceil(-a / b)
  if hi < lo:
    return 0
  if dil == 1:
    return hi - lo + 1
  period = dil // math.gcd(step, dil)
  first = next((j for j in range(lo, lo + period) if (j * step + off) % dil == 0), None)
  return 0 if first is None or first > hi else (hi - first) // period + 1


def _conv_pairs(n_out, n_win, n_in, stride, pad_lo, lhs_dil, rhs_dil) -> int:
  """(output position, window position) pairs of one spatial dimension that meet an input element
  (not padding, not a hole left by lhs dilation): the products that are not zero by position."""
  last = (n_in - 1) * lhs_dil
  if n_win <= n_out:
    return sum(_window_hits(n_out, stride, k * rhs_dil - pad_lo, last, lhs_dil)
               for k in range(n_win))
  return sum(_window_hits(n_win, rhs_dil, p * stride - pad_lo, last, lhs_dil)
             for p in range(n_out))


def _conv_macs(out, lhs, rhs, attrs) -> int:
  """Multiply-adds of an HLO convolution: output elements x input features (rhs 'i') x the window
  positions that meet input data. XLA:TPU writes matmuls as convolutions, batch dimensions as
  spatial ones whose window walks a dilated input (size=n stride=n-1 lhs_dilate=n: one hit per
  output position), so the window is counted position by position, not as its size."""
  labels = _DIM_LABELS.search(attrs)
  lhs_l, rhs_l, out_l = labels.groups()
  spatial = sorted(c for c in out_l if c.isdigit())
  found = _WINDOW.search(attrs)
  window = dict(f.split("=", 1) for f in (found.group(1) if found else "").split() if "=" in f)

  def field(name, k, default):
    vals = window.get(name)
    return int(vals.split("x")[k]) if vals else default

  pads = window.get("pad", "").split("x") if window.get("pad") else None
  macs = rhs[rhs_l.index("i")] * math.prod(out[out_l.index(c)] for c in out_l if not c.isdigit())
  for k, c in enumerate(spatial):
    macs *= _conv_pairs(out[out_l.index(c)], rhs[rhs_l.index(c)], lhs[lhs_l.index(c)],
                        field("stride", k, 1), int(pads[k].split("_")[0]) if pads else 0,
                        field("lhs_dilate", k, 1), field("rhs_dilate", k, 1))
  return macs


def hlo_dot_flops(hlo_text: str) -> int:
  """2 x MACs of the matmuls in an (optimised) HLO module's text: its dot instructions, and the
  convolutions XLA:TPU writes matmuls as, inside fusions or not. Each computation counts once per
  call: fusions and calls by the call graph from ENTRY, while-loop bodies times their known trip
  count (once where XLA knows none), every branch of a conditional. Matmuls inside custom calls
  (a fused Pallas kernel) are not visible here."""
  comps, entry, cur = {}, None, None
  for line in hlo_text.splitlines():
    head = _COMPUTATION.match(line)
    if head and not line.startswith((" ", "HloModule")):
      cur = head.group(2)
      comps[cur], entry = [], cur if head.group(1) else entry
      continue
    ins = _INSTRUCTION.match(line)
    if ins:
      if cur is None:  # a fragment without computation headers: one computation
        cur = entry = ""
        comps[cur] = []
      comps[cur].append((ins.group(1),) + _parse_instruction(ins.group(2)))
  shapes = {name: dims for body in comps.values() for name, dims, *_ in body}

  def dims_of(operand):
    m = _ARRAY.match(operand)  # newer text writes the operand's shape before its name
    if m:
      return [int(x) for x in m.group(1).split(",") if x]
    return shapes[operand.split()[-1].lstrip("%")]

  def own(body):
    total = 0
    for _, out, op, args, attrs in body:
      if op == "dot":
        contract = _CONTRACT.search(attrs).group(1)
        lhs = dims_of(args[0])
        total += math.prod(out) * math.prod(lhs[int(i)] for i in contract.split(",") if i)
      elif op == "convolution":
        total += _conv_macs(out, dims_of(args[0]), dims_of(args[1]), attrs)
    return total

  @functools.cache
  def macs(name):
    total = own(comps[name])
    for *_, attrs in comps[name]:
      trips = _TRIP_COUNT.search(attrs)
      for kind, callees in _CALLS.findall(attrs):
        for callee in re.findall(r"%?([\w.\-]+)", callees):
          if callee in comps:
            total += (int(trips.group(1)) if kind == "body" and trips else 1) * macs(callee)
    return total

  if entry is None:
    return 2 * sum(own(body) for body in comps.values())
  return 2 * macs(entry)
