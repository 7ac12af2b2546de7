"""Target + EAGLE-3 head speculative decoding, the way vLLM 0.32 runs it (llm_base_proposer.propose).

- The target exposes the residual stream entering layer i for each aux layer id i (layer L = after the
  last layer, before the final norm), like vLLM's EagleModelMixin._maybe_add_hidden_state
  (hidden_states + residual). Here: forward pre-hooks on the target's decoder layers.
- Draft first pass of a step: for every position t the target verified since the last step, the head
  reads (token t + 1, fc(aux_t)) at position t — vLLM shifts input_ids left by one and puts the newly
  emitted token last (set_inputs_first_pass), positions unchanged. Its KV entries are kept.
- Draft steps 2..γ: position + 1, the drafted token, and the head's own pre-norm output as hidden
  state; those KV entries are speculative and are dropped when the step ends (vLLM overwrites them).
- The loop, the replay and the counting are `measure.py`'s over `proposers.Eagle3Proposer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fp8ptq.spec.eagle3 import Eagle3Head
from fp8ptq.spec.models import LoadedModel
from fp8ptq.spec.sampling import probs as to_probs
from fp8ptq.spec.steps import draft_chain


@dataclass
class Eagle3Draft:
    """A loaded EAGLE-3 head: what proposers.Eagle3Proposer drafts with."""

    head: Eagle3Head
    label: str = ""
    method: ClassVar[str] = "eagle3"  # vLLM's speculative method (proposers.PROPOSERS)

    @property
    def vocab_size(self) -> int:
        return self.head.s.vocab


def decoder_layers(model) -> torch.nn.ModuleList:
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        from fp8ptq.spec import SpecError

        raise SpecError(
            f"cannot find the decoder layers of {type(model).__name__}",
            fix="EAGLE-3 needs a decoder-only target with model.layers",
        )
    return layers


class AuxCapture:
    """Context manager: records the residual stream entering each layer in `layer_ids` during forwards."""

    def __init__(self, model, layer_ids: list[int]):
        self.layers, self.ids, self.handles, self.seen = decoder_layers(model), list(layer_ids), [], {}

    def __enter__(self):
        n = len(self.layers)
        for i in self.ids:
            if i < n:
                self.handles.append(self.layers[i].register_forward_pre_hook(self._pre(i), with_kwargs=True))
            else:
                self.handles.append(self.layers[n - 1].register_forward_hook(self._post(i), with_kwargs=True))
        return self

    def _pre(self, i):
        def hook(module, args, kwargs):
            self.seen[i] = (args[0] if args else kwargs["hidden_states"]).detach()

        return hook

    def _post(self, i):
        def hook(module, args, kwargs, output):
            self.seen[i] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    def take(self) -> torch.Tensor:
        """[B, T, len(ids) * H] in fp32, in layer-id order (vLLM's fc input order)."""
        out = torch.cat([self.seen[i].float() for i in self.ids], -1)
        self.seen = {}
        return out

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


class HeadState:
    """The head's KV cache: `committed` positions computed from target hidden states (kept across steps)."""

    def __init__(self, head: Eagle3Head):
        self.head, self.k, self.v, self.committed = head, None, None, 0

    def past(self, upto: int):
        return None if self.k is None or upto == 0 else (self.k[:, :, :upto], self.v[:, :, :upto])

    def extend(self, upto: int, kv) -> None:
        k, v = kv
        if self.k is None or upto == 0:
            self.k, self.v = k, v
        else:
            self.k, self.v = torch.cat([self.k[:, :, :upto], k], 2), torch.cat([self.v[:, :, :upto], v], 2)


def _sample(head: Eagle3Head, logits: torch.Tensor, temperature: float, g):
    """A drafted target id and q over the target vocabulary (None when greedy) from draft-vocab logits."""
    if temperature == 0:
        return int(head.draft_to_target(logits.argmax())), None
    p = to_probs(logits, temperature)
    q = p.new_zeros(head.s.vocab)
    q[head.draft_to_target(torch.arange(p.numel(), device=p.device))] = p
    return int(torch.multinomial(q.cpu(), 1, generator=g)), q


@torch.inference_mode()
def propose(draft: Eagle3Draft, st: HeadState, seq: list[int], aux: torch.Tensor, *, gamma, temperature, g, threshold):
    """seq: tokens so far (the target has verified positions 0..len(seq)-2 and aux holds their rows from
    st.committed on). Returns (drafted target ids, q rows)."""
    head, dev = draft.head, aux.device
    base = len(seq)
    start = st.committed
    pos = torch.arange(start, base - 1, device=dev)
    toks = torch.tensor([seq[start + 1 : base]], device=dev)
    out, logits, kv = head.block(toks, head.fuse(aux[None]), pos, st.past(start))
    st.extend(start, kv)
    st.committed = base - 1
    hidden = out[:, -1:]

    def step(tok, k):  # drafted token k sits at position base - 1 + k; its KV entries are speculative
        nonlocal hidden
        p = torch.tensor([base - 1 + k], device=dev)
        hidden, lg, kv = head.block(torch.tensor([[tok]], device=dev), hidden, p, (st.k, st.v))
        st.k, st.v = torch.cat([st.k, kv[0]], 2), torch.cat([st.v, kv[1]], 2)
        return lg[0, -1]

    drafted, q_rows = draft_chain(
        logits[0, -1], gamma, threshold, lambda x: _sample(head, x.float(), temperature, g), step
    )
    st.k, st.v = st.k[:, :, : st.committed], st.v[:, :, : st.committed]  # drop the speculative entries
    return drafted, q_rows


@torch.inference_mode()
def head_step_time(
    target: LoadedModel, draft: Eagle3Draft, context: list[int], repeats: int, device: str, batch: int = 1
) -> float:
    """Median wall time of one head step (1 token after a KV cache of len(context) positions), for `batch`
    sequences at once."""
    from fp8ptq.spec.steps import median_time

    with AuxCapture(target.model, draft.head.s.layer_ids) as cap:
        target.model(input_ids=torch.tensor([context], device=device))
        aux = cap.take()[0]
    st = HeadState(draft.head)
    propose(draft, st, list(context) + [context[-1]], aux, gamma=1, temperature=0.0, g=None, threshold=None)
    h = torch.zeros(batch, 1, draft.head.s.hidden, device=device)
    tok = torch.tensor([[context[-1]]] * batch, device=device)
    pos = torch.tensor([len(context)], device=device)
    past = (st.k.expand(batch, -1, -1, -1), st.v.expand(batch, -1, -1, -1))
    return median_time(lambda: draft.head.block(tok, h, pos, past), repeats)
