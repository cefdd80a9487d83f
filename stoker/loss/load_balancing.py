"""The load-balancing loss of a Mixture-of-Experts model (Mixtral, Qwen-MoE style), weighed exactly under
accumulation and data parallelism, over the scope `moe_aux_loss_scope` names.

Such a model, with output_router_logits=True and labels, adds coef x N_E x sum_i f_i P_i to its loss (transformers'
load_balancing_loss_func over the concatenated layers' router outputs, padding masked by attention_mask; coef is
router_aux_loss_coef, N_E the number of experts): f_i is the fraction of the top-k assignments that go to expert
i, P_i the mean router probability of expert i. stoker takes that term out of the model's loss and adds its own:

    micro_batch   each micro-batch's own aux loss (f and P over its own tokens), weighed like its task loss by
                  its share of the window's target items: the window's loss is the task loss plus coef x the
                  item-weighted mean of its micro-batches' aux losses. Balance is forced inside every micro-batch.
    global_batch  f over the whole window on every process (Qiu et al., ACL 2025, "Demons in the Detail"),
                  counted by a routing pass (forward only, no gradients) over the window before its first
                  backward, and one all-reduce; each micro-batch then backpropagates coef x N_E x sum_i f_i(window)
                  x its tokens' probability sums / the window's tokens, which add up over the window to the aux
                  loss of one batch of the window's rows: B x A x W equals one batch of B*A*W exactly. A window of
                  one micro-batch (no accumulation) needs no pass: its training forward routes the whole window,
                  and its counts are all-reduced between that forward and its backward.

In both the logged loss is the task loss plus coef x the aux loss of that scope (for global_batch, exactly the
loss transformers' model reports for one batch of the whole window).
"""

from __future__ import annotations

import inspect

import torch

from ..sdpa_mask import unpadded_attention

MICRO_BATCH, GLOBAL_BATCH = "micro_batch", "global_batch"
SCOPES = (MICRO_BATCH, GLOBAL_BATCH)


def has_router_loss(model) -> bool:
    """Whether the model adds a router's load-balancing loss to its own: a router_aux_loss_coef and
    output_router_logits=True in its config (as transformers' MoE models read them)."""
    config = getattr(model, "config", None)
    return (getattr(config, "output_router_logits", None) is True
            and getattr(config, "router_aux_loss_coef", None) is not None)


def load_balancing_problems(scope: str, model, compute_loss_func) -> list[str]:
    """Why `model` cannot train with moe_aux_loss_scope=`scope` (only 'global_batch' needs anything)."""
    if scope != GLOBAL_BATCH:
        return []
    setting = f"moe_aux_loss_scope={scope!r}"
    config = getattr(model, "config", None)
    name = type(model).__name__
    if getattr(config, "router_aux_loss_coef", None) is None or not hasattr(config, "output_router_logits"):
        return [f"{setting}: {name} has no router load-balancing loss (no router_aux_loss_coef / "
                "output_router_logits in its config); it is for Mixture-of-Experts models such as Mixtral and "
                "Qwen-MoE: leave moe_aux_loss_scope='micro_batch'"]
    if config.output_router_logits is not True:
        return [f"{setting}: {name} returns no router logits (its config has output_router_logits="
                f"{config.output_router_logits!r}), so it adds no load-balancing loss to balance: set "
                "model.config.output_router_logits=True, or leave moe_aux_loss_scope='micro_batch'"]
    if compute_loss_func is not None:
        return [f"{setting}: compute_loss_func replaces the model's loss, to which the load-balancing loss is "
                "added; use one or the other"]
    return []


def expert_assignments(router_logits, attention_mask, num_experts: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """(top-k assignments per expert, routed rows) over every layer's router logits ([tokens, N_E] each, the
    batch's rows flattened), padding left out as transformers' load_balancing_loss_func leaves it out: f_i is
    the first over the second."""
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    mask = _flat_mask(attention_mask, router_logits[0], device)
    for layer in router_logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        # a float count of whole assignments is exact below 2**24 per expert and window; scatter_add needs no host
        # sync, unlike bincount
        assigned = assigned.scatter_add(0, selected.reshape(-1), mask.repeat_interleave(top_k))
    return assigned, mask.sum() * len(router_logits)


def expert_probability_sums(router_logits, attention_mask) -> torch.Tensor:
    """Router probability per expert summed over every layer and every real token (P_i times the routed rows)."""
    device = router_logits[0].device
    mask = _flat_mask(attention_mask, router_logits[0], device)
    total = 0
    for layer in router_logits:
        weights = torch.nn.functional.softmax(layer.to(device), dim=-1)
        total = total + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
    return total


def _flat_mask(attention_mask, layer: torch.Tensor, device) -> torch.Tensor:
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.numel() != layer.shape[0]:
        return torch.ones(layer.shape[0], dtype=torch.float32, device=device)  # no padding (padding-free rows)
    return attention_mask.reshape(-1).to(device=device, dtype=torch.float32)


class LoadBalancing:
    """The load-balancing loss of one MoE model over `scope` (module docstring). `label_names` are left out of the
    routing pass's inputs (no loss computed there), `forward_kwargs` are those of every loss forward."""

    def __init__(self, model, scope: str, label_names: list[str], forward_kwargs: dict):
        config = model.config
        self.scope, self.label_names, self.forward_kwargs = scope, label_names, forward_kwargs
        # the model's own attributes where it keeps them (transformers' forward reads those), else its config's
        self.coef = float(getattr(model, "router_aux_loss_coef", config.router_aux_loss_coef))
        self.num_experts = int(getattr(model, "num_experts", None) or getattr(config, "num_local_experts", None)
                               or config.num_experts)
        self.top_k = int(getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok)
        # the routing pass needs no logits: one position's keeps its lm_head (vocab x hidden per token) out of it
        self.keeps_one_logit = "logits_to_keep" in _parameters(model)
        self.fraction, self.rows, self.scale = None, None, 1  # the window's f, routed rows, process factor

    @property
    def routes_windows(self) -> bool:
        """Whether each window needs a routing pass before its first backward (global_batch)."""
        return self.scope == GLOBAL_BATCH

    def route(self, model, window: list[dict], accelerator, averaged_across_devices: bool) -> None:
        """The routing pass of global_batch: every micro-batch of the window forward, no gradients, and one
        all-reduce of the expert assignments and routed rows, so that f_i(window, every process) is known before
        the first backward. Costs a forward of the model's body per micro-batch (measured in
        benchmarks/moe_routing.py).

        Run in training mode under one fork of the random state, so the passes draw the dropout masks (and any
        router jitter) the training forwards will draw after them, in the same order: the routing counted is
        the routing trained on. Buffers are put back."""
        # the data-parallel ranks average the gradients (the ranks of a tensor-parallel group share theirs)
        self.scale = 1 if averaged_across_devices else accelerator.data_parallel_size
        if len(window) == 1:  # counted from the training forward itself (aux_share)
            self.fraction = None
            return
        model.train()
        body = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
        device = accelerator.device
        counts = torch.zeros(self.num_experts + 1, dtype=torch.float32, device=device)
        buffers = [(b, b.detach().clone()) for b in body.buffers()]
        extra = {**self.forward_kwargs, "output_router_logits": True}
        if self.keeps_one_logit:
            extra["logits_to_keep"] = 1
        with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for batch in window:
                inputs = {k: v for k, v in batch.items() if k not in self.label_names}
                # as the training forward runs: rows the host counted as unpadded hand sdpa no mask without a read
                # of it on the device (stoker.sdpa_mask), one wait on a GPU's queue per micro-batch otherwise
                with unpadded_attention(batch):
                    router_logits = getattr(body(**inputs, **extra), "router_logits", None)
                if router_logits is None or len(router_logits) == 0:
                    raise ValueError(f"moe_aux_loss_scope='global_batch': {type(body).__name__} returned no "
                                     "router_logits with output_router_logits=True; a model without a router's "
                                     "logits cannot balance its experts over the global batch")
                assigned, rows = expert_assignments(router_logits, batch.get("attention_mask"), self.num_experts,
                                                    self.top_k)
                counts[:-1] += assigned
                counts[-1] += rows
            for b, saved in buffers:
                b.copy_(saved)
        self.fraction, self.rows = self._window_fraction(counts, accelerator)

    @staticmethod
    def _window_fraction(counts: torch.Tensor, accelerator) -> tuple[torch.Tensor, torch.Tensor]:
        """(f_i, routed rows) of the window on every process, from this process's counts (assignments per
        expert, then routed rows)."""
        if accelerator.num_processes > 1:  # the one collective the scope adds to a step
            counts = accelerator.reduce(counts, reduction="sum")
        rows = counts[-1].clamp_min(1)
        return counts[:-1] / rows, rows

    def task_loss(self, loss: torch.Tensor, outputs) -> torch.Tensor:
        """The model's loss without the aux term it added (coef x its micro-batch's aux loss). The gradient of
        that term cancels exactly; its value to float rounding."""
        aux = getattr(outputs, "aux_loss", None)
        return loss if aux is None else loss - self.coef * aux.to(loss.device)

    def aux_share(self, outputs, inputs: dict, convention, num_items, accelerator) -> torch.Tensor | float:
        """The micro-batch's share of coef x the window's aux loss over this scope."""
        if self.scope == GLOBAL_BATCH:
            mask = inputs.get("attention_mask")
            fraction, rows = self.fraction, self.rows
            if fraction is None:  # the window is this micro-batch (on every process): routed by this forward
                with torch.no_grad():
                    assigned, routed = expert_assignments(outputs.router_logits, mask, self.num_experts, self.top_k)
                    fraction, rows = self._window_fraction(torch.cat([assigned, routed.reshape(1)]), accelerator)
            sums = expert_probability_sums(outputs.router_logits, mask)
            aux = self.num_experts * (fraction.to(sums.device) * sums).sum() / rows.to(sums.device)
            return self.coef * aux * self.scale
        aux = getattr(outputs, "aux_loss", None)
        return 0.0 if aux is None else convention.share(self.coef * aux, inputs, num_items)


def _parameters(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)
