"""What a GPU kernel's PTX says about it: tensor-core instructions, asynchronous copies, atomics,
and which kernel parameters (global buffers) it reads and writes.

The compile mode, bench/kernel_sweep.py and the PTX regression test read XLA's PTX dump
(`--xla_dump_to`) through `kernel_facts`. A kernel that reads a global buffer it also writes
depends on the order of its own memory operations, which Triton's software pipeliner does not
keep (the first fused kernel's wrong gradients, docs/kernels.md): `read_back` must be empty.
"""
import pathlib
import re

_ENTRY = re.compile(r"\.entry\s+(\w+)")
# `ld.param.u64` in jax 0.10.2's PTX, `ld.param::entry.b64` in jax 0.12's (a newer NVPTX backend)
_PARAM_LOAD = re.compile(r"ld\.param(?:::\w+)?\.\w+\s+(%\w+),\s*\[\w+_param_(\d+)\]")
_DEF = re.compile(r"[a-z][\w.]*\s+(%rd\w+),\s*(.*);")


def buffers(ptx: str) -> tuple[set, set, set, list]:
  """(parameters read by asynchronous copies, parameters read by plain global loads, parameters
  written (stores, atomics, bulk copies out), addresses that lead to no parameter), found by
  following each 64-bit address register back through the instructions that define it to the
  ld.param it derives from."""
  src = {}
  async_read, plain_read, written, unresolved = set(), set(), set(), []

  def params(addrs, line):
    if not addrs or addrs[0] not in src or not src[addrs[0]]:
      unresolved.append(line)
      return set()
    return src[addrs[0]]

  statements = [st.strip() + ";" for ln in ptx.splitlines() for st in ln.split(";") if st.strip()]
  for line in statements:  # Triton's inline asm puts several instructions on one line
    line = re.sub(r"^@!?%\w+\s+", "", line)  # a predicate guard
    if m := _PARAM_LOAD.match(line):
      src[m.group(1)] = {int(m.group(2))}
      continue
    op = line.split(None, 1)[0] if line else ""
    addrs = re.findall(r"\[\s*(%rd\w+)", line)
    if op.startswith("cp.async") and ".global" in op and "prefetch" not in op:
      if ".global.shared" in op:  # bulk copy shared -> global: a write
        written |= params(addrs, line)
      else:  # global -> shared: the global address is the second operand
        async_read |= params(addrs[-1:], line)
    elif op.startswith(("st.global", "red.global", "atom.global")):
      written |= params(addrs, line)
    elif op.startswith("ld.global"):
      plain_read |= params(addrs, line)
    elif m := _DEF.match(line):
      if not op.startswith(("ld.", "atom.")):  # arithmetic on addresses: union of its operands
        src[m.group(1)] = set().union(*[src.get(r, set())
                                        for r in re.findall(r"%\w+", m.group(2))])
  return async_read, plain_read, written, unresolved


def loop_prefetches(ptx: str) -> list[int]:
  """Parameters read by plain global loads inside a loop body before the body's first
  tensor-core instruction: loads issued at the top of an iteration, whose latency the
  iteration's matmuls hide (the fused kernel's position tiles, loaded a tile ahead)."""
  lines = ptx.splitlines()
  labels = {m.group(1): i for i, ln in enumerate(lines)
            if (m := re.match(r"^(\$L__\w+):", ln.strip()))}
  found = set()
  for j, ln in enumerate(lines):
    m = re.search(r"\bbra(?:\.uni)?\s+(\$L__\w+);", ln)
    start = labels.get(m.group(1), j + 1) if m else j + 1
    if start > j:
      continue  # not a backward branch: no loop
    first_mma = next((i for i in range(start, j)
                      if re.search(r"\b(?:wgmma\.mma_async|mma\.sync)", lines[i])), None)
    if first_mma is None:
      continue
    pre, head = "\n".join(lines[:start]), "\n".join(lines[:first_mma])
    found |= {p for p in buffers(head)[1]
              if _count_param_loads(head, p) > _count_param_loads(pre, p)}
  return sorted(found)


def _count_param_loads(ptx: str, param: int) -> int:
  src, n = {}, 0
  statements = [st.strip() + ";" for ln in ptx.splitlines() for st in ln.split(";") if st.strip()]
  for line in statements:
    line = re.sub(r"^@!?%\w+\s+", "", line)
    if m := _PARAM_LOAD.match(line):
      src[m.group(1)] = {int(m.group(2))}
      continue
    op = line.split(None, 1)[0] if line else ""
    addrs = re.findall(r"\[\s*(%rd\w+)", line)
    if op.startswith("ld.global"):
      n += bool(addrs) and param in src.get(addrs[0], set())
    elif (m := _DEF.match(line)) and not op.startswith(("ld.", "atom.")):
      src[m.group(1)] = set().union(*[src.get(r, set()) for r in re.findall(r"%\w+", m.group(2))])
  return n


def kernel_facts(ptx: str) -> dict:
  """One kernel's PTX: its name, target, tensor-core instructions (wgmma on sm_90, mma.sync),
  asynchronous copies (cp.async, and bulk/TMA copies), global atomics, the parameters it reads
  and writes, and `read_back`: parameters it both reads and writes."""
  name = _ENTRY.search(ptx)
  target = re.search(r"^\.target\s+(\w+)", ptx, re.M)
  async_read, plain_read, written, unresolved = buffers(ptx)
  count = lambda pattern: len(re.findall(pattern, ptx))
  return {"kernel": name.group(1) if name else "?",
          "target": target.group(1) if target else "?",
          "wgmma": count(r"\bwgmma\.mma_async"),
          "mma": count(r"\bmma\.sync"),
          "cp_async": count(r"\bcp\.async\.c[ag]\.shared\.global"),
          "bulk_async": count(r"\bcp\.async\.bulk(?!\.prefetch)"),
          "atomics": count(r"\b(?:red|atom)\.global"),
          "reads_async": sorted(async_read), "reads": sorted(plain_read),
          "writes": sorted(written),
          "read_back": sorted((async_read | plain_read) & written),
          "loop_prefetch": loop_prefetches(ptx),
          "unresolved": len(unresolved)}


def dumped_kernels(dump_dir, prefix: str = "") -> list[dict]:
  """kernel_facts of every kernel in an XLA dump directory whose name starts with prefix."""
  out = []
  for f in sorted(pathlib.Path(dump_dir).glob("*.ptx")):
    text = f.read_text()
    m = _ENTRY.search(text)
    if m and m.group(1).startswith(prefix):
      out.append(kernel_facts(text))
  return out
