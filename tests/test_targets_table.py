"""bench/targets_table.py's search for the smallest setting that fits: what it skips, on the numbers
real out-of-memory compiles gave (docs/targets.json's V100 rows; XLA:TPU's out-of-memory line)."""

from bench import targets_table

GiB = 2**30


def _gpu_row(split, argument, temp, capacity, peak=None):
  """A compiled step that does not fit, as the compile mode records it."""
  peak = argument + temp if peak is None else peak
  return {"batch_split": split, "train": {"compiled": True, "memory": {
      "argument": argument, "output": argument, "alias": argument, "temp": temp, "peak": peak,
      "capacity": capacity, "fits": peak <= capacity}}}


def test_a_split_whose_lower_bound_exceeds_the_device_is_skipped():
  # configs/enwik8.py on a V100 16 GB: split 1 peaks at 2.1 GB + 35.5 GB of temporaries;
  # split 2 cannot fit (37.6 / 2 > 16), split 4 may (37.6 / 4).
  n = targets_table.need(_gpu_row(1, int(2.1 * GiB), int(35.5 * GiB), 16 * GiB))
  assert n == (int(2.1 * GiB) + int(35.5 * GiB), 16 * GiB)
  failed = [(1, n)]
  assert targets_table.hopeless(2, failed)
  assert not targets_table.hopeless(4, failed)
  # enwik8_large at split 2 (peak 53.4 GB): 4 cannot fit 16 GB, 8 may; on 32 GB, 4 may.
  big = [(2, targets_table.need(_gpu_row(2, int(7.1 * GiB), int(46.3 * GiB), 16 * GiB)))]
  assert targets_table.hopeless(4, big) and not targets_table.hopeless(8, big)
  big32 = [(2, targets_table.need(_gpu_row(2, int(7.1 * GiB), int(46.3 * GiB), 32 * GiB)))]
  assert not targets_table.hopeless(4, big32)


def test_the_bound_is_the_peak_not_arguments_plus_temporaries():
  # XLA's peak can sit well below arguments + temporaries (v5e enwik8_large: 12.3 GiB against
  # 15.9): a split whose halved peak fits must not be skipped.
  n = targets_table.need(_gpu_row(1, int(4 * GiB), int(20 * GiB), 16 * GiB, peak=int(18 * GiB)))
  assert not targets_table.hopeless(2, [(1, n)])  # 18 / 2 = 9 fits; 4 + 20 / 2 = 14 would too
  n = targets_table.need(_gpu_row(1, int(8 * GiB), int(20 * GiB), 16 * GiB, peak=int(20 * GiB)))
  assert not targets_table.hopeless(2, [(1, n)])  # 8 + 10 = 18 > 16, but the peak says 10


def test_the_tpu_compilers_out_of_memory_line_bounds_the_next_split():
  err = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
         "hbm. Used 63.80G of 30.75G hbm. Exceeded hbm capacity by 33.05G.")
  row = {"batch_split": 1, "train": {"compiled": False, "error": err}}
  peak, capacity = targets_table.need(row)
  assert abs(peak - 63.80 * GiB) < GiB / 100 and abs(capacity - 30.75 * GiB) < 1e7
  assert targets_table.hopeless(2, [(1, (peak, capacity))])  # 31.9 > 30.75
  assert not targets_table.hopeless(4, [(1, (peak, capacity))])


def test_the_other_wording_of_the_tpu_out_of_memory_line():
  # configs/enwik8_pers.py on v4:2x2x2 (reference attention) at its own split of 2
  err = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
         "temporaries (49.27G) exceeds available HBM (15.25G).")
  n = targets_table.need({"batch_split": 2, "train": {"compiled": False, "error": err}})
  assert abs(n[0] - 49.27 * GiB) < GiB / 100 and abs(n[1] - 15.25 * GiB) < GiB / 100
  assert targets_table.hopeless(4, [(2, n)]) and not targets_table.hopeless(8, [(2, n)])


def test_a_failure_that_is_not_memory_prunes_nothing():
  row = {"batch_split": 1, "train": {"compiled": False, "error": "INTERNAL: Mosaic failed"}}
  assert targets_table.need(row) is None
  assert not targets_table.hopeless(8, [(1, None)])
