"""Data: reference-exact tokenisation, stream batching, downloads and checks. No network."""
import hashlib
import io
import json
import pathlib
import random
import zipfile

import numpy as np
import pytest

from configs.base import get_base_config
from span_lm.data import batching
from span_lm.data import demo
from span_lm.data import download as dl
from span_lm.data import prepare
from span_lm.data import sources

# ------------------------------------------------------------- plain ports of the reference


def _ref_enwik8_text(part: bytes) -> str:  # awd-lstm-lm prep_enwik8.py
  return " ".join([str(c) if c != ord("\n") else "\n" for c in part])


def _ref_text8_text(part: str) -> str:  # transformer-xl prep_text8.py
  return " ".join(["_" if c == " " else c for c in part.strip()])


def _ref_tokenize(text_path, dictionary_to_update):  # adaptive-span data._tokenize
  nb_tokens_in_dictionary = len(dictionary_to_update)
  with open(text_path, "r", encoding="utf8") as f:
    for line in f:
      for token in line.split() + ["<eos>"]:
        if token not in dictionary_to_update:
          dictionary_to_update[token] = nb_tokens_in_dictionary
          nb_tokens_in_dictionary += 1
  ids = []
  with open(text_path, "r", encoding="utf8") as f:
    for line in f:
      for token in line.split() + ["<eos>"]:
        ids.append(dictionary_to_update[token])
  return ids


def _ref_corpus(tmp_path, texts):
  """The reference Corpus over three split texts written as the prep scripts do."""
  dictionary = {}
  ids = []
  for name, text in zip(prepare.SPLITS, texts):
    path = tmp_path / f"{name}.txt"
    with open(path, "w") as f:
      f.write(text)
    ids.append(_ref_tokenize(path, dictionary))
  return ids, list(dictionary)


def _ref_sorted_dictionary(train_path):  # adaptive-span Dictionary(sort_dict=True)
  word2count = {}
  with open(train_path, "r", encoding="utf8") as f:
    for line in f:
      for word in line.split() + ["<eos>"]:
        word2count[word] = word2count.get(word, 0) + 1
  sorted_dict = sorted(word2count.items(), key=lambda kv: kv[1])[::-1]
  return {w: i for i, (w, _) in enumerate(sorted_dict)}


def _check_equal(tok, ref_ids, ref_vocab):
  assert list(tok.vocab) == ref_vocab
  for split, ref in zip(prepare.SPLITS, ref_ids):
    np.testing.assert_array_equal(tok.split(split).astype(np.int64), np.asarray(ref, np.int64))


# ------------------------------------------------------------------------------ tokenisation


def _random_bytes(rng, n_max):
  alphabet = [10, 10, 10, 32, 13, 9, 0, 60, 65, 200, 255]
  n = rng.randrange(n_max + 1)
  return bytes(rng.choice(alphabet) for _ in range(n))


def test_enwik8_tokenizer_matches_reference_on_random_bytes(tmp_path):
  rng = random.Random(0)
  cases = [(b"", b"", b""), (b"\n", b"\n\n", b"a"), (b"ab\n", b"\nb", b"\n\n\nc\n"),
           (b"a\n\nb", b"", b"\n")]
  cases += [tuple(_random_bytes(rng, 30) for _ in range(3)) for _ in range(150)]
  for parts in cases:
    ref_ids, ref_vocab = _ref_corpus(tmp_path, [_ref_enwik8_text(p) for p in parts])
    _check_equal(prepare.tokenize_enwik8(*parts), ref_ids, ref_vocab)


def test_text8_tokenizer_matches_reference(tmp_path):
  rng = random.Random(1)
  cases = [("", "", ""), ("   ", " a ", "b"), (" ab  c ", "_a", "c_ ")]
  cases += [tuple("".join(rng.choice("ab _") for _ in range(rng.randrange(20))) for _ in range(3))
            for _ in range(150)]
  for parts in cases:
    ref_ids, ref_vocab = _ref_corpus(tmp_path, [_ref_text8_text(p) for p in parts])
    _check_equal(prepare.tokenize_text8(*(p.encode() for p in parts)), ref_ids, ref_vocab)
  with pytest.raises(ValueError, match="whitespace"):
    prepare.tokenize_text8(b"a\nb", b"a", b"b")


def _random_lines(rng, words):
  lines = []
  for _ in range(rng.randrange(8)):
    sep = rng.choice([" ", "  ", "\t", " \t "])
    lines.append(sep.join(rng.choice(words) for _ in range(rng.randrange(5))) + rng.choice(["", " "]))
  return "\n".join(lines) + rng.choice(["", "\n"])


def test_word_tokenizer_matches_reference(tmp_path):
  rng = random.Random(2)
  for _ in range(100):
    texts = [_random_lines(rng, ["the", "a", "cat", "<unk>", "@-@"]) for _ in range(2)]
    texts.append(_random_lines(rng, ["the", "a", "dog"]))
    tok = prepare.tokenize_words(*(io.StringIO(t, newline=None) for t in texts))
    ref_ids, ref_vocab = _ref_corpus(tmp_path, texts)
    _check_equal(tok, ref_ids, ref_vocab)


def test_frequency_vocab_matches_reference_sort_dict(tmp_path):
  rng = random.Random(3)
  for _ in range(100):
    train = _random_lines(rng, ["the", "a", "cat", "<unk>", "@-@", "on"]) or "\n"
    known = sorted(set(train.split())) or ["<eos>"]
    texts = [train] + [_random_lines(rng, known).replace("<eos>", "") for _ in range(2)]
    srt = prepare.sort_by_frequency(prepare.tokenize_words(*(io.StringIO(t) for t in texts)))
    ref_ids, ref_vocab = _ref_corpus(tmp_path, texts)
    assert len(ref_vocab) == len(set(train.split()) | {"<eos>"})  # valid/test add nothing
    word2id = _ref_sorted_dictionary(tmp_path / "train.txt")
    assert srt.vocab == tuple(sorted(word2id, key=word2id.get))
    for split, ref in zip(prepare.SPLITS, ref_ids):
      np.testing.assert_array_equal(srt.split(split), [word2id[ref_vocab[i]] for i in ref])


def test_vocab_is_first_appearance_over_train_then_valid_then_test():
  tok = prepare.tokenize_enwik8(b"ba\nb", b"c", b"\nda")
  assert tok.vocab == ("98", "97", "<eos>", "99", "100")
  np.testing.assert_array_equal(tok.train, [0, 1, 2, 0, 2])
  np.testing.assert_array_equal(tok.valid, [3, 2])
  np.testing.assert_array_equal(tok.test, [2, 4, 1, 2])
  assert tok.train.dtype == np.uint8


def test_frequency_order_ties_reverse_first_appearance():
  tok = prepare.tokenize_words(["a b b c"], ["c d"], [])  # counts a1 b2 c1 <eos>1
  srt = prepare.sort_by_frequency(tok)
  assert srt.vocab == ("b", "<eos>", "c", "a", "d")  # d (not in train) keeps its place after
  np.testing.assert_array_equal(srt.train, [3, 0, 0, 2, 1])
  np.testing.assert_array_equal(srt.valid, [2, 4, 1])


# ------------------------------------------------------------------------------ local files


def test_enwik8_head_local_file(enwik8_head, tmp_path):
  raw = np.fromfile(enwik8_head, np.uint8)
  splits = sources.file_splits(enwik8_head)
  assert splits.vocab_size == 200 and splits.vocab[0] == "60"  # '<' opens the XML
  a, b = round(raw.size * 0.9), round(raw.size * 0.95)
  for ids, part in ((splits.train, raw[:a]), (splits.valid, raw[a:b]), (splits.test, raw[b:])):
    byte_of = np.array([10 if t == "<eos>" else int(t) for t in splits.vocab])
    expected = part if part[-1] == 10 else np.append(part, 10)
    np.testing.assert_array_equal(byte_of[ids], expected)
  # Equal to the reference on a prefix, split at explicit offsets.
  head = tmp_path / "head.bin"
  head.write_bytes(raw[:30_000].tobytes())
  small = sources.file_splits(head, split_bytes=(20_000, 25_000))
  parts = [raw[:20_000], raw[20_000:25_000], raw[25_000:30_000]]
  ref_ids, ref_vocab = _ref_corpus(tmp_path, [_ref_enwik8_text(p.tobytes()) for p in parts])
  _check_equal(small, ref_ids, ref_vocab)
  raw_bytes = sources.file_splits(head, split_bytes=(20_000, 25_000), vocab="bytes")
  assert raw_bytes.vocab_size == 256
  np.testing.assert_array_equal(raw_bytes.valid, parts[1])


def test_local_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="nope.bin"):
    sources.file_splits(tmp_path / "nope.bin")
  empty = tmp_path / "empty.bin"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match="empty"):
    sources.file_splits(empty)
  short = tmp_path / "short.bin"
  short.write_bytes(b"hello world\n" * 100)
  with pytest.raises(ValueError, match="empty split"):
    sources.file_splits(short, split_bytes=(500, 500))
  cfg = get_base_config().data
  cfg.path = str(short)
  with pytest.raises(ValueError, match=r"1,200 bytes, but this config needs a file of at least"):
    sources.load_splits(cfg)
  cfg.block, cfg.batch, cfg.eval_batch = 4, 2, 2
  splits = sources.load_splits(cfg)
  assert splits.name == "file:short.bin" and splits.train.size == 1080  # ends with a newline: no extra <eos>


# ----------------------------------------------------------------------- packaged demo data

SHARED_HEAD = pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "enwik8_head.bin"


def test_packaged_head_is_the_first_bytes_of_enwik8():
  raw = demo.read_bytes()
  assert len(raw) == demo.SIZE == 4_154_000
  assert hashlib.md5(raw).hexdigest() == demo.MD5
  assert raw.startswith(b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/"')
  assert demo.compressed_path().stat().st_size < 1_300_000  # xz, shipped in the package
  if SHARED_HEAD.exists():  # the project's copy of enwik8's head, where it is beside the checkout
    assert raw == SHARED_HEAD.read_bytes()


def test_packaged_head_dataset_splits_like_the_file(enwik8_head):
  cfg = get_base_config().data
  cfg.dataset = "enwik8_head"
  splits = sources.load_splits(cfg, allow_download=False)
  assert splits.name == "enwik8_head"
  as_file = sources.file_splits(enwik8_head, split_bytes=demo.SPLIT_BYTES)
  assert splits.vocab == as_file.vocab and splits.vocab_size == 200
  for s in prepare.SPLITS:
    np.testing.assert_array_equal(splits.split(s), as_file.split(s))
  # 3,654,000 / 250,000 / 250,000 bytes; each split gets the closing <eos> (no final newline).
  assert (splits.train.size, splits.valid.size, splits.test.size) == (3_654_001, 250_001, 250_001)
  cfg.file_vocab = "bytes"
  raw = sources.load_splits(cfg, allow_download=False)
  np.testing.assert_array_equal(raw.valid, demo.as_array()[3_654_000:3_904_000])
  cfg.split_bytes = (4_054_000, 4_104_000)  # configs/demo.py: 50,000-byte valid and test
  raw = sources.load_splits(cfg, allow_download=False)
  assert (raw.train.size, raw.valid.size, raw.test.size) == (4_054_000, 50_000, 50_000)
  np.testing.assert_array_equal(raw.test, demo.as_array()[4_104_000:])


def test_min_file_bytes_is_the_smallest_file_that_holds_one_batch(tmp_path):
  # block 128, batch 16: train and valid need 16 x 129 tokens; valid is 5 % of the file.
  need = sources.min_file_bytes(128, 16, 8)
  assert need == 41_280
  cfg = get_base_config().data
  cfg.block, cfg.batch, cfg.eval_batch = 128, 16, 8
  text = (b"abcdefghij" * 5000)[:need - 1] + b"\n"
  f = tmp_path / "f.txt"
  for size, ok in ((need, True), (need - 1, False)):
    f.write_bytes(text[-size:])
    cfg.path = str(f)
    if ok:
      splits = sources.load_splits(cfg)
      assert splits.valid.size >= 16 * 129
    else:
      with pytest.raises(ValueError, match=f"{need - 1:,} bytes, but this config needs a file "
                                           f"of at least {need:,} bytes"):
        sources.load_splits(cfg)
  assert sources.min_file_bytes(128, 16, 8, split_bytes=(3000, 6000)) == 6016
  assert sources.min_file_bytes(128, 16, 8, split_bytes=(3000, 4000)) is None  # valid too short


# ------------------------------------------------------------------------------- synthetic


def test_synthetic_has_the_dependency_at_distance_d():
  d, v, noise = 7, 16, 0.2
  x, perm = sources.synthetic_tokens(200_000, v, d, noise, seed=3)
  x2, _ = sources.synthetic_tokens(200_000, v, d, noise, seed=3)
  np.testing.assert_array_equal(x, x2)
  hit = lambda lag: np.mean(x[lag:] == perm[x[:-lag]])
  assert abs(hit(d) - (1 - noise + noise / v)) < 0.01
  for lag in (d - 1, d + 1, 2 * d):
    assert hit(lag) < 0.15  # no dependency there (2D would need perm twice)
  assert np.bincount(x, minlength=v).min() > 0.5 * x.size / v
  cfg = get_base_config().data
  cfg.dataset, cfg.synthetic_length = "synthetic", 100_000
  cfg.block, cfg.batch = 64, 8
  splits = sources.load_splits(cfg)
  assert splits.vocab_size == 16 and splits.train.size == 90_000 and splits.test.size == 5_000


# -------------------------------------------------------------------------------- batching


def _ref_train_positions(stream_len, block, n_steps, seed):
  """The reference train_iteration loop, with our seeded offset in place of random.randrange."""
  train_pos, restarts, out = 0, 0, []
  for _ in range(n_steps):
    pos = train_pos
    train_pos += block
    reset = False
    if train_pos >= stream_len - block:
      train_pos = batching.restart_offset(seed, restarts, block, stream_len)
      restarts += 1
      reset = True
    out.append((pos, reset))
  return out


def test_streams_and_blocks_follow_the_reference():
  data = np.arange(103)
  streams = batching.as_streams(data, 4)
  assert streams.shape == (4, 25)
  np.testing.assert_array_equal(streams[2], np.arange(50, 75))
  it = batching.StreamIterator(data, batch=4, block=4, seed=5)
  expected = _ref_train_positions(25, 4, 60, seed=5)
  assert sum(r for _, r in expected) >= 5
  for pos, reset in expected:
    batch = next(it)
    np.testing.assert_array_equal(batch.x, streams[:, pos:pos + 4])
    np.testing.assert_array_equal(batch.y, streams[:, pos + 1:pos + 5])
    assert batch.reset == reset and batch.x.dtype == np.int32
  # First pass: blocks at 0, 4, ..., 20; the block at 20 is the last (24 >= 25 - 4): reset there.
  assert [r for _, r in expected[:6]] == [False] * 5 + [True]


@pytest.mark.parametrize("align,block", [(8, 8), (4, 8)])
def test_aligned_walk_keeps_blocks_on_records(align, block):
  """Records of `align` tokens (CIFAR images): every training block and every evaluation block
  starts on a record boundary, across restarts, while align=1 draws unaligned offsets."""
  n_records, batch = 40, 3
  data = np.tile(np.arange(align), n_records)  # token = position within its record
  streams = batching.as_streams(data, batch, align)
  assert streams.shape[1] % align == 0 and np.all(streams[:, 0] == 0)
  it = batching.StreamIterator(data, batch=batch, block=block, seed=4, align=align)
  starts = [next(it).x[:, 0] for _ in range(200)]
  assert it.state.restarts >= 10
  assert all(np.all(x == 0) for x in starts)
  for blk in batching.eval_blocks(data, batch, block, align=align):
    assert np.all(blk.x[:, 0] == 0)
  offsets = {batching.restart_offset(4, r, block, 500, align) for r in range(100)}
  assert offsets == set(range(0, block, align))  # every aligned offset, only those
  assert len({batching.restart_offset(4, r, block, 500) for r in range(100)}) > block // align


def test_restart_offset_deterministic_and_resumable():
  data = np.random.default_rng(0).integers(0, 50, 5_000)
  a = batching.StreamIterator(data, batch=8, block=16, seed=11)
  for _ in range(37):
    next(a)
  saved = json.dumps(a.state.to_dict())
  b = batching.StreamIterator(data, batch=8, block=16, seed=11, state=json.loads(saved))
  assert b.state == a.state
  for _ in range(200):
    ba, bb = next(a), next(b)
    np.testing.assert_array_equal(ba.x, bb.x)
    assert ba.reset == bb.reset
  assert a.state.restarts > 5
  offsets = [batching.restart_offset(11, r, 16, 625) for r in range(50)]
  assert offsets == [batching.restart_offset(11, r, 16, 625) for r in range(50)]
  assert len(set(offsets)) > 5 and all(0 <= o < 16 for o in offsets)
  assert offsets != [batching.restart_offset(12, r, 16, 625) for r in range(50)]


def test_process_slices_partition_the_streams():
  data = np.arange(4_000)
  full = next(batching.StreamIterator(data, batch=8, block=16, seed=0))
  parts = [next(batching.StreamIterator(data, 8, 16, 0, process_index=i, process_count=4))
           for i in range(4)]
  np.testing.assert_array_equal(np.concatenate([p.x for p in parts]), full.x)
  with pytest.raises(ValueError):
    batching.process_slice(8, 0, 3)


def test_stream_too_short_is_a_clear_error():
  with pytest.raises(ValueError, match="shorter than one block"):
    batching.StreamIterator(np.arange(40), batch=4, block=10, seed=0)


@pytest.mark.parametrize("n,batch,block", [(1003, 8, 16), (64, 8, 7), (800, 8, 10), (77, 2, 100)])
def test_full_eval_scores_every_target_once(n, batch, block):
  data = np.random.default_rng(n).integers(0, 1000, n)
  streams = batching.as_streams(data, batch)
  seen = np.zeros(streams.shape, np.int64)
  total = 0
  width = None
  for pos, eb in zip(batching.eval_positions(streams.shape[1], block),
                     batching.eval_blocks(data, batch, block)):
    pos = pos[0]
    width = width or eb.x.shape[1]
    assert eb.x.shape == eb.y.shape == eb.weights.shape == (batch, block)
    m = int(eb.weights[0].sum())
    np.testing.assert_array_equal(eb.y[:, :m], streams[:, pos + 1:pos + m + 1])
    np.testing.assert_array_equal(eb.x[:, :m], streams[:, pos:pos + m])
    seen[:, pos + 1:pos + m + 1] += 1
    total += eb.n_tokens
  assert (seen[:, 0] == 0).all() and (seen[:, 1:] == 1).all()
  assert total == n // batch * batch - batch


def _ref_full_eval_blocks(streams, block):  # adaptive-span trainer.full_eval's data walk
  train_pos, out = 0, []
  for _ in range(-(-streams.shape[1] // block)):
    out.append((streams[:, train_pos:train_pos + block],
                streams[:, train_pos + 1:train_pos + block + 1]))
    train_pos += block
    if train_pos >= streams.shape[1] - block:
      break
  return out


@pytest.mark.parametrize("n,batch,block", [(1003, 8, 16), (800, 8, 10), (8 * 33, 8, 16)])
def test_full_eval_drop_last_matches_reference(n, batch, block):
  data = np.arange(n)
  ref = _ref_full_eval_blocks(batching.as_streams(data, batch), block)
  ours = list(batching.eval_blocks(data, batch, block, drop_last=True))
  assert len(ours) == len(ref)
  for (x, y), eb in zip(ref, ours):
    np.testing.assert_array_equal(eb.x, x)
    np.testing.assert_array_equal(eb.y, y)
    assert eb.weights.all()
  assert sum(eb.n_tokens for eb in ours) == len(ref) * batch * block


# ------------------------------------------------------------------------ downloads, checks


class _FakeResponse(io.BytesIO):

  def __init__(self, body, status, length=None):
    super().__init__(body)
    self.status = status
    self.headers = {"Content-Length": str(len(body) if length is None else length)}

  def getcode(self):
    return self.status


def _fake_server(payload, honour_range=True, cut_at=None, log=None):
  """A urlopen stand-in serving `payload`, optionally stopping early (a dropped connection)."""
  def opener(request, timeout=None):
    del timeout
    rng = request.get_header("Range")
    if log is not None:
      log.append(rng)
    start = int(rng[len("bytes="):-1]) if rng and honour_range else 0
    body = payload[start:cut_at] if cut_at else payload[start:]
    return _FakeResponse(body, 206 if start else 200, length=len(payload) - start)
  return opener


def test_download_file_url_and_checksum(tmp_path):
  src = tmp_path / "src.bin"
  payload = bytes(range(256)) * 100
  src.write_bytes(payload)
  md5 = hashlib.md5(payload).hexdigest()
  dest = dl.download(src.as_uri(), tmp_path / "out" / "a.bin", md5=md5,
                     expected_size=len(payload), progress=False)
  assert dest.read_bytes() == payload
  with pytest.raises(dl.DataIntegrityError, match=f"expected {'0' * 32}.*deleted"):
    dl.download(src.as_uri(), tmp_path / "b.bin", md5="0" * 32, progress=False)
  assert not (tmp_path / "b.bin").exists() and not (tmp_path / "b.bin.part").exists()
  with pytest.raises(dl.DataIntegrityError, match="25,600 bytes, expected 30,000"):
    dl.download(src.as_uri(), tmp_path / "c.bin", expected_size=30_000, progress=False)
  (tmp_path / "d.bin").write_bytes(payload[:-1])  # an existing, truncated file is refused
  with pytest.raises(dl.DataIntegrityError, match="d.bin: 25,599 bytes, expected 25,600"):
    dl.download(src.as_uri(), tmp_path / "d.bin", expected_size=len(payload), progress=False)
  with pytest.raises(dl.DownloadError):
    dl.download((tmp_path / "missing").as_uri(), tmp_path / "e.bin", progress=False)


def test_download_resumes_with_range(tmp_path):
  payload = np.random.default_rng(0).bytes(10_000)
  sha = hashlib.sha256(payload).hexdigest()
  dest = tmp_path / "x.zip"
  log = []
  with pytest.raises(dl.DownloadError, match="resume"):
    dl.download("http://example/x.zip", dest, sha256=sha, progress=False,
                opener=_fake_server(payload, cut_at=4_000, log=log))
  assert (tmp_path / "x.zip.part").stat().st_size == 4_000 and not dest.exists()
  dl.download("http://example/x.zip", dest, sha256=sha, progress=False,
              opener=_fake_server(payload, log=log))
  assert log == [None, "bytes=4000-"] and dest.read_bytes() == payload
  # A server that ignores Range: the part file is rewritten from the start.
  (tmp_path / "y.zip.part").write_bytes(payload[:3_000])
  dl.download("http://example/y.zip", tmp_path / "y.zip", sha256=sha, progress=False,
              opener=_fake_server(payload, honour_range=False))
  assert (tmp_path / "y.zip").read_bytes() == payload


def _zip(path, members):
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
    for name, data in members.items():
      zf.writestr(name, data)
  return path


def test_corrupt_and_truncated_zip_are_clear_errors(tmp_path):
  data = np.random.default_rng(0).integers(97, 100, 50_000, dtype=np.uint8).tobytes()
  good = _zip(tmp_path / "good.zip", {"m": data})
  assert dl.read_zip_member(good, "m", expected_size=len(data),
                            md5=hashlib.md5(data).hexdigest()) == data
  raw = good.read_bytes()
  truncated = tmp_path / "truncated.zip"
  truncated.write_bytes(raw[:len(raw) // 2])
  with pytest.raises(dl.DataIntegrityError, match="truncated.zip: not a readable zip"):
    dl.read_zip_member(truncated, "m")
  corrupt = tmp_path / "corrupt.zip"
  flipped = bytearray(raw)
  flipped[len(raw) // 3] ^= 0xFF
  corrupt.write_bytes(bytes(flipped))
  with pytest.raises(dl.DataIntegrityError, match="corrupt.zip"):
    dl.read_zip_member(corrupt, "m")
  with pytest.raises(dl.DataIntegrityError, match="is 50,000 bytes, expected 100,000,000"):
    dl.read_zip_member(good, "m", expected_size=100_000_000)
  with pytest.raises(dl.DataIntegrityError, match="no member 'enwik8'"):
    dl.read_zip_member(good, "enwik8")
  with pytest.raises(dl.DataIntegrityError, match="md5 .*, expected a1fa5ff"):
    dl.read_zip_member(good, "m", md5="a1fa5ffddb56f4953e226637dabbb36a")


# ----------------------------------------------------------- corpora: download, prepare, cache


def test_corpus_download_prepare_cache(tmp_path, monkeypatch):
  text = b"<page>\n  <title>A</title>\n</page>\n" * 300 + b"tail"
  served = _zip(tmp_path / "served.zip", {"enwik8": text})
  corpus = sources.Corpus(served.as_uri(), "enwik8.zip", ("enwik8",), member_size=len(text),
                          member_md5=hashlib.md5(text).hexdigest(), heldout=1_000)
  monkeypatch.setitem(sources.CORPORA, "enwik8", corpus)
  cfg = get_base_config().data
  cfg.data_dir, cfg.block, cfg.batch, cfg.eval_batch = str(tmp_path / "cache"), 8, 4, 4
  splits = sources.load_splits(cfg)
  ref_ids, ref_vocab = _ref_corpus(
      tmp_path, [_ref_enwik8_text(p) for p in (text[:-2000], text[-2000:-1000], text[-1000:])])
  _check_equal(prepare.Splits(splits.train, splits.valid, splits.test, splits.vocab),
               ref_ids, ref_vocab)
  files = sorted(p.name for p in (tmp_path / "cache" / "enwik8").iterdir())
  assert files == ["test.npy", "train.npy", "valid.npy", "vocab.json"]
  info = json.loads((tmp_path / "cache" / "enwik8" / "vocab.json").read_text())
  assert info["vocab"] == ref_vocab and info["lengths"]["test"] == 1_001
  # The cache is enough: no zip needed any more.
  served.unlink()
  (tmp_path / "cache" / "enwik8.zip").unlink()
  again = sources.load_splits(cfg)
  np.testing.assert_array_equal(again.train, splits.train)
  # A missing cache and an unreachable URL: a clear message saying where to put the zip.
  cfg.data_dir = str(tmp_path / "empty")
  with pytest.raises(sources.DatasetUnavailableError, match=r"place it at .*empty/enwik8.zip"):
    sources.load_splits(cfg)


def test_text8_and_wikitext_from_zips(tmp_path, monkeypatch):
  text8 = (b" anarchism originated as a term of abuse " * 200).strip() + b" x"
  served = _zip(tmp_path / "t8.zip", {"text8": text8})
  monkeypatch.setitem(sources.CORPORA, "text8", sources.Corpus(
      served.as_uri(), "text8.zip", ("text8",), member_size=len(text8), heldout=500))
  t8 = sources.corpus_splits("text8", tmp_path / "c")
  ref_ids, ref_vocab = _ref_corpus(tmp_path, [
      _ref_text8_text(p.decode()) for p in (text8[:-1000], text8[-1000:-500], text8[-500:])])
  _check_equal(prepare.Splits(t8.train, t8.valid, t8.test, t8.vocab), ref_ids, ref_vocab)

  texts = [" = A = \n\n the cat sat \n the dog \n", " the cat \n", " \n the <unk> \n"]
  members = {f"wikitext-103/wiki.{s}.tokens": t.encode() for s, t in zip(prepare.SPLITS, texts)}
  _zip(tmp_path / "c" / "wikitext-103-v1.zip", members)  # placed by hand: no download
  monkeypatch.setitem(sources.CORPORA, "wikitext103", sources.Corpus(
      "http://unreachable.invalid/w.zip", "wikitext-103-v1.zip", tuple(members)))
  wt = sources.corpus_splits("wikitext103", tmp_path / "c")  # auto: frequency order
  ref_ids, ref_vocab = _ref_corpus(tmp_path, texts)
  word2id = _ref_sorted_dictionary(tmp_path / "train.txt")
  assert wt.vocab[:len(word2id)] == tuple(sorted(word2id, key=word2id.get))
  np.testing.assert_array_equal(wt.train, [word2id[ref_vocab[i]] for i in ref_ids[0]])
  first = sources.corpus_splits("wikitext103", tmp_path / "c", vocab_order="first")
  _check_equal(prepare.Splits(first.train, first.valid, first.test, first.vocab),
               ref_ids, ref_vocab)


def test_load_splits_dispatch(tmp_path):
  cfg = get_base_config().data
  cfg.dataset = "nope"
  with pytest.raises(ValueError, match="nope"):
    sources.load_splits(cfg)
  cfg.dataset = "file"
  with pytest.raises(ValueError, match="data.path"):
    sources.load_splits(cfg)
  f = tmp_path / "f.bin"
  f.write_bytes(b"abc\n" * 1000)
  cfg.dataset, cfg.path, cfg.block, cfg.batch, cfg.eval_batch = "enwik8", str(f), 8, 4, 4
  assert sources.load_splits(cfg).name == "file:f.bin"  # the local file wins


def test_tfds_builders_import():
  pytest.importorskip("tensorflow_datasets")
  from span_lm.data import tfds_builders  # pylint: disable=import-outside-toplevel
  assert tfds_builders.Enwik8.name == "enwik8" and tfds_builders.Text8.name == "text8"


def test_vocab_size_offline_reads_local_data_else_the_corpus_known_size(tmp_path):
  """The vocabulary the compile mode and the flops report size a model with when config.model
  says 0: the local data's (no download), else the corpus's known size (text8's 28 symbols,
  wikitext103's 267,735 words, not bytes' 256), else 256."""
  cfg = get_base_config().data
  cfg.dataset = "enwik8_head"
  assert sources.vocab_size_offline(cfg) == (200, "local data")
  cfg.data_dir = str(tmp_path)  # no corpus here, and nothing is downloaded
  for name, size in (("text8", 28), ("wikitext103", 267_735), ("enwik8", 256)):
    cfg.dataset = name
    assert sources.vocab_size_offline(cfg) == (size, f"{name} (known size)")
    assert not list(tmp_path.iterdir())
  cfg.dataset = "file"  # no path: nothing to read, nothing known
  assert sources.vocab_size_offline(cfg) == (256, "assumed (bytes)")
