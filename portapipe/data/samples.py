"""Windows of tokens into micro-batches: inputs, targets and the documents inside each sample.

One path for every caller (training's batches, ``portapipe verify``'s random ones): a window of
``seq_len + 1`` tokens becomes the inputs (its first ``seq_len``) and the targets (its last
``seq_len``). Where the documents matter (``data.document_mask``, ``data.mask_eos_loss``), the
window comes with a flag on each token that starts a document, and the micro-batch with it:

- ``data.document_mask``: a third tensor, each input token's *position* inside its document as
  the sample holds it (0 at a document's first token and at the window's first token, then 1, 2,
  ...). A model reads its documents from it: a document starts where the position is 0. The
  attention of a token then stays inside its document and its rotary position is this one
  (Megatron's ``reset_attention_mask`` and ``reset_position_ids``).
- ``data.mask_eos_loss``: each target that starts a document (the prediction made at the end of
  the previous document, at its EOS) becomes :data:`IGNORE`, which the cross-entropy leaves out
  (Megatron's ``eod_mask_loss``). The step's loss is then the mean over the *global batch's* kept
  targets (:func:`kept_targets`), as Megatron's: each micro-batch's summed cross-entropy is divided
  by the kept targets per micro-batch of the whole step, so the mean over micro-batches and
  replicas is that global mean, whatever micro-batches and replicas the batch is cut into (a mean
  per micro-batch would weigh a target by how many others its micro-batch kept, which changes
  with ``micro_batch_size``).
"""

from __future__ import annotations

import numpy as np
import torch

#: the target the loss leaves out (``torch.nn.functional.cross_entropy``'s ``ignore_index``)
IGNORE = -100

MicroBatch = tuple[torch.Tensor, ...]


def positions(starts: np.ndarray) -> np.ndarray:
    """Each token's position in its document as the window holds it, from ``starts[n, s]`` (True
    where a document starts; the window's first token starts one whatever it says)."""
    n, s = starts.shape
    at = np.arange(s, dtype=np.int64)
    first = np.where(starts, at, 0)
    first[:, 0] = 0
    return at - np.maximum.accumulate(first, axis=1)


def make_microbatches(
    windows: np.ndarray, starts: np.ndarray | None, n_microbatches: int, document_mask: bool = False, mask_eos_loss: bool = False
) -> list[MicroBatch]:
    """``windows[n, seq_len + 1]`` (token ids) as ``n_microbatches`` micro-batches of ``n /
    n_microbatches`` rows: ``(inputs, targets)``, with the positions third under ``document_mask``.
    ``starts`` (same shape, True where a document starts) is needed by either option."""
    if (document_mask or mask_eos_loss) and starts is None:
        raise ValueError("document_mask and mask_eos_loss need the document starts of each window")
    tokens = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    if mask_eos_loss:
        targets[torch.from_numpy(np.ascontiguousarray(starts[:, 1:]))] = IGNORE
    rows = windows.shape[0] // n_microbatches
    parts: list[torch.Tensor] = [inputs, targets]
    if document_mask:
        parts.append(torch.from_numpy(positions(starts[:, :-1])))
    # each micro-batch in storage of its own: a row slice of the whole batch would keep every
    # micro-batch's tokens alive with the one a stage saves for its backward (and count them there)
    return [tuple(p[m * rows : (m + 1) * rows].clone(memory_format=torch.contiguous_format) for p in parts) for m in range(n_microbatches)]


def kept_targets(starts: np.ndarray) -> int:
    """The targets ``data.mask_eos_loss`` keeps in windows whose document starts are ``starts[n,
    seq_len + 1]``: every target but those starting a document."""
    return int(starts[:, 1:].size - np.count_nonzero(starts[:, 1:]))
