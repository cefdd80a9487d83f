"""The loss: how a micro-batch's loss becomes its exact share of the window's, whatever computes it.

    computation.py     a micro-batch's share of the window loss, as Trainer.compute_loss returns it:
                       LossConvention (what is known of the model's loss, the window's target items, a mean's
                       share), count_targets, and the one computation chosen per model (loss_computation: the
                       model's own loss, compute_loss_func, label smoothing, chunked, a shared prefix first); a
                       plain step's path through the package, all of it in this module
    normalization.py   how a model's loss is normalised, found out once: its family from transformers' mappings,
                       the probes of the first batch (causal shift, num_items_in_batch, per-token or per-sample)
    smoothing.py       label smoothing, the one implementation (LabelSmoothing: the Trainer's label_smoother)
    chunked.py         chunked cross-entropy of a causal LM from its hidden states (chunked_loss)
    prefix.py          a micro-batch's shared prompt prefix, run once and handed on as a KV cache (shared_prefix)
    load_balancing.py  a Mixture-of-Experts model's load-balancing loss over moe_aux_loss_scope
"""

from .chunked import chunked_cross_entropy, chunked_loss_problems, output_head
from .computation import LossConvention, count_targets, loss_computation
from .load_balancing import LoadBalancing, has_router_loss, load_balancing_problems
from .normalization import loss_or_none, model_family
from .prefix import prefix_body, shared_prefix_problems
from .smoothing import LabelSmoothing

__all__ = ["LabelSmoothing", "LoadBalancing", "LossConvention", "chunked_cross_entropy", "chunked_loss_problems",
           "count_targets", "has_router_loss", "load_balancing_problems", "loss_computation", "loss_or_none",
           "model_family", "output_head", "prefix_body", "shared_prefix_problems"]
