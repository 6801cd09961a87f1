"""`ConceptSFTTrainer`: TRL's `SFTTrainer` that trains on the model's own loss.

`trl.SFTTrainer` patches the model with a fused LM head and, in training, computes the loss itself from
the backbone's last hidden states (`trl.trainer.utils.add_fused_lm_head`). For the families here that loss
is not the model's: ConceptMoE's and DLCM's ratio loss and LSLM's KL term are dropped, and DLCM's μP
output scaling (logits × 1/s_token) is skipped. The router then follows the LM loss alone and its
compression drifts; the model warns once, at the first training step (`modeling/loss_terms.py`: its
backbone ran in training without the causal LM assembling the loss).

`ConceptSFTTrainer` keeps everything of `SFTTrainer` (datasets, formatting, collators, completion-only
labels, PEFT wiring) and takes the loss from the model's own forward, as `ConceptTrainer` does, with
`ConceptTrainer`'s metric logging and the running counts of the global ratio scope. Its extra SFT metrics
(entropy, token accuracy), which need the fused head's outputs, are not logged. Needs `trl` (the dev extra
installs it); import it from this module: `from hf_concept.training.sft import ConceptSFTTrainer`.
"""

from __future__ import annotations

from trl import SFTTrainer

from hf_concept.training.trainer import ConceptTrainer


class ConceptSFTTrainer(ConceptTrainer, SFTTrainer):
    """`trl.SFTTrainer` whose loss is the model's own (LM + ratio or KL term), logged as `ConceptTrainer`
    logs it."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # SFTTrainer's forwards run without a cache (it would conflict with gradient checkpointing).
        inputs["use_cache"] = False
        return ConceptTrainer.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)
