"""TrainPipelineFusedSparseDist between steps: ``detach()`` / ``attach()``,
``reset()``, train/eval switches, table writes and learning-rate changes.

When ``progress()`` returns, our pipeline has already issued the next batch's
embedding lookup; whatever a user does before the next ``progress()`` that
would change that lookup (reload or edit the tables, switch to eval or
``no_grad``, step an LR scheduler) must make the pipeline redo it. Each gloo
run trains a non-pipelined reference, torchrec's ``TrainPipelineSparseDist``
and our pipeline (all four flag combinations) with the same intervention after
step ``PAUSE_AT`` and compares every step bit for bit, and the TBE counters.
"""

from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Dict, Iterator, List, Tuple

import pytest
import torch
from harness.gloo import run_gloo
from harness.pipelines import (
    FLAG_COMBOS,
    N_BATCHES,
    assert_same,
    build_dmp,
    make_batches,
    on_cpu,
    run_pipeline,
    run_reference,
)


def _tbe_counters(model: Any) -> List[Any]:
    """(step, iter) of every fbgemm TBE of the model's sharded modules."""
    from recpipe.pipeline.tiered.tbe_tables import tbe_counters
    from recpipe.pipeline.train_pipeline.take_back import fused_tbes

    return [tbe_counters(t) for mod in (model.module.ebc, model.module.ec) for t in fused_tbes(mod)]


RUN_NAMES = ["torchrec"] + [f"recpipe stream={s} after_opt={a}" for s, a in FLAG_COMBOS]
"""torchrec's TrainPipelineSparseDist, then ours with every flag combination."""


def _runs(device: torch.device) -> List[Tuple[str, Callable[[Any, Any], Any]]]:
    """(name in RUN_NAMES, pipeline factory(model, optimizer))."""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from recpipe.pipeline.train_pipeline.fused_pipeline import TrainPipelineFusedSparseDist

    runs: List[Tuple[str, Callable[[Any, Any], Any]]] = [
        ("torchrec", lambda m, o: TrainPipelineSparseDist(m, o, device))
    ]
    for stream, after_opt in FLAG_COMBOS:
        runs.append(
            (
                f"recpipe stream={stream} after_opt={after_opt}",
                lambda m, o, s=stream, a=after_opt: TrainPipelineFusedSparseDist(
                    m, o, device, use_emb_lookup_stream=s, embedding_lookup_after_opt=a
                ),
            )
        )
    return runs


PAUSE_AT = 4
"""Steps trained before the pause (batches PAUSE_AT and PAUSE_AT + 1 are in flight)."""

MODES = ("eval", "reload", "twice")
"""What happens during the pause: evaluate the detached model on other batches;
load other weights into it; detach/attach twice with a weight load each time."""


def _pause(mode: str, model: Any, rank: int, alt: Any, out: List[torch.Tensor]) -> None:
    """The work done on the detached (or, for the reference, plain) model."""
    if mode == "eval":
        model.eval()
        with torch.no_grad():
            for b in make_batches(rank, n=2, seed=9):
                out.append(model(b)[1][1].clone())
        model.train()
    else:
        # torchrec's load hooks consume the state dict: take a fresh one each time.
        model.load_state_dict(alt.state_dict())


def _steps(pipeline: Any, it: Iterator[Any], n: int, losses: List[torch.Tensor], preds: List[torch.Tensor]) -> None:
    for _ in range(n):
        loss, logits = pipeline.progress(it)
        losses.append(loss.clone())
        preds.append(logits.clone())


ATTACH_KINDS = ("attach", "attach_no_sparse_dist", "implicit")
"""How the pipeline resumes: ``attach(model)``; ``attach(model, sparse_dist=False)``;
no call at all (``progress()`` re-attaches)."""


def _resume(pipe: Any, model: Any, kind: str) -> None:
    if kind == "attach":
        pipe.attach(model)
    elif kind == "attach_no_sparse_dist":
        pipe.attach(model, sparse_dist=False)
    # "implicit": the next progress() attaches the detached model itself.


def _detach_body(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    device = torch.device("cpu")
    batches = make_batches(rank)
    alt, _ = build_dmp(sharding, device, seed=7)
    out: Dict[str, Any] = {}
    for mode in MODES:
        pauses = 2 if mode == "twice" else 1
        # Non-pipelined reference: the pause falls between step PAUSE_AT - 1 and PAUSE_AT.
        ref, ref_opt = build_dmp(sharding, device)
        evals: List[torch.Tensor] = []

        def pause(step: int, ref: Any = ref, pauses: int = pauses, mode: str = mode) -> None:
            for _ in range(pauses if step == PAUSE_AT else 0):
                _pause(mode, ref, rank, alt, evals)

        losses, preds = run_reference(ref, ref_opt, batches, before_step=pause)
        out[f"{mode} reference"] = on_cpu((losses, preds, evals))

        # torchrec 1.9.2's own pipeline resumes correctly only with sparse_dist=False:
        # attach(model) restarts the in-flight batch's input dist with new module
        # contexts but keeps the old input-dist tensors, and the sequence EC's output
        # all-to-all then fails ('in->size == out->size' on gloo).
        (torchrec, make_torchrec), *ours = _runs(device)
        runs: List[Tuple[str, str, Callable[[Any, Any], Any]]] = [
            (torchrec, "attach_no_sparse_dist", make_torchrec)
        ] + [(f"{name} {kind}", kind, make) for (name, make), kind in itertools.product(ours, ATTACH_KINDS)]
        for name, kind, make in runs:
            model, opt = build_dmp(sharding, device)
            pipe = make(model, opt)
            it = iter(batches)
            losses, preds, evals = [], [], []
            _steps(pipe, it, PAUSE_AT, losses, preds)
            for _ in range(pauses):
                detached = pipe.detach()
                _pause(mode, detached, rank, alt, evals)
                _resume(pipe, detached, kind)
            _steps(pipe, it, N_BATCHES - PAUSE_AT, losses, preds)
            with pytest.raises(StopIteration):
                pipe.progress(it)
            out[f"{mode} {name}"] = on_cpu((losses, preds, evals))
            out[f"{mode} {name} counters"] = _tbe_counters(model)
    out["runs"] = [name for name, _, _ in runs]
    return out


@pytest.mark.parametrize("sharding", ("table_wise", "row_wise"))
def test_detach_pause_attach_matches_torchrec_and_non_pipelined(sharding: str) -> None:
    """Evaluating or reloading the detached model between steps, resumed by each
    kind of attach: every later step equals the non-pipelined reference (and
    torchrec's pipeline where it resumes), bit for bit."""
    results = run_gloo(2, _detach_body, sharding, timeout_s=400)
    for rank, res in enumerate(results):
        runs = res["runs"]
        # Every flag combination meets every attach kind.
        assert {r.rsplit(" ", 1)[1] for r in runs[1:]} == set(ATTACH_KINDS)
        assert len(runs) == 1 + 12
        for mode in MODES:
            want = res[f"{mode} reference"]
            losses, preds, evals = want
            assert len(losses) == N_BATCHES
            assert len(evals) == (2 if mode == "eval" else 0)
            # The pause matters: without it the later steps differ (teeth).
            if mode != "eval":
                plain = res["eval reference"]
                assert not all((a == b).all() for a, b in zip(losses[PAUSE_AT:], plain[0][PAUSE_AT:]))
            for name in runs:
                got = res[f"{mode} {name}"]
                label = f"rank {rank} {sharding} {mode} {name}"
                assert_same(label, got[:2], want[:2])
                assert len(got[2]) == len(evals), label
                for i, (a, b) in enumerate(zip(got[2], evals)):
                    assert (a == b).all(), f"{label}: eval output {i} differs"
                # the discarded lookup is taken back from the TBEs' lookup counters
                assert res[f"{mode} {name} counters"] == res[f"{mode} torchrec counters"], label


def _reset_body(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    device = torch.device("cpu")
    first, second = make_batches(rank), make_batches(rank, seed=3)
    ref, ref_opt = build_dmp(sharding, device)
    # The pipelines drop the two in-flight batches of ``first`` at reset().
    out: Dict[str, Any] = {"reference": on_cpu(run_reference(ref, ref_opt, first[:PAUSE_AT] + second))}
    for name, make in _runs(device):
        model, opt = build_dmp(sharding, device)
        pipe = make(model, opt)
        losses: List[torch.Tensor] = []
        preds: List[torch.Tensor] = []
        _steps(pipe, iter(first), PAUSE_AT, losses, preds)
        pipe.reset()
        more_losses, more_preds, stops_again = run_pipeline(pipe, second)
        out[name] = on_cpu((losses + more_losses, preds + more_preds)) + (stops_again,)
        out[name + " counters"] = _tbe_counters(model)
    return out


@pytest.mark.parametrize("sharding", ("table_wise", "row_wise"))
def test_reset_then_new_dataloader_matches_non_pipelined(sharding: str) -> None:
    """``reset()`` mid-epoch drops the in-flight batches (and the lookup already
    issued for the next one); training on a new dataloader then equals the
    reference trained on the batches actually consumed, and torchrec's pipeline."""
    for rank, res in enumerate(run_gloo(2, _reset_body, sharding, timeout_s=300)):
        want = res["reference"]
        assert len(want[0]) == PAUSE_AT + N_BATCHES
        for name in RUN_NAMES:
            losses, preds, stops_again = res[name]
            assert_same(f"rank {rank} {sharding} reset {name}", (losses, preds), want)
            assert stops_again, name
            assert res[name + " counters"] == res["torchrec counters"], name


EVAL_STEPS = range(3, 6)
"""Steps run in eval mode by the mode-switch test (the others train)."""


def _switch_body(rank: int, world_size: int, sharding: str, no_grad: bool) -> Dict[str, Any]:
    import contextlib

    device = torch.device("cpu")
    batches = make_batches(rank)

    def grad_mode(step: int) -> Any:
        return torch.no_grad() if no_grad and step in EVAL_STEPS else contextlib.nullcontext()

    ref, ref_opt = build_dmp(sharding, device)
    outputs: List[torch.Tensor] = []
    for step, b in enumerate(batches):
        ref.train(step not in EVAL_STEPS)
        with grad_mode(step):
            if step in EVAL_STEPS:
                outputs.append(ref(b)[1][1].detach().clone())
                continue
            ref_opt.zero_grad()
            loss, _ = ref(b)
            loss.backward()
            ref_opt.step()
            outputs.append(loss.detach().clone())
    out: Dict[str, Any] = {"reference": [t.numpy() for t in outputs]}
    for name, make in _runs(device):
        model, opt = build_dmp(sharding, device)
        pipe = make(model, opt)
        it = iter(batches)
        outputs = []
        for step in range(N_BATCHES):
            model.train(step not in EVAL_STEPS)
            with grad_mode(step):
                loss, logits = pipe.progress(it)
            outputs.append((logits if step in EVAL_STEPS else loss).detach().clone())
        out[name] = [t.numpy() for t in outputs]
        out[name + " relookups"] = getattr(getattr(pipe, "stats", None), "relookups", None)
        out[name + " counters"] = _tbe_counters(model)
    return out


@pytest.mark.parametrize("no_grad", (True, False), ids=("eval_no_grad", "eval_with_grad"))
@pytest.mark.parametrize("sharding", ("table_wise", "row_wise"))
def test_train_eval_train_switch_between_steps(sharding: str, no_grad: bool) -> None:
    """``model.eval()`` (under ``torch.no_grad()`` or not) for steps 3-5 of one
    dataloader, then ``model.train()``: every loss and eval prediction equals the
    loop and torchrec's pipeline. The lookup issued for step 6 during eval step 5
    has no autograd graph under no_grad; it is redone (kept, step 6 would update
    no table)."""
    for rank, res in enumerate(run_gloo(2, _switch_body, sharding, no_grad, timeout_s=300)):
        want = res["reference"]
        assert len(want) == N_BATCHES
        for name in RUN_NAMES:
            got = res[name]
            assert len(got) == N_BATCHES, name
            for step, (a, b) in enumerate(zip(got, want)):
                assert (a == b).all(), (
                    f"rank {rank} {sharding} {name}: step {step} differs (eval steps {list(EVAL_STEPS)})"
                )
            if name != "torchrec":
                # one redone lookup per switch (train -> eval, eval -> train)
                assert res[name + " relookups"] == 2, (name, res[name + " relookups"])
                assert res[name + " counters"] == res["torchrec counters"], name


WRITES = ("load_state_dict", "edit_shards", "edit_data")
"""Table writes between two steps of an attached pipeline: load other weights;
halve every table's local shards in place through ``state_dict()``; the same
through ``.data``, which bumps no version counter the pipeline can see, followed
by the documented remedy ``pipeline.attach(sparse_dist=False)``."""


def _write_tables(kind: str, model: Any, alt: Any) -> None:
    if kind == "load_state_dict":
        model.load_state_dict(alt.state_dict())
        return
    with torch.no_grad():
        for key, value in model.state_dict().items():
            if key.endswith(".weight") and (".embedding_bags." in key or ".embeddings." in key):
                for shard in value.local_shards():
                    (shard.tensor.data if kind == "edit_data" else shard.tensor).mul_(0.5)


def _write_body(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    device = torch.device("cpu")
    batches = make_batches(rank)
    alt, _ = build_dmp(sharding, device, seed=7)
    out: Dict[str, Any] = {}
    for kind in WRITES:
        ref, ref_opt = build_dmp(sharding, device)

        def write(step: int, ref: Any = ref, kind: str = kind) -> None:
            if step == PAUSE_AT:
                _write_tables(kind, ref, alt)

        out[f"{kind} reference"] = on_cpu(run_reference(ref, ref_opt, batches, before_step=write))
        for name, make in _runs(device):
            model, opt = build_dmp(sharding, device)
            pipe = make(model, opt)
            it = iter(batches)
            losses, preds = [], []
            _steps(pipe, it, PAUSE_AT, losses, preds)
            _write_tables(kind, model, alt)  # attached: no detach()
            if kind == "edit_data":
                pipe.attach(sparse_dist=False)
            _steps(pipe, it, N_BATCHES - PAUSE_AT, losses, preds)
            out[f"{kind} {name}"] = on_cpu((losses, preds))
            out[f"{kind} {name} relookups"] = getattr(getattr(pipe, "stats", None), "relookups", None)
            out[f"{kind} {name} counters"] = _tbe_counters(model)
    return out


@pytest.mark.parametrize("sharding", ("table_wise", "row_wise"))
def test_tables_written_between_steps_are_looked_up_again(sharding: str) -> None:
    """Writing the tables of the attached model between two ``progress()`` calls
    (``load_state_dict``, in-place edits of its state-dict shards, or ``.data``
    edits followed by ``attach()``): the batch looked up early is looked up again
    (exactly once), so every step equals the loop and torchrec's pipeline, which
    looks batches up in the forward."""
    for rank, res in enumerate(run_gloo(2, _write_body, sharding, timeout_s=300)):
        for kind in WRITES:
            want = res[f"{kind} reference"]
            for name in RUN_NAMES:
                assert_same(f"rank {rank} {sharding} {kind} {name}", res[f"{kind} {name}"], want)
                if name != "torchrec":
                    assert res[f"{kind} {name} relookups"] == 1, (kind, name, res[f"{kind} {name} relookups"])
                    assert res[f"{kind} {name} counters"] == res[f"{kind} torchrec counters"], (kind, name)


SCHEDULES = ("step_lr", "lambda_warmup", "warmup_optimizer")
"""How the learning rate of the fused tables (and the dense Adam) changes: torch's
StepLR (halved every 3 steps) and LambdaLR (warm-up over 4 steps, which also
changes the rate at construction) stepped after each ``progress()``; torchrec's
WarmupOptimizer (linear warm-up over 4 steps, set inside ``step()``)."""


def _scheduled(kind: str, model: Any, dense: Any) -> Tuple[Any, Callable[[], None]]:
    """(optimizer over the fused and dense parameters, the per-step scheduler call)."""
    from torchrec.optim.keyed import CombinedOptimizer
    from torchrec.optim.warmup import WarmupOptimizer, WarmupPolicy, WarmupStage

    combined = CombinedOptimizer([model.fused_optimizer, dense])
    if kind == "warmup_optimizer":
        stage = WarmupStage(policy=WarmupPolicy.LINEAR, max_iters=4, value=0.25)
        return WarmupOptimizer(combined, [stage], lr=0.05), lambda: None
    if kind == "step_lr":
        sched = torch.optim.lr_scheduler.StepLR(combined, step_size=3, gamma=0.5)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(combined, lambda s: min(1.0, (s + 1) / 4))
    return combined, sched.step


def _schedule_body(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    device = torch.device("cpu")
    batches = make_batches(rank)
    out: Dict[str, Any] = {}
    for kind in SCHEDULES:
        model, dense = build_dmp(sharding, device)
        opt, sched_step = _scheduled(kind, model, dense)
        losses: List[torch.Tensor] = []
        for b in batches:
            opt.zero_grad()
            loss, _ = model(b)
            loss.backward()
            opt.step()
            sched_step()
            losses.append(loss.detach().clone())
        out[f"{kind} reference"] = [t.numpy() for t in losses]
        for name, make in _runs(device):
            model, dense = build_dmp(sharding, device)
            opt, sched_step = _scheduled(kind, model, dense)
            pipe = make(model, opt)
            it = iter(batches)
            losses = []
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                for _ in range(N_BATCHES):
                    losses.append(pipe.progress(it)[0].clone())
                    sched_step()
            out[f"{kind} {name}"] = [t.numpy() for t in losses]
            out[f"{kind} {name} relookups"] = getattr(getattr(pipe, "stats", None), "relookups", None)
            out[f"{kind} {name} counters"] = _tbe_counters(model)
            out[f"{kind} {name} warnings"] = [str(w.message) for w in caught if "learning rate" in str(w.message)]
    return out


@pytest.mark.parametrize("sharding", ("table_wise", "row_wise"))
def test_fused_learning_rate_changes_between_steps(sharding: str) -> None:
    """fbgemm's TBE takes the learning rate its backward applies at lookup time,
    and torchrec's fused optimizers set it in zero_grad() / step(). A batch looked
    up early under the old rate is looked up again, so every step equals the loop
    and torchrec's pipeline; changes at consecutive steps warn once."""
    # LR of step i's batch: StepLR changes at steps 3, 6, 9; LambdaLR at 1, 2, 3.
    expected = {"step_lr": (3, False), "lambda_warmup": (3, True)}
    for rank, res in enumerate(run_gloo(2, _schedule_body, sharding, timeout_s=300)):
        for kind in SCHEDULES:
            want = res[f"{kind} reference"]
            assert len({float(x) for x in want}) > 1
            for name in RUN_NAMES:
                got = res[f"{kind} {name}"]
                for step, (a, b) in enumerate(zip(got, want)):
                    assert (a == b).all(), f"rank {rank} {sharding} {kind} {name}: step {step} differs"
                if name == "torchrec":
                    continue
                relookups, warns = res[f"{kind} {name} relookups"], res[f"{kind} {name} warnings"]
                assert res[f"{kind} {name} counters"] == res[f"{kind} torchrec counters"], (kind, name)
                if kind in expected:
                    assert relookups == expected[kind][0], (kind, name, relookups)
                    assert bool(warns) == expected[kind][1], (kind, name, warns)
                else:  # WarmupOptimizer: a new rate at each of its warm-up steps
                    assert relookups >= 3 and len(warns) == 1, (kind, name, relookups, warns)
                if warns:
                    assert "Possible solutions" in warns[0]


class _AdamTbeCounters(torch.nn.Module):
    """The counters of an fbgemm TBE with an iteration-counting optimizer (Adam,
    LAMB), advanced as fbgemm 1.9's forward does (fbgemm runs Adam on CUDA only)."""

    def __init__(self, loaded_iter: int) -> None:
        super().__init__()
        self.step = 0
        self.iter_cpu = torch.zeros(1, dtype=torch.int64)
        self.register_buffer("iter", torch.tensor([loaded_iter], dtype=torch.int64))
        self.learning_rate_tensor = torch.tensor(0.1)

    def lookup(self) -> None:
        self.step += 1
        if int(self.iter_cpu) == 0:  # re-sync with a loaded checkpoint's iter
            self.iter_cpu.fill_(int(self.iter))
        self.iter_cpu.add_(1)
        self.iter.add_(1)


@pytest.mark.parametrize("loaded_iter", (0, 7))
@pytest.mark.parametrize("first", (True, False))
def test_discarded_lookup_takes_back_adam_iteration(loaded_iter: int, first: bool) -> None:
    """A discarded lookup, then another lookup in between (an eval forward of the
    detached model), then the redone lookup: the counters end as if the discarded
    one never ran, also when it was the first after a checkpoint load."""
    from recpipe.pipeline.tiered.tbe_tables import tbe_counters, undo_tbe_lookup

    ours, plain = _AdamTbeCounters(loaded_iter), _AdamTbeCounters(loaded_iter)
    if not first:
        ours.lookup()
        plain.lookup()
    before = tbe_counters(ours)
    ours.lookup()  # issued early, later discarded
    after = tbe_counters(ours)
    ours.lookup()  # eval forward while detached
    plain.lookup()
    undo_tbe_lookup(ours, before, after)
    ours.lookup()  # the redone lookup
    plain.lookup()
    assert (ours.step, int(ours.iter_cpu), int(ours.iter)) == (plain.step, int(plain.iter_cpu), int(plain.iter))
    assert int(plain.iter) == loaded_iter + (3 if not first else 2)
