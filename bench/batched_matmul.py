"""Speed of the batched bf16 matmuls of banded attention on this device, by their shape.

The fixed-span step's score-sized products are 64 (= B x G) independent matmuls per layer. On
the 2-core AMX Xeon (2026-11-24, commit 38f4928) XLA:CPU's YNNPACK runs them at ~300 GFLOP/s
when each has 128 or 64 rows (q k^T, dO v^T, the key/value gradients, as span_lm lays them out)
and at ~700 with 1152 rows (the same FLOPs with the key axis as rows), and the 128-row form is
no faster on two cores than on one. This prints the table behind that (docs/benchmarks.md,
"Why the last 5 % of the fixed span did not come"), alternating the shapes so that drift hits
all of them alike.

  python -m bench.batched_matmul
  taskset -c 0 python -m bench.batched_matmul   # one core
"""
import argparse
import time

import jax
import jax.numpy as jnp

from span_lm.train import cpu_host

# (batch, rows M, contracted K, columns N) of (B G, M, K) x (B G, K, N) -> (B G, M, N) float32.
SHAPES = (
    ("q k^T, dO v^T (as laid out)", (64, 128, 64, 1152)),
    ("the same, key axis as rows", (64, 1152, 64, 128)),
    ("key/value gradients (as laid out)", (64, 64, 128, 1152)),
    ("the same, key axis as rows", (64, 1152, 128, 64)),
    ("p v, dS k (contract the keys)", (64, 128, 1152, 64)),
    ("q k^T in 128-key blocks", (576, 128, 64, 128)),
)


def main():
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--reps", type=int, default=20)
  cpu_host.add_flag(p)
  a = p.parse_args()
  cpu_host.apply_flags(a)  # before the backend starts
  key = jax.random.key(0)
  dims = (((2,), (1,)), ((0,), (0,)))
  mm = jax.jit(lambda x, y: jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32))
  cases = []
  for name, (z, m, k, n) in SHAPES:
    x = jax.random.normal(key, (z, m, k), jnp.bfloat16)
    y = jax.random.normal(key, (z, k, n), jnp.bfloat16)
    jax.block_until_ready(mm(x, y))
    cases.append((name, (z, m, k, n), x, y, []))
  for _ in range(a.rounds):
    for *_, x, y, times in cases:
      t0 = time.perf_counter()
      for _ in range(a.reps):
        out = mm(x, y)
      jax.block_until_ready(out)
      times.append((time.perf_counter() - t0) / a.reps)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; median (min) of {a.rounds} "
        f"rounds of {a.reps} calls\n")
  print("| product | batch x (M x K x N) | ms | GFLOP/s |")
  print("|---|---|---|---|")
  for name, (z, m, k, n), _, _, times in cases:
    times.sort()
    med = times[len(times) // 2]
    print(f"| {name} | {z} x ({m} x {k} x {n}) | {med * 1e3:.2f} ({times[0] * 1e3:.2f}) | "
          f"{2 * z * m * k * n / med / 1e9:.0f} |")


if __name__ == "__main__":
  main()
