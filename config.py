"""Run configurations: frozen dataclasses and the named presets (smoke, dev, record).

Each concern owns one section below. A preset name selects one entry from every section; the
command line of train_gpt.py overrides individual fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass, replace


class ConfigError(ValueError):
    """The configuration of a run (flags, SPEEDRUN_* variables, preset) cannot work; raised before
    any work starts. `problems` holds one line each: the flag or variable, its value, what is
    allowed and the fix. Entry points print them as one-line errors and exit 2, no traceback
    (cli.exit_on_config_error); a traceback stays for bugs."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


# ================================================================================================
# Model dimensions (used by model/).
# ================================================================================================


@dataclass(frozen=True)
class ModelConfig:
    """Widths and table sizes of the record #360 network. The topology (which layers have
    attention, MLPs, gates, MUDD) is fixed in model/gpt.py; these numbers only size it."""
    vocab_size: int = 50304  # record #360: GPT-2's 50257 padded to a multiple of 128
    model_dim: int = 768  # record #360
    num_heads: int = 6  # record #360; num_heads · head_dim must equal model_dim
    head_dim: int = 128  # record #360: the wide heads (layers 3, 10) and the bank row width
    narrow_head_dim: int = 64  # record #360: d_qk on 0,1,2,5,8, d_v on 1,8, and the rotary dims
    mlp_hidden_dim: int = 2816  # record #360
    mudd_hidden_dim: int = 64  # record #360: hidden width of the MUDD blocks and the MUDD gates
    ngram_rows: int = 84_602_880  # record #360: bigram half + trigram half, sharded by world size
    ngram_sign_rows: int = 8192  # record #360: the ±1 sign pool (a power of two: rows are hash & 8191)

    def __post_init__(self):
        if self.num_heads * self.head_dim != self.model_dim:
            raise ValueError(f"ModelConfig: num_heads·head_dim = {self.num_heads * self.head_dim} "
                             f"must equal model_dim {self.model_dim}")
        if self.model_dim % 12 or self.num_heads % 2 or self.narrow_head_dim % 2:
            raise ValueError("ModelConfig: model_dim must split into 12 MUDD groups and heads into pairs")
        if not self.narrow_head_dim < self.head_dim:
            raise ValueError("ModelConfig: narrow_head_dim must be below head_dim (the key offset "
                             "needs stationary dims on the wide heads)")
        if self.ngram_rows % 2 or self.ngram_sign_rows & (self.ngram_sign_rows - 1):
            raise ValueError("ModelConfig: ngram_rows must be even (two halves), ngram_sign_rows a power of two")


MODEL_PRESETS = {
    "record": ModelConfig(),
    # One GPU holds the whole n-gram table: 8,388,608 rows (12.9 GB bf16) instead of 130 GB.
    "dev": ModelConfig(ngram_rows=8_388_608),
    # CPU: same topology and vocabulary (GPT-2 tokens), small widths and tables.
    "smoke": ModelConfig(model_dim=96, head_dim=16, narrow_head_dim=8, mlp_hidden_dim=192,
                         mudd_hidden_dim=16, ngram_rows=16_384),
}


# ================================================================================================
# Schedule and optimizer (used by optim/).
# ================================================================================================
# The stage table and the step-indexed switches live in ScheduleConfig; the optimizer's constants in
# OptimConfig. optim/schedule.py turns a ScheduleConfig into per-step values
# (`python -m optim.schedule --config record` prints the table).

TOKENS_PER_BATCH_UNIT = 2048 * 8  # record #360: a stage's batch is units x 2048 tokens x 8 ranks


@dataclass(frozen=True)
class StageConfig:
    """One training stage. Batch sizes are global tokens (split evenly over ranks)."""
    batch_tokens: int
    doc_cap: int                        # documents longer than this are cut (tokens)
    ws_short: int                       # short sliding window, in window blocks
    ws_long: int                        # long sliding window, in window blocks
    lr_mul: float
    mtp_start: tuple[float, ...]        # MTP weights at the stage start, one per predicted offset
    mtp_end: tuple[float, ...]          # ... and at its end (linear in between)
    prefix_weights: tuple[float, ...]   # split the stage into len() equal parts
    softmax_p: tuple[int, ...] = ()     # sampled-softmax candidates, equal parts; () = full softmax


# record #360 (track_1_short/config.py TRAINING_STAGES). lr_mul 1.52 ~ (16/8)^0.6 and 1.73 ~ (24/8)^0.5; the
# taper keeps 1.73
# scaled by sqrt(20/24) for its smaller batch; the extension's lr_mul is unused (lr is at the floor).
RECORD_STAGES = (
    StageConfig(8 * TOKENS_PER_BATCH_UNIT, 896, 1, 3, 1.0, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0),
                (0.25,), (10240,)),
    StageConfig(16 * TOKENS_PER_BATCH_UNIT, 2048, 3, 7, 1.52, (1.0, 0.5), (1.0, 0.0),
                (0.20, 0.15, 0.10, 0.05), (10240,)),
    StageConfig(24 * TOKENS_PER_BATCH_UNIT, 3072, 5, 11, 1.73, (1.0,), (1.0,),
                (0.0,), (14336, 14336, 24576)),
    StageConfig(20 * TOKENS_PER_BATCH_UNIT, 3072, 5, 11, 1.73 * (20 / 24) ** 0.5, (1.0,), (1.0,),
                (0.0,)),
    StageConfig(8 * TOKENS_PER_BATCH_UNIT, 3072, 6, 13, 1.0, (1.0,), (1.0,), (0.0,)),
)


@dataclass(frozen=True)
class ScheduleConfig:
    """The five-stage schedule and every step-indexed switch (record #360: track_1_short/schedule.py)."""
    stages: tuple[StageConfig, ...] = RECORD_STAGES
    base_steps: int = 1122                  # record #360: NUM_SCHEDULED_ITERATIONS default
    # Durations of stages 0..2 as fractions of base_steps (normalized by their sum, 0.9994); the
    # taper (stage 3) is taken out of the last one; the extension (stage 4) has a fixed step count.
    stage_durations: tuple[float, float, float] = (0.2854, 0.3209, 0.3931)  # record #360
    taper_duration: float = 0.06            # record #360
    growth_steps: int = 52                  # record #360: added to stage 2 (keeps later parities)
    growth_stage: int = 2                   # record #360
    extension_steps: int = 20               # record #360
    lr_cooldown_frac: float = 0.80          # record #360: linear cooldown over the last 80%
    lr_floor: float = 0.30                  # record #360 code value (its README says 0.20)
    rail_warmup_steps: int = 240            # record #360 get_rail_beta: 0.85 -> 0.93 over 240 steps
    rail_cooldown_steps: int = 50           # ... back to 0.85 over the last 50
    rail_beta_min: float = 0.85             # record #360
    rail_beta_max: float = 0.93             # record #360
    rail_engage_step: int = 514             # record #360: twin-rail blend engages
    table_period4_step: int = 336           # record #360: n-gram/VE events every 4th step from here
    split_embed_stage: int = 4              # record #360: embed unties at (start of stage 4) | 1
    block_size: int = 128                   # record #360: tokens per window block
    virtual_seq_cap: int = 2560             # record #360: attention segments cut every 2560 tokens
    ws_post_yarn_ext: int = 20              # record #360: final validation long window (blocks)
    # Tail averages (record #360: track_1_short/tail_average.py): windows in steps, rates per tick, ship blends.
    tail_ema_window: int = 298
    tail_ema_blend: float = 0.65
    tail_avg_window: int = 250
    tail_avg_period: int = 4
    tail_avg_rate: float = 4.0 / 53.0       # record #360's tuned rate (not derived from the window)
    bank_blend_window: int = 298
    bank_blend_period: int = 4
    bank_blend: float = 0.55
    richardson_w: float = 0.2007            # record #360: vo/mlp ship at 0.55 - 0.2007


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer constants (record #360: track_1_short/optim/anvil.py and training.py). NorMuon's are
    record #89's."""
    bank_optimizer: str = "anvil"           # "anvil" (record #360) or "normuon" (record #89)
    anvil_lr: float = 0.023                 # record #360
    anvil_weight_decay: float = 2.25        # record #360 (NorMuon: 1.2)
    lane_beta2: float = 0.9                 # record #360 (and #89): lane equalizer EMA
    rail_fast_beta: float = 0.85            # record #360: fast rail beta from the engage step
    rail_slow_beta: float = 0.98            # record #360
    rail_fast_weight: float = 0.4385        # record #360: fast rail's blend weight once engaged
    frobenius_margin: float = 1.05          # record #360 (NorMuon: 1.02)
    frobenius_eps: float = 1e-6             # record #360
    normuon_lr: float = 0.023               # record #89
    normuon_weight_decay: float = 1.2       # record #89
    normuon_frobenius_margin: float = 1.02  # record #89
    adam_lr: float = 0.008                  # record #360
    adam_eps: float = 1e-10                 # record #360
    adam_weight_decay: float = 0.005        # record #360
    ngram_lr_mul: float = 70.0              # record #360 (record #89's bigram: 75)
    ngram_beta2: float = 0.95               # record #360; squared once events are every 4th step
    ngram_wd_mul: float = 5.0               # record #360; 10 once events are every 4th step


@dataclass(frozen=True)
class ParamRule:
    """How one parameter is optimized (its row of the optimizer table, optim/adam.py). Plain data,
    here at the bottom layer so that a feature's declaration (FEATURES below) carries the rows of
    the parameters it adds.

    optim:   "bank" (ANVIL or NorMuon, per OptimConfig) or "adam"
    comms:   "sharded" (reduce-scatter, update 1/W, all-gather) or "replicated" (all-reduce)
    cadence: "every" (banks), "adam" (odd steps, two steps of summed gradient) or "table" (the
             n-gram table's update events, gradient summed over the cycle: value_embeds)
    """
    optim: str
    comms: str
    cadence: str
    betas: tuple[float, float] | None = None
    lr_mul: float = 1.0
    wd_mul: float = 1.0


def _smoke_schedule() -> ScheduleConfig:
    """70 steps on CPU that cross every stage boundary, the cadence switch, the rail engage step,
    the split and the tail windows. Batches are tiny; the stage structure is the record's."""
    small = (1024, 2048, 3072, 2560, 1024)  # global tokens, the record's 8/16/24/20/8 ratios
    # sampled-softmax P is cut 8x (still multiples of 256) for a smoke vocabulary
    stages = tuple(StageConfig(b, s.doc_cap, s.ws_short, s.ws_long, s.lr_mul, s.mtp_start,
                               s.mtp_end, s.prefix_weights, tuple(p // 8 for p in s.softmax_p))
                   for b, s in zip(small, RECORD_STAGES))
    return ScheduleConfig(stages=stages, base_steps=60, growth_steps=4, extension_steps=6,
                          rail_warmup_steps=12, rail_cooldown_steps=3, rail_engage_step=30,
                          table_period4_step=20, tail_ema_window=18, tail_avg_window=15,
                          bank_blend_window=18)


SCHEDULE_PRESETS = {
    "record": ScheduleConfig(),
    "dev": ScheduleConfig(),   # 1 GPU, same schedule (grad accumulation keeps the global batch)
    "smoke": _smoke_schedule(),
}
# smoke: ANVIL's Frobenius margin 1.10 instead of record #360's 1.05. Its 96-wide banks on tiny batches
# can get a nearly rank-1 update (σ1/||X||_F = 0.9989 at step 34 with --seed 0), whose normalized σ1
# (0.9989/1.05 = 0.9513) sits a bf16 rounding under the 1/1.05 edge the six maps are built for; past
# it they blow up (NaN two steps later). With 1.10 the largest normalized σ1 is 1/1.10 = 0.909, and the
# cascade's output hardly moves: every singular value inside the maps' range ends near 1 either way
# (docs/data.md, "A divergence it found"). The record and recipe presets keep 1.05.
OPTIM_PRESETS = {"record": OptimConfig(), "dev": OptimConfig(),
                 "smoke": OptimConfig(frobenius_margin=1.10)}


# ================================================================================================
# Feature switches (ablations): each removes a record feature's cost, not only its effect. A switch
# is one `Feature` in FEATURES (docs/features.md, "Adding a switch").
# ================================================================================================


@dataclass(frozen=True)
class Feature:
    """One switch, declared once: `features.<name>`, its default, the parameters it adds (name ->
    optimizer row, in the model's registration order), what it removes when off and its docs row.
    From FEATURES below come FeatureConfig's fields, the log's features line (features_line), the
    optimizer table's rows for these parameters (optim/adam.py), the parameters a model without the
    feature lacks (switched_off_parameters) and docs/features.md's table (`python -m tools.features_doc`).
    The model code that uses the switch reads `features.<name>`; nothing else names it."""
    name: str                                        # the field: --set features.<name>=false
    removes: str                                     # the record's (default on): when off, short: the log's features line
    removes_in_full: str                             # ... when off, what is not built, launched, sent: docs row
    introduced_by: str                               # docs row
    gain: str                                        # docs row: record #360's measured gain (its ablation), or the PR's claim
    params: tuple[tuple[str, ParamRule], ...] = ()   # parameters it adds and their optimizer rows
    default: bool = True                             # the record's value: on for its features, off for a proposal's
    requires: tuple[str, ...] = ()                   # features it needs on (refused up front without them)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.params)

    @property
    def frontier(self) -> bool:
        """A feature past the record (an open PR's, off by default): its texts say what it adds
        when on (`removes` reads as "adds" for it)."""
        return not self.default


# Every default is the record: its features on, and off the features past it (open PRs, `default=False`,
# switched on by --proposal, PROPOSALS below). A switched-off feature costs nothing: no tensor allocated, no kernel
# launched, no collective, no host work. The other switches that price a feature live elsewhere:
# `--set optim.bank_optimizer=normuon` (ANVIL -> record #89's NorMuon), SPEEDRUN_CUDA_GRAPHS=0 and
# SPEEDRUN_COMPILE=0 (perf/backend.py: execution paths, not math). The `removes` texts are ours; the
# gains are record #360's own ablation (upstream PR #360: net seconds at 164 ms per millinat, each
# feature removed from the record).
FEATURES: tuple[Feature, ...] = (
    # PR #360 ("New Embedding Table"): the 84.6M-row hashed bigram + trigram table, its sign pool, row
    # exchange and row-sparse Adam, and its injections (layer 0, 1, 4, 5, 9, MUDD mu11, the gates'
    # n-gram lanes). The table is not a parameter (its rows have their own optimizer): no params.
    Feature(
        "ngram",
        removes="no n-gram table, row exchange, row optimizer, sign pool or injections",
        removes_in_full="the hashed bigram + trigram table (84.6M rows; 15.13 GiB bf16 per rank on 8), its sign "
                        "pool, the host hashing in the loader, the row plan, pull, prefetch and gradient push (94 GB "
                        "sent per rank over the record schedule), the row-sparse Adam and its table events, the "
                        "n-gram embedding and its injections (layers 0, 1, 4, 5, 9 and MUDD μ11)",
        introduced_by='PR #360 ("New Embedding Table"; record #89 had a 377k-row bigram table)',
        gain="+7.05 s"),
    # in record #89's tree (introduced before it; 4 planes on layers 1, 2, 8, 10 since PR #360): the
    # planes added to V and read by the post-loop MUDD mix, and their gates.
    Feature(
        "value_embeds",
        removes="no value_embeds/ve_gate_bank, no value embeddings on V or in the MUDD mix",
        removes_in_full="`value_embeds` [4·V, D] and `ve_gate_bank`, their gather and scatter-add, Adam state, fp16 "
                        "cycle gradient, reduce-scatter and all-gather, tail average; V then gets only layer 10's "
                        "MUDD mix, and the post-loop mix reads its 6 other sources",
        introduced_by="before record #89 (4 planes on layers 1, 2, 8, 10 since PR #360)",
        gain="not priced whole (its sparse exchange path: +1.13 s)",
        # record #360 (track_1_short/training.py): value_embeds (0.75, 0.95), lr_mul 70 (record #89: 75),
        # wd_mul 5, on the table's cadence (squared betas and 10 from table_period4_step: optim/adam.py
        # value_embed_hparams); ve_gate_bank (0.9, 0.99)
        params=(("value_embeds", ParamRule("adam", "sharded", "table", (0.75, 0.95), lr_mul=70.0, wd_mul=5.0)),
                ("ve_gate_bank", ParamRule("adam", "replicated", "adam", (0.9, 0.99))))),
    # PR #360 ("Sampled-softmax"): the training CE over P candidates until stage 3.
    Feature(
        "sampled_softmax",
        removes="full softmax every step, no candidate sets",
        removes_in_full="the candidate sets (host build, upload, the class remap): the full softmax every step",
        introduced_by='PR #360 ("Sampled-softmax")',
        gain="+8.40 s (the sampled-softmax CE stack)"),
    # in record #89's tree (introduced before it): the multi-token-prediction terms (weights on the
    # targets t+1, t+2). Off: one weight, (1.0,), every step: the next-token CE alone.
    Feature(
        "mtp",
        removes="next-token loss only",
        removes_in_full="the multi-token-prediction terms: one weight, (1.0,), every step",
        introduced_by="before record #89",
        gain="not priced"),
    # PR #337 (the prefix-token record #89 merged onto): the prefix-token auxiliary term. Off: no term,
    # no prefix table (not built on the clock, no buffer in the model).
    Feature(
        "prefix_loss",
        removes="no prefix term, no prefix table",
        removes_in_full="the prefix-token term, the model's prefix table and its build on the clock",
        introduced_by="PR #337",
        gain="not priced"),
    # in record #89's tree (fp8 lm_head and MLP forward; PR #342 the down projection), extended by PR #344
    # (packed fp8 QKV) and PR #360 (fp8 MLP backward, cached lm_head, e4m3 logits). The one fp8 switch
    # (any preset, recorded with the run); a device without fp8 GEMMs (below SM89: perf/backend.py reads
    # it from the device) trains in bf16 whatever it says, and the record preset refuses such a device.
    Feature(
        "fp8",
        removes="bf16 GEMMs, no fp8 caches",
        removes_in_full="fp8 GEMMs (MLP forward and backward, lm_head and its e4m3 logits, packed QKV) and the fp8 "
                        "weight caches: bf16 GEMMs throughout",
        introduced_by="record #89 (fp8 lm_head and MLP; PR #342 the down projection), PR #344 (QKV), PR #360 (MLP "
                      "backward, e4m3 logits)",
        gain="+4.96 s (the fp8 extension)"),
    # PR #360 (record #92's residual fusions, perf/residual_fusion.py). Off: the plain expressions
    # r·x + p·y, the same math rounded in another order, in more kernels.
    Feature(
        "residual_fusions",
        removes="plain residual products r·x + p·y, the post-λ's outside the O and down projections",
        removes_in_full="the residual fusions: `scale`/`scale_add` with 0-D λ's at every residual site, the attention "
                        "post-λ riding the O projection (`o_gain`), the MLP post-λ folded into the fp8 down-projection "
                        "scale, `rms_norm_with_head` for the value-embedding gates; off: the plain `r·x + p·y` (same "
                        "math, rounded in another order, more kernels; `python -m tools.bench_residual_fusion` times "
                        "both)",
        introduced_by="PR #360",
        gain="not priced"),
    # ---- past the record: open upstream PRs, off by default (frontier_doc_copy.md; --proposal runs each) ----
    # PR #375: the n-gram row and sign hashes read each token's normalization class (model/token_norm.py).
    # No parameter; the map is built before the clock.
    Feature(
        "token_norm_hashes",
        removes="n-gram hashes over normalized token classes",
        removes_in_full="the n-gram row and sign hashes read each token's normalization class (NFKC, accents "
                        "stripped, lowercased, whitespace runs collapsed, outer whitespace stripped: \" The\", "
                        "\"THE\" and \"the\" share rows; 32,980 classes over GPT-2's 50,257 ids), mapped on the "
                        "host before hashing; embeddings, targets and the data stream keep raw ids",
        introduced_by="PR #375 (open)",
        gain="−0.42 s claimed (40.588 vs 41.008 s, 7 + 7 runs), 1194 → 1179 steps",
        default=False, requires=("ngram",)),
    # PR #378 (stacked on #375): the longest earlier exact match of each position's normalized context in
    # its document gives a candidate token and a bucket (model/doc_copy.py); embed(candidate)·scale[bucket]
    # + bucket_embed[bucket] is added after the smear (gain site[0]) and before the final norm (site[1]).
    Feature(
        "doc_copy",
        removes="a copy candidate from the document, added at two sites",
        removes_in_full="the document-local matcher (10 context lengths 1..32, one stable sort of 10·T int64 keys "
                        "inside the compiled forward), the candidate's row in the embedding lookup (2T rows), "
                        "`copy_doc_scale` [31], `copy_doc_bucket_embed` [31, D] and `copy_doc_site` [2] with their "
                        "Adam state, the copy vector after the smear and before the final norm",
        introduced_by="PR #378 (open; on #375)",
        gain="−1.174 s claimed (39.181 vs 40.355 s, 8 + 4 runs), 1194 → 1132 steps",
        # PR #378 (track_1_short/training.py): replicated Adam, betas (0.9, 0.99), lr_mul 1, no decay
        params=(("copy_doc_scale", ParamRule("adam", "replicated", "adam", (0.9, 0.99), wd_mul=0.0)),
                ("copy_doc_bucket_embed", ParamRule("adam", "replicated", "adam", (0.9, 0.99), wd_mul=0.0)),
                ("copy_doc_site", ParamRule("adam", "replicated", "adam", (0.9, 0.99), wd_mul=0.0))),
        default=False, requires=("token_norm_hashes",)),
    # PR #379 (frontier_cplm.md): the next token's distribution becomes a mixture of the LM softmax and a
    # pointer over the earlier tokens of the same document (model/cplm.py, perf/kernels/copy_pointer.py); α
    # is the softmax mass of the `<copy>` column (50257, a padding column of lm_head: no new column).
    Feature(
        "cplm",
        removes="a copy pointer mixed into the next-token loss",
        removes_in_full="the pointer head on the final normed rows (q/k projections 768 → 2·128 in bf16, QK norm, "
                        "a flash-style pointer over the earlier positions of the query's document within a band of "
                        "2048 tokens, 8192 at validation), `copy_qk_bank` [2, 128, 768], `copy_k_sink` [128] and "
                        "`copy_qk_gain` [1] with their Adam state, `<copy>` (id 50257) always in the sampled "
                        "candidate set, the next-token term replaced by the mixture NLL (MTP and prefix terms "
                        "unchanged), the validation mixture and its diagnostics line",
        introduced_by="PR #379 (open)",
        gain="−4.566 s claimed (36.009 ± 0.039 vs 40.575 ± 0.024 s, 8 + 13 runs), 1194 → 1050 steps",
        # PR #379 (track_1_short/training.py's Adam table): replicated Adam, betas (0.9, 0.99), lr_mul 1; the
        # bank decays (wd_mul 1), the sink key and the gain do not
        params=(("copy_qk_bank", ParamRule("adam", "replicated", "adam", (0.9, 0.99))),
                ("copy_k_sink", ParamRule("adam", "replicated", "adam", (0.9, 0.99), wd_mul=0.0)),
                ("copy_qk_gain", ParamRule("adam", "replicated", "adam", (0.9, 0.99), wd_mul=0.0))),
        default=False),
    # PR #371 part 1 (frontier_approx_backward.md §3): on the sampled-softmax steps of at least 32,768 rows per
    # rank (the record's stage-1 batch: steps 320-1106) the lm_head's weight gradient keeps one row of four,
    # by a counter-keyed hash, for its positive part (times 4) and adds the negative part exactly at the
    # target columns (perf/sampled_head_grad.py); dX and the forward are the record's
    Feature(
        "approx_lm_head_grad",
        removes="a sampled lm_head weight gradient (1 row in 4) on the large sampled-softmax steps",
        removes_in_full="on the sampled-softmax steps whose batch is at least the stage-1 batch (record: 32,768 rows "
                        "per rank, steps 320-1106), the lm_head's dW over the candidates as one fp8 GEMM over a quarter "
                        "of the rows (one of every four consecutive rows, chosen by a counter-keyed hash, scaled by 4) "
                        "for the gradient's positive part, plus its negative part exact in fp32 at each row's target, "
                        "prefix and gathered columns; a device counter per rank advanced by the world size per call",
        introduced_by="PR #371 (open; part 1 of 2)",
        gain="−0.759 s claimed for both parts together (39.583 ± 0.266 vs 40.342 ± 0.184 s, 12 + 6 runs), same "
             "1194 steps; no per-part ablation published",
        default=False, requires=("fp8", "sampled_softmax")),
    # PR #371 part 2: five short-window layers' attention backward keeps, per head, only the key tiles
    # within a window chosen from two steps' exact gradients (model/attention_calibration.py); the forward,
    # its output and LSE, are the record's
    Feature(
        "approx_attention_backward",
        removes="per-head shortened attention backwards on layers 0, 1, 2, 5, 8 (calibrated twice, then kept)",
        removes_in_full="on two steps of stage 1 (record: 592, 593) the exact attention gradients of layers 0, 1, 2, "
                        "5, 8 are snapshotted (first 8192 rows) and each head is given the cheapest window of 64, 128 "
                        "or 256 whose relative dQ/dK/dV error is at most 0.2 on every rank (else full); from the "
                        "next step to the taper (record: 594-1106) those heads' backwards skip the pairs further "
                        "apart, without renormalizing; the last stages are exact",
        introduced_by="PR #371 (open; part 2 of 2)",
        gain="−0.759 s claimed for both parts together (39.583 ± 0.266 vs 40.342 ± 0.184 s, 12 + 6 runs), same "
             "1194 steps; no per-part ablation published",
        default=False),
)


def _off(self) -> list[str]:
    """The record's features switched off, in declaration order."""
    return [f.name for f in fields(self) if f.default and not getattr(self, f.name)]


def _added(self) -> list[str]:
    """The features past the record (default off) switched on, in declaration order."""
    return [f.name for f in fields(self) if not f.default and getattr(self, f.name)]


def feature_config_class(features: tuple[Feature, ...]) -> type:
    """The frozen dataclass of the switches: one `bool` field per declaration, defaulting to the
    declared value, in declaration order (what `--set features.X=...` and asdict() see)."""
    names = [f.name for f in features]
    if len(set(names)) != len(names) or not all(n.isidentifier() for n in names):
        raise ValueError(f"FEATURES: names must be distinct identifiers, got {names}")
    owned = [p for f in features for p in f.param_names]
    if len(set(owned)) != len(owned):
        raise ValueError(f"FEATURES: a parameter belongs to one feature, got {owned}")
    unknown = [(f.name, r) for f in features for r in f.requires if r not in names or r == f.name]
    if unknown:
        raise ValueError(f"FEATURES: requires must name other declared features, got {unknown}")
    cls = make_dataclass(
        "FeatureConfig", [(f.name, bool, field(default=f.default)) for f in features], frozen=True,
        namespace={"off": _off, "added": _added, "__doc__": "Which of the record's features a run has (`--set features.ngram=false`, "
                   "...): one field per config.FEATURES declaration, its default the record's."})
    cls.__module__ = __name__  # (make_dataclass names its caller's caller: pickle and repr find it here)
    return cls


FeatureConfig = feature_config_class(FEATURES)


def switched_off_parameters(features) -> tuple[str, ...]:
    """The parameters of every switched-off feature, in declaration order: the record's parameters
    a model with these switches lacks (GPT.switched_off_parameters; the optimizer skips them). A
    feature past the record, off, is not listed: the record's table never had its rows."""
    return tuple(p for f in FEATURES if f.default and not getattr(features, f.name) for p in f.param_names)


def features_line(features) -> str | None:
    """`features: ngram off (no n-gram table, ...), doc_copy on (a copy candidate ...), ...` for every
    switch away from the record (its features off, a proposal's on); None for the record."""
    changed = [f for f in FEATURES if getattr(features, f.name) != f.default]
    if not changed:
        return None
    return "features: " + ", ".join(f"{f.name} {'on' if f.frontier else 'off'} ({f.removes})" for f in changed) + \
        " (the record has its features on and none past it)"


def feature_problems(features) -> list[str]:
    """A switched-on feature whose `requires` are off, one line each (config_check refuses the run)."""
    return [f"--set features.{f.name}=true needs features.{r} on ({f.introduced_by}); add --set features.{r}=true"
            for f in FEATURES if getattr(features, f.name) for r in f.requires if not getattr(features, r)]


# ================================================================================================
# Runs: one preset = model + schedule + optimizer + where it runs and what it reads (train_gpt.py).
# ================================================================================================
RECORD_WORLD_SIZE = 8  # record #360: the recipe's global batch is split over 8 ranks
NGRAM_TABLE_PLACEMENTS = ("auto", "device", "host")  # RunConfig.ngram_table


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs. `virtual_world_size` is the number of ranks the recipe's batch is
    split over; a run with fewer processes accumulates gradients over the missing ranks' batches
    (process p plays ranks p·A .. p·A + A − 1, A = virtual_world_size / processes), so the math
    does not depend on the process layout."""
    name: str
    model: ModelConfig
    schedule: ScheduleConfig
    optim: OptimConfig
    device: str                     # "cuda" or "cpu" ("auto": cuda when available)
    virtual_world_size: int
    allowed_world_sizes: tuple[int, ...]
    requires_fast_path: bool        # the record: SM90, Triton, fp8, FA3, compile, or refuse to start
    data_path: str                  # folder holding the shards
    train_pattern: str              # glob inside data_path
    val_pattern: str
    val_tokens: int                 # final validation tokens (a multiple of val_batch_tokens)
    val_batch_tokens: int           # global tokens per validation step
    val_every: int = 0              # 0: validate only at the end (record #360)
    canonical_mask: bool = False    # record #92 (PR #350): drop (prev, cur) pairs GPT-2 never emits
    warmup: bool = True             # untimed warmup at every schedule transition, then reset
    seed: int | None = None         # None: unseeded, as records run
    label: str = ""
    records_dir: str = "records"
    log_train_loss: bool = False    # a `train_loss` line per step (a host sync: off for records)
    save_checkpoint: bool = False
    max_steps: int | None = None    # stop the timed loop early (a truncated check run: no tail ship)
    overrides: tuple[str, ...] = ()  # the --set assignments applied to the preset (logged, recorded)
    features: FeatureConfig = FeatureConfig()  # ablation switches, all on (--set features.ngram=false)
    proposal: str = ""              # the open PR this run reproduces (--proposal NAME, PROPOSALS below), or ""
    # ours: how long a rank waits in a collective for the others (the process group's timeout). Sized
    # against a cold compile: ranks compile each geometry between two collectives of the warmup, and
    # one geometry of the record took up to 140 s to compile for SM90 on 2 CPU cores (tools.cross_compile);
    # 600 s leaves 4x for a rank whose compile cache is cold while the others' are warm.
    collective_timeout_s: int = 600
    # ours: where the n-gram table lives (perf/host_table.py): "device", "host" (host memory, rows
    # gathered and written back off the main thread) or "auto" (host when the shard would take more
    # than half the device's memory: the record's recipe on fewer than 8 GPUs); logged
    ngram_table: str = "auto"          # one of NGRAM_TABLE_PLACEMENTS


RUN_PRESETS = {
    "record": RunConfig(
        name="record", model=MODEL_PRESETS["record"], schedule=SCHEDULE_PRESETS["record"],
        optim=OPTIM_PRESETS["record"], device="cuda", virtual_world_size=RECORD_WORLD_SIZE,
        allowed_world_sizes=(8,), requires_fast_path=True, data_path="data/fineweb10B",
        train_pattern="fineweb_train_*.bin", val_pattern="fineweb_val_*.bin",
        val_tokens=10_485_760, val_batch_tokens=2_097_152,  # record #360: 5 val steps of 4·64·1024·8
        canonical_mask=True),
    "dev": RunConfig(
        name="dev", model=MODEL_PRESETS["dev"], schedule=SCHEDULE_PRESETS["dev"],
        optim=OPTIM_PRESETS["dev"], device="cuda", virtual_world_size=RECORD_WORLD_SIZE,
        allowed_world_sizes=(1, 2, 4, 8), requires_fast_path=False, data_path="data/fineweb10B",
        train_pattern="fineweb_train_*.bin", val_pattern="fineweb_val_*.bin",
        val_tokens=10_485_760, val_batch_tokens=2_097_152, canonical_mask=True),
    # The record's recipe exactly (its table, schedule and validation) on 1, 2, 4 or 8 GPUs of any
    # kind: each process plays 8 / processes ranks (optim/lanes.py), the table goes to host memory
    # where it does not fit (ngram_table=auto), and the fast path's pieces are used where the device
    # has them (fp8 GEMMs on SM89+, FA3 on SM90), the portable ones elsewhere, named in the log. Its
    # runs are grouped apart from the record's (records.report groups by config) and never a record.
    "recipe": RunConfig(
        name="recipe", model=MODEL_PRESETS["record"], schedule=SCHEDULE_PRESETS["record"],
        optim=OPTIM_PRESETS["record"], device="cuda", virtual_world_size=RECORD_WORLD_SIZE,
        allowed_world_sizes=(1, 2, 4, 8), requires_fast_path=False, data_path="data/fineweb10B",
        train_pattern="fineweb_train_*.bin", val_pattern="fineweb_val_*.bin",
        val_tokens=10_485_760, val_batch_tokens=2_097_152, canonical_mask=True),
    # CPU (gloo), minutes on 2 cores: 2 virtual ranks, so 1 or 2 processes run the same math.
    "smoke": RunConfig(
        name="smoke", model=MODEL_PRESETS["smoke"], schedule=SCHEDULE_PRESETS["smoke"],
        optim=OPTIM_PRESETS["smoke"], device="auto", virtual_world_size=2,
        allowed_world_sizes=(1, 2), requires_fast_path=False, data_path="data/synthetic",
        train_pattern="*_train_*.bin", val_pattern="*_val_*.bin",
        # data/synthetic: the embedded corpus (data/synthetic.py), written there on first use; real
        # text with --data-path (docs/data.md). Its documents average 128 tokens (tinyshakespeare's
        # paragraphs ~46): up to 1,536 per rank fit the 128-row cu_seqlens table either way (data/loader.py).
        # Validation steps of 2 × 1,024 tokens: the portable attention
        # and the full-vocabulary loss dominate a CPU validation, so a check validates on as few
        # tokens as it likes (--val-tokens 2048); the default keeps 32,768. Validating every 35
        # steps gives the untrained loss at step 0.
        val_tokens=32_768, val_batch_tokens=2_048, val_every=35, log_train_loss=True),
}


# ================================================================================================
# Proposals: open upstream PRs past the record, each as its PR ran it (train_gpt.py --proposal NAME).
# ================================================================================================


@dataclass(frozen=True)
class Proposal:
    """One open PR as it ran: the features it switches on and its schedule's base steps (the record
    schedule's rules, config.ScheduleConfig, give its stage ends). `--proposal NAME` applies both to the
    preset before --steps and --set (which still win); on a preset whose schedule is not the record's
    (smoke) only the features apply. The claim is the PR's own measurement (8×H100), for the log and
    the docs, never ours."""
    name: str
    pr: str                        # the PR, and what it stacks on
    title: str
    features: tuple[str, ...]      # switched on
    base_steps: int                # schedule.base_steps on the record's schedule
    claim: str                     # the PR's measured time and loss against its baseline

    def applies_schedule(self, cfg: RunConfig) -> bool:
        """Whether the proposal's base steps apply: the preset runs the record's schedule."""
        return replace(cfg.schedule, base_steps=ScheduleConfig.base_steps) == ScheduleConfig()

    def apply(self, cfg: RunConfig) -> RunConfig:
        """cfg with the proposal's features on (and its base steps, `applies_schedule`), named in `proposal`."""
        features = replace(cfg.features, **{name: True for name in self.features})
        schedule = replace(cfg.schedule, base_steps=self.base_steps) if self.applies_schedule(cfg) else cfg.schedule
        return replace(cfg, features=features, schedule=schedule, proposal=self.name)


PROPOSALS = {
    # PR #375 (frontier_doc_copy.md §1): 1122 → 1107 base steps (1179 in all: stage ends 0, 316, 672, 1093, 1159, 1179)
    "token_norm_hashes": Proposal(
        "token_norm_hashes", "PR #375", "token-normalized n-gram hashes", ("token_norm_hashes",), 1107,
        "40.588 s vs 41.008 s for #360 (7 + 7 runs), val 3.27350 vs 3.27554"),
    # PR #378 (frontier_doc_copy.md §2.6): 1060 base steps (1132 in all: 0, 303, 643, 1048, 1112, 1132)
    "doc_copy": Proposal(
        "doc_copy", "PR #378 (on PR #375)", "DocCopy: a document-local copy candidate as an input",
        ("token_norm_hashes", "doc_copy"), 1060,
        "39.181 ± 0.099 s (8 runs) vs 40.355 ± 0.155 s for #360 (4 runs, same node), val 3.27548 ± 0.00057"),
    # PR #379 (frontier_cplm.md §8): NUM_SCHEDULED_ITERATIONS=978 (1050 in all: 0, 279, 593, 971, 1030, 1050);
    # its fixed-step constants (rail engage 514, table cadence 336, beta warmup 240 / cooldown 50, tail
    # windows) stay the record's, as the PR left them (docs/features.md)
    "cplm": Proposal(
        "cplm", "PR #379", "CPLM: a copy pointer mixed into the next-token loss", ("cplm",), 978,
        "36.009 ± 0.039 s (8 runs) vs 40.575 ± 0.024 s for #360 (13 runs, same node), val 3.2769 ± 0.0016"),
    # PR #371 (frontier_approx_backward.md §1): the record's schedule, 1194 steps (base 1122), both parts on
    "approx_backward": Proposal(
        "approx_backward", "PR #371", "ApproximateBackward: a sampled lm_head dW and shortened attention backwards",
        ("approx_lm_head_grad", "approx_attention_backward"), 1122,
        "39.583 ± 0.266 s (12 runs) vs 40.342 ± 0.184 s for #360 (6 runs, same node), val 3.278705"),
    # ours, not a PR: every proposal above at once. No one has run it, so no step count is known: it starts
    # from the fewest base steps any of its PRs ran (CPLM's 978) and its step count is a flag
    # (--set schedule.base_steps=N; records.certify --steps-sweep finds the fewest that still meet the bar)
    "stack": Proposal(
        "stack", "PRs #375 + #378 + #379 + #371 (ours: never run upstream)",
        "the stack: token-normalized hashes, DocCopy, CPLM and ApproximateBackward together",
        ("token_norm_hashes", "doc_copy", "cplm", "approx_lm_head_grad", "approx_attention_backward"), 978,
        "none: no PR ran the stack; each part's claim is its own proposal's"),
}


def proposal_line(cfg: RunConfig) -> str | None:
    """The log's line naming the run's proposal, its features and where its schedule comes from."""
    if not cfg.proposal:
        return None
    p = PROPOSALS[cfg.proposal]
    schedule = (f"schedule: base {p.base_steps} steps (record rules)" if p.applies_schedule(cfg) else
                f"schedule: the {cfg.name} preset's own (the PR's base {p.base_steps} steps apply to the record's schedule)")
    return (f"proposal {p.name}: {p.pr}, {p.title}; features on: {', '.join(p.features)}; {schedule}; "
            f"claimed on 8×H100: {p.claim}")
