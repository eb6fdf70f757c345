"""The tests' one factory of tiny random models and small data files (no download, a second to build).

``tiny_config`` / ``tiny_model`` (one tiny random config per supported family) live in ``families.py``,
which the transformers-glue tests extend, and are re-exported here; everything else is defined here.
Importable from every test: pytest puts ``tests/`` on the path (``pythonpath`` in pyproject.toml).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from pathlib import Path

import torch
from families import tiny_config, tiny_model

__all__ = [
    "RTE_ROWS",
    "kernel_backends",
    "kill_when_written",
    "require_kernels",
    "save_model",
    "save_sentence_transformer",
    "save_tokenizer",
    "swap_labels",
    "tiny_bert_config",
    "tiny_config",
    "tiny_model",
    "write_rte",
]

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PIECES = list(string.ascii_lowercase + string.digits + string.punctuation)
VOCAB = SPECIALS + PIECES + ["##" + piece for piece in PIECES]


def save_tokenizer(folder: Path) -> None:
    """A character-level WordPiece tokenizer (fast), so offsets work for any English text."""
    from transformers import BertTokenizer  # transformers 5: backed by `tokenizers` (fast)

    folder.mkdir(parents=True, exist_ok=True)
    BertTokenizer(
        vocab={piece: index for index, piece in enumerate(VOCAB)}, do_lower_case=True
    ).save_pretrained(folder)


def tiny_bert_config(num_labels: int = 2, labels: Sequence[str] | None = None):
    from transformers import BertConfig

    config = BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=512,
        pad_token_id=0,
        initializer_range=0.2,
        num_labels=num_labels,
    )
    if labels is not None:
        config.id2label = dict(enumerate(labels))
        config.label2id = {name: index for index, name in enumerate(labels)}
    return config


def save_model(
    folder: Path,
    head: str = "cls",
    labels: Sequence[str] | None = ("entailment", "not_entailment"),
    num_labels: int | None = None,
    seed: int = 0,
) -> Path:
    """A random 2-layer BERT with a ``cls`` (sequence classification), ``qa`` or ``base`` head."""
    import transformers as T

    torch.manual_seed(seed)
    count = num_labels if num_labels is not None else (len(labels) if labels else 2)
    config = tiny_bert_config(count, labels)
    model_class = {
        "cls": T.BertForSequenceClassification,
        "qa": T.BertForQuestionAnswering,
        "base": T.BertModel,
    }[head]
    model = model_class(config).eval()
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def save_sentence_transformer(
    folder: Path,
    pooling: str | Sequence[str] = "mean",
    dense: int | None = None,
    normalize: bool = True,
    max_seq_length: int = 64,
    seed: int = 0,
) -> Path:
    """A SentenceTransformer around a random 2-layer BERT: Transformer, Pooling, [Dense], [Normalize]."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer

    base = save_model(folder.parent / f"{folder.name}-bert", head="base", labels=None, seed=seed)
    torch.manual_seed(seed)
    transformer = Transformer(str(base), max_seq_length=max_seq_length)
    modes = (pooling,) if isinstance(pooling, str) else tuple(pooling)
    modules = [transformer, Pooling(transformer.get_embedding_dimension(), pooling_mode=modes)]
    if dense is not None:
        modules.append(Dense(modules[-1].get_embedding_dimension(), dense))
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def swap_labels(source: Path, folder: Path) -> Path:
    """The same classifier with its two outputs and label names swapped: the same predictions by name."""
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(source)
    with torch.no_grad():
        model.classifier.weight.copy_(model.classifier.weight.flip(0))
        model.classifier.bias.copy_(model.classifier.bias.flip(0))
    names = [model.config.id2label[1], model.config.id2label[0]]
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {name: index for index, name in enumerate(names)}
    model.save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def write_rte(folder: Path, rows: Sequence[tuple[str, str, str]]) -> Path:
    """``folder/RTE/dev.tsv`` in the GLUE layout (header; string labels; quotes are text)."""
    path = folder / "RTE" / "dev.tsv"
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ["index\tsentence1\tsentence2\tlabel"]
    lines += [f"{index}\t{a}\t{b}\t{label}" for index, (a, b, label) in enumerate(rows)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


RTE_ROWS = [
    ("A cat sat on the mat.", "A cat sat.", "entailment"),
    ('He said "yes, it works.', "He agreed.", "entailment"),
    ("The sky is green.", "The sky is blue.", "not_entailment"),
    ("Dogs bark at night.", "Cats bark.", "not_entailment"),
    ("Paris is in France.", "Paris is a city in France.", "entailment"),
    ("It rained all day.", "The ground stayed dry.", "not_entailment"),
    ("Tom bought 3 apples.", "Tom has apples.", "entailment"),
    ("The shop was closed on Sunday, so we left.", "The shop opened.", "not_entailment"),
]


def kernel_backends() -> list:
    """(backend name, device) pairs of the kernel backends; the CUDA one carries the ``cuda`` marker."""
    import pytest

    return [
        pytest.param("cpu", "cpu", id="cpu"),
        pytest.param("cuda", "cuda", id="cuda", marks=pytest.mark.cuda),
    ]


def require_kernels(backend: str) -> None:
    """Skip the test where ``backend``'s kernels are not available here, saying why."""
    import pytest

    from bert_cluster import dispatch

    ok, why = dispatch.BACKENDS[backend].is_available()
    if not ok:
        pytest.skip(f"{backend} kernels unavailable: {why}")


def kill_when_written(process, path: Path, timeout: float = 300.0) -> None:
    """``kill -9`` ``process`` once ``path`` exists (a checkpoint written); fail with its stderr if never."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while not path.is_file() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(signal.SIGKILL)
    _, error = process.communicate(timeout=30)
    assert path.is_file(), error.decode()[-2000:]
