"""Self-distillation: train the converted model towards the unmodified checkpoint's own outputs.

Fine-tuning on the task's labels adapts the weights to the approximation, but it also trains the task
further, and on a small train set (RTE: 2,490 examples) that moves the model away from the checkpoint it
started from. The teacher here is that checkpoint with its original attention, frozen: the loss
``(1 - weight) * task loss + weight * distance to the teacher's outputs`` with ``weight = 1`` asks only that
the clustered model give what the exact one gives, which is what an approximation should win back.

The distance for each head the finetune losses train: classes, the KL divergence of the temperature-softened
distributions (times T², Hinton et al.'s scaling, so that the gradient's size does not depend on T); a
regression score, the squared difference; SQuAD spans, the mean of the start and end logits' KL divergences
over each window's real tokens (padding masked in both).

Both models run without dropout: with it, the distance would be mostly the dropout's noise, which no weights
can remove (RTE's checkpoint on 128 train pairs: KL 0.067 from dropout alone, 0.0067 from C = 10). A
control with exact attention has no distance at all then; ``dropout=True`` keeps the student's dropout on.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch.nn import functional

#: The inputs that are labels (given to the model for its task loss, never to the teacher).
LABEL_KEYS = ("labels", "start_positions", "end_positions")


def _kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """Mean over the rows of KL(teacher || student) between softmax(logits / T), times T²."""
    log_student = functional.log_softmax(student.float() / temperature, dim=-1)
    log_teacher = functional.log_softmax(teacher.float() / temperature, dim=-1)
    per_row = (log_teacher.exp() * (log_teacher - log_student)).sum(dim=-1)
    return per_row.mean() * temperature**2


def distillation_loss(
    loss: str, student: Any, teacher: Any, attention_mask: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """The distance of ``student``'s outputs from ``teacher``'s for the head that trains ``loss``."""
    if loss == "cross-entropy":
        return _kl(student.logits, teacher.logits, temperature)
    if loss == "mse":
        return functional.mse_loss(student.logits.float(), teacher.logits.float())
    if loss == "span-cross-entropy":
        pair = []
        for name in ("start_logits", "end_logits"):
            s, t = getattr(student, name).float(), getattr(teacher, name).float()
            if attention_mask is not None:  # padding gets no probability in either distribution
                padding = attention_mask == 0
                s = s.masked_fill(padding, torch.finfo(s.dtype).min / 4)
                t = t.masked_fill(padding, torch.finfo(t.dtype).min / 4)
            pair.append(_kl(s, t, temperature))
        return (pair[0] + pair[1]) / 2
    raise ValueError(f"no distillation loss for {loss!r}")


class DistillationTrainer(transformers.Trainer):
    """``Trainer`` whose loss mixes the task loss with the distance to a frozen teacher's outputs."""

    def __init__(
        self,
        *args: Any,
        teacher: Any,
        weight: float,
        temperature: float,
        loss: str,
        dropout: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher.to(self.args.device).eval().requires_grad_(False)
        self.weight, self.temperature, self.loss_kind, self.dropout = weight, temperature, loss, dropout

    def compute_loss(  # noqa: D102
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        if not self.dropout:
            model.eval()  # Trainer set train mode: without dropout the distance is the approximation's alone
        outputs = model(**inputs)
        with torch.no_grad():
            teacher = self.teacher(**{key: value for key, value in inputs.items() if key not in LABEL_KEYS})
        distance = distillation_loss(
            self.loss_kind, outputs, teacher, inputs.get("attention_mask"), self.temperature
        )
        loss = distance if self.weight == 1.0 else (1.0 - self.weight) * outputs.loss + self.weight * distance
        return (loss, outputs) if return_outputs else loss
