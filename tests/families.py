"""Tiny random models of every encoder family the glue knows, for tests of the transformers glue."""

from __future__ import annotations

import pytest
import torch

from bert_cluster.hf import ROUTED_FAMILIES, SUPPORTED_FAMILIES

# The family lists live once, in bert_cluster.hf (which warns when it converts a family outside them).
#: Families whose attention goes through transformers' AttentionInterface: ``convert`` supports them.
SUPPORTED = list(SUPPORTED_FAMILIES)
#: Further native families whose attention goes through the interface (checked on 5.24), tested lighter.
ALSO_ROUTED = list(ROUTED_FAMILIES)
#: Families that compute attention in their own code: ``convert`` refuses them.
REFUSED = ["deberta", "deberta-v2", "mpnet", "megatron-bert"]
#: Families with sliding-window (local) layers next to global ones.
HYBRID = ["modernbert", "ultrabert", "neomme"]

#: Tiny sizes shared by every family. initializer_range 0.2 makes attention sharp, so approximations show.
COMMON = dict(
    vocab_size=120,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=80,
    pad_token_id=0,
    initializer_range=0.2,
)
#: Hybrid families get three layers (local, local, global) and a window of 4 on each side.
HYBRID_LAYERS = 3
HALF_WINDOW = 4


def _config_class(name: str):
    """``transformers.<name>``; the test skips when this transformers lacks that family (an older release
    than the family: the GPU machine's 5.17 has no ``GteConfig`` or ``UltrabertConfig``)."""
    import transformers

    found = getattr(transformers, name, None)
    if found is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return found


class _Transformers:
    """transformers' config classes, each looked up (and the test skipped when absent) as it is used."""

    def __getattr__(self, name: str):
        return _config_class(name)


def tiny_config(family: str):
    """A 2-layer (3 for hybrid families), 4-head random config of an encoder family."""
    T = _Transformers()
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
        return T.AlbertConfig(embedding_size=16, **COMMON)
    if family in ("roberta", "xlm-roberta", "camembert", "gte", "jina_embeddings_v3"):
        # RoBERTa-style position ids start after pad_token_id; the rotary ones ignore it.
        configs = {
            "roberta": T.RobertaConfig,
            "xlm-roberta": T.XLMRobertaConfig,
            "camembert": T.CamembertConfig,
            "gte": T.GteConfig,
            "jina_embeddings_v3": T.JinaEmbeddingsV3Config,
        }
        return configs[family](**{**COMMON, "pad_token_id": 1})
    if family == "modernbert":
        return T.ModernBertConfig(
            **{**COMMON, "num_hidden_layers": HYBRID_LAYERS},
            local_attention=2 * HALF_WINDOW,
            global_attn_every_n_layers=3,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            initializer_cutoff_factor=3.0,
            bos_token_id=2,
            eos_token_id=3,
            cls_token_id=2,
            sep_token_id=3,
        )
    if family == "ultrabert":
        return T.UltrabertConfig(
            **{**COMMON, "num_hidden_layers": HYBRID_LAYERS},
            num_key_value_heads=2,  # grouped-query attention
            sliding_window=HALF_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            prediction_head_size=32,
        )
    if family == "neomme":
        # Rotary dims must be a multiple of 4 on both M-RoPE axes: head_dim 16. Layer 1 keeps NeoMME's
        # default long window (1,024), wider than any test input.
        return T.NeoMMEConfig(
            **{**COMMON, "hidden_size": 64, "num_hidden_layers": HYBRID_LAYERS},
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=HALF_WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            embedding_rank=16,
            embedding_dim=16,
        )
    if family == "eurobert":
        return T.EuroBertConfig(
            **COMMON, num_key_value_heads=2, mask_token_id=3, bos_token_id=2, eos_token_id=2
        )
    if family in ALSO_ROUTED:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        extra = {
            "mobilebert": dict(embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16),
            "xmod": dict(languages=["en_XX"], default_language="en_XX"),
        }.get(family, {})
        if family not in CONFIG_MAPPING:
            import transformers

            pytest.skip(f"transformers {transformers.__version__} has no {family!r} family")
        return CONFIG_MAPPING[family](**COMMON, **extra)
    configs = {
        "bert": T.BertConfig,
        "electra": T.ElectraConfig,
        "nomic_bert": T.NomicBertConfig,
        "deberta": T.DebertaConfig,
        "deberta-v2": T.DebertaV2Config,
        "mpnet": T.MPNetConfig,
        "megatron-bert": T.MegatronBertConfig,
    }
    return configs[family](**COMMON)


def tiny_model(family: str, head: str = "base"):
    """A random model of ``family`` in eval mode (seed 0), with the head named by ``head``."""
    import transformers as T

    auto = {"base": T.AutoModel, "cls": T.AutoModelForSequenceClassification}[head]
    torch.manual_seed(0)
    model = auto.from_config(tiny_config(family)).eval()
    with torch.no_grad():  # NeoMME starts its output projections at zero: attention would not show
        for weight in model.parameters():
            if weight.dim() >= 2 and not weight.any():
                weight.normal_(0.0, 0.2)
    return model


def uses_absolute_positions(family: str) -> bool:
    """Whether position ids come from the input's index (a left-padded row then needs explicit ones)."""
    return family in ("bert", "distilbert", "electra", "albert", "megatron-bert")
