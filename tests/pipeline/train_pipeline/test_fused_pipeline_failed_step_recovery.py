"""TrainPipelineFusedSparseDist against torchrec's TrainPipelineSparseDist when a step fails.

A user's step can raise in the model's forward, in the optimizer step, in the
dataloader or in an embedding lookup (an out-of-range id with fbgemm's
``BoundsCheckMode.FATAL``, run on one process as a TABLE_WISE table's lookup
fails on its owner rank only; a training TBE under ``torch.inference_mode()``);
the user may retry ``progress()``, ``detach()`` / ``attach()``, call ``reset()``
and continue, or save a checkpoint. torchrec's pipeline looks a batch up inside
its forward; the fused pipeline issues that lookup one step earlier, so after a
failure it must take back what torchrec would not have run yet (fbgemm TBE
``step`` / ``iter``, which row-wise Adagrad counts), raise a lookup's exception
in the step torchrec raises it, and fail again the way torchrec does on a retry.
The reference is torchrec's own pipeline on an identically initialised copy
(``breadth_model.BreadthModel``: two EBCs, a weighted EBC and an EC, called in
that order, row-wise Adagrad, TABLE_WISE / COLUMN_WISE / ROW_WISE): every step's
outputs or exception (an ``AssertionError`` is compared as such), the final
parameters, fused optimizer state and TBE counters must be equal, for every
``use_emb_lookup_stream`` x ``embedding_lookup_after_opt``.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import harness.breadth_model as breadth
import pytest
import torch
from harness.gloo import run_gloo
from harness.pipelines import FLAG_COMBOS

SHARDINGS = {"ta": "column_wise", "tb": "row_wise", "ts": "row_wise"}


class InjectedFailure(ValueError):
    """The failure the scenarios inject (in the forward, the optimizer or the dataloader)."""


class FlakyOptimizer:
    """The dense optimizer, whose ``step()`` raises once when ``fail_next`` is set.

    Args:
        optimizer (torch.optim.Optimizer): the wrapped optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.fail_next = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.fail_next:
            self.fail_next = False
            raise InjectedFailure("optimizer step failed")
        self.optimizer.step()


class FlakyIterator:
    """Batches, raising ``InjectedFailure`` once instead of yielding batch ``fail_at``.

    Args:
        batches (Sequence[Any]): the batches.
        fail_at (int): the position whose first ``next()`` raises (-1: never).
    """

    def __init__(self, batches: Sequence[Any], fail_at: int = -1) -> None:
        self._batches = list(batches)
        self._pos = 0
        self._fail_at = fail_at

    def __iter__(self) -> "FlakyIterator":
        return self

    def __next__(self) -> Any:
        if self._pos == self._fail_at:
            self._fail_at = -1
            raise InjectedFailure("dataloader failed")
        if self._pos >= len(self._batches):
            raise StopIteration
        self._pos += 1
        return self._batches[self._pos - 1]


# A scenario: a list of actions.
#   ("steps", n): n progress() calls, each recording its outputs or its exception
#   ("fail_forward", module): the next call of that sharded module raises
#   ("fail_optimizer",): the next optimizer step raises
#   ("reset",): pipeline.reset()
#   ("counters",): records the TBE (step, iter) counters (what a checkpoint saved now holds)
#   ("detach_attach",): pipeline.attach(pipeline.detach())
#   ("eval_inference",) / ("train",): model.eval() under torch.inference_mode() / model.train()
SCENARIOS: Dict[str, Dict[str, Any]] = {
    "optimizer_fails_then_reset": {
        "actions": [("steps", 2), ("fail_optimizer",), ("steps", 1), ("counters",), ("reset",), ("steps", 5)]
    },
    "optimizer_fails_then_retry": {"actions": [("steps", 2), ("fail_optimizer",), ("steps", 3), ("counters",)]},
    "forward_fails_midway_then_retry": {
        "actions": [("steps", 2), ("fail_forward", "ec"), ("steps", 1), ("counters",), ("steps", 2)]
    },
    "forward_fails_midway_retry_then_reset": {
        "actions": [("steps", 2), ("fail_forward", "ec"), ("steps", 2), ("reset",), ("steps", 5)]
    },
    "forward_fails_first_then_retry": {
        "actions": [("steps", 2), ("fail_forward", "ebc1"), ("steps", 1), ("counters",), ("steps", 7)]
    },
    # detach() / attach() (re-attaching after a failure) does not make the failed batch rerun
    "forward_fails_midway_then_detach_attach": {
        "actions": [
            ("steps", 2),
            ("fail_forward", "ec"),
            ("steps", 1),
            ("detach_attach",),
            ("steps", 2),
            ("counters",),
            ("reset",),
            ("steps", 5),
        ]
    },
    # the dataloader raises once instead of yielding batch 4 (in the third step)
    "dataloader_fails_then_retry": {"fail_at": 4, "actions": [("steps", 3), ("counters",), ("steps", 7)]},
    # fbgemm's training TBE cannot run under inference_mode: the lookup raises
    # NotImplementedError, in the forward of the first such step in torchrec
    "eval_under_inference_mode_then_reset": {
        "actions": [
            ("steps", 2),
            ("eval_inference",),
            ("steps", 2),
            ("train",),
            ("steps", 1),
            ("counters",),
            ("reset",),
            ("steps", 5),
        ]
    },
    # one process: an out-of-range id with fbgemm's BoundsCheckMode.FATAL makes the
    # lookup of that batch raise (in its own step, in torchrec)
    "out_of_range_id_in_batch_3_then_reset": {
        "world_size": 1,
        "bad_id_batch": 3,
        "actions": [("steps", 5), ("counters",), ("reset",), ("steps", 5)],
    },
    "out_of_range_id_in_batch_0_then_reset": {
        "world_size": 1,
        "bad_id_batch": 0,
        "actions": [("steps", 2), ("counters",), ("reset",), ("steps", 7)],
    },
}


def _with_bad_id(batch: Any) -> Any:
    """``batch`` with its first id of feature "c" (table "tc", TABLE_WISE) out of range."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = batch.features
    values = kjt.values().clone()
    assert kjt["c"].values().numel() > 0
    values[kjt.offset_per_key()[kjt.keys().index("c")]] = 10**6
    batch.features = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), values=values, lengths=kjt.lengths())
    return batch


def _body(rank: int, world_size: int, name: str) -> Dict[Any, Any]:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    scenario = SCENARIOS[name]
    fused_params: Dict[str, Any] = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    if "bad_id_batch" in scenario:
        fused_params["bounds_check_mode"] = BoundsCheckMode.FATAL
    device = torch.device("cpu")
    out: Dict[Any, Any] = {}
    for key in ["torchrec", *FLAG_COMBOS]:
        dmp, dense = breadth.build_breadth(SHARDINGS, fused_params)
        opt = FlakyOptimizer(dense)
        if key == "torchrec":
            pipe: Any = TrainPipelineSparseDist(dmp, opt, device)
        else:
            pipe = TrainPipelineFusedSparseDist(
                dmp, opt, device, use_emb_lookup_stream=key[0], embedding_lookup_after_opt=key[1]
            )
        fail_module: List[Optional[str]] = [None]

        def pre_hook(module: torch.nn.Module, args: Any, module_name: str = "") -> None:
            if fail_module[0] == module_name:
                fail_module[0] = None
                raise InjectedFailure(f"forward failed in {module_name}")

        for module_name in ("ebc1", "ec"):
            getattr(dmp.module, module_name).register_forward_pre_hook(lambda m, a, n=module_name: pre_hook(m, a, n))
        batches = breadth.make_breadth_batches(rank, [8] * 9, seed=3)
        if "bad_id_batch" in scenario:
            _with_bad_id(batches[scenario["bad_id_batch"]])
        it: Iterator[Any] = FlakyIterator(batches, scenario.get("fail_at", -1))
        inference = torch.inference_mode()
        trace: List[Tuple[Any, ...]] = []
        for action in scenario["actions"]:
            if action[0] == "steps":
                for _ in range(action[1]):
                    try:
                        output = pipe.progress(it)
                    except StopIteration:
                        trace.append(("stop",))
                    except AssertionError:  # torchrec's PipelinedForward raises a bare AssertionError
                        trace.append(("raised", "AssertionError"))
                    except (InjectedFailure, NotImplementedError, RuntimeError) as e:
                        trace.append(("raised", type(e).__name__, str(e)[:200]))
                    else:
                        trace.append(("ok", [t.numpy() for t in breadth.flatten_outputs(output)]))
            elif action[0] == "fail_forward":
                fail_module[0] = action[1]
            elif action[0] == "fail_optimizer":
                opt.fail_next = True
            elif action[0] == "reset":
                pipe.reset()
            elif action[0] == "detach_attach":
                pipe.attach(pipe.detach())
            elif action[0] == "counters":
                trace.append(("counters", breadth.tbe_counters(dmp)))
            elif action[0] == "eval_inference":
                dmp.eval()
                inference.__enter__()
            elif action[0] == "train":
                inference.__exit__(None, None, None)
                dmp.train()
        out[key] = (trace, breadth.final_state(dmp))
    return out


def _assert_same(label: str, got: Tuple[Any, Any], want: Tuple[Any, Any]) -> None:
    g_trace, g_state = got
    w_trace, w_state = want
    g_events = [e[:2] if e[0] != "ok" else ("ok",) for e in g_trace]
    w_events = [e[:2] if e[0] != "ok" else ("ok",) for e in w_trace]
    assert g_events == w_events, f"{label}: steps / exceptions / TBE counters {g_events} vs torchrec {w_events}"
    for step, (a, b) in enumerate(zip(g_trace, w_trace)):
        if a[0] == "ok":
            for k, (x, y) in enumerate(zip(a[1], b[1])):
                assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), f"{label}: step {step} output {k} differs"
    assert g_state["tbe (step, iter)"] == w_state["tbe (step, iter)"], (
        f"{label}: TBE (step, iter) {g_state['tbe (step, iter)']} vs torchrec {w_state['tbe (step, iter)']}"
    )
    assert sorted(g_state) == sorted(w_state), f"{label}: state keys differ"
    for key, value in w_state.items():
        if not isinstance(value, list):
            assert torch.equal(torch.as_tensor(g_state[key]), torch.as_tensor(value)), f"{label}: {key} differs"


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_failed_step_then_retry_or_reset_matches_torchrec(name: str) -> None:
    """A step that raises (forward midway or before any embedding module, optimizer,
    dataloader, an embedding lookup), then retried ``progress()`` calls and
    ``reset()``: same outputs, same exceptions in the same ``progress()`` calls (a
    retried batch whose forward already called a module raises an
    ``AssertionError``, as torchrec's ``PipelinedForward``), same parameters and
    TBE counters (at the failure and at the end) as torchrec: a lookup issued
    early for the next batch (before an optimizer that raised) or for modules the
    failed forward never reached is taken back (also by ``reset()``), and a
    lookup that raises (an out-of-range id with ``BoundsCheckMode.FATAL``, a
    training TBE under ``inference_mode``) raises in that batch's own
    ``progress()``, where its forward calls the module, so a ``reset()`` resumes
    the dataloader at the same batch as torchrec."""
    for rank, res in enumerate(run_gloo(SCENARIOS[name].get("world_size", 2), _body, name, timeout_s=300)):
        w_trace = res["torchrec"][0]
        assert any(e[0] == "raised" for e in w_trace), "the scenario must fail somewhere"
        assert sum(e[0] == "ok" for e in w_trace) >= 2, "the scenario must train"
        for stream, after_opt in FLAG_COMBOS:
            label = f"rank {rank} {name} use_emb_lookup_stream={stream} embedding_lookup_after_opt={after_opt}"
            _assert_same(label, res[(stream, after_opt)], res["torchrec"])
