"""Data: benchmark corpora, local files and a synthetic task, batched as the reference does.

`load_splits(config.data)` gives token ids; `StreamIterator` and `eval_blocks` cut them into
blocks. tfds_builders is optional and imported only on demand (it needs tensorflow_datasets).
"""
from span_lm.data.batching import Batch
from span_lm.data.batching import EvalBatch
from span_lm.data.batching import StreamIterator
from span_lm.data.batching import StreamState
from span_lm.data.batching import as_streams
from span_lm.data.batching import eval_blocks
from span_lm.data.batching import process_slice
from span_lm.data.download import DataIntegrityError
from span_lm.data.download import DownloadError
from span_lm.data.prepare import Splits
from span_lm.data.sources import DatasetUnavailableError
from span_lm.data.sources import corpus_splits
from span_lm.data.sources import file_splits
from span_lm.data.sources import load_splits
from span_lm.data.sources import synthetic_splits
from span_lm.data.sources import synthetic_tokens
