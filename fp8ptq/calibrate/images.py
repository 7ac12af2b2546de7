"""Image+text calibration of a multimodal checkpoint's language model: `quantize --images FILE.jsonl`.

Each line of FILE is {"image": PATH, "text": TEXT}, PATH relative to FILE's folder. A line becomes one
calibration sample, in file order, taking the place of a text sample (the first of --num-samples):
- the checkpoint's own processor renders the image and the text as one user turn (its chat template when
  that places the image, else its image token before the text) and expands the image's placeholder tokens;
- the sample is filled up to --seq-len with the text sample it replaces (EOS between), or cut there;
- its first decoder layer's input is what the model's own forward computes: the vision tower and projector
  run with the checkpoint's weights (fp32) and their features land where the family merges them. Every
  later layer sees these hidden states through the usual layer-by-layer pipeline.

The pipeline shares one set of per-layer arguments (positions, masks) across text samples. Families whose
decoder takes image-dependent ones (Gemma 3's bidirectional attention inside an image, Qwen-VL's M-RoPE
positions) are found by comparing what their forward passes every layer for the first image row with the
text-only arguments: their image rows are then calibrated one sample per chunk, each with the arguments
the model's own forward gave it (`ImageRows.own_arguments`, `dist.ChunkPlan.singles`).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from fp8ptq.data import render_chat
from fp8ptq.errors import DataError, ModelError

_TEXT_ONLY = "calibrate it with text: leave out --images"  # for a forward that fails on an image


@dataclass(frozen=True)
class ImageRows:
    """The image+text samples of a run: rows 0..n-1 of the calibration ids."""

    source: str
    ids: torch.Tensor  # [n, seq_len]: processor tokens (image placeholders expanded), then text
    extras: tuple[dict[str, torch.Tensor], ...]  # per row: the processor's other outputs (pixel_values, ...)
    # the family's layers take image-dependent arguments (masks, positions): each row is its own chunk
    own_arguments: bool = False

    @property
    def singles(self) -> int:
        """Leading samples calibrated one per chunk (dist.ChunkPlan.singles)."""
        return len(self) if self.own_arguments else 0

    def __len__(self) -> int:
        return self.ids.shape[0]

    def merged(self, text_ids: torch.Tensor) -> torch.Tensor:
        """The run's calibration ids: these rows, then the text samples they did not replace."""
        return torch.cat([self.ids, text_ids[len(self) :]])

    def digest(self) -> str:
        """What a resumed run compares: the pixels and every other processor output, in order."""
        h = hashlib.sha256()
        for extra in self.extras:
            for key in sorted(extra):
                value = extra[key]
                data = (
                    value.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                    if torch.is_tensor(value)
                    else repr(value).encode()
                )
                h.update(key.encode() + data)
        return h.hexdigest()


def read_rows(source: str) -> list[tuple[Path, str]]:
    """(image path, text) per line of a JSONL file; DataError naming the line for anything else."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise DataError(f"--images '{source}' is not a file", fix='pass a .jsonl file of {"image": PATH, "text": TEXT}')
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise DataError(f"--images '{source}' line {n} is not JSON ({err})") from None
        image, text = (row.get("image"), row.get("text")) if isinstance(row, dict) else (None, None)
        if not isinstance(image, str) or not isinstance(text, str):
            raise DataError(
                f'--images \'{source}\' line {n}: expected {{"image": PATH, "text": TEXT}}, got {line[:80]}',
                fix="give every line a string 'image' (a path relative to the file) and a string 'text'",
            )
        rows.append((path.parent / image, text))
    if not rows:
        raise DataError(f"--images '{source}' holds no rows", fix='add lines of {"image": PATH, "text": TEXT}')
    return rows


def processor_of(src):
    """The checkpoint's own processor (no remote code); ModelError when it has none or no image token."""
    from transformers import AutoProcessor

    try:
        proc = AutoProcessor.from_pretrained(str(src.path), trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        first = (str(err).strip().splitlines() or [""])[0][:160]
        raise ModelError(
            f"--images: cannot load the processor of '{src.label}' ({type(err).__name__}: {first})",
            fix="the model folder needs its processor files (preprocessor_config.json / processor_config.json)",
        ) from None
    if getattr(proc, "image_processor", None) is None or not isinstance(getattr(proc, "image_token", None), str):
        raise ModelError(
            f"--images: the processor of '{src.label}' ({type(proc).__name__}) has no image processor or image token",
            fix=_TEXT_ONLY,
        )
    return proc


MAX_IMAGE_PIXELS = 64_000_000  # an 8K photograph is 33 MP; a processor resizes calibration images far below


def _read_image(path: Path, where: str):
    """An RGB PIL image, its size bounded from the header before any pixel is decoded (a 17 KB PNG may
    declare 144 megapixels, 2.5 GB decoded); a FIFO, a device, a NUL in the path or an unreadable file is a
    DataError naming the row."""
    from PIL import Image, UnidentifiedImageError

    if "\x00" in str(path) or not path.is_file():  # is_file: a FIFO would block open() for ever
        raise DataError(f"{where}: image {str(path)!r} is not a regular file", fix="point it at an image file")
    try:
        with Image.open(path) as im:
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                raise DataError(
                    f"{where}: image '{path}' declares {w} x {h} pixels (limit {MAX_IMAGE_PIXELS:,})",
                    fix="resize it: the processor scales calibration images down anyway",
                )
            return im.convert("RGB")
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError, ValueError) as err:
        raise DataError(f"{where}: cannot read image '{path}' ({type(err).__name__}: {err})") from None


def image_rows(source: str, src, text_ids: torch.Tensor, eos: int | None) -> ImageRows:
    """The first min(rows, samples) samples of `text_ids` [samples, seq_len] as image+text samples."""
    if not getattr(src.arch, "towers", ()):
        raise ModelError(
            f"--images: '{src.label}' ({src.config.model_type}) has no vision tower",
            fix="pass --images with a multimodal checkpoint (image-text-to-text), or leave it out",
        )
    rows = read_rows(source)[: text_ids.shape[0]]
    proc = processor_of(src)
    seq_len = text_ids.shape[1]
    config = src.config  # the placeholder the projector's features replace (Gemma 3: not the processor's <boi>)
    image_token = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
    image_token = image_token or proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    ids, extras = [], []
    for n, (path, text) in enumerate(rows, 1):
        image = _read_image(path, f"--images '{source}' row {n}")
        enc = proc(text=[_prompt(proc, text)], images=[[image]], return_tensors="pt")
        tokens = enc["input_ids"][0]
        where = (tokens == image_token).nonzero()
        if len(where) and int(where[-1]) >= seq_len:
            raise DataError(
                f"--images '{source}' row {n}: its image takes tokens up to position {int(where[-1]) + 1}, "
                f"beyond --seq-len {seq_len}",
                fix=f"raise --seq-len to at least {int(where[-1]) + 1}",
            )
        row = torch.cat([tokens, torch.tensor([] if eos is None else [eos]), text_ids[n - 1]])[:seq_len]
        ids.append(row.long())
        extras.append(
            {k: _fit(v, len(tokens), seq_len) for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        )
    rows = ImageRows(source, torch.stack(ids), tuple(extras))
    return replace(rows, own_arguments=_own_arguments(src, rows))


def _own_arguments(src, rows: ImageRows) -> bool:
    """Whether the family's layers take other arguments for an image row than for text (Gemma 3's
    bidirectional image mask, Qwen-VL's M-RoPE positions): the first row run through `embed` on the CPU."""
    from fp8ptq.models.skeleton import build_skeleton
    from fp8ptq.quantization.numerics import register_attention

    cpu = torch.device("cpu")
    model = build_skeleton(src.config, attn_implementation=register_attention())
    text = src.arch.layer_inputs(model, rows.ids.shape[1], cpu)
    first = embed(model, src, src.arch, rows, text, local=range(1), device=cpu)
    try:
        return next(first)[2] is not None
    finally:
        first.close()  # puts the decoder layers back and the towers on meta


def _prompt(proc, text: str) -> str:
    """One user turn holding the image and the text, as the checkpoint's chat template writes it, when it
    places the image; else the image token before the text."""
    if getattr(proc, "chat_template", None):
        turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompt = render_chat(proc, turn, tokenize=False)
        if proc.image_token in prompt:
            return prompt
    return proc.image_token + text


def _fit(value, tokens: int, seq_len: int):
    """A per-token processor output ([1, tokens]: token types) fitted to the row: zeros after, cut at seq_len."""
    if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, tokens):
        out = torch.zeros(1, seq_len, dtype=value.dtype)
        out[:, : min(tokens, seq_len)] = value[:, :seq_len]
        return out
    return value


@torch.inference_mode()
def embed(model: torch.nn.Module, src, arch, rows: ImageRows, text_inputs, *, local: range, device):
    """(sample index, first-layer input [1, seq_len, hidden] fp32, own arguments) for the image rows in
    `local`: the model's own forward with its towers and embedding loaded, its decoder layers replaced by
    recorders (capture.record_layers). Own arguments: None where every layer's other arguments equal the
    text-only ones (`text_inputs`: layer index -> CapturedInputs), else each layer's for this row."""
    from fp8ptq.models.arch.capture import record_layers
    from fp8ptq.models.arch.generic import CapturedInputs

    layers = len(arch.decoder_layers(model))
    prefixes = (*arch.towers, arch.embed)
    loaded = [model.get_submodule(p) for p in prefixes]
    for prefix, module in zip(prefixes, loaded):
        state = {n: src.tensor(f"{prefix}.{n}").float() for n, _ in module.named_parameters()}
        module.load_state_dict(state, strict=False, assign=True)
        module.to(device)
    try:
        for i in range(len(rows)):
            if i not in local:
                continue
            extra = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in rows.extras[i].items()}
            forward = functools.partial(model, input_ids=rows.ids[i : i + 1].to(device), use_cache=False, **extra)
            try:
                seen = record_layers(arch, model, forward)
            except Exception as err:  # noqa: BLE001 - a foreign forward's failure is reported by name
                raise ModelError(
                    f"--images: the forward of '{arch.name}' failed on image row {i + 1}: {type(err).__name__}: {err}",
                    fix=_TEXT_ONLY,
                ) from None
            if len(seen) != layers:
                raise ModelError(f"--images: the forward of '{arch.name}' called {len(seen)} of its {layers} layers")
            shared = all(
                not _differs(seen[j][1], text_inputs(j).args, "args")
                and not _differs(seen[j][2], text_inputs(j).kwargs)
                for j in range(layers)
            )
            own = None if shared else [CapturedInputs(None, None, seen[j][1], seen[j][2]) for j in range(layers)]
            yield i, seen[0][0].float(), own
    finally:
        for module in loaded:
            module.to("meta")


def _differs(got, want, where: str = "") -> str:
    """The first argument path at which two captured argument sets differ ('' when equal)."""
    if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
        same = isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor) and got.shape == want.shape
        return "" if same and torch.equal(got.to(want.device, want.dtype), want) else where or "arguments"
    if isinstance(want, dict) and isinstance(got, dict):
        for key in sorted(set(want) | set(got)):
            found = _differs(got.get(key), want.get(key), key if not where else f"{where}.{key}")
            if found:
                return found
        return ""
    if isinstance(want, (tuple, list)) and isinstance(got, (tuple, list)) and len(want) == len(got):
        return next((f for k, (g, w) in enumerate(zip(got, want)) if (f := _differs(g, w, f"{where}[{k}]"))), "")
    return "" if got == want else where or "arguments"
