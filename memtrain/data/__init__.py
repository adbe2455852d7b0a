"""Training data: corpus, tokenizer, canaries and the packed single-pass stream.

    from memtrain.data import DataConfig, CanaryConfig, build_stream
    stream = build_stream(DataConfig(seq_len=256), CanaryConfig(number=8, copies=[1, 2, 4, 8]), seed=0)
    batch = stream.batch(step, batch_size)      # input_ids, labels (-100 = unsupervised), doc_pos
    stream.write_manifest(run_dir, batch_size, data_shards)
"""

from memtrain.data.canaries import Canary, Placement, render_secret
from memtrain.data.config import CanaryConfig, DataConfig
from memtrain.data.corpus import Corpus, Document, load_corpus
from memtrain.data.packing import document_positions, locate, occurrences
from memtrain.data.stream import TrainStream, build_stream
from memtrain.data.tokenizer import load_tokenizer, train_bpe, vocab_size

__all__ = [
    "Canary", "CanaryConfig", "Corpus", "DataConfig", "Document", "Placement", "TrainStream", "build_stream",
    "document_positions", "load_corpus", "load_tokenizer", "locate", "occurrences", "render_secret",
    "train_bpe", "vocab_size",
]
