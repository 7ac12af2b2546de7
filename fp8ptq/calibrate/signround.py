"""Block-wise SignRound: after a residual block's groups are solved (RTN or GPTQ), the rounding of all
of them is trained together on the block's output error (calibration.rounding: signround).

Target: the float model's output of the block, computed from the float model's own activations (a second
activation stream, `RunState.float_store`, advanced block by block), while the block under training runs on
the quantized past's activations, as auto-round does by default: each block also absorbs the drift the
blocks before it left. Each step runs the block on one chunk with every solved group's weights
fake-quantized at their current offsets (ops/signround.py) and the engine's input and KV quantizers in
place, takes the mean squared error to the target, and moves every offset by lr * sign(gradient), lr
falling linearly from `rounding_lr` (default 0.005, auto-round's) to 0 as SignRound does. The offsets of the
step with the lowest loss are kept; step 0 is the solver's own result, so a step that never beats it
leaves the block as the solver left it. Params (scales, zero points) are never changed: the export is
the solver's with other codes.

Cost: `rounding_iters` forward + backward passes of the block on one chunk, plus one float pass for the
targets, which are held in memory (the block's output over every local sample), and a second activation
store (the float stream: in RAM or offloaded as the first). A resumed run restarts the float stream from
the restored (quantized-past) activations.
"""

from __future__ import annotations

import dataclasses

import torch

from fp8ptq.calibrate.gptaq import record_float_inputs
from fp8ptq.calibrate.state import finite_stats
from fp8ptq.models.arch import Block
from fp8ptq.ops.precision import fast_bf16
from fp8ptq.ops.signround import Offsets, step_of
from fp8ptq.quantization.weights import SolvedGroup, fake_quant_with


def float_targets(cal, block: Block, stages: list) -> dict[int, torch.Tensor] | None:
    """The float model's output of this block per chunk, from the float model's own input (the run's float
    stream, advanced here), as SignRound's reference (auto-round's default: quantized input, float target),
    so each block also corrects the drift the quantized blocks before it left; the same pass records the
    inputs of the block's groups (`stages`) where GPTQ targets the float model (calibrate/gptaq.py). None: no
    float stream, or no SignRound (the outputs are then only written to the stream). Runs before any of the
    block's groups is quantized (no_grad, not inference mode: the targets enter the training steps' loss)."""
    st = cal.state
    if st.float_store is None:
        return None
    out, base = {}, st.chunks.local_samples().start
    keep = cal.recipe.calibration.rounding == "signround"
    with torch.no_grad(), cal._precision(), record_float_inputs(cal, stages):
        for c, first, x in st.each_chunk():
            cal.chunk = (c, first)  # as the calibrator's passes set it: the recording hooks read it
            x = st.float_store.read(first - base, first - base + x.shape[0]).to(st.device, st.dtype)
            y = cal._run_block(block, x, st.inputs_at(cal.index, first))
            st.float_store.write(first - base, y)
            if keep:
                out[c] = y
    return out if keep else None


def plain(value):
    """`value` (a tensor, or tuples, lists, dicts and dataclasses of them) with every tensor cloned outside
    inference mode: the passes make the layer's inputs and the store's chunks as inference tensors, which
    autograd refuses to save."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)})
    return value


def refine_block(cal, block: Block, targets: dict[int, torch.Tensor]) -> None:
    """Train the rounding of the block's solved groups (`cal.solved`, installed) against `targets`, then
    install the kept codes and add the losses to the layer's report. Outputs the calibrator recorded for
    replay are dropped: the refined groups' are stale."""
    cal.replay.clear()
    solved = [s[1] for s in cal.solved]
    report = _train(cal, block, solved, targets)
    cal.result.report.setdefault("rounding", []).append(report)
    for s in cal.solved:
        cal.install(*s)


def _train(cal, block: Block, solved: list[SolvedGroup], targets: dict[int, torch.Tensor]) -> dict:
    """The signed-gradient steps: sets each group's `q` to the kept codes; returns the loss report."""
    cfg = cal.recipe.calibration
    iters = cfg.rounding_iters
    lr0 = cfg.rounding_lr
    offsets = [Offsets(g.start, g.q, step_of(g.scale, g.w.shape), lambda x, g=g: fake_quant_with(x, g)) for g in solved]
    chunks = [(c, plain(x), plain(cal.state.inputs_at(cal.index, first))) for c, first, x in cal.state.each_chunk()]
    for p in cal.layer.parameters():  # only the offsets are trained
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(cfg.seed * 7919 + cal.index)
    order = [int(i) for i in torch.randperm(len(chunks), generator=gen)]
    params = {n: cal.modules[n].weight for g in solved for n in g.names}
    device = next(iter(params.values())).device
    bf16 = fast_bf16(device)  # the steps only need the gradient's sign: bf16 where its matmuls are native
    start = {}  # each chunk's loss at the solver's codes: steps on different chunks compare as ratios to it
    amp = lambda: torch.autocast(device.type, torch.bfloat16, enabled=bf16)  # noqa: E731
    with torch.no_grad(), cal._precision(), amp():  # as the steps compute: step 1 (v = 0) scores ratio 1
        for c, x, inputs in chunks:
            start[c] = _loss(cal._run_block(block, x, inputs), targets[c])
    best, best_v = 1.0, [o.v.detach().clone() for o in offsets]
    try:
        for it in range(1, iters + 2):  # the last forward scores the last update
            c, x, inputs = chunks[order[it % len(chunks)]]
            for g, o in zip(solved, offsets):
                for name, shard in zip(g.names, o.weight().split(g.rows)):
                    m = cal.modules[name]
                    m.__dict__.pop("weight", None)
                    m._parameters.pop("weight", None)
                    m.weight = shard.to(params[name].dtype)  # a plain tensor: F.linear reads it, autograd flows
            with cal._precision(), amp():
                loss = _loss(cal._run_block(block, x, inputs), targets[c])
            ratio = loss.detach().item() / max(float(start[c]), 1e-30)
            finite_stats(f"{cal.plan.prefix}{solved[0].names[0]} (rounding loss)", torch.tensor([ratio]))
            if ratio < best:
                best, best_v = ratio, [o.v.detach().clone() for o in offsets]
            if it > iters:
                break
            loss.backward()
            for o in offsets:
                o.sign_step(lr0 * (1.0 - (it - 1) / iters))
    finally:
        for name, p in params.items():
            cal.modules[name].__dict__.pop("weight", None)
            cal.modules[name].weight = p
    for g, o, v in zip(solved, offsets, best_v):
        g.q = o.codes(v)
    loss = sum(float(v) for v in start.values()) / len(start)
    steps = "bf16" if bf16 else "fp32"
    return {
        "rounding_loss_start": loss,
        "rounding_loss_kept_ratio": best,
        "rounding_iters": iters,
        "rounding_steps": steps,
    }


def _loss(y: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(y.float(), target.float())
