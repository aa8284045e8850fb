"""A semi-synchronous training loop in plain torch: the reference of ``TrainPipelineSemiSync`` (no tests here).

No pipeline machinery: each step calls the sharded embedding modules itself, in the order the
semi-sync schedule fixes, and runs the model's forward on embeddings looked up earlier
(``served``: the sharded modules return them instead of looking up). For batch i:

1. ``optimizer.zero_grad()``; batch i is looked up now if no earlier step did;
2. forward of batch i on its embeddings;
3. semi-sync phase (i >= ``start_batch``): batch i+1 looked up by the early modules;
4. ``loss.backward()`` (the fused optimizers update batch i's rows); batch i+1 looked up by
   ``after_backward`` modules (semi-sync phase);
5. semi-sync phase with ``stash_gradients``: every parameter takes the gradient stashed at the
   previous step and stashes its own (nothing stashed yet: no optimizer step);
6. ``optimizer.step()``; batch i+1 looked up by ``after_optimizer`` modules (semi-sync phase), or
   by every module (synchronous phase).

This is torchrec's own semi-sync test (``test_equal_to_non_pipelined`` of
``EmbeddingTrainPipelineTest``: ``dense_forward(prior_batch, prior_sparse_out)``, then
``sparse_forward(batch)`` before ``loss.backward()`` once semi-sync) written for any model whose
sharded modules read one feature attribute of the batch. Runs inside gloo ranks.
"""

from __future__ import annotations

import contextlib
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

#: name -> (sharded module, the batch's features it looks up)
SparseLookups = Dict[str, Tuple[nn.Module, Callable[[Any], Any]]]


def two_module_lookups(dmp: Any) -> SparseLookups:
    """The sharded EBC and EC of ``harness.pipelines.TwoModuleModel`` (the pipeline's names)."""
    return {"ebc": (dmp.module.ebc, lambda b: b.ebc_features), "ec": (dmp.module.ec, lambda b: b.ec_features)}


def look_up(lookups: SparseLookups, names: Sequence[str], batch: Any) -> Dict[str, Any]:
    """Each named sharded module's output on ``batch`` (input dist, lookup, output dist, waited)."""
    return {name: lookups[name][0](lookups[name][1](batch)).wait() for name in names}


@contextlib.contextmanager
def served(lookups: SparseLookups, embeddings: Dict[str, Any]) -> Iterator[None]:
    """While open, each sharded module returns its entry of ``embeddings`` instead of looking up
    (an instance attribute ``forward``, removed on exit)."""
    for name, result in embeddings.items():
        lookups[name][0].forward = lambda *args, _result=result, **kwargs: _result  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name in embeddings:
            del lookups[name][0].forward


def swap_gradients(model: nn.Module, stash: Optional[Dict[str, Optional[torch.Tensor]]]) -> Dict[str, Any]:
    """Stashes (copies) every parameter's gradient and sets the ones of ``stash`` (None: no grads)."""
    mine = {name: (p.grad.clone() if p.grad is not None else None) for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.grad = None if stash is None else stash[name]
    return mine


def semi_sync_reference_steps(
    model: nn.Module,
    optimizer: Any,
    batches: Sequence[Any],
    lookups: SparseLookups,
    *,
    start_batch: int,
    stash_gradients: bool,
    after_backward: AbstractSet[str] = frozenset(),
    after_optimizer: AbstractSet[str] = frozenset(),
    look_up_at_step: AbstractSet[int] = frozenset(),
    before_step: Optional[Callable[[int], None]] = None,
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Trains ``model`` on ``batches`` semi-synchronously from ``start_batch`` on, yielding each step's
    ``(loss, logits)``; an exception of the model or optimizer propagates after the steps before it
    (the lookup of the next batch made in the failing step is dropped).

    Args:
        model: a model returning ``(loss, (loss, logits))`` whose sharded modules are ``lookups``.
        optimizer: its dense optimizer.
        batches: the batches, in order.
        lookups: the sharded modules, in the order they are looked up.
        start_batch: the first step whose next batch is looked up before the backward.
        stash_gradients: the optimizer applies the previous step's gradients (semi-sync phase).
        after_backward, after_optimizer: modules whose semi-sync lookup follows the backward / the
            optimizer step.
        look_up_at_step: steps whose batch is looked up at their own start (step 1), not by the
            step before.
        before_step: called with the step's index before it starts.
    """
    names = list(lookups)
    early = [n for n in names if n not in after_backward and n not in after_optimizer]
    late_backward = [n for n in names if n in after_backward and n not in after_optimizer]
    late_optimizer = [n for n in names if n in after_optimizer]
    stash: Optional[Dict[str, Any]] = None
    embeddings: Optional[Dict[str, Any]] = None
    for i, batch in enumerate(batches):
        if before_step is not None:
            before_step(i)
        semi = i >= start_batch
        nxt = batches[i + 1] if i + 1 < len(batches) and i + 1 not in look_up_at_step else None
        optimizer.zero_grad()
        if embeddings is None:
            embeddings = look_up(lookups, names, batch)
        with served(lookups, embeddings):
            loss, (_, out) = model(batch)
        upcoming: Dict[str, Any] = {}
        if nxt is not None and semi:
            upcoming.update(look_up(lookups, early, nxt))
        loss.backward()
        if nxt is not None and semi:
            upcoming.update(look_up(lookups, late_backward, nxt))
        step = True
        if semi and stash_gradients:
            step = stash is not None
            stash = swap_gradients(model, stash)
        if step:
            optimizer.step()
        if nxt is not None:
            upcoming.update(look_up(lookups, late_optimizer if semi else names, nxt))
        embeddings = {n: upcoming[n] for n in names} if nxt is not None else None
        yield loss.detach().clone(), out.clone()


def run_semi_sync_reference(
    model: nn.Module, optimizer: Any, batches: Sequence[Any], lookups: SparseLookups, **kwargs: Any
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """:func:`semi_sync_reference_steps` run to the end: ``(losses, logits)`` per step."""
    steps = list(semi_sync_reference_steps(model, optimizer, batches, lookups, **kwargs))
    return [loss for loss, _ in steps], [out for _, out in steps]
