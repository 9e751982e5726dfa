"""docs/targets.md: the paper configs compiled for every chip we name, at the paper's global batch.

For each (config, target) the compile mode (span_lm/tools/compile.py) compiles the training step
as the config ships; a step that does not fit is compiled again with the batch split doubled
(up to `--max_split`), then with remat='layer', and the table gives the first setting that fits.
A split that cannot fit by the numbers of those that did not (`hopeless`) is skipped, not
compiled: each TPU compile of a paper config takes 5 to 20 minutes on a 2-core host.
Needs the toolchains: pip install "jax[cuda12]==<jax version>" "jax[tpu]==<jax version>".

  python -m bench.targets_table --configs configs/enwik8.py configs/enwik8_large.py \
      --targets h100:8 a100_80:8 a100_40:8 v100_32:8 v5e:4x4 v5p:2x2x2 v6e:2x4 v4:2x2x2 \
      --out docs/targets
  # float16 rows: the same search with one more override on every row
  python -m bench.targets_table --configs configs/enwik8_large.py --targets v100_16:8 v100_32:8 \
      --set model.dtype=float16 --out docs/targets_float16_v100
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from span_lm import config as config_lib
from span_lm.tools import compile as compile_lib


def attempts(split: int, remat: str, batch: int, devices: int, max_split: int):
  """(batch_split, remat) settings to try, in order: as shipped, more pieces, then remat (unless
  the config ships with it)."""
  out, s = [(split, remat)], split
  while s * 2 <= max_split and batch % (s * 2) == 0 and (batch // (s * 2)) % devices == 0:
    s *= 2
    out.append((s, remat))
  if remat == "none":
    out.append((s, "layer"))
  return out


_OOM = (re.compile(r"Used ([0-9.]+)([KMGT]?) of ([0-9.]+)([KMGT]?) hbm"),  # XLA:TPU's two wordings
        re.compile(r"required for HLO temporaries \(([0-9.]+)([KMGT]?)\) exceeds available HBM "
                   r"\(([0-9.]+)([KMGT]?)\)"))


def need(row: dict) -> tuple[float, float] | None:
  """(peak bytes, capacity) of a training step that did not fit: XLA's memory analysis where it
  compiled, else XLA:TPU's out-of-memory line ("Used 63.80G of 30.75G hbm", or "required for HLO
  temporaries (49.27G) exceeds available HBM (15.25G)"). The peak, not arguments + temporaries:
  XLA's peak can be well below their sum (buffers live at different times)."""
  r = row.get("train") or {}
  m = r.get("memory") or {}
  if m.get("capacity") and not m.get("fits", True):
    return float(m["peak"]), m["capacity"]
  err = r.get("error", "")
  hit = _OOM[0].search(err) or _OOM[1].search(err)
  if hit:
    unit = lambda u: 1024.0 ** " KMGT".index(u or " ")
    return float(hit.group(1)) * unit(hit.group(2)), float(hit.group(3)) * unit(hit.group(4))
  return None


def hopeless(split: int, failed: list) -> bool:
  """Whether a batch split cannot fit, given the splits that did not fit: a piece's memory
  shrinks at best in proportion to its size, so peak * s / split is a lower bound on its peak
  (each step skipped saves a 5 to 20 minute compile; docs/targets.md)."""
  return any(n is not None and n[0] * s / split > n[1] for s, n in failed)


def _commit() -> str:
  """The checkout's commit (with '+changes' when the tree differs), so a row says what it ran."""
  git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, check=False,
                                  cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
  head = git("rev-parse", "--short", "HEAD") or "unknown"
  return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def one(path: str, target: str, split: int, remat: str, plan: str, sets: dict | None = None) -> dict:
  overrides = {"mode": "compile", "compile.targets": target, "compile.steps": "train",
               "compile.plan": plan, "optim.batch_split": split, "model.remat": remat,
               **(sets or {})}
  tgt = compile_lib.parse_target(target)
  devices = tgt.chips * (tgt.chip.cores_per_chip if tgt.chip.name == "v4" else 1)
  eval_batch = config_lib.load_config(path).data.eval_batch
  extra = "".join(f" --config.{k}={v}" for k, v in (sets or {}).items())
  if eval_batch % devices:  # the state holds the evaluation caches: one stream per device at least
    overrides["data.eval_batch"] = devices
    extra += f" --config.data.eval_batch={devices}"
  config = config_lib.load_config(path, overrides)
  with tempfile.TemporaryDirectory() as tmp:
    config.compile.out = tmp
    row = compile_lib.report(config)["rows"][0]
  # ptxas' report: our kernels and XLA's that spill (the other ~150 per step add nothing here)
  row["kernels"] = [k for k in row.get("kernels", []) if k["kernel"].startswith("span_attention")
                    or k["spill_store"] or k["spill_load"]]
  row["commit"] = _commit()
  row["command"] = (f"python main.py --config={path} --config.mode=compile "
                    f"--config.compile.targets={target} --config.optim.batch_split={split} "
                    f"--config.model.remat={remat} --config.compile.plan={plan}{extra}")
  return row


def fits(row: dict) -> bool:
  r = row.get("train") or {}
  return bool(r.get("compiled") and r["memory"].get("fits"))


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--configs", nargs="+", default=["configs/enwik8.py", "configs/enwik8_large.py"])
  p.add_argument("--targets", nargs="+", default=["h100:8", "a100_80:8", "v5p:2x2x2"])
  p.add_argument("--plan", default="full", choices=["full", "initial"])
  p.add_argument("--max_split", type=int, default=8)
  p.add_argument("--out", default="docs/targets")
  p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                 help="config overrides for every row, e.g. model.dtype=float16")
  args = p.parse_args()
  sets = dict(kv.split("=", 1) for kv in args.set)
  results = []
  if os.path.exists(args.out + ".json"):  # resume: keep rows already measured
    results = json.load(open(args.out + ".json"))["rows"]
  done = {(r["config"], r["target"]) for r in results}
  for path in args.configs:
    base = config_lib.load_config(path, sets)
    for target in args.targets:
      if (path, target) in done:
        continue
      tgt = compile_lib.parse_target(target)
      devices = tgt.chips * (tgt.chip.cores_per_chip if tgt.chip.name == "v4" else 1)
      tried, failed, skipped = [], [], []
      plan = attempts(base.optim.batch_split, base.model.remat, base.data.batch, devices,
                      args.max_split)
      for i, (split, remat) in enumerate(plan):
        if 0 < i < len(plan) - 1 and hopeless(split, failed):
          skipped.append((split, remat))  # the last setting (remat, or the largest split) runs
          continue
        t0 = time.perf_counter()
        row = one(path, target, split, remat, args.plan, sets)
        row["wall_s"] = time.perf_counter() - t0
        if "(status -9)" in row.get("error", ""):  # SIGKILL: the host ran out of memory, not the chip
          print(f"{path} on {target}: {row['error'][:120]}; row not recorded (rerun with fewer "
                "compiles at once)", file=sys.stderr)
          tried = []
          break
        tried.append(row)
        if fits(row) or "error" in row:
          break
        failed.append((split, need(row)))
      if not tried:
        continue
      results.append({"config": path, "target": target, "shipped": tried[0],
                      "fitting": tried[-1] if fits(tried[-1]) else None,
                      "tried": [(r["batch_split"], r["command"].split("remat=")[1].split()[0])
                                for r in tried], "skipped": skipped})
      with open(args.out + ".json", "w") as f:
        json.dump({"command": " ".join(sys.argv), "rows": results}, f, indent=1)
  write_table(args.out + ".md", markdown(results))


BEGIN, END = "<!-- targets_table.py: begin -->", "<!-- targets_table.py: end -->"


def write_table(path: str, table: str):
  """The table into `path` between BEGIN and END (the prose around it stays), or the table alone
  when the file has no such markers."""
  text = open(path).read() if os.path.exists(path) else ""
  if BEGIN in text and END in text:
    head, rest = text.split(BEGIN, 1)
    text = f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}"
  else:
    text = table + "\n"
  with open(path, "w") as f:
    f.write(text)


def _cell(row: dict) -> tuple[str, str, str, str]:
  """(compiled, peak/capacity GiB, roofline tok/s and bound, compile s)."""
  if "error" in row:
    return f"no: {row['error'][:120]}", "", "", ""
  r = row["train"]
  if not r["compiled"]:
    return f"no: {r['error'][:120]}", "", "", f"{r['compile_s']:.0f}"
  m, rf = r["memory"], r["roofline"]
  return ("yes", f"{m['peak'] / 2**30:.1f} / {m['capacity'] / 2**30:.0f}",
          f"{(rf['tokens_per_s'] or 0) / 1e3:.0f}k ({rf['bound']})", f"{r['compile_s']:.0f}")


def markdown(results) -> str:
  lines = ["| config | target | attention | compiles as shipped | peak / HBM GiB per device | "
           "smallest setting that fits | its peak GiB | roofline tok/s (bound) | compile s |",
           "|---|---|---|---|---|---|---|---|---|"]
  for res in results:
    s = res["shipped"]
    comp, peak, _, _ = _cell(s)
    f = res["fitting"]
    if f is None:
      fit, fpeak, roof, csec = "none tried fits: " + ", ".join(
          f"split {a} remat {b}" for a, b in res["tried"]), "", "", ""
    else:
      _, fpeak, roof, csec = _cell(f)
      fit = "as shipped" if len(res["tried"]) == 1 else f"batch_split={f['batch_split']}, " \
          "remat=" + f["command"].split("remat=")[1].split()[0]
    if res.get("skipped"):
      fit += " (cannot fit, not compiled: " + ", ".join(
          f"split {a} remat {b}" for a, b in res["skipped"]) + ")"
    # what the step ran: the train row's own (auto's fit fallback recompiles with the kernel)
    attention = (s.get("train") or {}).get("attention") or s.get("attention", "")
    lines.append(f"| {res['config']} | {res['target']} | {attention} | {comp} | "
                 f"{peak} | {fit} | {fpeak} | {roof} | {csec} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
