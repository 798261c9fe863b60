"""The record #360 GPT (ANVIL2, README record #92): 11 layers, attention on 7 of them, MUDD, gates.

Topology (record #360: track_1_short/model/gpt.py): attention on layers (0,1,2,3,5,8,10) with head widths
(d_qk, d_v) = (64,128) paired on 0,2,5, (64,64) on 1,8, (128,128) long-window + key offset on 3,10;
XSA on 1,3; output gates on 3,10; value embeddings on 1,2,8 (learned gates) and 10 (MUDD gates);
x0 injections on (0,1,2,4,5,7), n-gram injections on (0 pre-loop,1,4,5,9); a gated skip from
cache[3] at layer 6; layer 7 only scales the residual; a parallel MLP at layer 8 (bank slot 11);
MUDD at layer 10 (14 coefficients) and after the loop (10 sources, 12 channel-group deltas); the
pre gate (23 lanes, from x0) and the post gate (13 lanes, at layer 4).

The residual updates use the fusions of perf/residual_fusion.py (record #360; docs/design.md): `scale` /
`scale_add` with 0-D λ's, the attention post-λ carried into the O weight (`o_gain`), the MLP post-λ
folded into the fp8 down-projection scale in training (`scale_add` with the bf16 MLP otherwise),
and `rms_norm_with_head` for the value-embedding gates. `--set features.residual_fusions=false` runs the
plain expressions instead (same math, rounded in another order; tools/bench_residual_fusion.py times both).

Forward contract (B = 1; T tokens of the rank's packed batch):
    loss = model(inputs, targets, cu_seqlens, ngram_rows, ngram_sign_rows, step)
  inputs int32 [T], targets int64 [T], cu_seqlens int32 [R] (padded with T), ngram_rows [2T, D]
  (this batch's gathered n-gram rows, bigram then trigram; a leaf with requires_grad receives the
  row-sparse sink gradient), ngram_sign_rows int32 [2T] (rows of `ngram_sign_pool`), step a
  `StepArgs`. Training returns the summed loss over the T tokens (fp8 MLPs and lm_head; call
  `refresh_fp8()` after every optimizer step and before the first training forward); validation
  (`step.training=False`) returns the mean next-token cross-entropy (bf16, no MTP/prefix/sampling),
  or with `step.logits` the softcapped logits [T, V] fp32 that loss is the cross-entropy of (evaluate.py;
  rows `step.logits_from`.. only, since the lm_head is most of a short evaluation forward).

Hooks for the training loop: `refresh_fp8()` after every optimizer step; `rearm_fp8()` after the
post-warmup reset; `rescale_rotary(old, new)` when the (ws_short, ws_long) windows change (YaRN);
`set_prefix_table(build_prefix_table(V))` once the table is built (model/prefix.py);
`value_embed_grad_buffer = manager.cycle_gradient("value_embeds")` once, so the value-embedding
backward adds its row sums straight into the optimizer's fp16 cycle buffer (record #360:
track_1_short/perf/value_embed_pull.py; `value_embeds` then never gets a dense `.grad`; without it
the gradient is dense bf16).

Feature switches (config.FeatureConfig, `--set features.X=false`): without `ngram` the model has no
sign pool, no n-gram embedding and no n-gram injection (forward takes ngram_rows = ngram_sign_rows =
None); without `value_embeds` no value_embeds / ve_gate_bank, nothing added to V but layer 10's MUDD
mix, and the post-loop mix over its six other sources; without `prefix_loss` no prefix table; without
`fp8` bf16 GEMMs and no fp8 caches. The gates and MUDD blocks keep the record's widths (their unused
n-gram and value-embedding lanes are computed and dropped). Past the record (off by default):
`doc_copy` (PR #378, model/doc_copy.py) matches each position's context earlier in its document, looks
up the candidate's embedding row with the tokens' (2T rows) and adds the copy vector after the smear
and before the final norm; `token_norm_hashes` (PR #375) changes only the loader's hashes; `cplm` (PR
#379, model/cplm.py) adds a pointer head on the final normed rows whose (p_copy, a_sink) mix into the
next-token term of the loss, in training and validation.

    python -m model.summary --config record    # every parameter and buffer, built on "meta"
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from config import FeatureConfig, ModelConfig, ScheduleConfig, switched_off_parameters
from model import mudd as M
from model.attention import AttnArgs, CausalSelfAttention
from model.cplm import COPY_BAND_TRAIN, COPY_BAND_VAL, DIAGNOSTICS, copy_head, init_copy_parameters
from model.doc_copy import COPY_BUCKETS, COPY_SITE_INIT, copy_vector, doc_copy_features, hash_powers
from model.embeddings import NUM_VALUE_EMBED_PLANES, SMEAR_CHANNELS, ngram_sign_pool, smear, value_embeddings
from model.loss import LM_HEAD_INIT_STD, TransposedLinear, training_loss, validation_logits, validation_loss
from model.mlp import NUM_MLP_SLOTS, PARALLEL_MLP_LAYER, PARALLEL_MLP_SLOT, mlp_slot_output
from model.rotary import Yarn
from model.token_norm import token_norm_map
from perf.kernels.mlp import Fp8MLPState
from perf.kernels.ngram_embed import ngram_embed
from perf.residual_fusion import rms_norm_with_head, scale, scale_add

# --- topology (record #360: track_1_short/model/gpt.py) ---------------------------------------------
NUM_LAYERS = 11
ATTN_LAYERS = (0, 1, 2, 3, 5, 8, 10)
NO_MLP_LAYERS = (7,)
LONG_WINDOW_LAYERS = (3, 10)  # long window and the partial key offset
PAIRED_HEAD_LAYERS = (0, 2, 5)
WIDE_QK_LAYERS = (3, 10)  # d_qk = d_v = head_dim
HALF_V_LAYERS = (1, 8)  # d_qk = d_v = narrow_head_dim; the rest (0, 2, 5) have d_qk narrow, d_v wide
XSA_LAYERS = (1, 3)
ATTN_GATE_LAYERS = (3, 10)
VALUE_EMBED_LAYERS = (1, 2, 8, 10)  # planes 0, 1, 2, 3
VALUE_EMBED_GATE_LAYERS = (1, 2, 8)  # ve_gate_bank rows 0, 1, 2
VALUE_EMBED_GATE_CHANNELS = 6
# ours (the value-embedding ablation): of the post-loop MUDD sources (cache[0], cache[7], cache[9], ve0,
# cache[3], ve1, ve3, ve2, MLP input, late input), those left without value embeddings, by index into
# block 1's 10 coefficients
POST_LOOP_SOURCES_WITHOUT_VE = (0, 1, 2, 4, 8, 9)
X0_INJECT_LAYERS = (0, 1, 2, 4, 5, 7)
NGRAM_INJECT_LAYERS = (0, 1, 4, 5, 9)  # layer 0's happens before the loop
POST_GATE_LAYER = 4
SKIP_LAYER, SKIP_SOURCE = 6, 3
CACHE_LAYERS = (3, 7)
MUDD_LAYER = 10
ATTN_BANK_ORDER = (0, 2, 5, 1, 8, 3, 10)  # bank slot j belongs to layer ATTN_BANK_ORDER[j]
BANK_SLOTS_PADDED = 8  # record #360: qk/vo banks padded to 8 slots so 8 ranks shard them evenly
NARROW_ATTN_SCALE, WIDE_ATTN_SCALE = 0.13, 0.085  # record #360: initial softmax scales
# --- initialization (record #360: track_1_short/model/gpt.py) ---------------------------------------
RESID_LAMBDA_INIT = math.sqrt(1.1)
SA_LAMBDA_INIT = (0.5, 1.0)  # on the QKV weight, on the O weight
SMEAR_LAMBDA_INDEX, SKIP_LAMBDA_INDEX = 2 * NUM_LAYERS, 2 * NUM_LAYERS + 1
SKIP_LAMBDA_INIT = -1.5
VALUE_EMBED_INIT_STD = 0.01
# parameters kept in fp32 (record #360 casts every other one to the training dtype; PR #378 adds its three,
# PR #379 its sink key and gain: its q/k bank is cast like the backbone's matrices)
FP32_PARAMETERS = ("post_lambdas", "resid_lambdas", "scalars", "mudd_gate_scale",
                   "copy_doc_scale", "copy_doc_bucket_embed", "copy_doc_site", "copy_k_sink", "copy_qk_gain")


@dataclass
class StepArgs:
    """Per-step schedule values the forward reads (optim/schedule.py produces them).

    Python values here (ints, flags, which terms exist) are the step's geometry: a compiled model
    keeps one graph per combination. Values that change from step to step travel as tensors whose
    contents change in place (optim/schedule.py `StepWeights`), so they never recompile.
    """
    ws_short: int = 1  # short window, in blocks of GPT.block_size tokens (record #360: 128)
    ws_long: int = 3  # long window (layers 3, 10), in blocks
    mtp_weights: Tensor | tuple = (1.0,)  # fp32 [K] weights of the loss on targets t, t+1, ... (K static)
    prefix_weight: Tensor | float | None = None  # 0-D prefix-token loss weight; None or 0.0: no prefix term
    candidates: Tensor | None = None  # sampled softmax: sorted class ids [P]; None = full softmax
    training: bool = True  # False: the validation forward (bf16, mean CE)
    max_seq_len: int | None = None  # longest attention segment of the batch (Batch.max_seq_len; FA3)
    canonical_mask: Tensor | None = None  # validation: record #92's packed (prev, cur) mask, or None
    logits: bool = False  # validation only: return the softcapped logits fp32, not the mean loss (evaluate.py)
    logits_from: int = 0  # with logits: rows logits_from.. only, [T − logits_from, V] (the rows the caller reads)
    head_sample: object | None = None  # PR #371: the sampled lm_head dW's counter (perf/sampled_head_grad.py HeadSample)
    # PR #371 part 2: the attention backward's mode (0, 1 calibration, 2 restricted; static) and, in modes 1
    # and 2, the layers' head tables and snapshots (model/attention_calibration.py CalibrationState)
    attention_mode: int = 0
    attention_calibration: object | None = None

    @property
    def prefix_on(self) -> bool:
        """Whether the prefix term exists this step (static: a tensor weight always means yes)."""
        w = self.prefix_weight
        return w is not None and (isinstance(w, Tensor) or w != 0)


def attn_widths(layer: int, cfg: ModelConfig) -> tuple[int, int]:
    """(d_qk, d_v) of an attention layer."""
    if layer in WIDE_QK_LAYERS:
        return cfg.head_dim, cfg.head_dim
    if layer in HALF_V_LAYERS:
        return cfg.narrow_head_dim, cfg.narrow_head_dim
    return cfg.narrow_head_dim, cfg.head_dim


def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, fp8: bool = True,
                 features: FeatureConfig = FeatureConfig(), block_size: int = ScheduleConfig.block_size):
        """fp8: the device runs fp8 GEMMs (perf.backend's `fp8`, read from the device); training uses
        them when features.fp8, the one switch, is on too. features: the record features this model has (config.FeatureConfig); a switched-off
        one leaves no parameter, buffer or op behind (`switched_off_parameters`). block_size: the
        run's schedule.block_size, the tokens per window block (StepArgs' windows and
        `rescale_rotary`'s count blocks; record #360: 128)."""
        super().__init__()
        if block_size < 1:
            raise ValueError(f"GPT: block_size={block_size} (schedule.block_size) must be a positive token count")
        self.cfg, self.features, self.block_size = cfg, features, block_size
        self.fused_residuals = features.residual_fusions
        self.fp8 = fp8 and features.fp8
        V, D, H, hd = cfg.vocab_size, cfg.model_dim, cfg.num_heads, cfg.head_dim
        h = cfg.mudd_hidden_dim
        bound = math.sqrt(3) * 0.5 * D ** -0.5  # record #360: 1/32 at D = 768
        live_slots = len(ATTN_BANK_ORDER)

        self.lm_head = TransposedLinear(D, V)  # [D, V]
        nn.init.normal_(self.lm_head.weight, std=LM_HEAD_INIT_STD)
        self.embed = nn.Embedding(V, D)
        with torch.no_grad():
            self.embed.weight.copy_(self.lm_head.weight.t())  # tied at init
        if features.value_embeds:
            self.value_embeds = nn.Parameter(VALUE_EMBED_INIT_STD * torch.randn(NUM_VALUE_EMBED_PLANES * V, D))
            self.ve_gate_bank = nn.Parameter(torch.zeros(len(VALUE_EMBED_GATE_LAYERS), H,
                                                         2 * VALUE_EMBED_GATE_CHANNELS))
        # qk: per slot H groups of two heads (Q0Q1, Q2Q3, ..., K4K5), each [2·hd, D]; padding zero
        self.qk_bank = nn.Parameter(torch.zeros(BANK_SLOTS_PADDED * H, 2 * hd, D))
        # vo: per slot its V [H·hd, D] and O [D, H·hd] (nn.Linear layouts); padding zero
        self.vo_bank = nn.Parameter(torch.zeros(2 * BANK_SLOTS_PADDED, D, D))
        # mlp: per slot c_fc and c_proj, both [H_mlp, D]; c_proj starts at zero
        self.mlp_bank = nn.Parameter(torch.zeros(NUM_MLP_SLOTS, 2, cfg.mlp_hidden_dim, D))
        with torch.no_grad():
            self.qk_bank[: live_slots * H].uniform_(-bound, bound)
            self.vo_bank[: 2 * live_slots].uniform_(-bound, bound)
            self.mlp_bank[:, 0].uniform_(-bound, bound)
        self.smear_gate = nn.Linear(SMEAR_CHANNELS, 1, bias=False)
        nn.init.zeros_(self.smear_gate.weight)
        self.post_lambdas = nn.Parameter(torch.ones(NUM_LAYERS, 2))
        if features.doc_copy:  # PR #378: here in its order, no random draw; the copy vector starts at 0
            self.copy_doc_scale = nn.Parameter(torch.zeros(COPY_BUCKETS))  # [31]
            self.copy_doc_bucket_embed = nn.Parameter(torch.zeros(COPY_BUCKETS, D))  # [31, D]
            self.copy_doc_site = nn.Parameter(torch.tensor(COPY_SITE_INIT))  # [2]: input site, output site
        self.resid_lambdas = nn.Parameter(torch.full((NUM_LAYERS, 2), RESID_LAMBDA_INIT))
        scalars = torch.zeros(2 * NUM_LAYERS + 2)
        scalars[0: 2 * NUM_LAYERS: 2], scalars[1: 2 * NUM_LAYERS: 2] = SA_LAMBDA_INIT
        scalars[SKIP_LAMBDA_INDEX] = SKIP_LAMBDA_INIT  # the smear λ starts at 0
        self.scalars = nn.Parameter(scalars)
        # MUDD blocks and gates (Kaiming-uniform a=√5 on the first layer: bound 1/√D)
        self.mudd_w1 = nn.Parameter(torch.empty(2, h, D).uniform_(-D ** -0.5, D ** -0.5))
        self.mudd_w2 = nn.Parameter(torch.zeros(2, M.LAST_LAYER_MUDD_COEFS, h))
        self.mudd_b2 = nn.Parameter(M.mudd_block_bias(M.LAST_LAYER_MUDD_COEFS))
        self.mudd_w2g = nn.Parameter(torch.zeros(M.LAST_LAYER_MUDD_COEFS, M.MUDD_GROUPS, h))
        self.mudd_gate_scale = nn.Parameter(torch.tensor(M.MUDD_GATE_SCALE_INIT))
        self.mudd_gate_w1 = nn.Parameter(torch.empty(2, h, D).uniform_(-D ** -0.5, D ** -0.5))
        self.mudd_gate_w2 = nn.Parameter(torch.zeros(2, M.PRE_GATE_LANES, h))
        self.mudd_gate_b2 = nn.Parameter(M.mudd_gate_bias())
        # matrices in the training dtype (record #360 casts exactly this set); scalars stay fp32
        for name, p in self.named_parameters():
            if name not in FP32_PARAMETERS:
                p.data = p.data.to(dtype)
        # Layer 7 has no MLP, so its bank slot (slot i serves layer i) is never read. The optimizer
        # (optim/manager.py) reads this set of indices into the bank's [24, H_mlp, D] matrix view,
        # (c_fc, c_proj) = (14, 15), and gives them lr 0: they never move, decay included
        # (record #360: track_1_short/training.py's optimizer table).
        self.mlp_bank.frozen_matrices = frozenset(2 * layer + k for layer in NO_MLP_LAYERS for k in (0, 1))

        # switched-off features register nothing (the MUDD gates keep their n-gram lanes and the
        # MUDD blocks their value-embedding and n-gram coefficients: those widths are the record's
        # parameter shapes; the unused lanes are computed and dropped, a few columns of tiny GEMMs).
        # A None buffer is neither in state_dict() nor in named_buffers().
        self.register_buffer("ngram_sign_pool", ngram_sign_pool(cfg).to(dtype) if features.ngram else None)
        self.register_buffer("prefix_table", torch.full((V,), -1, dtype=torch.long) if features.prefix_loss else None,
                             persistent=False)
        # DocCopy's constants (PR #378): the normalization map the matcher compares contexts in, the
        # hash's power tables, and the mask that keeps bucket 0 (no match) at zero
        if features.doc_copy and not features.token_norm_hashes:
            raise ValueError("GPT: features.doc_copy needs features.token_norm_hashes (PR #378 is stacked on #375)")
        pow_fwd, pow_bwd = hash_powers() if features.doc_copy else (None, None)
        self.register_buffer("token_norm_map", torch.tensor(token_norm_map(V).ids) if features.doc_copy else None,
                             persistent=False)
        self.register_buffer("copy_pow_fwd", pow_fwd, persistent=False)
        self.register_buffer("copy_pow_bwd", pow_bwd, persistent=False)
        self.register_buffer("copy_doc_live", (torch.arange(COPY_BUCKETS) > 0).float() if features.doc_copy else None,
                             persistent=False)
        self.yarn = Yarn(cfg.narrow_head_dim, cfg.narrow_head_dim, NARROW_ATTN_SCALE)
        self.yarn_paired = Yarn(cfg.narrow_head_dim, cfg.narrow_head_dim, NARROW_ATTN_SCALE, paired=True)
        self.yarn_wide = Yarn(cfg.head_dim, cfg.narrow_head_dim, WIDE_ATTN_SCALE)
        self.attn = nn.ModuleDict({
            str(i): CausalSelfAttention(H, hd, *attn_widths(i, cfg), paired=i in PAIRED_HEAD_LAYERS)
            for i in ATTN_LAYERS})
        self.mlp_fp8 = Fp8MLPState(NUM_MLP_SLOTS, cfg.mlp_hidden_dim, D) if self.fp8 else None
        self.value_embed_grad_buffer: Tensor | None = None  # the optimizer's, set by the training loop
        if features.cplm:  # PR #379: created last, after every backbone draw, so a seeded backbone is the record's
            bank, k_sink, gain = init_copy_parameters(D)
            self.copy_qk_bank = nn.Parameter(bank.to(dtype))  # [2, 128, D]: W_q, W_k
            self.copy_k_sink = nn.Parameter(k_sink)  # [128] fp32
            self.copy_qk_gain = nn.Parameter(gain)  # [1] fp32
        # the validation's diagnostic sums (model/cplm.py DIAGNOSTICS), zeroed and read by the run, off the clock
        self.register_buffer("cplm_diag", torch.zeros(len(DIAGNOSTICS)) if features.cplm else None, persistent=False)

    # --- hooks the training loop calls -------------------------------------------------------------
    def refresh_fp8(self, exact: bool | None = None) -> None:
        """Re-quantize the MLP weights and roll the delayed scales (after every optimizer step).
        exact: the mode `next_fp8_refresh_exact()` returned, when the caller counts the refresh
        itself (outside a captured region); None counts it here."""
        if self.mlp_fp8 is not None:
            self.mlp_fp8.refresh(self.mlp_bank.detach(), exact)

    def next_fp8_refresh_exact(self) -> bool:
        """Whether the next `refresh_fp8` uses exact weight scales, counting it (a host counter)."""
        return self.mlp_fp8 is not None and self.mlp_fp8.next_refresh_exact()

    def rearm_fp8(self) -> None:
        """After the post-warmup state reset: exact weight scales again, warmup amaxes dropped."""
        if self.mlp_fp8 is not None:
            self.mlp_fp8.rearm()

    @property
    def switched_off_parameters(self) -> tuple[str, ...]:
        """The record's parameters this model lacks because a feature is off: the parameters the
        switched-off features declare (config.FEATURES); the optimizer's table skips exactly these
        (optim/manager.py `absent`)."""
        return switched_off_parameters(self.features)

    def set_prefix_table(self, table: Tensor) -> None:
        if self.prefix_table is None:
            raise ValueError("set_prefix_table: this model has no prefix table (features.prefix_loss is off)")
        with torch.no_grad():
            self.prefix_table.copy_(table)

    def reset_rotary(self) -> None:
        """Back to the initial YaRN tables and attention scales (after the untimed warmup)."""
        for table in (self.yarn, self.yarn_paired, self.yarn_wide):
            table.reset()

    def rescale_rotary(self, old: tuple[int, int], new: tuple[int, int]) -> None:
        """Window change (ws_short, ws_long) old → new in blocks: YaRN on the three tables."""
        if old[1] != new[1]:
            self.yarn_wide.rescale(old[1] * self.block_size, new[1] * self.block_size)
            for table in (self.yarn, self.yarn_paired):
                table.rescale(old[0] * self.block_size, new[0] * self.block_size)

    def gate_lanes(self, x: Tensor, gate: int, num_lanes: int) -> Tensor:
        """Raw lanes of the pre (gate 0) or post (gate 1) MUDD gate: [T, num_lanes]."""
        return M.mudd_gate(x, self.mudd_gate_w1[gate], self.mudd_gate_w2[gate], self.mudd_gate_b2[gate],
                           self.mudd_gate_scale, num_lanes)

    # --- layer weights, cut from the banks once per forward ---------------------------------------
    def attn_weights(self) -> dict[int, tuple[Tensor, Tensor, Tensor]]:
        """Per attention layer (qk_w [2·H·d_qk, D], v_w [H·d_v, D], o_w [D, H·d_v]).

        Each bank is unbound once, so its backward assembles one gradient instead of one
        zero-filled bank per slice.
        """
        H, hd, D = self.cfg.num_heads, self.cfg.head_dim, self.cfg.model_dim
        n = len(ATTN_BANK_ORDER)
        qk_slots = self.qk_bank[: n * H].view(n, 2 * H, hd, D).unbind(0)  # heads Q0..Q5, K0..K5
        vo_slots = self.vo_bank[: 2 * n].view(n, 2, D, D).unbind(0)  # (V, O) per slot
        weights = {}
        for j, layer in enumerate(ATTN_BANK_ORDER):
            dq, dv = attn_widths(layer, self.cfg)
            v, o = vo_slots[j].unbind(0)
            weights[layer] = (qk_slots[j][:, :dq].reshape(2 * H * dq, D),
                              v.view(H, hd, D)[:, :dv].reshape(H * dv, D),
                              o.view(D, H, hd)[:, :, :dv].reshape(D, H * dv))
        return weights

    # --- residual products: fused (record #360) or plain -------------------------------------------
    def _scale(self, r: Tensor, x: Tensor) -> Tensor:
        return scale(r, x) if self.fused_residuals else r * x

    def _scale_add(self, r: Tensor, x: Tensor, p: Tensor, y: Tensor) -> Tensor:
        return scale_add(r, x, p, y) if self.fused_residuals else r * x + p * y

    def _norm_with_head(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.fused_residuals:
            return rms_norm_with_head(x, VALUE_EMBED_GATE_CHANNELS)
        normed = norm(x)
        return normed, normed[:, :VALUE_EMBED_GATE_CHANNELS]

    def forward(self, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor, ngram_rows: Tensor | None,
                ngram_sign_rows: Tensor | None, step: StepArgs) -> Tensor:
        cfg, T, features = self.cfg, inputs.numel(), self.features
        H, hd = cfg.num_heads, cfg.head_dim
        if inputs.dim() != 1 or targets.shape != inputs.shape:
            raise ValueError(f"GPT.forward: inputs/targets must be [T], got {tuple(inputs.shape)}, {tuple(targets.shape)}")
        if features.ngram and (ngram_rows is None or ngram_rows.shape != (2 * T, cfg.model_dim)):
            raise ValueError(f"GPT.forward: ngram_rows must be [2T, {cfg.model_dim}] = [{2 * T}, {cfg.model_dim}], got "
                             f"{None if ngram_rows is None else tuple(ngram_rows.shape)}")
        if not features.ngram and (ngram_rows is not None or ngram_sign_rows is not None):
            raise ValueError("GPT.forward: features.ngram is off: pass ngram_rows=None and ngram_sign_rows=None")
        if step.prefix_on and self.prefix_table is None:
            raise ValueError("GPT.forward: a prefix weight was given but features.prefix_loss is off (no prefix table)")
        use_fp8 = step.training and self.fp8
        fp8_state = self.mlp_fp8 if use_fp8 else None

        # --- preamble: embeddings (with the copy candidates' rows), smear, the copy vector, x0, the pre gate ---
        if features.doc_copy:  # one lookup of 2T rows: the tokens, then their copy candidates (PR #378)
            candidate, bucket = doc_copy_features(inputs, self.token_norm_map, self.copy_pow_fwd, self.copy_pow_bwd)
            x, copied = self.embed(torch.cat([inputs, candidate.clamp_min(0).to(inputs.dtype)])).split(T)  # 2 × (T, D)
        else:
            x = self.embed(inputs)  # (T, D)
        dt = x.dtype
        r_attn, r_mlp = self.resid_lambdas.to(dt).unbind(1)  # record #360: λ's cast once per forward
        p_attn, p_mlp = self.post_lambdas.to(dt).unbind(1)
        sa = self.scalars.view(-1)[: 2 * NUM_LAYERS].view(NUM_LAYERS, 2)
        ngram = ngram_embed(ngram_rows, self.ngram_sign_pool, ngram_sign_rows).to(dt) if features.ngram else None  # (T, D)
        ve = value_embeddings(self.value_embeds, inputs, cfg.vocab_size, self.value_embed_grad_buffer) \
            if features.value_embeds else None  # 4 × (T, D)
        ve_of_layer = dict(zip(VALUE_EMBED_LAYERS, ve)) if ve is not None else {}
        attn_w = self.attn_weights()
        mlp_w = [slot.unbind(0) for slot in self.mlp_bank.unbind(0)]  # 12 × (c_fc, c_proj)
        x = smear(x, self.smear_gate.weight, self.scalars[SMEAR_LAMBDA_INDEX])
        copy_out = None
        if features.doc_copy:  # inside x0: it reaches the gates, the residual start and every x0 injection
            v = copy_vector(copied, bucket, self.copy_doc_scale, self.copy_doc_bucket_embed, self.copy_doc_live)
            site = self.copy_doc_site.to(dt)
            x, copy_out = x + site[0] * v, site[1] * v  # (T, D), (T, D)
        x0 = norm(x)
        pre = self.gate_lanes(x0, 0, M.PRE_GATE_LANES)  # (T, 23)
        xsa = {layer: pre[:, s] for layer, s in M.PRE_GATE_XSA.items()}
        attn_gate = {layer: pre[:, s] for layer, s in M.PRE_GATE_ATTN_GATE.items()}
        x0_gate = {layer: pre[:, lane, None] for layer, lane in M.PRE_GATE_X0.items()}
        ngram_gate = {layer: pre[:, lane, None] for layer, lane in M.PRE_GATE_NGRAM.items()}
        x = x0 + ngram * ngram_gate[0] if ngram is not None else x0
        cache = {0: x}
        late_input = None  # (norm(cache[7]), its head): shared by layers 8 and 10

        for i in range(NUM_LAYERS):
            if i == POST_GATE_LAYER:
                post = self.gate_lanes(x, 1, M.POST_GATE_LANES)  # (T, 13), from the raw residual
                attn_gate.update({layer: post[:, s] for layer, s in M.POST_GATE_ATTN_GATE.items()})
                x0_gate.update({layer: post[:, lane, None] for layer, lane in M.POST_GATE_X0.items()})
                ngram_gate.update({layer: post[:, lane, None] for layer, lane in M.POST_GATE_NGRAM.items()})
                skip_gate = post[:, M.POST_GATE_SKIP, None]

            # --- attention slot ---
            if i == MUDD_LAYER:
                cache[9] = x
                mu, _ = M.mudd_coefficients(x, self.mudd_w1[0], self.mudd_w2[0], self.mudd_b2[0],
                                            M.LAST_LAYER_MUDD_COEFS)
                mu = mu[:, :, None].unbind(1)  # 14 × (T, 1)
                v_mudd = mu[0] * cache[0] + mu[1] * cache[7] + mu[2] * x
                x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[7]
            if i in ATTN_LAYERS:
                if 7 in cache:  # layers 8 and 10 share one norm(cache[7])
                    if late_input is None:
                        late_input = self._norm_with_head(cache[7]) if ve is not None else (norm(cache[7]), None)
                    a, a_head = late_input
                elif i in VALUE_EMBED_GATE_LAYERS and ve is not None:
                    a, a_head = self._norm_with_head(x)
                else:
                    a, a_head = norm(x), None
                aux_v = None
                if ve is None:  # no value embeddings: only layer 10's MUDD mix reaches V
                    aux_v = v_mudd if i == MUDD_LAYER else None
                elif i in VALUE_EMBED_GATE_LAYERS:
                    w_gate = self.ve_gate_bank[VALUE_EMBED_GATE_LAYERS.index(i)]  # (H, 12)
                    v_emb = ve_of_layer[i]
                    gate_in = torch.cat([a_head, v_emb[:, :VALUE_EMBED_GATE_CHANNELS]], dim=-1)  # (T, 12)
                    gamma = 2 * torch.sigmoid(gate_in @ w_gate.t())  # (T, H)
                    aux_v = (gamma[:, :, None] * v_emb.view(T, H, hd)).view(T, -1)
                elif i == MUDD_LAYER:  # heads of the first half gated by μ6, of the second by μ7
                    gamma = torch.cat([mu[6].expand(T, H // 2), mu[7].expand(T, H // 2)], dim=1)
                    aux_v = (gamma[:, :, None] * ve_of_layer[i].view(T, H, hd)).view(T, -1) + v_mudd
                fold_o_gain = self.fused_residuals and i != MUDD_LAYER
                long = i in LONG_WINDOW_LAYERS
                args = AttnArgs(
                    sa_lambdas=sa[i], cu_seqlens=cu_seqlens,
                    window=(step.ws_long if long else step.ws_short) * self.block_size,
                    yarn=self.yarn_wide if long else (self.yarn_paired if i in PAIRED_HEAD_LAYERS else self.yarn),
                    key_offset=long, attn_gate=attn_gate.get(i), aux_v=aux_v, xsa_alpha=xsa.get(i),
                    o_gain=p_attn[i] if fold_o_gain else None, fp8=use_fp8, max_seqlen=step.max_seq_len)
                if step.attention_mode and i in step.attention_calibration.tables:  # PR #371's five layers
                    calibration = step.attention_calibration
                    args.backward_mode, args.head_windows = step.attention_mode, calibration.tables[i]
                    args.snapshot = calibration.snapshots[i] if step.attention_mode == 1 else None
                out = self.attn[str(i)](a, *attn_w[i], args)  # (T, D)
                if i == MUDD_LAYER:
                    x = mu[8] * x + mu[9] * out + mu[10] * cache[0]
                    if ngram is not None:
                        x = x + mu[11] * ngram
                elif fold_o_gain:
                    x = scale(r_attn[i], x) + out
                else:
                    x = r_attn[i] * x + p_attn[i] * out
            elif i == SKIP_LAYER:
                x = x + torch.sigmoid(self.scalars[SKIP_LAMBDA_INDEX]).to(dt) * skip_gate * cache[SKIP_SOURCE]
            else:
                x = self._scale(r_attn[i], x)
            if i != MUDD_LAYER:
                if i in X0_INJECT_LAYERS:
                    x = x + x0 * x0_gate[i]
                if i in NGRAM_INJECT_LAYERS and i != 0 and ngram is not None:
                    x = x + ngram * ngram_gate[i]

            # --- MLP slot ---
            if i in NO_MLP_LAYERS:
                x = self._scale(r_mlp[i], x)
            else:
                m = norm(x)
                m8 = fp8_state.quantize_input(m) if fp8_state is not None else None
                if i == MUDD_LAYER:
                    mlp_input_last = m
                    x = mu[12] * x + mu[13] * mlp_slot_output(m, mlp_w, i, fp8_state, None, m8)
                elif fp8_state is not None and self.fused_residuals:  # post λ folded into the fp8 scale
                    x = scale(r_mlp[i], x) + mlp_slot_output(m, mlp_w, i, fp8_state, p_mlp[i], m8)
                else:
                    x = self._scale_add(r_mlp[i], x, p_mlp[i], mlp_slot_output(m, mlp_w, i, fp8_state, None, m8))
                if i == PARALLEL_MLP_LAYER:  # same input, same post λ, bank slot 11
                    if fp8_state is not None and self.fused_residuals:
                        x = x + mlp_slot_output(m, mlp_w, PARALLEL_MLP_SLOT, fp8_state, p_mlp[i], m8)
                    else:
                        par = mlp_slot_output(m, mlp_w, PARALLEL_MLP_SLOT, fp8_state, None, m8)
                        x = x + self._scale(p_mlp[i], par)
            if i in CACHE_LAYERS:
                cache[i] = x

        # --- post-loop MUDD mix over 10 sources, then the final norm and the loss ---
        mu_post, hidden = M.mudd_coefficients(x, self.mudd_w1[1], self.mudd_w2[1], self.mudd_b2[1],
                                              M.POST_LOOP_MUDD_COEFS)
        delta = M.mudd_group_deltas(hidden, self.mudd_w2g, M.POST_LOOP_MUDD_COEFS)
        if ve is not None:
            sources = [cache[0], cache[7], cache[9], ve[0], cache[3], ve[1], ve[3], ve[2], mlp_input_last, late_input[0]]
        else:  # the six sources left, with their own coefficients (block 1 keeps its 10 outputs)
            sources = [cache[0], cache[7], cache[9], cache[3], mlp_input_last, late_input[0]]
            keep = list(POST_LOOP_SOURCES_WITHOUT_VE)
            mu_post, delta = mu_post[:, keep], delta[:, keep]  # (T, 6), (T, 6, 12)
        x = M.post_loop_mix(x, sources, mu_post, delta)  # (T, D)
        if copy_out is not None:  # DocCopy's output site, before the final norm
            x = x + copy_out
        x = norm(x)

        copy = None  # CPLM (PR #379): the pointer over earlier same-document tokens, mixed into the next-token loss
        if features.cplm and not step.logits:
            band = COPY_BAND_TRAIN if step.training else COPY_BAND_VAL
            copy = copy_head(x, self.copy_qk_bank, self.copy_k_sink, self.copy_qk_gain, inputs, targets, cu_seqlens,
                             band)  # (T,), (T,)
        if not step.training:
            if step.logits:  # evaluate.py: log-probabilities and next tokens (no canonical mask; the LM alone)
                return validation_logits(x[step.logits_from:], self.lm_head.weight)
            return validation_loss(x, self.lm_head.weight, targets, inputs, step.canonical_mask, copy, self.cplm_diag)
        prefix = self.prefix_table[targets] if step.prefix_on else None
        return training_loss(x, self.lm_head.weight, targets, step.mtp_weights, prefix, step.prefix_weight,
                             step.candidates, fp8=use_fp8, copy=copy, head_sample=step.head_sample)
