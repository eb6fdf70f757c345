"""Tiny random models of every BERT family, for tests of the transformers glue."""

from __future__ import annotations

import torch


def tiny_config(family: str):
    """A 2-layer, 4-head random config of a BERT-family model."""
    import transformers as T

    common = dict(
        vocab_size=120,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=80,
        pad_token_id=0,
        initializer_range=0.2,
    )  # sharp attention, so approximations show
    if family == "distilbert":
        return T.DistilBertConfig(
            vocab_size=120,
            dim=32,
            n_layers=2,
            n_heads=4,
            hidden_dim=37,
            max_position_embeddings=80,
            pad_token_id=0,
            initializer_range=0.2,
        )
    if family == "albert":
        return T.AlbertConfig(embedding_size=16, **common)
    if family == "roberta":
        return T.RobertaConfig(**{**common, "pad_token_id": 1})
    if family == "xlm-roberta":
        return T.XLMRobertaConfig(**{**common, "pad_token_id": 1})
    configs = {
        "bert": T.BertConfig,
        "electra": T.ElectraConfig,
        "camembert": T.CamembertConfig,
        "deberta-v2": T.DebertaV2Config,
        "mpnet": T.MPNetConfig,
    }
    return configs[family](**common)


def tiny_model(family: str, head: str = "base"):
    import transformers as T

    auto = {"base": T.AutoModel, "cls": T.AutoModelForSequenceClassification}[head]
    torch.manual_seed(0)
    return auto.from_config(tiny_config(family)).eval()
