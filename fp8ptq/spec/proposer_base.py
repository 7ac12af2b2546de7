"""The proposer interface (`Proposer`, documented in `proposers.py`, which holds the proposers and picks
one by the DRAFT argument) and what the proposers on the target's hidden states share
(`TargetHiddenProposer`: EAGLE-3 in `proposers.py`, MTP in `mtp.py`)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from fp8ptq.spec import SpecError


class Proposer:
    """The interface (see proposers.py's module doc)."""

    method = ""
    has_probabilities = True  # dynamic draft length (a confidence threshold) needs them
    vocab_trimmed = False  # a VocabTrim draft model (measure.json's `trimmed`; an EAGLE-3 head's d2t is not)
    reads_target = False  # runs on the target's hidden states: loading it needs the loaded target
    model_free = False  # no separate draft to size or hold (n-gram, suffix; MTP: its weights are the target's)

    def __init__(self, draft):
        self.draft = draft

    @classmethod
    def claims(cls, draft) -> bool:
        """Whether the DRAFT argument names this proposer (read without loading it; proposers.proposer_class
        asks each in PROPOSERS' order, the draft model last)."""
        raise NotImplementedError

    @classmethod
    def load(cls, draft, target=None, device: str = "cpu"):
        """The draft that DRAFT (a path or `ngram[:MIN-MAX]`) names, as this proposer runs it; `target`: the
        loaded target (needed where reads_target)."""
        from fp8ptq.spec.models import load_draft

        return load_draft(draft, device)

    def check(self, target) -> None:
        """The draft must read and write the target's token ids."""
        if self.draft.vocab_size != target.vocab_size:
            raise SpecError(
                f"draft vocabulary size {self.draft.vocab_size} != target vocabulary size {target.vocab_size}",
                fix="use a draft that shares the target's tokenizer (fp8ptq draft-train TARGET makes one)",
            )

    def capture(self, model):
        """A context manager recording the target hidden states this proposer reads during the target's
        forwards (its value's take() -> rows); a nullcontext (value None) where it reads none."""
        return nullcontext()

    def begin(self, vocab: int, aux: torch.Tensor | None, device: str) -> None:
        raise NotImplementedError

    def begin_replay(self, target, prompt: list[int], stream: list[int], device: str) -> None:
        """A replay against a fixed continuation: no target forwards per step (see measure.replay_greedy)."""
        self.begin(0, None, device)

    def propose(self, seq: list[int], *, gamma: int, temperature: float, threshold, g) -> tuple[list, list]:
        raise NotImplementedError

    def verified(self, base: int, n: int, aux: torch.Tensor | None) -> None:
        raise NotImplementedError

    def step_time(self, target, context: list[int], *, max_k: int, repeats: int, device: str, batch: int = 1) -> float:
        """Median wall time of this proposer's work per drafted token, for `batch` sequences at once."""
        raise NotImplementedError

    # The engines' configs for serving it (recommend.vllm_config / sglang_flags pick the class by the path).
    sglang_algorithm = ""
    sglang_draft_path = True

    @classmethod
    def vllm_config(cls, draft: str, gamma: int) -> dict:
        """vLLM's --speculative-config (vLLM 0.32 SpeculativeConfig) for the draft at `draft`."""
        return {"method": cls.method, "model": str(draft), "num_speculative_tokens": gamma}

    @classmethod
    def sglang_flags(cls, draft: str, gamma: int) -> list[str]:
        """SGLang (0.5.23) server flags: sequence drafting (topk 1) of γ steps by the draft at `draft` (no
        path where SGLang takes the draft from the target itself: sglang_draft_path False)."""
        path = ["--speculative-draft-model-path", str(draft)] if cls.sglang_draft_path else []
        return [
            "--speculative-algorithm",
            cls.sglang_algorithm,
            *path,
            "--speculative-num-steps",
            str(gamma),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            str(gamma + 1),
        ]


def one_hot_rows(drafted: list[int], temperature: float, vocab: int) -> list:
    """q rows of a deterministic proposer (n-gram, suffix): None when greedy, else one-hot over the vocabulary
    (exact sampling then accepts x with probability p(x))."""
    one_hot = torch.nn.functional.one_hot
    return [None if temperature == 0 else one_hot(torch.tensor(t), vocab).double() for t in drafted]


class TargetHiddenProposer(Proposer):
    """A proposer on the target's hidden states (EAGLE-3, MTP): `capture` records them during the target's
    forwards; the first pass of a step reads the rows of the positions verified since the last one."""

    reads_target = True

    def capture(self, model):
        raise NotImplementedError

    def begin(self, vocab, aux, device):
        self.state, self.pending, self.full = self.new_state(), aux, None

    def begin_replay(self, target, prompt, stream, device):
        """The target's hidden states from ONE forward of fp8ptq's target over prompt + stream (its
        simulated numerics, not the engine's kernels: the one source of difference left in the comparison)."""
        with self.capture(target.model) as cap, torch.inference_mode():
            target.model(input_ids=torch.tensor([list(prompt) + list(stream)], device=device))
            full = cap.take()[0]
        self.begin(0, None, device)
        self.full = full

    def rows(self, seq):
        st = self.state
        return self.pending if self.full is None else self.full[st.committed : len(seq) - 1]

    def verified(self, base, n, aux):
        if self.full is None:
            self.pending = aux[: n + 1]  # target rows not yet fed to the draft
