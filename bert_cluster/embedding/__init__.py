"""Sentence embeddings of a whole corpus with a (patched) model: ``embed`` and ``bert-cluster embed``.

``documents`` reads the input as a stream (a run holds one shard of documents at a time), ``plan``
fixes the shards and batches, ``store`` keeps the output folder whole (lock, atomic shards, resume,
manifest), ``run`` ties them together and ``progress`` shows it.
"""

from bert_cluster.embedding.documents import (
    Corpus,
    Document,
    Input,
    Problem,
    Scan,
    open_documents,
    read_documents,
)
from bert_cluster.embedding.run import DTYPES, EmbedInterrupted, EmbedResult, embed
from bert_cluster.embedding.store import read_output

__all__ = [
    "DTYPES",
    "Corpus",
    "Document",
    "EmbedInterrupted",
    "EmbedResult",
    "Input",
    "Problem",
    "Scan",
    "embed",
    "open_documents",
    "read_documents",
    "read_output",
]
