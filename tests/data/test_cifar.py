"""CIFAR-10's archive (span_lm/data/cifar.py): its published md5 is checked before anything is
unpacked, and unpacking takes only the batch files, inside data_dir. Fake archives; no network."""
import hashlib
import io
import os
import tarfile

import numpy as np
import pytest

from span_lm import cli
from span_lm.data import cifar
from span_lm.data import download
from span_lm.data import sources


def _batch_bytes(n, seed):
  path = io.BytesIO()
  images = np.random.default_rng(seed).integers(0, 256, (n, 3072), dtype=np.uint8)
  d = {b"batch_label": b"b", b"labels": list(range(n)), b"data": images,
       b"filenames": [b"x.png"] * n}
  import pickle  # pylint: disable=g-import-not-at-top
  pickle.dump(d, path, protocol=4)
  return path.getvalue()


def _tar(path, members):
  """A .tar.gz of (name, bytes | ('symlink', target))."""
  with tarfile.open(path, "w:gz") as tar:
    for name, data in members:
      info = tarfile.TarInfo(name)
      if isinstance(data, tuple):
        info.type, info.linkname = tarfile.SYMTYPE, data[1]
        tar.addfile(info)
      else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
  return path


def _fake_archive(d, extra=()):
  files = [(f"{cifar.BATCH_DIR}/{f}", _batch_bytes(25, i))
           for i, f in enumerate(cifar.TRAIN_FILES + (cifar.TEST_FILE,))]
  files.append((f"{cifar.BATCH_DIR}/batches.meta", b"meta"))
  return _tar(d / cifar.ARCHIVE, files + list(extra))


def _md5(path):
  return hashlib.md5(path.read_bytes()).hexdigest()


def test_published_checksum():
  assert cifar.ARCHIVE == "cifar-10-python.tar.gz"
  assert cifar.ARCHIVE_MD5 == "c58f30108f718f92721af3b95e74349a"


def test_an_archive_with_another_checksum_is_refused_before_unpacking(tmp_path):
  archive = _fake_archive(tmp_path)
  with pytest.raises(download.DataIntegrityError) as e:
    sources.load_splits({"dataset": "cifar10", "data_dir": str(tmp_path), "block": 3072,
                         "batch": 1, "eval_batch": 1})
  msg = cli.user_message(e.value)
  assert "\n" not in msg and msg.startswith(f"{archive}: md5 {_md5(archive)}, expected "
                                            "c58f30108f718f92721af3b95e74349a"), msg
  assert "nothing was unpacked" in msg
  assert sorted(os.listdir(tmp_path)) == [cifar.ARCHIVE]  # nothing unpacked, no temporary left


def test_an_archive_with_its_checksum_unpacks_and_trains(tmp_path, monkeypatch):
  archive = _fake_archive(tmp_path)
  monkeypatch.setattr(cifar, "ARCHIVE_MD5", _md5(archive))  # the fake archive is "published"
  splits = sources.load_splits({"dataset": "cifar10", "data_dir": str(tmp_path), "block": 3072,
                                "batch": 1, "eval_batch": 1})
  assert splits.name == "cifar10" and splits.train.size == (5 * 25 - 5) * 3072
  out = tmp_path / cifar.BATCH_DIR
  assert sorted(os.listdir(out)) == sorted(cifar.TRAIN_FILES + (cifar.TEST_FILE, "batches.meta"))
  assert sorted(os.listdir(tmp_path)) == sorted([cifar.ARCHIVE, cifar.BATCH_DIR])
  # a second run reads the unpacked batches (the archive is not checked or unpacked again)
  monkeypatch.setattr(cifar, "ARCHIVE_MD5", "0" * 32)
  assert cifar.find_dir(tmp_path) == out


def test_unpacking_takes_only_the_batch_files(tmp_path):
  """Members outside cifar-10-batches-py, absolute or climbing paths, and a link in a batch's
  place are never written; the checksum is the one given (the fake archive's)."""
  outside = tmp_path / "outside"
  data_dir = tmp_path / "data"
  data_dir.mkdir()
  archive = _fake_archive(data_dir, extra=[
      ("../outside/evil", b"x"), (str(outside / "abs"), b"x"),
      (f"{cifar.BATCH_DIR}/../../outside/climb", b"x"), (f"{cifar.BATCH_DIR}/evil.sh", b"x"),
      (f"{cifar.BATCH_DIR}/readme.html", ("symlink", "/etc/passwd"))])
  out = cifar.unpack_archive(archive, data_dir, md5=_md5(archive))
  assert not outside.exists()
  assert sorted(os.listdir(out)) == sorted(cifar.TRAIN_FILES + (cifar.TEST_FILE, "batches.meta"))
  assert all(not (out / f).is_symlink() for f in os.listdir(out))
  assert sorted(os.listdir(data_dir)) == sorted([cifar.ARCHIVE, cifar.BATCH_DIR])


def test_a_broken_archive_with_its_checksum_is_one_line(tmp_path):
  archive = _fake_archive(tmp_path)
  archive.write_bytes(archive.read_bytes()[:2000])
  with pytest.raises(download.DataIntegrityError) as e:
    cifar.unpack_archive(archive, tmp_path, md5=_md5(archive))
  msg = cli.user_message(e.value)
  assert "\n" not in msg and msg.startswith(f"{archive}: "), msg
  assert sorted(os.listdir(tmp_path)) == [cifar.ARCHIVE]


def test_an_archive_without_batches_is_one_line(tmp_path):
  archive = _tar(tmp_path / cifar.ARCHIVE, [("other/file", b"x")])
  with pytest.raises(download.DataIntegrityError, match="no cifar-10-batches-py/data_batch_1"):
    cifar.unpack_archive(archive, tmp_path, md5=_md5(archive))


def test_no_batches_and_no_archive_says_where_to_put_it(tmp_path):
  with pytest.raises(FileNotFoundError, match="put cifar-10-python.tar.gz"):
    cifar.find_dir(tmp_path)


@pytest.mark.slow
def test_cli_training_with_a_wrong_archive_is_one_line(tmp_path):
  import pathlib  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  repo = pathlib.Path(__file__).resolve().parents[2]
  archive = _fake_archive(tmp_path)
  run_dir = tmp_path / "RUN"
  r = subprocess.run([sys.executable, "main.py", "--config=configs/cifar10_sparse.py",
                      f"--config.data.data_dir={tmp_path}", f"--config.workdir={run_dir}"],
                     cwd=repo, capture_output=True, text=True, timeout=600, check=False)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 1 and len(lines) == 1, r.stdout + r.stderr
  assert lines[0].startswith(f"error: {archive}: md5 ") and "Traceback" not in r.stderr
  assert not run_dir.exists() and sorted(os.listdir(tmp_path)) == [cifar.ARCHIVE]
