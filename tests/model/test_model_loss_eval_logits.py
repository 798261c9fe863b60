"""model/loss.py validation_logits through GPT.forward(StepArgs(training=False, logits=True)): the
logits evaluate.py reads are the ones the validation loss is the cross-entropy of."""
import math

import torch

from config import MODEL_PRESETS
from model.gpt import GPT, StepArgs
from model.loss import SOFTCAP_A

SMOKE = MODEL_PRESETS["smoke"]


def test_the_validation_loss_is_the_cross_entropy_of_the_returned_logits():
    torch.manual_seed(0)
    model = GPT(SMOKE)
    with torch.no_grad():  # off the init: an lm_head and MLP outputs that move the logits
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p.float()).to(p.dtype))
    T = 96
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 50257, (T,), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, 50257, (T,), generator=gen).long()
    cu = torch.tensor([0, 40, T, T], dtype=torch.int32)
    rows = (0.3 * torch.randn(2 * T, SMOKE.model_dim, generator=gen)).bfloat16()
    signs = torch.randint(0, SMOKE.ngram_sign_rows, (2 * T,), generator=gen, dtype=torch.int32)
    with torch.no_grad():
        loss = model(inputs, targets, cu, rows, signs, StepArgs(ws_short=1, ws_long=3, training=False))
        logits = model(inputs, targets, cu, rows, signs, StepArgs(ws_short=1, ws_long=3, training=False, logits=True))
    assert logits.shape == (T, SMOKE.vocab_size) and logits.dtype == torch.float32
    assert 0 < logits.min() and logits.max() < SOFTCAP_A  # softcapped: z = 23·σ(·)
    # the mean over rows of lse_t − z_t[y_t], summed by hand in float64 (one row at a time)
    by_hand = sum(math.log(sum(math.exp(v) for v in row.double().tolist())) - row[y].item()
                  for row, y in zip(logits[:4], targets[:4].tolist()))
    nll = torch.logsumexp(logits.double(), dim=1) - logits.double().gather(1, targets[:, None]).squeeze(1)
    assert abs(nll[:4].sum().item() - by_hand) < 1e-9
    assert abs(nll.mean().item() - loss.item()) < 1e-5 * loss.item()
    assert nll.std() > 0.01  # the rows differ: a check the loss could fail
    with torch.no_grad():  # the last rows alone: what evaluate.py reads
        tail = model(inputs, targets, cu, rows, signs, StepArgs(ws_short=1, ws_long=3, training=False, logits=True,
                                                                logits_from=T - 5))
    assert torch.equal(tail, logits[T - 5:])
